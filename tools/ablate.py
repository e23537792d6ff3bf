"""Methods x seeds on one preset, side by side: a table with intervals, and a plot.

    python -m tools.ablate                                  # every method, seeds 0-4, tiny preset
    python -m tools.ablate --methods cw-readings            # GRPO and the readings of CW-GRPO
    python -m tools.ablate --preset tiny-chain --methods all,cw-readings   # both, on the chain task
    python -m tools.ablate --methods grpo,cw -- --steps 300 # options after -- go to every run
    python -m tools.ablate --methods grpo,cw --evaluate     # and held-out pass@1 of each model

Each run is `python cwgrpo.py` in its own process and folder (<label>-seed<seed>/), as many at a
time as there are cores, each with one torch thread and one grading process, so a run here equals
the standalone command with the same options (`--threads 1 --reward-workers 1`) step for step.
Ctrl-C or SIGTERM stops the runs under way after their step, each with a checkpoint; rerunning
the same command skips finished runs and resumes unfinished ones. A method can carry options of
its own: `--methods "grpo,cw-detached=cw --cw-detach"`.
"""

import ctypes
import dataclasses
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

import cwgrpo
from cwgrpo_utils.models import preset_models
from cwgrpo_utils.options import presets
from cwgrpo_utils.options.cli import arg, parse_dataclasses, require
from cwgrpo_utils.run import checkpoints, plots
from cwgrpo_utils.run.folder import StopRequest, option_differences, read_records
from tools import diagnose

CWGRPO = Path(cwgrpo.__file__).resolve()
EVALUATE = CWGRPO.parent / "evaluate.py"
CW_READING_RUNS = (
    "grpo,cw,cw-detached=cw --cw-detach,cw-paper=cw --cw-reading paper,"
    "cw-gradient-only=cw --cw-reading gradient-only"
)


@dataclass
class AblationConfig:
    methods: str = arg(
        "all",
        "comma-separated methods (label=method options for a variant), "
        "all, or cw-readings (GRPO and CW-GRPO's readings)",
    )
    seeds: int = arg(5, "runs per method, with seeds 0 .. seeds-1")
    preset: Literal[tuple(presets.PRESETS)] = arg(
        "tiny", "the recipe every run uses; options after -- go to every run"
    )
    output_dir: str = arg(
        "runs/ablation", "gets <label>-seed<seed>/ per run, ablation.md and ablation.png"
    )
    publish: str = arg("", "also write the table and plot here, as <publish>.md and .png")
    workers: int = arg(0, "runs at a time; 0 is one per CPU core")
    diagnose_every: int = arg(
        0,
        "also measure the papers' diagnostics (python -m tools.diagnose train) at the first "
        "rollout step and every this many, and tabulate them per method; 0: off",
        ">= 0",
    )
    evaluate: bool = arg(
        False,
        "judge each final model as its run's printed evaluate.py command does (the preset's "
        "held-out benchmark, n = 8) and give its pass@1 beside the training accuracy",
    )
    evaluate_engine: Literal["hf", "vllm"] = arg(
        "hf", "--evaluate's sampler (evaluate.py --engine): vllm is the faster on a real model"
    )
    threshold: float = arg(
        0.7, "accuracy for 'steps to threshold' (first step whose 10-step mean reaches it)"
    )
    plot: bool = arg(True, "draw ablation.png")
    rerun_changed: bool = arg(
        False, "rerun from scratch the runs whose recorded options differ from the ones asked for"
    )


def parse_methods(spec: str) -> dict[str, list[str]]:
    """label -> the cwgrpo.py options that make it; "all" and "cw-readings" stand for their lists
    (together, "all,cw-readings", GRPO and CW-GRPO run once)."""
    method_sets = {"all": ",".join(cwgrpo.METHODS), "cw-readings": CW_READING_RUNS}
    entries = ",".join(method_sets.get(entry.strip(), entry) for entry in spec.split(","))
    runs = {}
    for entry in filter(None, (e.strip() for e in entries.split(","))):
        label, _, definition = entry.partition("=")
        method, *options = shlex.split(definition or label)
        if method not in cwgrpo.METHODS:
            raise SystemExit(
                f"error: unknown method {method}; choose from {', '.join(cwgrpo.METHODS)}"
            )
        label, options = label.strip(), ["--method", method, *options]
        if runs.setdefault(label, options) != options:
            raise SystemExit(
                f"error: {label} is defined twice; give each variant a label of its own"
            )
    return runs


def difference(values: list[float], baseline: list[float], digits: int = 3) -> str:
    """The paired difference over seeds, with its 95% interval; bold when it excludes 0."""
    mean, half = plots.interval([v - b for v, b in zip(values, baseline)])
    text = f"{mean:+.{digits}f} ± {plots.plus_minus(half, digits)}"
    return f"**{text}**" if abs(mean) > half else text  # False for NaN: one seed finds nothing


def run_figures(run_dir: Path, threshold: float) -> dict:
    """Per rollout step: accuracy and entropy; the run's first and final figures (10% each)."""
    every_update = read_records(run_dir / "metrics.jsonl")
    records = [r for r in every_update if r["update_pass"] == 0]  # one per rollout step
    summary = {
        "accuracy": [r["accuracy_mean"] for r in records],
        "entropy": [r["entropy_mean"] for r in records],
        "touched_frac": statistics.fmean(r["touched_frac"] for r in every_update),
    }
    # the whole curve: every step's accuracy counts, so a run is read from all its samples, not
    # from the last 10% of steps alone
    summary["mean_accuracy"] = statistics.fmean(summary["accuracy"])
    for key in ("accuracy_mean", "format_mean", "reward_mean", "entropy_mean"):
        summary["first_" + key], summary["final_" + key] = plots.first_to_last(records, key)
    reached = [
        r["rollout_step"]
        for r, a in zip(records, plots.moving_average(summary["accuracy"]))
        if a >= threshold
    ]
    summary["steps_to_threshold"] = reached[0] if reached else None
    summary["wall_s"] = wall_time(run_dir)["wall_s"]
    results = run_dir / "eval" / "results.json"  # --evaluate's, in % over the benchmarks
    if results.is_file():
        summary["held_out_pass@1"] = json.loads(results.read_text())["average_pass@1"] / 100
    return summary


def run_arguments(
    options: list[str], seed: int, run_dir: Path, acfg: AblationConfig, run_args: list
) -> list[str]:
    """cwgrpo.py's command line for one run of the ablation."""
    pinned = ["--threads", "1", "--reward-workers", "1"]
    return [
        "--preset",
        acfg.preset,
        *options,
        "--seed",
        str(seed),
        "--output-dir",
        str(run_dir),
        *pinned,
        *run_args,
    ]


def run_configs(runs: list, methods: dict, acfg: AblationConfig, run_args: list) -> dict:
    """Every run's options (its Config and RunConfig), parsed before any run starts: a typo in the
    options, or a value out of range, stops here in one line, with no folder made; an option a
    method ignores is noted."""
    return {
        run_dir: cwgrpo.parse_config(run_arguments(methods[label], seed, run_dir, acfg, run_args))
        for label, seed, run_dir in runs
    }


def changed_runs(configs: dict) -> dict:
    """The runs already in the folder whose recorded options are not the ones asked for now,
    each with what differs (a finished 10-step run is not a 30-step one)."""
    changed = {}
    for run_dir, (cfg, run_cfg) in configs.items():
        if (run_dir / "run_config.json").is_file():
            recorded = json.loads((run_dir / "run_config.json").read_text())
            asked = dataclasses.asdict(cfg) | dataclasses.asdict(run_cfg)
            differences = option_differences(recorded, asked)
            if differences:
                changed[run_dir] = f"{run_dir.name} ({'; '.join(differences)})"
    return changed


def run_one(
    label: str, options: list[str], seed: int, run_dir: Path, acfg: AblationConfig, run_args: list
) -> None:
    if CHILDREN.stopped_by:  # before making its folder: a run the stop caught queued
        raise Stopped
    if not wall_time(run_dir)["finished"]:
        train_one(label, options, seed, run_dir, acfg, run_args)
    if acfg.evaluate and not (run_dir / "eval" / "results.json").is_file():
        evaluate_one(run_dir, acfg)


def evaluation_engine(run_dir: Path) -> str | None:
    """The sampler that judged the run's final model (--evaluate), None if none has."""
    results = run_dir / "eval" / "results.json"
    if not results.is_file():
        return None
    return json.loads(results.read_text())["config"]["engine"]


def wall_time(run_dir: Path) -> dict:
    """<run>/wall_time.json: the run's wall time over all its parts so far, and whether it
    finished (a file from before that flag was written only by a finished run)."""
    path = run_dir / "wall_time.json"
    if not path.is_file():
        return {"wall_s": 0.0, "finished": False}
    return {"finished": True, **json.loads(path.read_text())}


def train_one(
    label: str, options: list[str], seed: int, run_dir: Path, acfg: AblationConfig, run_args: list
) -> None:
    every = acfg.diagnose_every
    program = ["-m", "tools.diagnose", "train", "--every", str(every)] if every else [str(CWGRPO)]
    command = [sys.executable, *program, *run_arguments(options, seed, run_dir, acfg, run_args)]
    earlier = 0.0  # the wall time of a resumed run's parts before this one
    if checkpoints.latest_checkpoint(run_dir) is not None:
        command.append("--resume")
        earlier = wall_time(run_dir)["wall_s"]
    elif (run_dir / "run_config.json").exists():  # stopped before its first checkpoint
        command.append("--overwrite-output-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    start, finished = time.perf_counter(), False
    try:
        CHILDREN.run_logged(command, run_dir / "log.txt", f"{label} seed {seed}")
        finished = True
    finally:
        spent = earlier + time.perf_counter() - start
        record = {"wall_s": spent, "finished": finished}
        (run_dir / "wall_time.json").write_text(json.dumps(record))


def evaluate_one(run_dir: Path, acfg: AblationConfig) -> None:
    """The run's final model judged by the evaluate.py command the run printed, on one thread
    and one grading process, into <run>/eval; evaluate.py keeps the problems it finished, so a
    stopped evaluation resumes where it was."""
    options = presets.final_model_evaluation(run_dir, acfg.preset)
    options += ["--engine", acfg.evaluate_engine, "--reward-workers", "1"]
    options += ["--output-dir", str(run_dir / "eval")]
    evaluate = [sys.executable, str(EVALUATE), *options]
    CHILDREN.run_logged(evaluate, run_dir / "eval-log.txt", f"evaluating {run_dir.name}")


class Stopped(Exception):
    """A run or evaluation ended by the ablation's stop, not by its own failure."""


class Children:
    """The ablation's training and evaluation processes. Each runs in a process group of its own,
    so a terminal's Ctrl-C or `timeout`'s signal reaches it once, through here: the first Ctrl-C
    or SIGTERM to the ablation, or a run's failure, sends each running one SIGTERM (cwgrpo.py
    finishes its step and saves a checkpoint) and starts no more, so that rerunning the command
    resumes them; a second one sends another (they stop at once). Should the ablation die
    unwarned (kill -9), so do they, losing the step under way as a killed run does: the kernel
    sends them SIGTERM as each of its threads ends (PR_SET_PDEATHSIG)."""

    SIGNALS = StopRequest.SIGNALS  # the names a run gives the same signals

    def __enter__(self) -> "Children":
        self.running, self.lock, self.stopped_by, self.previous = set(), threading.RLock(), "", {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def handle(self, number: int, _frame) -> None:
        name = self.SIGNALS[number]
        print(f"\n{name}: stopping the runs after their step, with a checkpoint", file=sys.stderr)
        self.stop(name)

    def stop(self, reason: str) -> None:
        with self.lock:  # re-entrant: a signal may land while the main thread is in here
            self.stopped_by = self.stopped_by or reason
            for process in self.running:
                process.send_signal(signal.SIGTERM)

    def run_logged(self, command: list[str], log_path: Path, what: str) -> None:
        """command on one torch thread, its output added to log_path; a failure stops the
        ablation in one line naming `what` and the log."""
        with log_path.open("a") as log, self.lock:
            if self.stopped_by:
                raise Stopped
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                # tools.diagnose runs as a module of the repository, from any folder
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(CWGRPO.parent)},
                process_group=0,
                preexec_fn=die_with_parent,
            )
            self.running.add(process)
        returncode = process.wait()
        with self.lock:
            self.running.discard(process)
            if returncode and self.stopped_by:
                raise Stopped
        if returncode:
            self.stop(f"{what} failing")  # here, so that this thread's next run sees it
            raise SystemExit(f"error: {what} failed; see {log_path}")

    def __exit__(self, *_) -> None:
        for number, previous in self.previous.items():
            signal.signal(number, previous)


# looked up here: between fork and exec a child may not load anything (another thread of the
# ablation may have held the loader's lock when it forked)
PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


def die_with_parent() -> None:
    """In a child, before it starts: SIGTERM when the ablation's thread that started it ends (and
    again as each thread it passes to ends)."""
    if PRCTL is not None:
        PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


CHILDREN = Children()  # one per process, as the signals it answers are


def ablate(argv: list) -> Path:
    split = argv.index("--") if "--" in argv else len(argv)
    own, run_args = argv[:split], argv[split + 1 :]
    (acfg,), _ = parse_dataclasses(AblationConfig, own, prog="python -m tools.ablate")
    methods = parse_methods(acfg.methods)
    if acfg.evaluate and acfg.evaluate_engine == "vllm":
        require("vllm", "--evaluate-engine vllm")
    if acfg.plot:
        plots.pyplot()  # fail now, not after the runs, if matplotlib is missing
    output_dir = Path(acfg.output_dir)
    runs = [
        (label, seed, output_dir / f"{label}-seed{seed}")
        for label in methods
        for seed in range(acfg.seeds)
    ]
    configs = run_configs(runs, methods, acfg, run_args)
    first = configs[runs[0][2]][0]  # the preset's model and task, built once before the runs
    preset_models.ready(first.model, first.dataset)
    output_dir.mkdir(parents=True, exist_ok=True)
    changed = changed_runs(configs)
    if changed and not acfg.rerun_changed:
        raise SystemExit(
            f"error: {counted(len(changed), 'run')} in {output_dir} "
            f"{'was' if len(changed) == 1 else 'were'} made with other options: "
            f"{', '.join(changed.values())}; pass --rerun-changed to redo them, or choose "
            f"another --output-dir"
        )
    for run_dir in changed:
        shutil.rmtree(run_dir)
    judged_otherwise = [
        run_dir.name
        for _, _, run_dir in runs
        if acfg.evaluate and evaluation_engine(run_dir) not in (None, acfg.evaluate_engine)
    ]
    if judged_otherwise:
        raise SystemExit(
            f"error: {', '.join(judged_otherwise)} in {output_dir} were judged with another "
            f"--evaluate-engine; pass the one they were judged with, or delete their eval/ "
            f"folders to judge them again"
        )
    workers = acfg.workers or os.cpu_count() or 1
    try:
        with CHILDREN, ThreadPoolExecutor(workers) as pool:
            jobs = [
                pool.submit(run_one, label, methods[label], seed, run_dir, acfg, run_args)
                for label, seed, run_dir in runs
            ]
            try:
                for job in tqdm(as_completed(jobs), total=len(jobs), desc="ablation"):
                    job.result()
            except BaseException:  # a run failed, or the stop: the others stop where they are
                CHILDREN.stop("an error")
                for job in jobs:
                    job.cancel()
                raise
    except Stopped:
        raise SystemExit(
            f"stopped by {CHILDREN.stopped_by}, each unfinished run with a checkpoint; resume "
            f"with: python -m tools.ablate {shlex.join(argv)}"
        ) from None
    summaries = {
        label: [run_figures(d, acfg.threshold) for lb, _, d in runs if lb == label]
        for label in methods
    }
    table = ablation_table(summaries, methods, acfg, run_args, workers)
    print(table)
    if acfg.diagnose_every:  # the papers' measurements per method, beside the table
        found = {
            label: [diagnose.run_summary(d) for lb, _, d in runs if lb == label]
            for label in methods
        }
        diagnostics = diagnose.summary_table(found, command(acfg, run_args))
        print(diagnostics)
    for stem in filter(None, (output_dir / "ablation", acfg.publish and Path(acfg.publish))):
        Path(stem).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{stem}.md").write_text(table)
        if acfg.diagnose_every:
            Path(f"{stem}-diagnostics.md").write_text(diagnostics)
        if acfg.plot:
            plots.plot_ablation(
                Path(f"{stem}.png"),
                {
                    label: {key: [r[key] for r in runs] for key in ("accuracy", "entropy")}
                    for label, runs in summaries.items()
                },
                f"preset {acfg.preset}: mean over {acfg.seeds} seeds, band: 95% interval",
            )
        print(f"written: {stem}.md" + f" and {stem}.png" * acfg.plot)
    return output_dir


def command(acfg: AblationConfig, run_args: list) -> str:
    """The command that makes this ablation, as its tables quote it."""
    every = f" --diagnose-every {acfg.diagnose_every}" if acfg.diagnose_every else ""
    evaluate = " --evaluate" if acfg.evaluate else ""
    evaluate += f" --evaluate-engine {acfg.evaluate_engine}" * (acfg.evaluate_engine != "hf")
    options = f" -- {shlex.join(run_args)}" if run_args else ""
    return (
        f"python -m tools.ablate --methods {shlex.quote(acfg.methods)} --seeds {acfg.seeds} "
        f"--preset {acfg.preset}{every}{evaluate}{options}"
    )


def counted(n: int, thing: str) -> str:
    """'1 run', '2 runs'."""
    return f"{n} {thing}{'s' * (n != 1)}"


def ablation_table(
    summaries: dict, methods: dict, acfg: AblationConfig, run_args: list, workers: int
) -> str:
    seeds, baseline = acfg.seeds, summaries.get("grpo")
    run_minutes = sum(r["wall_s"] for runs in summaries.values() for r in runs) / 60
    over = "seed 0 (one run: no interval)" if seeds == 1 else f"seeds 0-{seeds - 1}"
    lines = [
        f"`{command(acfg, run_args)}`: {counted(len(methods) * seeds, 'run')}, "
        f"{run_minutes:.1f} minutes of run time in all, {workers} at a time.",
        "",
        f"Mean ± half-width of the 95% Student-t interval over {over}. First and "
        f"final figures are means over the first and last 10% of rollout steps. Δ is the "
        f"paired difference from grpo over the same seeds, **bold** where its interval "
        f"excludes 0 (a finding); elsewhere the seeds cannot tell the two apart. Accuracy over "
        f"all steps is the mean of every rollout step's accuracy (the whole curve). 'steps to "
        f"{acfg.threshold}' is the first rollout step whose 10-step mean accuracy reaches it "
        f"(seeds that never do are left out and counted)."
        + (
            " Held-out pass@1: each final model on the preset's benchmark, 8 samples a "
            f"problem (evaluate.py, as each run printed it, --engine {acfg.evaluate_engine})."
            if acfg.evaluate
            else ""
        ),
        "",
        "| method | options | accuracy first → final | Δ final accuracy | "
        + "held-out pass@1 | Δ held-out | " * acfg.evaluate
        + "accuracy, all steps | Δ all steps | "
        + f"final format | Δ format | entropy first → final | Δ final entropy | "
        f"steps to {acfg.threshold} | wall s | touched |",
        "|---" * (13 + 2 * acfg.evaluate) + "|",
    ]
    for label, runs in summaries.items():

        def values(key, runs=runs):
            return [r[key] for r in runs]

        def delta(key, label=label):
            return (
                difference(values(key), [r[key] for r in baseline])
                if baseline and label != "grpo"
                else "-"
            )

        reached = [r["steps_to_threshold"] for r in runs if r["steps_to_threshold"] is not None]
        steps = (plots.cell(reached, 0) if reached else "never") + (
            f" ({len(runs) - len(reached)} never)" if reached and len(reached) < len(runs) else ""
        )
        lines.append(
            f"| {label} | `{shlex.join(methods[label])}` | "
            f"{statistics.fmean(values('first_accuracy_mean')):.3f} → "
            f"{plots.cell(values('final_accuracy_mean'))} | {delta('final_accuracy_mean')} | "
            + (
                f"{plots.cell(values('held_out_pass@1'))} | {delta('held_out_pass@1')} | "
                if acfg.evaluate
                else ""
            )
            + f"{plots.cell(values('mean_accuracy'))} | {delta('mean_accuracy')} | "
            f"{plots.cell(values('final_format_mean'))} | {delta('final_format_mean')} | "
            f"{statistics.fmean(values('first_entropy_mean')):.3f} → "
            f"{plots.cell(values('final_entropy_mean'))} | {delta('final_entropy_mean')} | "
            f"{steps} | "
            f"{plots.cell(values('wall_s'), 0)} | "
            f"{100 * statistics.fmean(values('touched_frac')):.1f}% |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ablate(sys.argv[1:])
