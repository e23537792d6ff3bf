"""runtime.py: the processes and files a training run owns, kept out of cwgrpo.py's algorithm.
It knows nothing of cwgrpo.

- TimeoutPool: a process pool in which every call has a hard wall-clock limit. A call that
  overruns has its worker process killed and replaced, and its result is `on_timeout`.
Workers ignore Ctrl-C (the parent decides what to do) and exit within a second of their parent's
death, however it dies. cwgrpo.py grades completions with it: math-verify's own timeout uses
SIGALRM, which works only on a main thread and cannot interrupt every hang (sympy evaluating
9^9^9^9), while killing a process always works.
- Checkpoints written atomically, the RNG states they hold, and metrics trimmed on resume.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import difflib
import fcntl
import json
import logging
import multiprocessing
import os
import random
import shlex
import shutil
import signal
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm
from transformers import HfArgumentParser


def _serve(fn: Callable, conn, parent_pid: int) -> None:
    """A worker's loop: call fn on what arrives, send back the result, until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":  # the kernel kills us when the parent dies, even mid-computation
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    while True:
        if os.getppid() != parent_pid:  # the parent died before prctl took effect, or not Linux
            return
        if not conn.poll(1.0):
            continue
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(fn(*args))


class _Worker:
    """One child process, started on first use and replaced after a call overruns."""

    def __init__(self, fn: Callable, timeout_s: float):
        self.fn, self.timeout_s, self.process = fn, timeout_s, None
        methods = multiprocessing.get_all_start_methods()
        self.context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")

    def call(self, args: tuple, on_timeout: Any) -> Any:
        if self.process is None:
            self.conn, child_conn = self.context.Pipe()
            self.process = self.context.Process(
                target=_serve, daemon=True, args=(self.fn, child_conn, os.getpid())
            )
            self.process.start()
            child_conn.close()
        self.conn.send(args)
        try:
            finished = self.conn.poll(self.timeout_s)
            result = self.conn.recv() if finished else on_timeout
        except (EOFError, OSError):  # the worker crashed (inside sympy, say): treat as a cutoff
            finished, result = False, on_timeout
        if not finished or not self.process.is_alive():
            self.close()
        return result

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
            self.conn.close()
            self.process = None


class TimeoutPool:
    """fn(*args) for many args on `workers` processes, each call cut off after timeout_s seconds."""

    def __init__(self, fn: Callable, workers: int, timeout_s: float, on_timeout: Any = None):
        self.on_timeout = on_timeout
        self.workers = [_Worker(fn, timeout_s) for _ in range(max(1, workers))]
        self.threads = ThreadPoolExecutor(len(self.workers))  # each thread drives one worker

    def submit(self, calls: list[tuple]) -> Future:
        """A future of [fn(*args) for args in calls], in order, the calls shared among workers."""
        shares = [calls[i :: len(self.workers)] for i in range(len(self.workers))]
        parts = [
            self.threads.submit(lambda w=w, s=s: [w.call(a, self.on_timeout) for a in s])
            for w, s in zip(self.workers, shares)
        ]
        done, lock = Future(), threading.Lock()

        def gather(_):
            with lock:
                if done.done() or not all(p.done() for p in parts):
                    return
                try:
                    results = [p.result() for p in parts]
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    done.set_exception(error)
                    return
                ordered = [None] * len(calls)
                for i, share in enumerate(results):
                    ordered[i :: len(self.workers)] = share
                done.set_result(ordered)

        for part in parts:
            part.add_done_callback(gather)
        return done

    def map(self, calls: list[tuple]) -> list:
        return self.submit(calls).result()

    @property
    def size(self) -> int:
        return len(self.workers)

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def close(self) -> None:
        self.threads.shutdown(wait=True, cancel_futures=True)
        for worker in self.workers:
            worker.close()


class CachedTimeoutPool(TimeoutPool):
    """A TimeoutPool that remembers results, for pure functions: a cache hit is not recomputed."""

    def __init__(
        self,
        fn: Callable,
        workers: int,
        timeout_s: float,
        on_timeout: Any = None,
        max_cache: int = 200_000,
    ):
        super().__init__(fn, workers, timeout_s, on_timeout)
        self.max_cache, self.cache = max_cache, {}

    def submit(self, calls: list[tuple]) -> Callable[[], list]:
        """Starts the uncached calls; returns a function that waits for all the results."""
        todo = list(dict.fromkeys(call for call in calls if call not in self.cache))
        if len(self.cache) + len(todo) > self.max_cache:
            self.cache.clear()
            todo = list(dict.fromkeys(calls))
        running = super().submit(todo)

        def results() -> list:
            self.cache.update(zip(todo, running.result()))
            return [self.cache[call] for call in calls]

        return results

    def map(self, calls: list[tuple]) -> list:
        return self.submit(calls)()


def save_checkpoint(
    output_dir: Path,
    name: str,
    model,
    tokenizer,
    trainer_state=None,
    files: dict | None = None,
    keep: int = 0,
) -> Path:
    """Written under a temporary name and renamed at the end: a crash mid-save leaves no
    complete-looking checkpoint, and a save that fails (a full disk, say) stops in one line with
    the previous checkpoint intact. files: name -> text, written into the checkpoint too. The
    optimizer's state (trainer_state["optimizer"], twice the weights for AdamW) goes to its own
    optimizer.pt, which only the newest checkpoint keeps: a resume needs no older one, evaluation
    needs only weights. keep: at most this many checkpoints stay, the newest (0: all)."""
    final, partial = output_dir / name, output_dir / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    check_free_disk(output_dir, name, model)
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        for file_name, text in (files or {}).items():
            (partial / file_name).write_text(text)
        if trainer_state is not None:
            state = dict(trainer_state)
            torch.save(state.pop("optimizer"), partial / "optimizer.pt")
            torch.save(state, partial / "trainer_state.pt")
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise SystemExit(
            f"error: could not write {final} ({error.strerror or error}); "
            f"{kept_checkpoint(output_dir)}; free space and resume with: {resume_command()}"
        ) from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    if trainer_state is not None:
        prune_checkpoints(output_dir, final, keep)
    return final


def prune_checkpoints(output_dir: Path, newest: Path, keep: int) -> None:
    """Older checkpoints lose their optimizer.pt, and all but the newest `keep` (0: all) go."""
    older = sorted(checkpoints(output_dir), key=checkpoint_step)
    older.remove(newest)
    for checkpoint in older:
        (checkpoint / "optimizer.pt").unlink(missing_ok=True)
    for checkpoint in older[: max(0, len(older) + 1 - keep)] if keep else []:
        shutil.rmtree(checkpoint)


def checkpoints(output_dir: Path) -> list[Path]:
    """The run's complete checkpoint-<step> folders (renamed into place: never partial)."""
    return [
        p
        for p in output_dir.glob("checkpoint-*")
        if p.name[11:].isdigit() and (p / "trainer_state.pt").is_file()
    ]


def checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def load_trainer_state(checkpoint: Path) -> dict:
    """trainer_state.pt with the optimizer's state from optimizer.pt (checkpoints written before
    the split hold it inside trainer_state.pt)."""
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    if (checkpoint / "optimizer.pt").is_file():
        state["optimizer"] = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    if "optimizer" not in state:
        raise SystemExit(f"error: {checkpoint} has no optimizer.pt; resume from a newer checkpoint")
    return state


def checkpoint_bytes(model) -> int:
    """What a checkpoint of `model` holds: its weights as they are, and AdamW's two moments in fp32
    (trainer_state.pt); tokenizer and configs are small."""
    parameters = list(model.parameters())
    return sum(p.numel() * p.element_size() for p in parameters) + 8 * sum(
        p.numel() for p in parameters if p.requires_grad
    )


def check_free_disk(output_dir: Path, name: str, model) -> None:
    """Stop before a save the disk cannot hold, rather than halfway through it."""
    needed, free = checkpoint_bytes(model), shutil.disk_usage(output_dir).free
    if free < needed:
        raise SystemExit(
            f"error: {output_dir / name} needs about {needed / 1e9:.2f} GB and "
            f"{free / 1e9:.2f} GB are free; {kept_checkpoint(output_dir)}; free space and resume "
            f"with: {resume_command()}"
        )


def kept_checkpoint(output_dir: Path) -> str:
    latest = latest_checkpoint(output_dir)
    return f"{latest} is intact" if latest else "no checkpoint was written yet"


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint a resume can continue: the one with the optimizer's state (every
    checkpoint of a run written before optimizer.pt existed has it inside)."""
    found = checkpoints(output_dir)
    resumable = [p for p in found if (p / "optimizer.pt").is_file()] or found
    return max(resumable, key=checkpoint_step) if resumable else None


def rng_states() -> dict:
    """The RNG states a run draws from: Python's, the CPU's, and its own GPU's (the current one,
    not every visible one: a resume on a machine with another GPU count must still work)."""
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]  # a list: every GPU's, as checkpoints before this one saved it
        torch.cuda.set_rng_state(cuda[0] if isinstance(cuda, list) else cuda)


def append_record(path: Path, record: dict) -> None:
    """One JSON line, flushed at once: a kill mid-write can leave at most a torn last line, which
    keep_records_until drops."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict]:
    """The records of a .jsonl log; a line torn by a kill mid-write (only the last can be) is left
    out."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def keep_records_until(path: Path, rollout_step: int) -> None:
    """On resume, drop the records of steps after the checkpoint (they are about to be redone) and
    any torn line; rewritten atomically, so a kill here loses nothing."""
    if path.exists():
        kept = [r for r in read_records(path) if r["rollout_step"] <= rollout_step]
        write_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Print a warning the first time `key` comes up in this process, and never again."""
    if key not in WARNED:
        WARNED.add(key)
        print(message, file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar on a terminal; elsewhere (a log file) one plain line every `every` steps, so a
    log holds a few lines rather than hundreds of bar redraws."""

    def __init__(self, start: int, total: int, label: str, every: int):
        self.done, self.total, self.label, self.every = start, total, label, every
        self.bar = tqdm(initial=start, total=total, desc=label) if sys.stderr.isatty() else None

    def step(self, **figures) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(figures)
        elif self.done % self.every == 0 or self.done == self.total:
            shown = ", ".join(f"{name} {value}" for name, value in figures.items())
            print(f"{self.label}: step {self.done}/{self.total}, {shown}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLock:
    """An exclusive lock on a run's output folder, held while the run lives. flock is released by
    the kernel when its holder dies, even by kill -9, so a dead run never blocks --resume."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / ".lock"

    def __enter__(self) -> "RunLock":
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise SystemExit(f"error: --output-dir {self.path.parent} is a file; choose a folder")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "unknown"
            self.file.close()
            raise SystemExit(
                f"error: {self.path.parent} is in use by a live run (pid {holder}); "
                f"wait for it or stop it, or choose another --output-dir"
            ) from None
        self.file.truncate(0)
        self.file.write(str(os.getpid()))
        self.file.flush()
        return self

    def __exit__(self, *_) -> None:
        if [p.name for p in self.path.parent.iterdir()] == [".lock"]:  # a run that wrote nothing
            self.path.unlink()
            self.path.parent.rmdir()
        self.file.close()  # releases the lock


class StopRequest:
    """The first Ctrl-C asks the loop to stop after the current step (and checkpoint); a second
    one interrupts at once. Outside the main thread it does nothing."""

    def __enter__(self) -> "StopRequest":
        self.requested, self.previous = False, None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, *_) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again: at once)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *_) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def resume_command() -> str:
    """The command line that continues this run: the same arguments, with --resume."""
    kept = [a for a in sys.argv[1:] if a not in ("--resume", "--overwrite-output-dir")]
    return "python " + shlex.join([Path(sys.argv[0]).name, *kept, "--resume"])


class LogCounter(logging.Handler):
    """Counts a logger's records that start with a prefix (a library's "Timeout during ..."
    warnings, say), and keeps that logger quiet."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix, self.count = prefix, 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith(self.prefix)

    @classmethod
    def installed(cls, logger_name: str, prefix: str) -> "LogCounter":
        logger = logging.getLogger(logger_name)
        found = [h for h in logger.handlers if isinstance(h, cls) and h.prefix == prefix]
        if not found:
            found = [cls(prefix)]
            logger.addHandler(found[0])
            logger.setLevel(logging.WARNING)
            logger.propagate = False
        return found[0]


def resolve_device(requested: str, gpu_recipe: str = "") -> torch.device:
    """auto is cuda where there is a GPU; a GPU recipe without one stops with the fix."""
    if requested == "auto":
        if gpu_recipe and not torch.cuda.is_available():
            raise SystemExit(
                f"error: --preset {gpu_recipe} is a GPU recipe and no CUDA GPU was "
                f"found; run the CPU demo with --preset tiny (or force --device cpu)"
            )
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU was found; use --device cpu")
    return torch.device(requested)


def bf16_autocast(device: torch.device):
    """A factory of autocast contexts: bf16 on CUDA (weights stay fp32 masters), none on CPU."""
    return lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def check_resumable(output_dir: Path, resume: bool) -> Path | None:
    """The checkpoint a --resume continues from (None without --resume)."""
    if not resume:
        return None
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        raise SystemExit(
            f"error: --resume, but {output_dir} holds no complete checkpoint; "
            f"drop --resume to start afresh"
        )
    return checkpoint


def option_differences(recorded: dict, options: dict, may_change: tuple = ()) -> list[str]:
    """Where `options` differ from a run's recorded ones, as '--name recorded -> now'. Resume and
    overwrite are how a run is started, not what it is."""
    ignored = (*may_change, "resume", "overwrite_output_dir")
    return [
        f"--{name} {recorded[name]!r} -> {value!r}"
        for name, value in options.items()
        if name in recorded and name not in ignored and recorded[name] != value
    ]


def check_resume(checkpoint: Path, options: dict, steps: int, may_change: tuple) -> bool:
    """A resume continues the run it finds with that run's options: one line naming any that
    differ but `may_change`. True when the run has nothing left to do."""
    recorded = recorded_options(checkpoint)
    differences = option_differences(recorded, options, may_change)
    if differences:
        raise SystemExit(
            f"error: --resume with options other than {checkpoint}'s: {'; '.join(differences)}; "
            f"resume with the run's own options or start another --output-dir (a resume may "
            f"change only --{', --'.join(may_change)})"
        )
    done = checkpoint_step(checkpoint)
    if done >= steps and (checkpoint.parent / "final-model").is_dir():
        print(
            f"nothing to do: {checkpoint.parent} has finished its {done} steps "
            f"(a larger --steps extends it)"
        )
        return True
    if recorded["steps"] != steps:
        print(
            f"note: --steps {steps} (was {recorded['steps']}): the cosine learning-rate schedule "
            f"is recomputed over the new total"
        )
    return False


def recorded_options(checkpoint: Path) -> dict:
    """The options a checkpoint was written with; older checkpoints: those of its run."""
    own = checkpoint / "run_config.json"
    return json.loads((own if own.exists() else checkpoint.parent / "run_config.json").read_text())


@contextlib.contextmanager
def never_fatal(what: str):
    """Pictures never cost a run: a failure inside warns once, in one line, and the run goes on."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - whatever broke, training is worth more
        message = (str(error).strip().splitlines() or [""])[0]
        warn_once(
            what,
            f"warning: could not {what} ({type(error).__name__}: {message}); "
            f"training goes on without it",
        )


def prepare_output_dir(
    output_dir: Path, resume_from: Path | None, overwrite: bool, config: dict
) -> Path:
    """A run's folder, emptied for --overwrite-output-dir, with its run_config.json; a resume
    keeps the record and adds to its "resumes" what it changed. Called holding the folder's
    lock (which it keeps)."""
    record = output_dir / "run_config.json"
    if resume_from is not None and record.exists():
        recorded = json.loads(record.read_text())
        changed = {
            k: [recorded.get(k), v]
            for k, v in config.items()
            if recorded.get(k) != v and k not in ("resume", "overwrite_output_dir")
        }
        recorded.setdefault("resumes", []).append({"from": resume_from.name, "changed": changed})
        write_atomically(record, json.dumps(recorded, indent=2))
        return output_dir
    if (output_dir / "metrics.jsonl").exists():
        if not overwrite:
            raise SystemExit(
                f"error: {output_dir} already holds a run; pass --resume to continue "
                f"it, --overwrite-output-dir to start afresh, or choose another "
                f"--output-dir"
            )
        for entry in output_dir.iterdir():
            if entry.name != ".lock":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    write_atomically(record, json.dumps(config, indent=2))
    return output_dir


def arg(default, help: str, **metadata):
    """A dataclass field with its --help text, for HfArgumentParser."""
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def parse_dataclasses(
    types, argv: list, presets: dict | None = None, hidden: tuple = (), **parser_options
) -> list:
    """HfArgumentParser over `types`. With presets (name -> option values), --preset's values are
    the defaults, and --help says whose they are. Options must be spelt out (no abbreviations:
    --method is never read as --methods); an unknown one stops in one line naming the closest real
    option. `hidden` options are left out of --help."""
    parser = HfArgumentParser(types, allow_abbrev=False, **parser_options)
    if presets:
        preset_parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        preset_parser.add_argument("--preset", default=next(iter(presets)), choices=list(presets))
        preset = preset_parser.parse_known_args(argv)[0].preset
        parser.set_defaults(**presets[preset])
        parser.description = f"{parser.description or ''} Defaults shown: --preset {preset}'s."
    for action in parser._actions:
        if action.dest in hidden:
            action.help = argparse.SUPPRESS
        elif action.option_strings and action.option_strings[0].startswith("--no_"):
            action.help = f"turn off --{action.dest}"  # HfArgumentParser repeats the field's help
    *parsed, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:
        raise SystemExit(unknown_option_error(unknown, parser))
    return parsed


# What each rule of check_rules means
RULE_TESTS = {
    ">= 2": lambda v: v >= 2,
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in [0, 100]": lambda v: 0 <= v <= 100,
}


def check_rules(options, rules: list[tuple[str, str]]) -> None:
    """Each (rule, names) row: the options named (space-separated) must meet the rule; the first
    that does not stops in one line."""
    for rule, names in rules:
        for name in names.split():
            if not RULE_TESTS[rule](getattr(options, name)):
                value = getattr(options, name)
                raise SystemExit(f"error: --{name.replace('_', '-')} must be {rule}; got {value}")


def unknown_option_error(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """One line for the first unknown command-line word: the closest option by its initials
    (--lr: --learning_rate) or spelling (--metod: --method)."""
    word = next((w for w in unknown if w.startswith("-")), None)
    if word is None:
        return f"error: unexpected argument {unknown[0]!r}; options start with --, see --help"
    name = word.lstrip("-").split("=")[0].replace("-", "_")
    options = [a.dest for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    initials = [o for o in options if "".join(part[0] for part in o.split("_")) == name]
    close = initials or difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else "; see --help for the options"
    return f"error: unknown option {word.split('=')[0]}{hint}"
