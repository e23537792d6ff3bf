"""Run cwgrpo.py with a fault injected at the Nth call of a named function, to see what a kill or
a failed write does to a run. The whole-run tests (tests/test_runs.py) drive it.

    CWGRPO_FAULT=cwgrpo:policy_loss:3 python -m tests.faults --preset tiny   # SIGKILL at update 3
    CWGRPO_FAULT=torch:save:2:after python -m tests.faults ...    # after the 2nd torch.save
    CWGRPO_FAULT=torch:save:2:enospc python -m tests.faults ...   # "No space left on device"

CWGRPO_FAULT is module:attribute:N[:mode], the attribute dotted for a method (Class.method) and
looked up where the caller finds it (RunFolder.log calls run_folder's append_record, so
cwgrpo_utils.run.folder:append_record; cwgrpo.py imports Grader, so cwgrpo:Grader.submit).
N+ (3+) is every call from the Nth on. Modes: kill (before the Nth call; the default), after (once
it returns), torn (for an append of one JSON record to a file: half the line is written, then the
kill), enospc (the call raises OSError ENOSPC, as a full disk does), nan (the call's tensor result,
or the first tensor of a tuple result, times NaN), oom (the call raises torch.OutOfMemoryError
with CUDA's message). The kill is SIGKILL, as from the OOM killer or a preempted job: no handler
runs, no file is closed, the grading workers are orphaned.

    CWGRPO_FAULT=cwgrpo:completion_logprobs:5:nan python -m tests.faults ...
    CWGRPO_FAULT=cwgrpo:sample_tokens:3+:oom python -m tests.faults ...        # out of memory
"""

import errno
import functools
import importlib
import json
import os
import signal
import sys

import torch

import cwgrpo  # before arming: the fault may patch its names

MODES = ("kill", "after", "torn", "enospc", "nan", "oom")
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.73 GiB of "
    "which 1.12 GiB is free. Of the allocated memory 13.85 GiB is allocated by PyTorch"
)


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def with_nan(result):
    """A call's result with its tensor (or a tuple's first tensor) times NaN."""
    if isinstance(result, torch.Tensor):
        return result * float("nan")
    first = next(i for i, part in enumerate(result) if isinstance(part, torch.Tensor))
    return (*result[:first], result[first] * float("nan"), *result[first + 1 :])


def faulty(function, n: int, every_after: bool, mode: str):
    """`function`, with the fault at its nth call (and every one after, if every_after)."""
    calls = 0

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls < n or (calls > n and not every_after):
            return function(*args, **kwargs)
        if mode == "nan":
            return with_nan(function(*args, **kwargs))
        if mode == "oom":
            raise torch.OutOfMemoryError(CUDA_OOM)
        if mode == "kill":
            kill_now()
        if mode == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if mode == "torn":
            path, record = args[:2]
            line = json.dumps(record) + "\n"
            with open(path, "a") as f:
                f.write(line[: len(line) // 2])
            kill_now()
        result = function(*args, **kwargs)
        kill_now()  # mode "after"
        return result

    return wrapper


def arm(spec: str) -> None:
    """Patch the function `spec` names (module:attribute:N[:mode]) with its fault."""
    module_name, attribute, n, *mode = spec.split(":")
    mode = (mode or ["kill"])[0]
    if mode not in MODES:
        raise SystemExit(f"error: CWGRPO_FAULT mode must be one of {', '.join(MODES)}: {spec}")
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    every_after = n.endswith("+")
    setattr(owner, name, faulty(getattr(owner, name), int(n.rstrip("+")), every_after, mode))


if __name__ == "__main__":
    if os.environ.get("CWGRPO_FAULT"):
        arm(os.environ["CWGRPO_FAULT"])
    # what resume_command() prints is then the command of python cwgrpo.py, as mimicked here
    sys.argv, sys.modules["__main__"].__spec__ = [str(cwgrpo.__file__), *sys.argv[1:]], None
    cwgrpo.main(*cwgrpo.parse_config(sys.argv[1:]))
