"""The GPU path's CPU twins: the vLLM engine's arguments on a CUDA card (a recording stand-in for
vllm.LLM, the card's numbers given), the refusals a card gets before anything loads (a T4, a V100,
an RTX 4090), and LoRA's weights pushed one layer at a time. What needs the card itself is
benchmarks/gpu_run.py's: each of its checks here, at the twin's shapes, passing and failing on the
defect it guards against."""

import dataclasses
import importlib.util
import inspect
import sys
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from benchmarks import gpu_run
from cwgrpo_utils.machine import memory_plan
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.machine.vllm_engine import Engine
from cwgrpo_utils.models import lora
from cwgrpo_utils.run import checkpoints
from tests.support import SMALL_SHAPE

CUDA = torch.device("cuda")  # no GPU needed: each test gives the card's numbers
# torch.cuda.get_arch_list() of a CUDA 13 build (torch 2.11+cu130): no sm_70, so no V100
CUDA_13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
# name, compute capability, total and free bytes as torch.cuda.mem_get_info gives them
T4 = ("Tesla T4", (7, 5), 15.64e9, 15.3e9)
V100 = ("Tesla V100-SXM2-16GB", (7, 0), 16.9e9, 16.5e9)
RTX_4090 = ("NVIDIA GeForce RTX 4090", (8, 9), 25.3e9, 24.8e9)


def precision_on(card, requested="auto") -> Precision:
    name, capability, _, _ = card
    return Precision.choose(
        requested, CUDA, capability=capability, card=name, arch_list=CUDA_13_ARCHS
    )


def test_a_card_the_installed_pytorch_has_no_kernels_for_is_one_line_before_loading():
    with pytest.raises(SystemExit) as stop:
        precision_on(V100)
    assert str(stop.value).startswith(
        "error: Tesla V100-SXM2-16GB (compute capability 7.0, sm_70) has no kernels in this "
        f"PyTorch build (torch {torch.__version__}: sm_75 sm_80 "
    )
    assert "\n" not in str(stop.value)
    assert precision_on(T4).name == "fp16"  # sm_75 itself
    assert precision_on(RTX_4090).name == "bf16"  # sm_86's cubins run on 8.9
    # a build with PTX at or below the card's capability runs it too: the driver compiles it
    v100 = Precision.choose("auto", CUDA, capability=(7, 0), card="V100", arch_list=["compute_70"])
    assert v100.name == "fp16"


def test_bf16_asked_of_a_card_without_it_is_one_line_naming_auto_and_fp16():
    with pytest.raises(SystemExit) as stop:
        precision_on(T4, requested="bf16")
    assert str(stop.value) == (
        "error: --precision bf16, but Tesla T4 (compute capability 7.5) has no bf16; use "
        "--precision auto (fp16 on this card) or --precision fp16"
    )
    assert precision_on(RTX_4090, requested="bf16").reason == "bf16: as asked"
    assert precision_on(T4, requested="fp16").name == "fp16"


def vllm_plan(preset: str, *args):
    cfg, run_cfg = cwgrpo.parse_config(["--preset", preset, "--rollout", "vllm", "--plan", *args])
    return cfg.model, memory_plan.PlanOptions.of(cfg, run_cfg)


def test_where_the_engines_share_is_what_does_not_fit_the_advice_is_the_share_that_does():
    """The T4 preset with --rollout vllm: 0.3 of a T4 leaves the engine's KV cache less than one
    group's; the one line says so and names the share that fits, and that share does."""
    name, _, total, free = T4
    model, options = vllm_plan("paper-1.5b-lora-16gb")
    with pytest.raises(SystemExit) as stop:
        memory_plan.check_fit(model, options, free, total)
    message = str(stop.value)
    assert message.startswith(
        "error: --vllm-gpu-memory-utilization 0.30 gives the vLLM engine 4.7 GB of this 15.6 GB "
        "card, which leaves its KV cache 0.14 GB beside its weights and CUDA graphs, less than "
        "one group's 0.53 GB; on this card: --vllm-gpu-memory-utilization 0.35 fits (the engine "
        "5.5 GB while it samples; the trainer 13.1 GB at its peak while it sleeps)"
    )
    assert "\n" not in message and "--preset" not in message
    share = memory_plan.plan(model, dataclasses.replace(options, vllm_gpu_memory_utilization=0.35))
    assert memory_plan.holds(share, total, free)
    _, larger = vllm_plan("paper-1.5b-lora-16gb", "--vllm-gpu-memory-utilization", "0.35")
    memory_plan.check_fit(model, larger, free, total)  # silent: it fits


def test_on_a_24_gb_card_the_24_gb_preset_fits_beside_its_engine():
    _, _, total, free = RTX_4090
    model, options = vllm_plan("qwen0.5b-24gb")
    memory_plan.check_fit(model, options, free, total)  # silent
    p = memory_plan.plan(model, options)
    engine = memory_plan.engine_memory(p, total)
    # every row's KV cache (144 rows of 3,072 positions), weights and graphs within 0.3 of the card
    assert engine["kv_cache"] == 144 * p["engine_row_kv"]
    assert engine["total"] <= 0.3 * total
    # the trainer's peak while the engine sleeps: the card's usable memory, no cap of the engine's
    assert p["peak"] <= memory_plan.USABLE * total < p["peak"] + engine["total"]


class RecordingLLM:
    """A stand-in for vllm.LLM that records what the engine asks of it."""

    made = []

    def __init__(self, **options):
        self.options, self.slept = options, []
        RecordingLLM.made.append(self)

    def sleep(self, level: int) -> None:
        self.slept.append(level)


@pytest.fixture
def recorded_engine(monkeypatch, tmp_path):
    """Engine.for_run's vllm.LLM arguments for the T4 preset at --vllm-gpu-memory-utilization 0.35
    on a faked T4, in fp16 as auto chooses there."""
    name, _, total, free = T4
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=RecordingLLM))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (int(free), int(total)))
    folder = tmp_path / "model"  # R1-Distill-Qwen-1.5B's architecture: its shipped config
    folder.mkdir()
    shipped = memory_plan.SHIPPED_CONFIGS / "deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B.json"
    (folder / "config.json").write_text(shipped.read_text())
    args = ["--preset", "paper-1.5b-lora-16gb", "--rollout", "vllm", "--plan"]
    cfg, run_cfg = cwgrpo.parse_config([*args, "--vllm-gpu-memory-utilization", "0.35"])
    RecordingLLM.made.clear()
    engine = Engine.for_run(dataclasses.replace(cfg, model=str(folder)), run_cfg, precision_on(T4))
    (llm,) = RecordingLLM.made
    return engine, llm, memory_plan.plan(cfg.model, memory_plan.PlanOptions.of(cfg, run_cfg))


def test_on_cuda_the_engine_pins_its_kv_cache_and_offloads_its_graphs_asleep(recorded_engine):
    """No process-wide memory cap: vLLM 0.34 turns its extensible KV cache (and with it
    torch.cuda.set_per_process_memory_fraction) on unless kv_cache_memory_bytes is given."""
    engine, llm, p = recorded_engine
    options = llm.options
    assert options["dtype"] == "half"  # fp16, the T4's
    assert options["gpu_memory_utilization"] == 0.35
    assert options["kv_cache_memory_bytes"] == memory_plan.engine_memory(p, T4[2])["kv_cache"]
    assert options["kv_cache_memory_bytes"] >= 12 * p["engine_row_kv"]  # a group at least
    assert options["enable_sleep_mode"] and options["sleep_mode_offload_cudagraph"]
    assert "enable_extensible_kv_cache" not in options  # the pinned size turns it off
    assert llm.slept == [2] and engine.sleeps  # asleep until its first call, weights freed


def adapted_bf16_model():
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**SMALL_SHAPE)).to(torch.bfloat16).requires_grad_(False)
    model = lora.adapted(base, rank=4, alpha=8, target_modules="all-linear")
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: a trained adapter's is not
            parameter.data.normal_(0, 0.1)
    return model


def test_lora_weights_are_pushed_one_merged_layer_at_a_time_in_the_bases_dtype():
    model = adapted_bf16_model()
    pushed = lora.merged_weights(model)
    assert inspect.isgenerator(pushed)  # a layer merged when the engine reaches it
    base = model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, lora.LoraLayer)}
    before = {}  # what a push gave before: every adapted layer merged at once, in fp32
    for name, tensor in base.state_dict().items():
        layer = layers.get(name.removesuffix(".base_layer.weight"))
        if name.endswith(".base_layer.weight") and layer is not None:
            tensor = tensor + layer.get_delta_weight(lora.ADAPTER)
        if ".lora_" not in name:
            before[name.replace(".base_layer.", ".")] = tensor
    pushed = dict(pushed)
    assert pushed.keys() == before.keys()
    assert {t.dtype for t in pushed.values()} == {torch.bfloat16}
    assert all(torch.equal(pushed[name], before[name].to(torch.bfloat16)) for name in before)
    merged = [name for name, tensor in before.items() if tensor.dtype == torch.float32]
    assert len(merged) == 7 * SMALL_SHAPE["num_hidden_layers"]  # every linear layer but the head


def test_the_plan_counts_one_layers_merge_while_lora_weights_are_pushed():
    model, options = vllm_plan("paper-1.5b-lora-16gb")
    p = memory_plan.plan(model, options)
    # gate_proj and up_proj (1536 x 8960), the largest: fp32 delta and sum, and the fp16 cast
    assert p["items"]["LoRA push (one layer merged)"] == 1536 * 8960 * (4 + 4 + 2)
    without = memory_plan.plan(model, dataclasses.replace(options, rollout="hf"))
    assert "LoRA push (one layer merged)" not in without["items"]


# The prepared GPU run's checks (benchmarks/gpu_run.py), each passing at the twin's shapes on the
# CPU and failing on the defect it guards against; CI runs the whole twin in the GPU image's
# packages (.ci/run, gpu_image_rehearsal)
CPU = torch.device("cpu")


def test_the_lora_push_check_fails_on_the_merge_of_every_layer_at_once():
    assert gpu_run.lora_push(gpu_run.TINY_CONFIG, CPU)["passed"]
    at_once = gpu_run.lora_push(gpu_run.TINY_CONFIG, CPU, merge=gpu_run.merged_at_once)
    assert not at_once["passed"] and at_once["peak_added_gb"] > at_once["bound_gb"]


def step_without_the_check(trained, optimizer, scheduler, scaler, max_grad_norm):
    """cwgrpo.optimizer_step as it would be if it stepped whatever the gradient's norm."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
    optimizer.step()
    scheduler.step()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, 0.0, True


def test_the_fp16_skip_check_fails_on_a_step_that_does_not_check_the_norm():
    assert gpu_run.fp16_skip(CPU)["passed"]
    broken = gpu_run.fp16_skip(CPU, step=step_without_the_check)
    assert not broken["passed"] and not broken["weights_unchanged"]


def plan_off_by(factor: float):
    """memory_plan.plan with its update phase's addition `factor` times what it is."""

    def plan(*args, **kwargs):
        p = memory_plan.plan(*args, **kwargs)
        added = p["phases"]["update"] - p["resident"]
        p["phases"]["update"] = p["resident"] + factor * added
        return p

    return plan


def test_the_update_peak_check_fails_when_the_plan_is_off_by_more_than_its_tolerance(tmp_path):
    args = dict(prompt=16, new=8, folder=tmp_path, logit_chunk_elements=16 * 300)
    right = gpu_run.update_peak(gpu_run.TINY_CONFIG, CPU, **args)
    assert right["passed"], right
    tolerance = right["tolerance"]
    for factor in (0.5, 1.6):  # the CPU's plan is high by a fifth to a quarter: these, beyond
        off = gpu_run.update_peak(gpu_run.TINY_CONFIG, CPU, **args, plan=plan_off_by(factor))
        assert not off["passed"], (factor, off)
        assert abs(off["measured_over_planned"] - 1) > tolerance


def moments_lost(run_folder):
    """The newest checkpoint's AdamW moments zeroed: a resume that loses part of its state."""
    newest = checkpoints.latest_checkpoint(run_folder)
    state = torch.load(newest / "optimizer.pt", weights_only=True)
    for moments in state["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            moments[name].zero_()
    torch.save(state, newest / "optimizer.pt")


@pytest.mark.parametrize("defect", [None, moments_lost])
def test_the_resumed_run_check_fails_when_a_resume_loses_state(tmp_path, defect):
    result = gpu_run.run_resumed(
        "tiny", CPU, "fp32", steps=4, kill_after=2, folder=tmp_path, evaluate=False, between=defect
    )
    assert result["killed_mid_run"] and not result["errors"], result
    assert result["passed"] == (defect is None), result


def test_an_engine_in_a_process_of_its_own_is_refused_in_one_line(monkeypatch, tmp_path):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 would put the engine where the trainer's weight push
    cannot reach: refused before vLLM is imported (here it need not be installed)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(SystemExit) as stop:
        Engine(str(tmp_path), max_model_len=64, n_rows=4, device=torch.device("cpu"))
    assert str(stop.value) == (
        "error: --rollout vllm pushes the trainer's weights into vLLM's engine in this process, "
        "and VLLM_ENABLE_V1_MULTIPROCESSING=1 starts it in another; unset it or set it to 0"
    )
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=RecordingLLM))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # vLLM "installed"
    with pytest.raises(SystemExit, match="VLLM_ENABLE_V1_MULTIPROCESSING=1 starts it in another"):
        cwgrpo.parse_config(["--preset", "tiny", "--rollout", "vllm"])
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cwgrpo.parse_config(["--preset", "tiny", "--rollout", "vllm"])  # silent
