"""Run cwgrpo.py with a fault injected at the Nth call of a named function, to see what a kill or
a failed write does to a run. The whole-run tests (tests/test_runs.py) drive it.

    CWGRPO_FAULT=cwgrpo:update:3 python -m tests.faults --preset tiny   # SIGKILL at update 3
    CWGRPO_FAULT=torch:save:2:after python -m tests.faults ...    # after the 2nd torch.save
    CWGRPO_FAULT=torch:save:2:enospc python -m tests.faults ...   # "No space left on device"

CWGRPO_FAULT is module:attribute:N[:mode], the attribute dotted for a method (Class.method) and
looked up where the caller finds it (RunFolder.log calls run_folder's append_record, so
cwgrpo_utils.run_folder:append_record; Grader is cwgrpo's own class, so cwgrpo:Grader.submit).
Modes: kill (before the Nth call; the
default), after (once it returns), torn (for an append of one JSON record to a file: half the line
is written, then the kill), enospc (the call raises OSError ENOSPC, as a full disk does). The kill
is SIGKILL, as from the OOM killer or a preempted job: no handler runs, no file is closed, the
grading workers are orphaned.
"""

import errno
import functools
import importlib
import json
import os
import signal
import sys

import cwgrpo  # before arming: the fault may patch its names


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def faulty(function, n: int, mode: str):
    """`function`, with the fault at its nth call."""
    calls = 0

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls != n:
            return function(*args, **kwargs)
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
    if (mode or ["kill"])[0] not in ("kill", "after", "torn", "enospc"):
        raise SystemExit(f"error: CWGRPO_FAULT mode must be kill, after, torn or enospc: {spec}")
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, faulty(getattr(owner, name), int(n), (mode or ["kill"])[0]))


if __name__ == "__main__":
    if os.environ.get("CWGRPO_FAULT"):
        arm(os.environ["CWGRPO_FAULT"])
    # what resume_command() prints is then the command of python cwgrpo.py, as mimicked here
    sys.argv, sys.modules["__main__"].__spec__ = [str(cwgrpo.__file__), *sys.argv[1:]], None
    cwgrpo.main(cwgrpo.parse_config(sys.argv[1:]))
