"""A run's output folder for as long as the run lives: the lock, the stop signals, the resume
policy, run_config.json and metrics.jsonl, and the run's progress and warnings.

    with RunFolder.for_run(cfg) as run:
        run.start(used)          # run_config.json, and on resume the records after it dropped
        run.log(metrics)         # one line of metrics.jsonl per optimizer step
        if run.stop.requested:   # Ctrl-C or SIGTERM: finish the step, checkpoint, exit
                                 # (a second one: at once, the step lost)

A live run holds an flock on its folder, which the kernel releases when the run dies, even by
kill -9, so a dead run never blocks --resume. A resume continues the newest complete checkpoint
with the run's own options.
"""

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from tqdm import tqdm

from cwgrpo_utils.options.cli import dashed, warn_once
from cwgrpo_utils.options.run_config import check_output_dir
from cwgrpo_utils.run import checkpoints
from cwgrpo_utils.run.trackers import Trackers

# The options a resumed run may change, none of them its recipe: more --steps extend it (the
# cosine schedule is then recomputed over the new total), some say where and how often it reports,
# and the memory options change how much is computed at once, not what (their floating-point
# rounding, and with --rollout-chunk which random numbers each sample draws)
RESUME_MAY_CHANGE = (
    "steps",
    "save_every",
    "log_every",
    "reward_workers",
    "output_dir",
    "report_to",
    "rollout_chunk",
    "groups_per_micro_batch",
    "gradient_checkpointing",
    "share_prompts",
    "logit_chunk_elements",
    "vllm_gpu_memory_utilization",
    "threads",
)
# Of those, what changes how the run computes (its floating-point rounding), not what; the
# threads as the run used them (run_config.json's torch_threads), not as asked
COMPUTES_DIFFERENTLY = (
    "torch_threads",
    "rollout_chunk",
    "groups_per_micro_batch",
    "gradient_checkpointing",
    "share_prompts",
    "logit_chunk_elements",
)


class RunFolder:
    """The folder of one run, locked and prepared; see the module's docstring."""

    def __init__(
        self, path, options: dict, resume: bool, overwrite: bool, may_change: tuple, report_to=()
    ):
        self.path, self.options, self.may_change = Path(path), options, may_change
        self.resume, self.overwrite, self.report_to = resume, overwrite, report_to
        self.metrics = self.path / "metrics.jsonl"
        self.trackers = None

    @classmethod
    def for_run(cls, cfg, run_cfg) -> "RunFolder":
        """The folder of a cwgrpo.py run of cfg and run_cfg (its output_dir, resume,
        overwrite_output_dir and report_to), whose options a resume may change only
        RESUME_MAY_CHANGE of."""
        options = dataclasses.asdict(cfg) | dataclasses.asdict(run_cfg)
        return cls(
            run_cfg.output_dir,
            options,
            run_cfg.resume,
            run_cfg.overwrite_output_dir,
            may_change=RESUME_MAY_CHANGE,
            report_to=run_cfg.report_to,
        )

    def __enter__(self) -> "RunFolder":
        with contextlib.ExitStack() as stack:
            stack.enter_context(RunLock(self.path))
            self.stop = stack.enter_context(StopRequest())
            self.resume_from = resumable_checkpoint(self.path, self.resume)
            self.resumed_step = (
                0 if self.resume_from is None else checkpoints.checkpoint_step(self.resume_from)
            )
            self.recorded = None
            if self.resume_from is not None:
                self.recorded = check_resume(self.resume_from, self.options, self.may_change)
            self.held = stack.pop_all()
        return self

    def __exit__(self, *exc_info):
        if self.trackers is not None:
            self.trackers.close()
        self.held.__exit__(*exc_info)
        if exc_info[0] is KeyboardInterrupt:  # a second stop signal, mid-step
            lost = "interrupted: the step under way is lost"
            raise SystemExit(f"{lost}; {checkpoints.how_to_continue(self.path)}") from None

    def finished(self, steps: int) -> bool:
        """A resumed run that has done its `steps` and written its final model says so; one
        extended to more steps says what that changes."""
        if self.resume_from is None:
            return False
        done = checkpoints.checkpoint_step(self.resume_from)
        if done >= steps and (self.path / "final-model").is_dir():
            print(f"nothing to do: {self.path} has finished its {done} steps", end="")
            print(" (a larger --steps extends it)")
            return True
        if self.recorded["steps"] != steps:
            print(
                f"note: --steps {steps} (was {self.recorded['steps']}): the cosine learning-rate "
                f"schedule is recomputed over the new total"
            )
        return False

    def start(self, **used) -> None:
        """run_config.json holds the run's options and what it `used` (torch threads, say; a
        resume adds what it changed under "resumes"), and metrics.jsonl keeps only the records up
        to the checkpoint resumed from."""
        record = self.options | used
        prepare_output_dir(self.path, self.resume_from, self.overwrite, record)
        keep_records_until(self.metrics, self.resumed_step)
        kept = read_records(self.metrics) if self.metrics.is_file() else []
        logged = kept[-1]["step"] if kept else 0  # optimizer steps
        self.trackers = Trackers(self.report_to, self.path, record, logged)

    def log(self, record: dict) -> None:
        """One line of metrics.jsonl, and the same numbers to the trackers (--report-to)."""
        append_record(self.metrics, record)
        self.trackers.log(record)

    def save(self, step: int, model, tokenizer, state: dict) -> None:
        """checkpoint-<step>: the weights, what a resume needs (checkpoints.trainer_state's
        `state`) and the run's options; only the newest --save-total-limit checkpoints stay."""
        self.saved = f"checkpoint-{step}"
        checkpoints.save_checkpoint(
            self.path,
            self.saved,
            model=model,
            tokenizer=tokenizer,
            trainer_state=state,
            files={"run_config.json": json.dumps(self.options, indent=2)},
            keep=self.options["save_total_limit"],
        )

    def stop_if_requested(self, step: int) -> None:
        if self.stop.requested:
            resume = checkpoints.resume_command()
            raise SystemExit(
                f"stopped after step {step} (saved {self.saved}); resume with: {resume}"
            )


def resumable_checkpoint(output_dir: Path, resume: bool) -> Path | None:
    """The checkpoint a --resume continues from (None without --resume)."""
    if not resume:
        return None
    checkpoint = checkpoints.latest_checkpoint(output_dir)
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


def check_resume(checkpoint: Path, options: dict, may_change: tuple) -> dict:
    """A resume continues the run it finds with that run's options: one line naming any that
    differ but `may_change`. Returns the recorded options."""
    recorded = recorded_options(checkpoint)
    differences = option_differences(recorded, options, may_change)
    if differences:
        raise SystemExit(
            f"error: --resume with options other than {checkpoint}'s: {'; '.join(differences)}; "
            f"resume with the run's own options or start another --output-dir (a resume may "
            f"change only --{', --'.join(may_change)})"
        )
    return recorded


def recorded_options(checkpoint: Path) -> dict:
    """The options a checkpoint was written with; older checkpoints: those of its run."""
    own = checkpoint / "run_config.json"
    return json.loads((own if own.exists() else checkpoint.parent / "run_config.json").read_text())


def prepare_output_dir(
    output_dir: Path, resume_from: Path | None, overwrite: bool, config: dict
) -> None:
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
        how = [
            f"{'torch threads' if k == 'torch_threads' else dashed(k)} {now} (was {was})"
            for k, (was, now) in changed.items()
            if k in COMPUTES_DIFFERENTLY
        ]
        if how:
            print(
                f"note: resumed with {', '.join(how)}: that changes how the run computes, not "
                "what, so its records may differ from an uninterrupted run's in the last bits "
                "(with --rollout-chunk, in the samples drawn)"
            )
        return
    check_output_dir(output_dir, resume=False, overwrite=overwrite)  # as at parse time
    if (output_dir / "metrics.jsonl").exists():  # --overwrite-output-dir
        for entry in output_dir.iterdir():
            if entry.name != ".lock":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    write_atomically(record, json.dumps(config, indent=2))


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
    """The first Ctrl-C or SIGTERM (what `timeout`, a job scheduler or a container stop sends)
    asks the loop to stop after the current step, with a checkpoint; a second one interrupts at
    once. Outside the main thread it does nothing."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __enter__(self) -> "StopRequest":
        self.requested, self.previous = False, {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def handle(self, number: int, _frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested, name = True, self.SIGNALS[number]
        message = f"\n{name}: stopping after this step, with a checkpoint ({name} again: at once)"
        print(message, file=sys.stderr, flush=True)

    def __exit__(self, *_) -> None:
        for number, previous in self.previous.items():
            signal.signal(number, previous)


class Progress:
    """A tqdm bar on a terminal; elsewhere (a log file) one plain line every `every` steps, so a
    log holds a few lines rather than hundreds of bar redraws. Each step shows its last metrics
    record's reward, entropy and skipped steps."""

    def __init__(self, start: int, total: int, label: str, every: int):
        self.done, self.total, self.label, self.every = start, total, label, every
        self.bar = tqdm(initial=start, total=total, desc=label) if sys.stderr.isatty() else None

    def step(self, record: dict) -> None:
        self.done += 1
        figures = {
            "reward": f"{record['reward_mean']:.3f}",
            "entropy": f"{record['entropy_mean']:.3f}",
            "skipped": str(record["skipped_steps"]),
        }
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(figures)
        elif self.done % self.every == 0 or self.done == self.total:
            shown = ", ".join(f"{name} {value}" for name, value in figures.items())
            print(f"{self.label}: step {self.done}/{self.total}, {shown}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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
