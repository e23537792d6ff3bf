"""How many CPU threads torch computes with: --threads N, or with 0 (the default) a number chosen
for the work and the machine, which cwgrpo.py and evaluate.py print and record with why.

A second thread pays only where a step's matrices are large enough to split, and only while a
second core is free: a thread that shares its core with another process holds every parallel
region back to its pace, and the other threads spin waiting for it. Measured on 2-core CPUs
(docs/performance.md, "Threads on a shared CPU"): the tiny preset gains nothing from a second
thread on a quiet machine and runs 2.5x slower with it beside one busy process, where one thread
keeps its speed; SmolLM2-135M's step is 1.45x faster on two quiet cores and 1.7x slower than one
thread's beside a busy process. So: one thread below ONE_THREAD_BELOW parameters; above it, as
many as the cores that were idle when the run started.
"""

import json
import os
import time
from pathlib import Path

import torch

from cwgrpo_utils.machine.memory_plan import Architecture, read_config

# Parameters below which a second thread does not pay: the tiny presets (0.1 M) gain nothing,
# SmolLM2 (135 M) gains 1.45x; 10 M lies between the two, where nothing was measured
ONE_THREAD_BELOW = 10_000_000


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def idle_cores(seconds: float = 0.2) -> float:
    """How many cores sat idle over the next `seconds`, from the kernel's CPU time counters
    (/proc/stat; elsewhere from the 1-minute load average)."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return max(0.0, os.cpu_count() - os.getloadavg()[0])

    def counters() -> tuple[int, int]:
        fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle and iowait, all

    idle, total = counters()
    time.sleep(seconds)
    idle_after, total_after = counters()
    return os.cpu_count() * (idle_after - idle) / max(1, total_after - total)


def choose(requested: int, parameters: int, on_gpu: bool) -> tuple[int | None, str]:
    """(threads, why): requested where given; None (torch's own default) for OMP_NUM_THREADS
    or a GPU run; else one thread for a small model, or the cores idle now."""
    if requested:
        return requested, f"--threads {requested}"
    if os.environ.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    if on_gpu:
        return None, "torch's default: the GPU computes"
    size = f"a {parameters / 1e6:.1f} M-parameter model"
    if parameters < ONE_THREAD_BELOW:
        return 1, f"{size}: a second thread does not pay; --threads N to choose"
    cores = usable_cores()
    idle = min(cores, max(1, round(idle_cores())))
    return (
        idle,
        f"{size}: {idle} of its {cores} cores were idle at the start; --threads N to choose",
    )


def set_for(requested: int, model: str, device: torch.device) -> str:
    """torch's thread count for a run or an evaluation of `model` on `device` (choose's), set for
    this process; one line says it and why, which is returned."""
    adapter = Path(model) / "adapter_config.json"  # a LoRA checkpoint: its base's size
    if adapter.is_file():
        model = json.loads(adapter.read_text())["base_model_name_or_path"]
    parameters = Architecture.from_config(read_config(model)).parameters()
    count, why = choose(requested, parameters, on_gpu=device.type == "cuda")
    if count is not None:
        torch.set_num_threads(count)
    print(f"threads: {torch.get_num_threads()} ({why})", flush=True)
    return why
