"""A run's metrics in the trackers people already watch, chosen as TRL's --report_to chooses them:
TensorBoard, Weights & Biases, trackio. metrics.jsonl stays the run's record; each tracker gets
every number of each of its lines at that line's step, and the run's options as hyperparameters.
A tracker's library is imported only when it is asked for, and checked at parse time.

A resumed run continues the same tracker run, with no step twice and none missing: TensorBoard
writes to the same folder and purges the events after the checkpoint; W&B and trackio, which
cannot purge, resume the run whose id the run folder keeps (trackers.json, with the last step
sent), and skip the steps they hold already: those of the killed run after its checkpoint.

Nothing leaves the machine unless the user asks: TensorBoard and trackio write local files, and
W&B syncs only when logged in (WANDB_MODE=offline keeps even that local).
"""

import importlib
import json
import os
import uuid
from pathlib import Path

from cwgrpo_utils.options import cli

TRACKERS = ("tensorboard", "wandb", "trackio")


def check(report_to: list[str]) -> None:
    """Every name a tracker and its library installed, or "none" alone: one line otherwise."""
    for name in report_to:
        known = f"--report-to {name}: choose none, or some of {', '.join(TRACKERS)}"
        cli.check(name in ("none", *TRACKERS), known)
    cli.check(report_to == ["none"] or "none" not in report_to, "--report-to none goes alone")
    for name in set(report_to) - {"none"}:
        cli.require(name, f"--report-to {name}")


def numbers(record: dict) -> dict:
    """The numbers of a metrics.jsonl line but its step, which the trackers take apart, and its
    Unix time, which they stamp themselves (trackio reserves the name)."""
    return {
        key: value
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
        and key not in ("step", "time")
    }  # fmt: skip


class Trackers:
    """The trackers of one run folder, continuing after `logged` optimizer steps (0: fresh)."""

    def __init__(self, report_to: list[str], path: Path, options: dict, logged: int):
        self.ids_file = Path(path) / "trackers.json"
        resumed = logged and self.ids_file.is_file()
        self.ids = json.loads(self.ids_file.read_text()) if resumed else {"sent": 0}
        opened = [name for name in report_to if name != "none"]
        self.trackers = [OPEN[name](Path(path), options, logged, self.ids) for name in opened]

    def log(self, record: dict) -> None:
        if not self.trackers:
            return
        for tracker in self.trackers:
            tracker.log(numbers(record), record["step"])
        self.ids["sent"] = max(self.ids["sent"], record["step"])
        self.ids_file.write_text(json.dumps(self.ids))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


class TensorBoard:
    """<run>/tensorboard; a resume purges the events of the steps after the checkpoint."""

    def __init__(self, path: Path, options: dict, logged: int, ids: dict):
        writer = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        self.writer = writer(str(path / "tensorboard"), purge_step=logged + 1 if logged else None)
        if not logged:
            self.writer.add_text("options", f"```\n{json.dumps(options, indent=1)}\n```")
            plain = (int, float, str, bool)
            hparams = {k: v if isinstance(v, plain) else str(v) for k, v in options.items()}
            self.writer.add_hparams(hparams, {}, run_name=".")

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a kill loses no step before the checkpoint it resumes from

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in <run>/wandb, resumed by its id; steps it holds already are not sent again."""

    def __init__(self, path: Path, options: dict, logged: int, ids: dict):
        self.wandb = importlib.import_module("wandb")
        ids.setdefault("wandb", uuid.uuid4().hex[:8])
        project = os.environ.get("WANDB_PROJECT", "cwgrpo")
        named = dict(project=project, name=path.name, id=ids["wandb"], dir=str(path))
        self.run = self.wandb.init(**named, resume="allow", config=options)
        self.sent = ids["sent"]

    def log(self, values: dict, step: int) -> None:
        if step > self.sent:  # W&B holds the steps before, the killed run's included
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    """A trackio run (a local database under HF_HOME), resumed by its name."""

    def __init__(self, path: Path, options: dict, logged: int, ids: dict):
        self.trackio = importlib.import_module("trackio")
        ids.setdefault("trackio", f"{path.name}-{uuid.uuid4().hex[:8]}")
        project = os.environ.get("TRACKIO_PROJECT", "cwgrpo")
        resume = "allow" if logged else "never"
        self.trackio.init(project=project, name=ids["trackio"], config=options, resume=resume)
        self.sent = ids["sent"]

    def log(self, values: dict, step: int) -> None:
        if step > self.sent:  # trackio holds the steps before, the killed run's included
            self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


OPEN = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}
