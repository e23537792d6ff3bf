"""System tests of the tools: ablation tables and standalone twins, the diagnostics, and
benchmarks/gpu_check.py at tiny shapes."""

import contextlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pandas
import pytest
import torch

import cwgrpo
from cwgrpo_utils.machine.grading_pool import Grader
from cwgrpo_utils.models import loading, smollm2, tiny
from cwgrpo_utils.models.prompts import PromptStream
from cwgrpo_utils.options import cli
from cwgrpo_utils.run import checkpoints, plots
from cwgrpo_verl import data
from tests.support import ROOT, processes_tagged, read_metrics, run_cli
from tools import ablate, diagnose, probe


def test_interval_by_hand():
    assert plots.interval([1.0, 2.0, 3.0]) == pytest.approx((2.0, 4.303 / math.sqrt(3)))
    mean, half = plots.interval([5.0])  # one seed: no interval
    assert mean == 5.0 and math.isnan(half)
    assert plots.cell([5.0]) == "5.000 ± n/a"
    assert ablate.difference([5.0], [4.0]) == "+1.000 ± n/a"  # and never bold


def test_ablate_table_holds_the_runs_figures_and_a_run_equals_its_standalone_twin(
    tmp_path, tiny_args
):
    out = tmp_path / "ablation"
    args = [
        "--methods",
        "grpo,cw-detached=cw --cw-detach",
        "--seeds",
        "2",
        "--no-plot",
        "--output-dir",
        str(out),
        "--",
        *tiny_args[2:],
        "--steps",
        "3",
        "--save-every",
        "3",
    ]
    ablate.ablate(args)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "cw-detached-seed0",
        "cw-detached-seed1",
        "grpo-seed0",
        "grpo-seed1",
    ]
    runs = {
        label: [ablate.run_figures(out / f"{label}-seed{seed}", 0.7) for seed in (0, 1)]
        for label in ("grpo", "cw-detached")
    }
    final = {label: [r["final_accuracy_mean"] for r in rs] for label, rs in runs.items()}
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")
        for line in (out / "ablation.md").read_text().splitlines()
        if line.startswith("| ")
    }
    assert rows["cw-detached"][1] == "`--method cw --cw-detach`"
    assert rows["grpo"][2].endswith(plots.cell(final["grpo"])) and rows["grpo"][3] == "-"
    assert rows["cw-detached"][3].strip("*") == ablate.difference(
        final["cw-detached"], final["grpo"]
    ).strip("*")
    stamp = (out / "grpo-seed0" / "wall_time.json").stat().st_mtime_ns
    ablate.ablate(["--evaluate", *args])  # finished runs are not run again, only judged
    assert (out / "grpo-seed0" / "wall_time.json").stat().st_mtime_ns == stamp
    held_out = [  # what each run's evaluate.py wrote: pass@1 in % on the tiny benchmark
        json.loads((out / f"grpo-seed{seed}" / "eval" / "results.json").read_text())
        for seed in (0, 1)
    ]
    assert [len(r["benchmarks"]) for r in held_out] == [1, 1]
    assert [r["config"]["n"] for r in held_out] == [8, 8]
    table = (out / "ablation.md").read_text()
    assert "--evaluate" in table and "| held-out pass@1 | Δ held-out |" in table
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.splitlines()[4:]}
    assert rows["grpo"][4] == plots.cell([r["average_pass@1"] / 100 for r in held_out])
    whole_curve = [  # the mean of every rollout step's accuracy, each seed's run
        statistics.fmean(
            r["accuracy_mean"]
            for r in read_metrics(out / f"grpo-seed{seed}" / "metrics.jsonl")
            if r["update_pass"] == 0
        )
        for seed in (0, 1)
    ]
    assert rows["grpo"][6] == plots.cell(whole_curve) and rows["grpo"][7] == "-"
    judged = (out / "grpo-seed0" / "eval-log.txt").stat().st_mtime_ns
    ablate.ablate(["--evaluate", *args])  # each model is judged once
    assert (out / "grpo-seed0" / "eval-log.txt").stat().st_mtime_ns == judged
    # a run stopped before its first checkpoint (killed, or its disk full) starts again afresh
    stopped = out / "grpo-seed0"
    finished = read_metrics(stopped / "metrics.jsonl")
    for part in ("checkpoint-3", "final-model", "eval"):
        shutil.rmtree(stopped / part)
    (stopped / "wall_time.json").unlink()
    (stopped / "metrics.jsonl").write_text(json.dumps(finished[0]) + "\n")
    ablate.ablate(args)
    assert read_metrics(stopped / "metrics.jsonl") == finished
    # the standalone twin: the same options, one thread and one grading process
    twin = run_cli(
        *tiny_args,
        "--method",
        "cw",
        "--cw-detach",
        "--seed",
        "1",
        "--steps",
        "3",
        "--save-every",
        "3",
        "--threads",
        "1",
        "--reward-workers",
        "1",
        "--output-dir",
        str(tmp_path / "twin"),
    )
    assert twin.returncode == 0, twin.stderr
    assert read_metrics(tmp_path / "twin" / "metrics.jsonl") == read_metrics(
        out / "cw-detached-seed1" / "metrics.jsonl"
    )
    recorded = json.loads((out / "cw-detached-seed1" / "run_config.json").read_text())
    assert (recorded["torch_threads"], recorded["reward_workers_used"]) == (1, 1)
    with pytest.raises(SystemExit, match="unknown method nope"):
        ablate.ablate(["--methods", "grpo,nope", "--no-plot", "--output-dir", str(out)])


def test_ablate_stopped_or_killed_leaves_no_run_behind_and_the_rerun_resumes_each(
    tmp_path, tiny_args
):
    out = tmp_path / "ablation"
    args = ["--methods", "grpo", "--seeds", "2", "--workers", "2", "--no-plot"]
    args += ["--output-dir", str(out), "--", *tiny_args[2:], "--steps", "40", "--save-every", "1"]
    runs = [out / f"grpo-seed{seed}" for seed in (0, 1)]
    marker = f"ablate-stop-{os.getpid()}"

    def started_until_step(step: int) -> subprocess.Popen:
        ablation = subprocess.Popen(
            [sys.executable, "-m", "tools.ablate", *args],
            cwd=ROOT,
            env={**os.environ, "CWGRPO_TEST_MARKER": marker},
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 300  # a hang guard
        while not all(last_step(run) >= step for run in runs):
            assert time.time() < deadline and ablation.poll() is None, "the runs did not start"
            time.sleep(0.1)
        return ablation

    def last_step(run) -> int:
        records = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        return records[-1]["rollout_step"] if records else 0

    def no_process_left(marker: str) -> bool:
        deadline = time.time() + 15  # the runs stop after their step, or at once
        while processes_tagged(marker) and time.time() < deadline:
            time.sleep(0.2)
        return processes_tagged(marker) == []

    def signalled(run) -> int:
        return (run / "log.txt").read_text().count("SIGTERM: stopping after this step")

    ablation = started_until_step(1)
    ablation.send_signal(signal.SIGTERM)
    _, stderr = ablation.communicate(timeout=300)
    assert ablation.returncode == 1
    assert stderr.strip().splitlines()[-1] == (
        "stopped by SIGTERM, each unfinished run with a checkpoint; resume with: "
        f"python -m tools.ablate {shlex.join(args)}"
    )
    assert no_process_left(marker)
    for run in runs:  # one SIGTERM each, so each finished its step and saved it
        assert signalled(run) == 1 and "stopped after step" in (run / "log.txt").read_text()
        assert checkpoints.latest_checkpoint(run).name == f"checkpoint-{last_step(run)}"
        assert not ablate.wall_time(run)["finished"]
    first_part = [ablate.wall_time(run)["wall_s"] for run in runs]
    ablation = started_until_step(max(last_step(run) for run in runs) + 1)
    ablation.kill()  # no goodbye: the kernel signals each run (PR_SET_PDEATHSIG)
    ablation.wait()
    assert no_process_left(marker)
    for run in runs:  # its second part (each part adds to the log) ended by the kernel's signal
        second = (run / "log.txt").read_text().split("cwgrpo: --method")[2]
        assert "stopped after step" in second or "interrupted: the step under way" in second
    ablate.ablate(args)  # the same command, to the end
    for run, earlier in zip(runs, first_part):
        records = read_metrics(run / "metrics.jsonl")
        steps = [r["rollout_step"] for r in records if r["update_pass"] == 0]
        assert steps == list(range(1, 41))
        assert ablate.wall_time(run)["finished"]
        assert ablate.wall_time(run)["wall_s"] > earlier  # the parts add up (kill -9's is lost)


def test_ablate_stops_at_a_failed_run_and_starts_no_other(tmp_path, tiny_base):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1"}\n')  # no answer to grade against
    out = tmp_path / "ablation"
    bad = f"bad=grpo --dataset {tmp_path / 'bad.jsonl'}"
    good = f"good=grpo --dataset {tiny_base / 'arithmetic.jsonl'}"
    args = ["--methods", f"{bad},{good}", "--seeds", "1", "--workers", "1", "--no-plot"]
    args += ["--output-dir", str(out), "--", "--model", str(tiny_base / "model"), "--steps", "2"]
    with pytest.raises(SystemExit, match=f"error: bad seed 0 failed; see {out}/bad-seed0/log.txt"):
        ablate.ablate(args)
    log = (out / "bad-seed0" / "log.txt").read_text().splitlines()
    assert log[-1].startswith("error: ") and "no column" in log[-1]  # cwgrpo.py's one line
    assert not (out / "good-seed0").exists()  # queued behind it, never started


def test_concentration_hand_computed():
    # 4 positive scores (10, 3, 2, 1) and 2 negative (-6, -2); zeros belong to neither side
    scores = torch.tensor([1.0, -2.0, 10.0, 0.0, 3.0, -6.0, 2.0])
    result = diagnose.concentration(scores)
    # top 0.01%, 0.1%, 1% of 4 tokens: 1 token; 10%: ceil(0.4) = 1; 100%: all four
    assert result["positive"] == {0.0001: 10.0, 0.001: 10.0, 0.01: 10.0, 0.1: 10.0, 1.0: 4.0}
    assert result["negative"] == {0.0001: -6.0, 0.001: -6.0, 0.01: -6.0, 0.1: -6.0, 1.0: -4.0}
    many = torch.arange(
        1.0, 1001.0
    )  # top 1% of 1000 = the 10 largest: mean 995.5; top 10%: mean 950.5
    assert diagnose.concentration(many)["positive"][0.01] == 995.5
    assert diagnose.concentration(many)["positive"][0.1] == 950.5
    assert diagnose.concentration(many)["negative"][1.0] == 0.0


def test_quantile_masks_partition():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0))
    masks = diagnose.quantile_masks(values, 4)
    assert torch.equal(sum(m.long() for m in masks), torch.ones(1001, dtype=torch.long))
    assert [int(m.sum()) for m in masks] == [251, 250, 250, 250]
    assert all(values[a].max() <= values[b].min() for a, b in zip(masks, masks[1:]))


@pytest.fixture(scope="module")
def scored_rollout(tiny_run, tiny_base):
    cfg, run_cfg = cwgrpo.parse_config(
        ["--preset", "tiny", "--prompts-per-step", "4", "--groups-per-micro-batch", "2"]
    )
    tokenizer = loading.load_tokenizer(str(tiny_run / "final-model"))
    model = loading.load_model(str(tiny_run / "final-model"), torch.float32, torch.device("cpu"))
    reference = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    prompts = PromptStream(tiny.arithmetic_dataset(0), tokenizer, cfg)
    questions = prompts.next_batch(4)
    golds = [gold for _, gold in questions for _ in range(cfg.group_size)]
    passes = cwgrpo.Passes.of(cfg, run_cfg)
    samples = cwgrpo.sample(model, tokenizer, [ids for ids, _ in questions], cfg, passes)
    with Grader(cwgrpo.grade_accuracy, cwgrpo.TIMED_OUT) as grader:
        grades = grader.map([(t, g, "default") for t, g in zip(samples.texts, golds)])
    rewards = cwgrpo.rewards_of(samples.texts, grades, cfg)
    advantages = cwgrpo.group_advantages(rewards.total, cfg.group_size)
    ref_logp = cwgrpo.token_stats(reference, samples, cfg, passes).logp
    rollout = cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=ref_logp)
    return model, rollout, cfg, passes


def test_quartile_gradients_sum_to_the_full_gradient(scored_rollout):
    model, rollout, cfg, passes = scored_rollout
    valid = rollout.completion_mask.bool()
    prob = cwgrpo.token_stats(model, rollout, cfg, passes).logp.exp()[valid]
    quartiles = [diagnose.scatter_valid(q, valid) for q in diagnose.quantile_masks(prob, 4)]
    assert torch.equal(sum(quartiles), rollout.completion_mask)

    def gradient(tokens):
        model.zero_grad(set_to_none=True)
        diagnose.step_gradient(model, rollout, cfg, passes, contextlib.nullcontext, only=tokens)
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = gradient(rollout.completion_mask)
    parts = [gradient(q) for q in quartiles]
    model.zero_grad(set_to_none=True)
    assert full.norm() > 0 and all(p.norm() > 0 for p in parts)
    torch.testing.assert_close(sum(parts), full, rtol=1e-4, atol=1e-6)


def test_diagnose_batch_report(scored_rollout):
    model, rollout, cfg, passes = scored_rollout
    rng = torch.get_rng_state()
    report = diagnose.diagnose_batch(model, rollout, cfg, passes, contextlib.nullcontext)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert set(report["full_gradient_norm"]) == {"beta=0", "beta=0.04"}
    assert (
        sum(q["tokens"] for q in report["quartiles"])
        == report["tokens"]
        == int(rollout.completion_mask.sum())
    )
    # with beta = 0 the token weight is the advantage alone: the KL part is zero
    valid = rollout.completion_mask.bool()
    prob = cwgrpo.token_stats(model, rollout, cfg, passes).logp.exp()[valid]
    adv = rollout.advantages[:, None].expand_as(rollout.completion_mask)[valid]
    for q, mask in zip(report["quartiles"], diagnose.quantile_masks(prob, 4)):
        assert q["beta=0"]["abs_weight_mean"] == pytest.approx(
            adv[mask].abs().mean().item(), rel=1e-5
        )
    assert any(
        q["beta=0.04"]["abs_weight_mean"] != q["beta=0"]["abs_weight_mean"]
        for q in report["quartiles"]
    )
    assert len(report["cw_weight_by_covariance_decile"]) == 10


def test_diagnose_batch_honours_or_refuses_each_option(tiny_base, tmp_path, capsys):
    model = ["--preset", "tiny", "--model", str(tiny_base / "model")]
    out = tmp_path / "diag"
    diagnose.batch([*model, "--plan", "--diagnostics-dir", str(out)])
    assert "fits: 12, 16, 24, 40, 48, 80, 141 GB" in capsys.readouterr().out  # the plan ...
    assert not out.exists()  # ... and no batch
    with pytest.raises(SystemExit) as error:
        diagnose.batch([*model, "--steps", "5"])
    assert str(error.value) == (
        "error: --steps has no effect in python -m tools.diagnose batch; drop it"
    )
    shown = subprocess.run(
        [sys.executable, "-m", "tools.diagnose", "batch", "--help"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    ).stdout  # fmt: skip
    assert "--plan" in shown and "--threads" in shown and "--steps" not in shown


def test_diagnose_command_and_training_diagnostics(tiny_run, tiny_base, tmp_path, TINY_RUN, capsys):
    out = tmp_path / "diag"
    diagnose.batch(
        [
            "--preset",
            "tiny",
            "--model",
            str(tiny_run / "final-model"),
            "--reference-model",
            str(tiny_base / "model"),
            "--diagnostics-dir",
            str(out),
            "--prompts-per-step",
            "2",
            "--dataset",
            str(tiny_base / "arithmetic.jsonl"),
        ]
    )
    table = (out / "diagnostics.md").read_text()
    assert "## Covariance concentration" in table
    assert capsys.readouterr().out.endswith(f"{table}\nwritten: {out / 'diagnostics.md'} and "
                                            f"{out / 'diagnostics.json'}\n")  # fmt: skip
    assert json.loads((out / "diagnostics.json").read_text())["tokens"] > 0
    # --diagnose-every appends figures without changing the training itself
    run = tmp_path / "cw-seed0"
    diagnose.train([*TINY_RUN, "--output-dir", str(run), "--every", "2"])
    assert [
        json.loads(line)["rollout_step"]
        for line in (run / "diagnostics.jsonl").read_text().splitlines()
    ] == [1, 2, 4]  # the first batch too, for first -> last
    assert read_metrics(run / "metrics.jsonl") == read_metrics(tiny_run / "metrics.jsonl")
    for report in map(json.loads, (run / "diagnostics.jsonl").read_text().splitlines()):
        shares = [q["beta=0.04"]["grad_share"] for q in report["quartiles"]]
        assert sum(shares) == pytest.approx(1, abs=1e-4)  # the quartiles' gradients add up
        mass = [report["concentration"]["mass_share"][str(c)] for c in diagnose.MASS_CUTOFFS]
        assert 0 < mass[0] <= mass[1] <= mass[2] <= 1
    # the summary over seeds: a second seed's run, one row for both
    seed1 = tmp_path / "cw-seed1"
    diagnose.train([*TINY_RUN, "--output-dir", str(seed1), "--every", "2", "--seed", "1"])
    table = diagnose.summary(["--runs", str(run), str(seed1), "--output", str(tmp_path / "s.md")])
    row = next(line for line in table.splitlines() if line.startswith("| cw | 2 |"))
    assert row.count(" → ") == 9 and row.count(" ± ") == 11
    assert (tmp_path / "s.md").read_text() == table


def test_ablate_with_diagnostics_tabulates_them_per_method_and_trains_as_without(
    tmp_path, tiny_args
):
    out, steps = tmp_path / "ablation", ["--steps", "3", "--save-every", "3"]
    ablate.ablate(
        ["--methods", "grpo", "--seeds", "2", "--diagnose-every", "2", "--no-plot"]
        + ["--output-dir", str(out), "--publish", str(tmp_path / "pub"), "--", *tiny_args[2:]]
        + steps
    )
    for seed in (0, 1):
        found = (out / f"grpo-seed{seed}" / "diagnostics.jsonl").read_text().splitlines()
        assert [json.loads(line)["rollout_step"] for line in found] == [1, 2]
    table = (out / "ablation-diagnostics.md").read_text()
    assert table.startswith("`python -m tools.ablate --methods grpo --seeds 2 --preset tiny ")
    assert "--diagnose-every 2 -- " in table.splitlines()[0]
    assert next(line for line in table.splitlines() if line.startswith("| grpo | 2 | "))
    assert (tmp_path / "pub-diagnostics.md").read_text() == table
    # measured as it trains, a run equals its standalone twin
    pinned = ["--threads", "1", "--reward-workers", "1", "--output-dir", str(tmp_path / "twin")]
    twin = run_cli(*tiny_args, "--method", "grpo", "--seed", "1", *steps, *pinned)
    assert twin.returncode == 0, twin.stderr
    assert read_metrics(tmp_path / "twin" / "metrics.jsonl") == read_metrics(
        out / "grpo-seed1" / "metrics.jsonl"
    )


def test_ablate_checks_every_runs_options_before_the_first_run(tmp_path, capsys):
    out = tmp_path / "ablation"
    with pytest.raises(SystemExit) as error:
        ablate.ablate(["--methods", "grpo,cw", "--output-dir", str(out), "--", "--stepz", "5"])
    assert str(error.value) == "error: unknown option --stepz; did you mean --steps?"
    with pytest.raises(SystemExit) as error:
        ablate.ablate(["--methods", "grpo", "--output-dir", str(out), "--", "--group-size", "1"])
    assert str(error.value).startswith("error: --group-size must be >= 2")
    assert not out.exists()
    cli.WARNED.clear()
    variants = "g=grpo --ar-alpha 0.9,h=grpo --stepz 1"  # the first one's note, then h's typo
    with pytest.raises(SystemExit, match="unknown option --stepz"):
        ablate.ablate(["--methods", variants, "--output-dir", str(out)])
    assert "--ar-alpha has no effect with --method grpo" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this venv"
)
def test_ablate_refuses_a_vllm_evaluation_without_vllm_before_any_run(tmp_path):
    out = tmp_path / "ablation"
    with pytest.raises(SystemExit) as error:
        ablate.ablate(["--evaluate", "--evaluate-engine", "vllm", "--output-dir", str(out)])
    assert str(error.value).startswith(
        "error: --evaluate-engine vllm needs vLLM, which is not installed: pip install"
    )
    assert not out.exists()


def test_ablate_takes_every_method_and_the_cw_readings_in_one_command():
    runs = ablate.parse_methods("all,cw-readings")
    assert list(runs)[: len(cwgrpo.METHODS)] == list(cwgrpo.METHODS)  # grpo and cw once
    assert list(runs)[len(cwgrpo.METHODS) :] == ["cw-detached", "cw-paper", "cw-gradient-only"]
    assert runs["cw-paper"] == ["--method", "cw", "--cw-reading", "paper"]
    with pytest.raises(SystemExit) as error:
        ablate.parse_methods("cw,cw=cw --cw-detach")
    assert str(error.value) == "error: cw is defined twice; give each variant a label of its own"


def test_ablate_never_reuses_a_run_made_with_other_options(tmp_path, tiny_base, capsys):
    base = ["--methods", "grpo", "--seeds", "1", "--no-plot", "--output-dir", str(tmp_path)]
    run_args = [
        "--",
        "--model",
        str(tiny_base / "model"),
        "--dataset",
        str(tiny_base / "arithmetic.jsonl"),
    ]
    ablate.ablate([*base, *run_args, "--steps", "2"])
    with pytest.raises(SystemExit) as error:
        ablate.ablate([*base, *run_args, "--steps", "3"])
    assert str(error.value) == (
        f"error: 1 run in {tmp_path} was made with other options: grpo-seed0 (--steps 2 -> 3); "
        f"pass --rerun-changed to redo them, or choose another --output-dir"
    )
    ablate.ablate([*base, "--rerun-changed", *run_args, "--steps", "3"])
    assert len(read_metrics(tmp_path / "grpo-seed0" / "metrics.jsonl")) == 3
    table = (tmp_path / "ablation.md").read_text()
    assert "± n/a" in table and "± 0.000" not in table  # one seed: no interval
    assert ": 1 run, " in table and "over seed 0 (one run: no interval)" in table
    printed = capsys.readouterr().out  # it ends by printing the table it wrote
    assert printed.endswith(f"{table}\nwritten: {tmp_path / 'ablation'}.md\n")


def test_ablation_bands_stay_within_each_metrics_range():
    mean, half = [0.05, 0.5, 0.97], [0.2, 0.1, 0.2]
    assert plots.band(mean, half, "accuracy") == (
        [0.0, 0.4, pytest.approx(0.77)],
        [pytest.approx(0.25), 0.6, 1.0],
    )
    assert plots.band([0.1], [0.3], "entropy") == ([0.0], [pytest.approx(0.4)])
    assert plots.band([0.1], [0.3], "loss") == ([pytest.approx(-0.2)], [pytest.approx(0.4)])


def test_ties_fill_every_decile():
    values = torch.cat([torch.zeros(60), torch.linspace(-1, 1, 40)])  # 60% of the scores are 0
    sizes = [int(m.sum()) for m in diagnose.quantile_masks(values, 10)]
    assert sizes == [10] * 10


# with LoRA, as its presets do, 4 of the 12 prompts sampled at once
@pytest.mark.parametrize("lora_rank, rollout_chunk", [("0", "0"), ("4", "4")])
def test_gpu_check_runs_at_tiny_shapes_in_each_precision(lora_rank, rollout_chunk):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", "--lora-rank", lora_rank,
         "--rollout-chunk", rollout_chunk, "--precisions", "fp32,fp16"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,  # a hang guard
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("device: cpu; 137,280 parameters; 12 prompts x G = 12")
    assert lines[0].endswith(
        f", {int(rollout_chunk) or 12} prompts sampled at once; precisions fp32, fp16"
    )
    fp32, fp16 = (  # each precision's steps, after the engine's line (here: vLLM not installed)
        lines.index("precision fp32: as asked:") + 2,
        lines.index("precision fp16: as asked, autocast on the cpu:") + 2,
    )
    assert lines[fp32 - 1].startswith("  vllm: not installed (pip install ")
    for start, dtype in ((fp32, "float32"), (fp16, "float16")):
        section = lines[start : start + 8]
        assert section[0].startswith("  step 1: decode ") and section[1].startswith("  step 2: ")
        assert "|trainer - sampler log-prob| mean " in section[0]
        assert f"  KV cache dtype: torch.{dtype}" in section
        assert (
            "  every logit finite after a left-padded prefill: cwgrpo's mask True, plain mask True"
            in section
        )
    assert "; kl 0; " in lines[fp32]  # the reference is the policy at step 1 (LoRA: the base)
    assert lines[fp32 + 2] == "  loss scale: none (no scaler); steps skipped as not finite: 0 of 2"
    assert lines[fp16 + 2].startswith("  loss scale: 65536 -> ")  # fp16's scaler, its path


def test_gpu_check_without_a_gpu_is_one_line_naming_tiny():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check"], capture_output=True, text=True,
        timeout=600, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""  # nothing was built
    assert done.stderr.strip() == (
        "error: benchmarks.gpu_check measures a CUDA GPU and none was found; "
        "python -m benchmarks.gpu_check --tiny runs the same path at tiny shapes on the CPU"
    )


def test_the_verl_converter_and_reward_need_no_verl(tmp_path):
    """python -m cwgrpo_verl in this venv, which has no verl (CI's main one), as docs/verl.md
    gives it; the parquet in verl's format and the reward verl would call."""
    sample = tmp_path / "open-rs-sample.jsonl"
    sample.write_text(
        '{"problem": "What is 1/2 + 1/4?", '
        '"solution": "It is $\\\\boxed{\\\\frac{3}{4}}$.", "level": 1}\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "cwgrpo_verl", "--dataset", str(sample)]
        + ["--output-dir", str(tmp_path / "verl")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == f"{tmp_path / 'verl' / 'train.parquet'}\n"
    row = pandas.read_parquet(tmp_path / "verl" / "train.parquet").iloc[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"] == "What is 1/2 + 1/4?"
    gold = row["reward_model"]["ground_truth"]
    assert row["reward_model"]["style"] == "rule" and "frac{3}{4}" in gold
    good = "<think>\nadd\n</think>\n<answer>\\boxed{0.75}</answer>"
    assert data.compute_score("open-rs", good, gold) == 2.0
    assert data.compute_score("open-rs", good, gold, {"format_weight": 0}) == 1.0
    assert data.compute_score("open-rs", "\\boxed{1}", gold) == 0.0


def test_probe_tabulates_each_form_from_the_samples_evaluate_py_drew(tmp_path, tiny_base):
    out = tmp_path / "probe"
    args = ["--model", str(tiny_base / "model"), "--forms", "sum-1d-1shot,diff-2d1d-3shot"]
    args += ["--problems", "3", "--n", "4", "--temperatures", "0.7,2.0", "--max-new-tokens", "8"]
    table = probe.probe([*args, "--output-dir", str(out)])
    assert (out / "probe.md").read_text() == table
    rows = [line.split(" | ") for line in table.splitlines()[4:]]
    forms = ("sum-1d-1shot", "diff-2d1d-3shot")
    probed = [(form, temperature) for temperature in ("0.7", "2.0") for form in forms]
    assert [(row[0][2:], row[1]) for row in rows] == probed
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    for (form, temperature), row in zip(probed, rows):
        asked = [json.loads(line) for line in (out / f"{form}.jsonl").open()]
        assert [(a["problem"], a["answer"]) for a in asked] == smollm2.task_problems(form, 3, 2)
        sampled = (out / f"eval-t{temperature}" / f"{form}.jsonl").open()
        sampled = [json.loads(line) for line in sampled]
        sampled = sorted(sampled[1:], key=lambda s: s["index"])  # after evaluate.py's header
        assert [(s["prompt"], s["gold"]) for s in sampled] == [
            (a["problem"], str(a["answer"])) for a in asked
        ]
        correct = [[bool(c) for c in s["correct"]] for s in sampled]
        assert all(len(c) == 4 for c in correct)
        accuracy = sum(map(sum, correct)) / 12
        assert row[2].startswith(f"{accuracy:.3f} ± ")
        assert row[3] == f"{sum(0 < sum(c) < 4 for c in correct) / 3:.2f}"
        completions = [c for s in sampled for c in s["completions"]]
        assert row[4] == f"{sum(chr(92) + 'boxed{' in c for c in completions) / 12:.2f}"
        tokens = [len(tokenizer(c)["input_ids"]) for c in completions]
        assert row[5] == f"{sum(tokens) / 12:.1f} |"
    with pytest.raises(SystemExit) as error:
        probe.probe(["--forms", "sum-1d-1shot,sums", "--output-dir", str(tmp_path / "none")])
    assert str(error.value).startswith("error: unknown form sums; choose from sum-1d-fixed, ")
    assert not (tmp_path / "none").exists()


def test_probe_row_by_hand():
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    problems = [
        {"correct": [1, 0, 1, 1], "completions": ["\\boxed{3}", "x", "\\boxed{3}", "3"]},
        {"correct": [0, 0, 0, 0], "completions": ["ab", "", "\\boxed{4}", "abcd"]},
        {"correct": [1, 1, 1, 1], "completions": ["1", "1", "1", "1"]},
    ]
    row = probe.form_row("sum-1d-1shot", "0.7", problems, tokenizer)
    per_problem = [0.75, 0.0, 1.0]
    assert row["accuracy"] == statistics.fmean(per_problem)  # 7 of 12 samples
    assert row["half"] == plots.interval(per_problem)[1]
    assert row["signal"] == 1 / 3  # only the first group's rewards differ
    assert row["boxed"] == 3 / 12
    lengths = [len(tokenizer(c)["input_ids"]) for p in problems for c in p["completions"]]
    assert row["tokens"] == sum(lengths) / 12 and lengths[:2] == [len("\\boxed{3}"), 1]
