"""ablate.py: methods x seeds on one preset, side by side: a table and a plot.

    python ablate.py --methods all --seeds 3 --preset tiny      # every method, seeds 0, 1, 2
    python ablate.py --methods grpo,cw -- --steps 300           # options after -- go to every run

Each run is `python cwgrpo.py` in its own process and folder (<method>-seed<seed>/), two at a time
on a 2-core machine; rerunning the same command skips finished runs and resumes unfinished ones.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm
from transformers import HfArgumentParser

import cwgrpo
import plots
import tiny

HERE = Path(__file__).resolve().parent


@dataclass
class AblationConfig:
    methods: str = cwgrpo.arg("all", "comma-separated method names, or all")
    seeds: int = cwgrpo.arg(3, "runs per method, with seeds 0 .. seeds-1")
    preset: Literal["paper-1.5b", "paper-7b", "tiny"] = cwgrpo.arg(
        "tiny", "the recipe every run uses; options after -- go to every run")
    output_dir: str = cwgrpo.arg("runs/ablation",
                                 "gets <method>-seed<seed>/ per run, ablation.md and ablation.png")
    workers: int = cwgrpo.arg(0, "runs at a time; 0 is one per CPU core")
    threshold: float = cwgrpo.arg(
        1.2, "reward level for 'steps to threshold' (first step whose 10-step mean reaches it)")
    plot: bool = cwgrpo.arg(True, "draw ablation.png")


def run_summary(run_dir: Path, threshold: float) -> dict:
    """Per rollout step: reward and entropy; and the run's final figures over its last 10%."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["rollout_step"], []).append(record)
    steps = sorted(by_step)
    reward = [by_step[s][0]["reward_mean"] for s in steps]
    entropy = [by_step[s][0]["entropy_mean"] for s in steps]
    tail = max(1, len(steps) // 10)
    reached = [s for s, r in zip(steps, plots.moving_average(reward)) if r >= threshold]
    records = [r for s in steps for r in by_step[s]]
    return {"reward": reward, "entropy": entropy, "final_reward": statistics.fmean(reward[-tail:]),
            "final_entropy": statistics.fmean(entropy[-tail:]),
            "steps_to_threshold": reached[0] if reached else None,
            "touched_frac": statistics.fmean(r["touched_frac"] for r in records),
            "wall_s": json.loads((run_dir / "wall_time.json").read_text())["wall_s"]}


def mean_std(values: list, digits: int = 3) -> str:
    if len(values) < 2:
        return f"{statistics.fmean(values):.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def run_one(method: str, seed: int, run_dir: Path, acfg: AblationConfig, run_args: list,
            workers: int) -> None:
    if (run_dir / "wall_time.json").is_file():
        return  # finished by an earlier invocation
    cores_per_run = str(max(1, (os.cpu_count() or 1) // workers))
    command = [sys.executable, str(HERE / "cwgrpo.py"), "--preset", acfg.preset, "--method",
               method, "--seed", str(seed), "--output-dir", str(run_dir), "--reward-workers",
               cores_per_run, *run_args]
    if (run_dir / "metrics.jsonl").exists():
        command.append("--resume")
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": cores_per_run})
    if done.returncode:
        raise SystemExit(f"error: {method} seed {seed} failed; see {run_dir / 'log.txt'}")
    (run_dir / "wall_time.json").write_text(json.dumps({"wall_s": time.perf_counter() - start}))


def ablate(argv: list) -> Path:
    split = argv.index("--") if "--" in argv else len(argv)
    own, run_args = argv[:split], argv[split + 1:]
    (acfg,) = HfArgumentParser(AblationConfig, prog="ablate.py").parse_args_into_dataclasses(own)
    methods = list(cwgrpo.METHODS) if acfg.methods == "all" else acfg.methods.split(",")
    unknown = [m for m in methods if m not in cwgrpo.METHODS]
    if unknown:
        raise SystemExit(f"error: unknown method {', '.join(unknown)}; choose from "
                         f"{', '.join(cwgrpo.METHODS)}")
    if acfg.plot:
        plots.pyplot()  # fail now, not after the runs, if matplotlib is missing
    if acfg.preset == "tiny" and "--model" not in run_args:
        tiny.build()
    output_dir = Path(acfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    workers = acfg.workers or os.cpu_count() or 1
    runs = [(m, seed, output_dir / f"{m}-seed{seed}") for m in methods for seed in range(acfg.seeds)]
    with ThreadPoolExecutor(workers) as pool:
        jobs = [pool.submit(run_one, *run, acfg, run_args, workers) for run in runs]
        for job in tqdm(jobs, desc="ablation"):
            job.result()
    summaries = {m: [run_summary(d, acfg.threshold) for mm, _, d in runs if mm == m]
                 for m in methods}
    write_ablation_table(output_dir / "ablation.md", summaries, acfg, run_args)
    if acfg.plot:
        plots.plot_ablation(output_dir / "ablation.png", {
            m: {key: [r[key] for r in runs] for key in ("reward", "entropy")}
            for m, runs in summaries.items()},
            f"preset {acfg.preset}: mean over {acfg.seeds} seeds, band ± 1 std")
    return output_dir


def write_ablation_table(path: Path, summaries: dict, acfg: AblationConfig, run_args: list):
    options = f" with {' '.join(run_args)}" if run_args else ""
    lines = [f"Preset `{acfg.preset}`{options}, {acfg.seeds} seeds per method (mean ± std over "
             f"seeds). Final figures are means over the last 10% of rollout steps; 'steps to "
             f"{acfg.threshold}' is the first rollout step whose 10-step mean reward reaches it "
             f"(seeds that never do are left out, counted in brackets); 'touched' is the share of "
             f"valid tokens the method weighted, masked or penalised differently from GRPO.", "",
             f"| method | final reward | final entropy | steps to {acfg.threshold} | wall s | "
             f"touched |", "|---|---|---|---|---|---|"]
    for method, runs in summaries.items():
        reached = [r["steps_to_threshold"] for r in runs if r["steps_to_threshold"] is not None]
        never = f" ({len(runs) - len(reached)} never)" if len(reached) < len(runs) else ""
        steps = mean_std(reached, 0) + never if reached else "never"
        lines.append(f"| {method} | {mean_std([r['final_reward'] for r in runs])} | "
                     f"{mean_std([r['final_entropy'] for r in runs])} | {steps} | "
                     f"{mean_std([r['wall_s'] for r in runs], 0)} | "
                     f"{100 * statistics.fmean(r['touched_frac'] for r in runs):.1f}% |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    print(f"done: {ablate(sys.argv[1:])}")
