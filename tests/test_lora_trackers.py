"""LoRA through PEFT (--lora-rank): the reference is the base with the adapter off, checkpoints
hold the adapter, a resume continues exactly, the final model is merged, and the memory plan's
items are the real allocations; and the trackers (--report-to) read back equal to metrics.jsonl."""

import copy
import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils.machine import memory_plan
from cwgrpo_utils.models import loading, lora
from cwgrpo_utils.options.run_config import RunConfig
from cwgrpo_utils.run import checkpoints, trackers
from tests.support import (
    LORA_ARGS,
    SMALL_SHAPE,
    Crash,
    crash_at_save,
    read_metrics,
    saved_activation_bytes,
    tensorboard_records,
)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, TINY_RUN):
    """The four steps of TINY_RUN with a rank-4 adapter, a checkpoint every two."""
    out = tmp_path_factory.mktemp("lora") / "run"
    cwgrpo.main(*cwgrpo.parse_config([*TINY_RUN, *LORA_ARGS, "--output-dir", str(out)]))
    return out


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))


def test_the_adapter_starts_as_the_base_and_the_reference_is_the_base(tiny_base, lora_run):
    base = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    model = lora.adapted(copy.deepcopy(base), 4, 8, "all-linear", seed=0)
    assert torch.equal(logits(model, IDS), logits(base, IDS))  # B = 0: the base exactly
    assert read_metrics(lora_run / "metrics.jsonl")[0]["kl_mean"] == 0.0  # so step 1's KL is 0
    trained = lora.load_adapter(copy.deepcopy(base), lora_run / "checkpoint-4")
    assert not torch.allclose(logits(trained, IDS), logits(base, IDS))
    with lora.reference_of(trained, None) as reference:  # the adapter off: the base itself
        assert torch.equal(logits(reference, IDS), logits(base, IDS))
    assert not torch.allclose(logits(trained, IDS), logits(base, IDS))  # and on again after


def test_checkpoints_hold_the_adapter_and_the_final_model_is_merged(tiny_base, lora_run):
    files = {p.name for p in (lora_run / "checkpoint-4").iterdir()}
    assert {"adapter_model.safetensors", "trainer_state.pt", "optimizer.pt"} <= files
    assert "model.safetensors" not in files  # the adapter only, not the base again
    config = json.loads((lora_run / "checkpoint-4" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_base / "model") and config["r"] == 4
    final = AutoModelForCausalLM.from_pretrained(lora_run / "final-model")  # a plain model
    base = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    trained = lora.load_adapter(base, lora_run / "checkpoint-4", trainable=False)
    torch.testing.assert_close(logits(final, IDS), logits(trained, IDS), atol=1e-5, rtol=1e-5)
    # evaluate.py and the tools load an adapter checkpoint as the model it amounts to
    adapter = loading.load_model(str(lora_run / "checkpoint-4"), torch.float32, "cpu")
    torch.testing.assert_close(logits(adapter, IDS), logits(final, IDS), atol=1e-5, rtol=1e-5)


def test_a_lora_resume_reproduces_the_uninterrupted_run(lora_run, tmp_path, TINY_RUN, monkeypatch):
    crashed = tmp_path / "crashed"
    args = [*TINY_RUN, *LORA_ARGS, "--output-dir", str(crashed)]
    crash_at_save(monkeypatch, 2)  # during step 4's save: no checkpoint-4, no final model
    with pytest.raises(Crash):
        cwgrpo.main(*cwgrpo.parse_config(args))
    monkeypatch.undo()
    assert checkpoints.latest_checkpoint(crashed).name == "checkpoint-2"
    cwgrpo.main(*cwgrpo.parse_config([*args, "--resume"]))
    assert read_metrics(crashed / "metrics.jsonl") == read_metrics(lora_run / "metrics.jsonl")


def test_the_adapter_learns_through_gradient_checkpointing(tiny_base):
    base = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    grads = []
    for checkpointing in (False, True):
        model = lora.adapted(copy.deepcopy(base), 4, 8, "all-linear", seed=0).train()
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # B != 0, so A's gradient is not 0 either
                parameter.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        if checkpointing:
            loading.enable_checkpointing(model)
        model(input_ids=IDS, labels=IDS).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj,down_proj"])
def test_the_lora_plan_is_the_real_allocations(tmp_path, targets, checkpointing, share):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_SHAPE))
    model.save_pretrained(tmp_path)
    options = ["--group-size", "4", "--prompts-per-step", "2", "--max-prompt-length", "24"]
    options += ["--max-completion-length", "40", "--length-limit", "new", "--lora-rank", "8"]
    options += ["--lora-target-modules", targets, "--beta", "0.04"]
    options += ["--gradient-checkpointing", str(checkpointing), "--share-prompts", str(share)]
    cfg, run_cfg = cwgrpo.parse_config(options)
    plan = memory_plan.plan(str(tmp_path), memory_plan.PlanOptions.of(cfg, run_cfg), cuda=False)
    items = plan["items"]
    model = lora.adapted(model.requires_grad_(False), 8, 16, targets).train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, 1e-3)
    model(input_ids=IDS % 300, labels=IDS % 300).loss.backward()
    optimizer.step()

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert size(frozen) == items["frozen base weights"]  # fp32 on the CPU, bf16 on CUDA
    assert size(trained) == items["LoRA adapter (fp32)"] == items["gradients (fp32)"]
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert size(moments) == items["AdamW moments (fp32)"]
    assert items["reference"] == 0  # the base with the adapter off
    assert plan["disk"]["checkpoint"] == 3 * size(trained)  # the adapter and AdamW's moments
    # activations: what the adapted model saves for backward, as the full model's are checked
    if checkpointing:
        loading.enable_checkpointing(model)
    measured = saved_activation_bytes(model, cfg, run_cfg, 4, 24, 40)
    planned = items["activations saved for backward"]
    if targets == "all-linear" or checkpointing:  # checkpointed, the layers' inputs alone
        assert measured == pytest.approx(planned, rel=0.03)
    else:  # frozen layers without an adapter keep less: the plan is an upper bound
        assert planned * 0.8 < measured <= planned


def test_the_lora_presets_fit_the_cards_they_name():
    for preset, card in (("paper-1.5b-lora-24gb", 24), ("paper-7b-lora-80gb", 80)):
        cfg, run_cfg = cwgrpo.parse_config(["--preset", preset])
        plan = memory_plan.plan(cfg.model, memory_plan.PlanOptions.of(cfg, run_cfg))
        assert card in memory_plan.fits(plan)[0], preset
        assert run_cfg.lora_rank == 32 and cfg.learning_rate == 1e-5


def test_report_to_checks_the_tracker_and_its_library_at_parse_time():
    with pytest.raises(SystemExit) as error:
        cwgrpo.parse_config(["--preset", "tiny", "--report-to", "tensorbord"])
    assert str(error.value) == (
        "error: --report-to tensorbord: choose none, or some of tensorboard, wandb, trackio"
    )
    with pytest.raises(SystemExit, match="--report-to none goes alone"):
        cwgrpo.parse_config(["--preset", "tiny", "--report-to", "none", "tensorboard"])
    missing = [name for name in trackers.TRACKERS if importlib.util.find_spec(name) is None]
    for name in missing:  # the ones this venv lacks: one line naming the pip package
        with pytest.raises(SystemExit) as error:
            cwgrpo.parse_config(["--preset", "tiny", "--report-to", name])
        assert str(error.value).endswith(f"which is not installed: pip install {name}")
    assert RunConfig().report_to == ["none"]
    if "tensorboard" not in missing:
        _, run_cfg = cwgrpo.parse_config(["--preset", "tiny", "--report-to", "tensorboard"])
        assert run_cfg.report_to == ["tensorboard"]


def test_tensorboard_holds_every_metric_at_its_step_and_the_options(tmp_path, TINY_RUN):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    args = [*TINY_RUN, "--report-to", "tensorboard", "--output-dir", str(out)]
    cwgrpo.main(*cwgrpo.parse_config([*args, "--steps", "2"]))
    cwgrpo.main(*cwgrpo.parse_config([*args, "--resume"]))  # extended to 4 steps, resumed
    records = read_metrics(out / "metrics.jsonl")
    numbers = [{k: v for k, v in r.items() if isinstance(v, int | float)} for r in records]
    logged = tensorboard_records(out)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for back, record in zip(logged, numbers):
        assert back == pytest.approx(record, rel=1e-6)  # float32 in the event files
    reader = importlib.import_module("tensorboard.backend.event_processing.event_accumulator")
    events = reader.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "options/text_summary" in events.Tags()["tensors"]  # the options, once


def test_wandb_offline_and_trackio_continue_their_run_across_a_resume(
    tmp_path, TINY_RUN, monkeypatch
):
    """With no network: W&B in offline mode writes its run files in the run folder, and a resume
    continues the same run id; trackio's local database holds each step once."""
    pytest.importorskip("wandb")
    storage = pytest.importorskip("trackio.sqlite_storage")
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    args = [*TINY_RUN, "--report-to", "wandb", "trackio", "--output-dir", str(out)]
    crash_at_save(monkeypatch, 2)  # during step 4's save: steps 3 and 4 sent, then lost
    with pytest.raises(Crash):
        cwgrpo.main(*cwgrpo.parse_config(args))
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_MODE", "offline")
    ids = json.loads((out / "trackers.json").read_text())
    cwgrpo.main(*cwgrpo.parse_config([*args, "--resume"]))
    assert json.loads((out / "trackers.json").read_text()) == ids | {"sent": 4}
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{ids['wandb']}") for name in runs)
    logs = storage.SQLiteStorage.get_logs("cwgrpo", ids["trackio"])
    assert [log["step"] for log in logs] == [1, 2, 3, 4]
    records = read_metrics(out / "metrics.jsonl")
    assert [log["reward_mean"] for log in logs] == pytest.approx(
        [r["reward_mean"] for r in records]
    )
