"""System tests of the memory and disk plan: every item against real allocations on the CPU, the
presets' plans, and the fit check before a CUDA run."""

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils.machine import memory_plan
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.models import loading
from cwgrpo_utils.options import presets
from cwgrpo_utils.run import checkpoints
from tests.support import ROOT, SMALL_SHAPE, read_metrics, saved_activation_bytes


@pytest.fixture(scope="module")
def plan_model(tmp_path_factory):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_SHAPE))
    folder = tmp_path_factory.mktemp("plan-model")
    model.save_pretrained(folder)
    return model, folder


def plan_options(**overrides):
    args = [
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--groups-per-micro-batch",
        "1",
        "--max-prompt-length",
        "24",
        "--max-completion-length",
        "40",
        "--length-limit",
        "new",
        "--beta",
        "0.04",
        "--steps",
        "6",
        "--save-every",
        "2",
    ]
    for name, value in overrides.items():
        args += [f"--{name}", str(value)]
    return memory_plan.PlanOptions.of(*cwgrpo.parse_config(args))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    "name,count",
    [
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1_777_088_000),
        ("Qwen/Qwen2.5-Math-7B-Instruct", 7_615_616_512),
        ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 134_515_008),  # Llama: no q/k/v biases
    ],
)
def test_parameter_counts_from_config_equal_the_published_ones(name, count):
    arch = memory_plan.Architecture.from_config(memory_plan.read_config(name))  # shipped: offline
    assert arch.parameters() == count


def test_parameter_count_equals_the_built_model(plan_model):
    model, folder = plan_model
    arch = memory_plan.Architecture.from_config(memory_plan.read_config(str(folder)))
    assert arch.parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("biases", [dict(), dict(attention_bias=True, mlp_bias=True)])
def test_parameter_count_equals_a_built_llama_with_and_without_biases(tmp_path, biases):
    LlamaForCausalLM(LlamaConfig(**SMALL_SHAPE, **biases)).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    arch = memory_plan.Architecture.from_config(memory_plan.read_config(str(tmp_path)))
    assert arch.parameters() == sum(p.numel() for p in model.parameters())


def test_weights_gradients_and_adamw_state_equal_the_plan_after_a_real_step(plan_model):
    model, folder = plan_model
    items = memory_plan.plan(str(folder), plan_options(), cuda=False)["items"]
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    model(
        input_ids=torch.randint(0, 300, (2, 8)), labels=torch.randint(0, 300, (2, 8))
    ).loss.backward()
    assert tensor_bytes(model.parameters()) == items["weights (fp32)"]
    assert tensor_bytes(p.grad for p in model.parameters()) == items["gradients (fp32)"]
    optimizer.step()
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert tensor_bytes(moments) == items["AdamW moments (fp32)"]
    assert items["reference"] == items["weights (fp32)"]  # fp32 on the CPU, with beta > 0


def test_the_kv_cache_after_sampling_is_the_plans(plan_model):
    model, folder = plan_model
    options = plan_options()
    planned = memory_plan.plan(str(folder), options, cuda=False)["items"]["KV cache"]
    n_rows, prompt, new = 8, options.max_prompt_length, options.max_completion_length
    cache = loading.KVCache(torch.float32)
    ids = torch.randint(0, 300, (n_rows, prompt))
    how = cwgrpo.Sampling(1, 1.0, 1.0, 0, new)
    cwgrpo.sample_tokens(model, ids, torch.ones_like(ids), how, new, [], 0, cache)
    measured = tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
    assert measured == pytest.approx(planned, rel=0.03)  # the last token is never fed back


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_saved_for_backward_are_the_plans(plan_model, checkpointing, share):
    model, folder = plan_model
    model = copy.deepcopy(model).train()
    if checkpointing:
        loading.enable_checkpointing(model)
    options = plan_options(
        gradient_checkpointing=checkpointing, groups_per_micro_batch=2, share_prompts=share
    )
    cfg, run_cfg = cwgrpo.parse_config(
        ["--max-prompt-length", "24", "--max-completion-length", "40", "--group-size", "4"]
        + ["--share-prompts", str(share)]
    )
    planned = memory_plan.plan(str(folder), options, cuda=False)["items"]
    n_rows, prompt, new = 8, options.max_prompt_length, options.max_completion_length
    measured = saved_activation_bytes(model, cfg, run_cfg, n_rows, prompt, new)
    assert measured == pytest.approx(planned["activations saved for backward"], rel=0.03)
    recomputed = planned["one layer recomputed in backward"]
    if not checkpointing:
        assert recomputed == 0
        return
    # what one layer saves, measured: the model without checkpointing, less a copy a layer short
    whole = copy.deepcopy(plan_model[0]).train()
    short = copy.deepcopy(whole)
    short.model.layers = short.model.layers[:-1]
    short.config.num_hidden_layers -= 1
    one_layer = saved_activation_bytes(
        whole, cfg, run_cfg, n_rows, prompt, new
    ) - saved_activation_bytes(short, cfg, run_cfg, n_rows, prompt, new)
    if share:  # a completions' layer, unless the prompts' whole pass (one checkpoint) is more
        assert 0.8 * one_layer < recomputed < one_layer
    else:
        assert recomputed == pytest.approx(one_layer, rel=0.03)


def test_a_checkpoint_on_disk_is_the_plans_and_only_the_newest_keeps_the_optimizer(
    tiny_args, tmp_path
):
    out = tmp_path / "run"
    keep_two = ["--save-every", "1", "--save-total-limit", "2", "--output-dir", str(out)]
    cwgrpo.main(*cwgrpo.parse_config([*tiny_args, "--steps", "4", *keep_two]))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert not (out / "checkpoint-3" / "optimizer.pt").exists()
    newest = out / "checkpoint-4"
    files = newest / "model.safetensors", newest / "optimizer.pt"
    plan = memory_plan.plan(
        str(newest),
        plan_options_of(tiny_args, steps=4, save_every=1, save_total_limit=2),
        cuda=False,
    )
    assert sum(f.stat().st_size for f in files) == pytest.approx(
        plan["disk"]["checkpoint"], rel=0.02
    )
    assert checkpoints.latest_checkpoint(out) == newest  # and a resume from it works:
    cwgrpo.main(*cwgrpo.parse_config([*tiny_args, "--steps", "5", *keep_two, "--resume"]))
    assert len(read_metrics(out / "metrics.jsonl")) == 5


def plan_options_of(argv, **overrides) -> memory_plan.PlanOptions:
    return dataclasses.replace(memory_plan.PlanOptions.of(*cwgrpo.parse_config(argv)), **overrides)


@pytest.mark.parametrize("preset", ["paper-1.5b", "paper-7b", "qwen0.5b-24gb", "tiny"])
def test_plan_prints_every_presets_numbers_offline(preset, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "cwgrpo.py"), "--preset", preset, "--plan"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.strip().splitlines() if not line.startswith("building")]
    count = {
        "paper-1.5b": "1,777,088,000",
        "paper-7b": "7,615,616,512",
        "qwen0.5b-24gb": "494,032,768",
    }.get(preset, "115,456")
    assert f"{count} parameters" in lines[0]
    fits = next(line for line in lines if line.startswith("fits: "))
    assert (
        fits
        == {
            "paper-1.5b": "fits: 80, 141 GB; does not fit: 12, 16, 24, 40, 48 GB",
            "paper-7b": "fits: none of them; does not fit: 12, 16, 24, 40, 48, 80, 141 GB",
            "qwen0.5b-24gb": "fits: 24, 40, 48, 80, 141 GB; does not fit: 12, 16 GB",
            "tiny": "fits: 12, 16, 24, 40, 48, 80, 141 GB; does not fit: none of them",
        }[preset]
    )
    cards = lines[
        lines.index(fits) + 1 :
    ]  # a line per size: the plan's verdict, each card's precision
    assert cards[0] == "cards (--precision auto: bf16 from compute capability 8.0, fp16 on 7.x):"
    verdict = "fits" if preset == "tiny" else "does not fit"
    assert (
        cards[2]
        == f"    16 GB  {verdict:13s} T4, V100 16 GB (fp16); RTX 4060 Ti 16 GB, A4000 (bf16)"
    )
    assert [line.split()[0] for line in cards[1:]] == ["12", "16", "24", "40", "48", "80", "141"]
    assert any(line.startswith("disk: ") for line in lines)


def test_paper_presets_plan_with_margin():
    def peak(preset):
        cfg, run_cfg = cwgrpo.parse_config(["--preset", preset])
        return memory_plan.plan(cfg.model, memory_plan.PlanOptions.of(cfg, run_cfg))["peak"]

    assert peak("paper-1.5b") < 0.75 * 80e9
    assert peak("qwen0.5b-24gb") < 0.85 * 24e9


def test_a_run_that_cannot_fit_stops_in_one_line_naming_the_largest_items():
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "paper-1.5b"])
    options = memory_plan.PlanOptions.of(cfg, run_cfg)
    with pytest.raises(SystemExit) as error:
        memory_plan.check_fit(cfg.model, options, 40 * 10**9, 40 * 10**9)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("error: this run needs about 59.4 GB and the GPU has 40.0 GB free ")
    assert "(largest: KV cache 16.9 GB, AdamW moments (fp32) 14.2 GB, activations" in message
    memory_plan.check_fit(cfg.model, options, 80 * 10**9, 80 * 10**9)  # silent


def test_a_cuda_run_that_cannot_fit_stops_before_loading(monkeypatch, tmp_path):
    """The wiring of the fit check into a run: CUDA's API answers as a 40 GB card would; the plan,
    the check and the run are the real ones, and nothing is loaded (the model is a hub id)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (40 * 10**9, 48 * 10**9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_86", "sm_90"])
    monkeypatch.setattr(loading, "load_dataset", lambda *_: pytest.fail("loaded before the check"))
    with pytest.raises(SystemExit) as error:
        cwgrpo.main(
            *cwgrpo.parse_config(["--preset", "paper-1.5b", "--output-dir", str(tmp_path / "run")])
        )
    assert str(error.value).startswith("error: this run needs about 59.4 GB and the GPU has 40.0")
    assert not (tmp_path / "run").exists()


def test_the_plan_with_vllm_counts_the_engine_share_per_card():
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "paper-1.5b", "--rollout", "vllm", "--plan"])
    p = memory_plan.plan(cfg.model, memory_plan.PlanOptions.of(cfg, run_cfg))
    hf = memory_plan.plan(cfg.model, memory_plan.PlanOptions.of(*cwgrpo.parse_config([])))
    assert p["items"]["KV cache"] == 0 and hf["items"]["KV cache"] > 0  # the engine's own
    items = p["items"]
    resident = items["weights (fp32)"] + items["AdamW moments (fp32)"] + items["reference"]
    assert p["phases"]["rollout"] == resident  # no HF forward while the engine samples
    assert p["phases"]["update"] == hf["phases"]["update"]  # the engine sleeps, holding nothing
    assert memory_plan.fits(p) == ([80, 141], [12, 16, 24, 40, 48])
    assert memory_plan.holds(p, 80e9)
    engine = memory_plan.engine_memory(p, 80e9)  # 24 GB: weights, graphs, every row's KV cache
    assert engine["kv_cache"] == hf["items"]["KV cache"] == p["n_rows"] * p["engine_row_kv"]
    assert engine["total"] == 3.554176e9 + memory_plan.CUDA_GRAPHS + engine["kv_cache"]
    assert not memory_plan.holds({**p, "engine_share": 0.06}, 80e9)  # 4.8 GB: no group's KV
    # the share caps the engine, which takes what its rows need: a larger one takes no more
    assert memory_plan.engine_memory({**p, "engine_share": 0.9}, 80e9) == engine
    report = memory_plan.report(cfg.model, memory_plan.PlanOptions.of(cfg, run_cfg))
    assert (
        "vLLM engine while sampling, within 30% of the card: its weights 3.55 GB, CUDA graphs up "
        "to 1 GB, a KV cache of up to 16.91 GB (every row at its longest)" in report
    )


def test_a_run_that_cannot_fit_is_told_what_does_fit_the_card():
    """On a 16 GB card (T4: 15.8 GB, 15.3 free) the paper's recipe is told of the T4 preset of the
    same model; a qwen0.5b run on a 12 GB card, of the fewest of its own flags that fit."""
    recipes = {name: cwgrpo.parse_config(["--preset", name]) for name in presets.GPU_PRESETS}
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "paper-1.5b"])
    options = memory_plan.PlanOptions.of(cfg, run_cfg)
    with pytest.raises(SystemExit) as stop:
        memory_plan.check_fit(cfg.model, options, 15.3e9, 15.8e9, recipes=recipes)
    assert "; on this card: --preset paper-1.5b-lora-16gb fits (13.1 GB); " in str(stop.value)
    small, small_run = cwgrpo.parse_config(["--preset", "qwen0.5b-24gb"])
    with pytest.raises(SystemExit) as stop:
        memory_plan.check_fit(small.model, memory_plan.PlanOptions.of(small, small_run), 11e9, 12e9)
    fit = str(stop.value).split("; on this card: ")[1].split("; python cwgrpo.py")[0]
    assert fit.endswith(" (LoRA wants 10x the learning rate)")  # the update's size needs it here
    flags, planned = fit.removesuffix(" (LoRA wants 10x the learning rate)").split(" fits (")
    changed = plan_options_of(["--preset", "qwen0.5b-24gb", *flags.split()])
    assert memory_plan.holds(memory_plan.plan(small.model, changed), 12e9, 11e9)
    assert (
        planned
        == f"{memory_plan.needed(memory_plan.plan(small.model, changed), 12e9) / 1e9:.1f} GB)"
    )


def test_the_t4_preset_leaves_a_tenth_of_a_16_gb_card_free_and_runs_fp16_there():
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "paper-1.5b-lora-16gb"])
    p = memory_plan.plan(cfg.model, memory_plan.PlanOptions.of(cfg, run_cfg))
    assert p["peak"] <= 0.9 * memory_plan.USABLE * 16e9
    longer = plan_options_of(
        ["--preset", "paper-1.5b-lora-16gb", "--max-completion-length", "2048"]
    )
    assert not memory_plan.holds(memory_plan.plan(cfg.model, longer), 16e9)  # the longest that fits
    cuda13 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
    t4 = Precision.choose(
        "auto", torch.device("cuda"), capability=(7, 5), card="Tesla T4", arch_list=cuda13
    )
    assert (run_cfg.lora_rank, run_cfg.precision, t4.name) == (32, "auto", "fp16")


def test_an_fp32_run_on_a_gpu_is_planned_with_fp32_copies_only():
    model = cwgrpo.parse_config([])[0].model
    half = memory_plan.plan(model, plan_options_of([]))
    full = memory_plan.plan(model, plan_options_of(["--precision", "fp32"]))
    assert full["items"]["reference"] == 2 * half["items"]["reference"]
    assert full["items"]["KV cache"] == 2 * half["items"]["KV cache"]
    assert (
        full["items"]["autocast weight copies (bf16)"]
        == 0
        < half["items"]["autocast weight copies (bf16)"]
    )
    assert half["items"]["weights (fp32)"] == full["items"]["weights (fp32)"]
