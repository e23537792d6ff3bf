"""Checkpoints written atomically, the RNG states they hold, and the command that resumes from them.

A checkpoint is written under a temporary name and renamed when complete, so a crash mid-save never
leaves one that looks complete; a save that fails (a full disk) stops in one line with the previous
checkpoint intact. The optimizer's state goes to optimizer.pt, which only the newest checkpoint
keeps: a resume needs no older one, evaluation needs only weights.
"""

import contextlib
import os
import pickle
import random
import re
import shutil
import sys
from pathlib import Path

import torch

from cwgrpo_utils.models import lora
from cwgrpo_utils.options import cli


def save_checkpoint(
    output_dir: Path,
    name: str,
    model,
    tokenizer,
    trainer_state=None,
    files: dict | None = None,
    keep: int = 0,
) -> Path:
    """model, tokenizer, `files` (name -> text) and, for a resumable checkpoint, trainer_state
    (its "optimizer" entry to optimizer.pt, the rest to trainer_state.pt) into output_dir/name.
    keep: at most this many checkpoints stay, the newest (0: all)."""
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
            f"{how_to_continue(output_dir, 'free space and ')}"
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
        if checkpoint_step(p) >= 0 and (p / "trainer_state.pt").is_file()
    ]


def checkpoint_step(path) -> int:
    """The step of a checkpoint-<step> folder (a path or a string, a trailing / allowed); -1 for
    any other name."""
    match = re.fullmatch(r"checkpoint-(\d+)", Path(str(path).rstrip("/")).name)
    return int(match.group(1)) if match else -1


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint a resume can continue: the one with the optimizer's state (every
    checkpoint of a run written before optimizer.pt existed has it inside)."""
    found = checkpoints(output_dir)
    resumable = [p for p in found if (p / "optimizer.pt").is_file()] or found
    return max(resumable, key=checkpoint_step) if resumable else None


def trainer_state(stateful: dict, step: int, **more) -> dict:
    """What a resume needs beyond the weights: the state_dict of each of `stateful` (name -> the
    optimizer, the schedule, fp16's loss scaler, the skipped steps), the RNG states, the step,
    and `more` (the data position, say); tensors and plain containers only."""
    state = {name: part.state_dict() for name, part in stateful.items()}
    return state | dict(rng=rng_states(), step=step, **more)


def restore(checkpoint: Path, stateful: dict) -> dict:
    """Each of `stateful` (as trainer_state's) and the RNG as the checkpoint holds them; a part it
    holds no state of (written before the part existed, or in another precision) is left as it
    is. Returns its trainer state."""
    state = load_trainer_state(checkpoint)
    for name, part in stateful.items():
        if state.get(name):
            part.load_state_dict(state[name])
    set_rng_states(state["rng"])
    return state


def load_trainer_state(checkpoint: Path) -> dict:
    """trainer_state.pt with the optimizer's state from optimizer.pt (checkpoints written before
    the split hold it inside trainer_state.pt)."""
    state = load_plain(checkpoint / "trainer_state.pt")
    if (checkpoint / "optimizer.pt").is_file():
        state["optimizer"] = load_plain(checkpoint / "optimizer.pt")
    if "optimizer" not in state:
        raise SystemExit(f"error: {checkpoint} has no optimizer.pt; resume from a newer checkpoint")
    return state


def load_plain(path: Path):
    """A .pt file of tensors and plain containers (torch.load with weights_only): anything else
    is a pickled object, whose loading could run any code, so it is refused in one line and
    nothing of it runs."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(error))
        held = f"a pickled {found.group(1)}" if found else "a pickled object"
        raise SystemExit(
            f"error: {path} holds {held}, not only tensors and plain containers, and loading it "
            "could run code: it was not loaded; resume only from checkpoints you wrote (or "
            "trust), or start afresh with --overwrite-output-dir"
        ) from None


def checkpoint_bytes(model) -> int:
    """What a checkpoint of `model` holds: its weights as they are, and AdamW's two moments in fp32
    (optimizer.pt); tokenizer and configs are small."""
    trained = [p for p in model.parameters() if p.requires_grad]
    saved = trained if lora.is_adapted(model) else list(model.parameters())  # LoRA: the adapter
    return sum(p.numel() * p.element_size() for p in saved) + 8 * sum(p.numel() for p in trained)


def check_free_disk(output_dir: Path, name: str, model) -> None:
    """Stop before a save the disk cannot hold, rather than halfway through it."""
    needed, free = checkpoint_bytes(model), shutil.disk_usage(output_dir).free
    if free < needed:
        raise SystemExit(
            f"error: {output_dir / name} needs about {needed / 1e9:.2f} GB and "
            f"{free / 1e9:.2f} GB are free; {how_to_continue(output_dir, 'free space and ')}"
        )


def how_to_continue(output_dir: Path, first: str = "", flag: str = "") -> str:
    """How a run that stopped goes on, the end of its one line: its newest checkpoint, intact, and
    the command that resumes from it; before its first checkpoint, the command that starts it
    afresh (--resume would find nothing to resume and be refused). `first` is what to do before
    it ("free space and "), `flag` an option the command adds ("--rollout-chunk 4")."""
    latest = latest_checkpoint(output_dir)
    if latest is None:
        again = command_with("--overwrite-output-dir", flag)
        return f"no checkpoint was written yet; {first}start afresh with: {again}"
    return f"{latest} is intact; {first}resume with: {command_with('--resume', flag)}"


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


@contextlib.contextmanager
def rng_kept():
    """Draws inside leave the RNG states as they were: what a run shows or measures between steps
    (clip_cov draws at random) must not change the training that follows."""
    states = rng_states()
    try:
        yield
    finally:
        set_rng_states(states)


def resume_command() -> str:
    """The command line that continues this run: the same arguments, with --resume."""
    return command_with("--resume")


def command_with(*options: str) -> str:
    """This run's command line without --resume and --overwrite-output-dir, with options added
    (each one word or more: "--rollout-chunk 4"; empty ones left out)."""
    kept = [a for a in sys.argv[1:] if a not in ("--resume", "--overwrite-output-dir")]
    return cli.command(None, [*kept, *(word for option in options for word in option.split())])
