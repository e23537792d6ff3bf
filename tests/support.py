"""What the system tests share: the repository's paths, the tools' command lines, reading a run's
metrics, faking a crash, and the processes a run leaves."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import torch

import cwgrpo
from cwgrpo_utils.run import checkpoints

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).parent


# CWGRPO_TEST_ROLLOUT=vllm runs the whole-run tests (kill anywhere, degenerate batches, bad input)
# with --rollout vllm, in a venv with vLLM (.ci/run; README "Fast rollouts with vLLM")
ROLLOUT = os.environ.get("CWGRPO_TEST_ROLLOUT", "hf")
# CWGRPO_TEST_LORA=1 runs them with a LoRA adapter and --report-to tensorboard; =ci with the kill
# points where the adapter matters, and two methods' degenerate batches (.ci/run)
LORA = os.environ.get("CWGRPO_TEST_LORA", "")
LORA_ARGS = ["--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "3e-3"]
# CWGRPO_TEST_PRECISION=fp16 runs them in fp16 (autocast with the loss scaler, on the CPU)
PRECISION = os.environ.get("CWGRPO_TEST_PRECISION", "")
FEATURES = [*LORA_ARGS, "--report-to", "tensorboard"] if LORA else []
FEATURES += ["--precision", PRECISION] if PRECISION else []

# A Qwen2 of a shape the tiny model is not, and the plan's count was not fit on: an untied head,
# 6 heads of 16, 2 KV heads
SMALL_SHAPE = dict(
    vocab_size=300,
    hidden_size=96,
    intermediate_size=320,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def started_run(*args, out: Path, **popen) -> subprocess.Popen:
    """python cwgrpo.py ARGS for 500 steps into `out`, in the background, once it logged a step."""
    command = [sys.executable, str(ROOT / "cwgrpo.py"), *args, "--steps", "500"]
    run = subprocess.Popen([*command, "--output-dir", str(out)], **popen)
    deadline = time.time() + 600  # a hang guard
    while not (out / "metrics.jsonl").exists() and time.time() < deadline and run.poll() is None:
        time.sleep(0.2)
    return run


def tensorboard_records(run: Path) -> list[dict]:
    """A run's TensorBoard scalars, read back by TensorBoard's own reader, as metrics.jsonl's
    records (step and numbers; no timings)."""
    reader = importlib.import_module("tensorboard.backend.event_processing.event_accumulator")
    events = reader.EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    steps = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            steps.setdefault(event.step, {"step": event.step})[tag] = event.value
    return [{k: v for k, v in steps[s].items() if k not in TIMING_KEYS} for s in sorted(steps)]


def saved_activation_bytes(model, cfg, run_cfg, n_rows: int, prompt: int, new: int) -> int:
    """The bytes the run's log-prob pass keeps for backward on a batch of random tokens of rows x
    (prompt + new), n_rows in groups of cfg.group_size sharing a prompt as a rollout's do, the
    last group's prompt 3 tokens shorter (left padding, as prompts of different lengths have):
    the unique storages saved_tensors_hooks sees, the weights left out."""
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (n_rows // cfg.group_size, prompt))
    prompt_mask = torch.ones(n_rows, prompt).long()
    prompt_mask[-cfg.group_size :, :3] = 0
    samples = cwgrpo.Samples(
        prompts.repeat_interleave(cfg.group_size, 0), prompt_mask,
        torch.randint(0, vocab, (n_rows, new)), torch.ones(n_rows, new),
        torch.zeros(n_rows, dtype=torch.bool), [""] * n_rows, torch.zeros(n_rows, new),
    )  # fmt: skip
    storages, weights = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(tensor):
        if tensor.numel():
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda tensor: tensor):
        cwgrpo.completion_logprobs(model, samples, cfg, cwgrpo.Passes.of(cfg, run_cfg))
    return sum(size for pointer, size in storages.items() if pointer not in weights)


def run_cli(*args, timeout=600):
    """python cwgrpo.py ARGS without a GPU; the timeout is a hang guard, not a measurement."""
    return subprocess.run(
        [sys.executable, str(ROOT / "cwgrpo.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


def evaluate_as_printed(run_output: str, *extra, cwd: Path, env: dict):
    """The `evaluate it:` command a finished run printed, run as printed (with this venv's
    python) from `cwd`, with `extra` options."""
    printed = run_output.split("evaluate it: ")[1].split(" (samples at")[0]
    return subprocess.run(
        [sys.executable, *shlex.split(printed)[1:], *extra],
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard
        env=env,
        cwd=cwd,
    )


TIMING_KEYS = {"rollout_s", "update_s", "tokens_per_s", "time"}


def read_metrics(path):
    """A run's metrics.jsonl records, their timings left out."""
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
        for line in path.read_text().splitlines()
    ]


class Crash(Exception):
    """What stops a run in-process where a kill would stop it in a process of its own."""


def crash_at_save(monkeypatch, n: int) -> None:
    """The run stops at its nth checkpoint save, before anything of it is written."""
    real, calls = checkpoints.save_checkpoint, []

    def save(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == n:
            (args[0] / f".{args[1]}.partial").mkdir()  # as a kill mid-save leaves it
            raise Crash(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_checkpoint", save)


def children_of(pid: int) -> list[int]:
    """The processes pid started (its grading workers, say)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    """A process that runs: neither gone nor a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


class PageParser(HTMLParser):
    """Checks that every tag is closed in order, and collects each view's token spans."""

    VOID = {"meta", "br", "img", "input", "link"}

    def __init__(self):
        super().__init__()
        self.stack, self.views, self.view, self.in_token = [], {}, None, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in self.VOID:
            self.stack.append(tag)
        if "data-view" in attrs:
            self.view = int(attrs["data-view"])
            self.views[self.view] = []
        if tag == "span" and attrs.get("class") == "t":
            self.in_token = True
            self.views[self.view].append("")

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing open"
        self.in_token = False

    def handle_data(self, data):
        if self.in_token:
            self.views[self.view][-1] += data


def fault_run(args, fault=None, marker="", timeout=600):
    """python -m tests.faults ARGS (cwgrpo.py's run), with CWGRPO_FAULT if given; marker tags its
    processes. The timeout is a hang guard, ten times a quiet run's."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CWGRPO_TEST_MARKER": marker}
    env.pop("CWGRPO_FAULT", None)
    if fault:
        env["CWGRPO_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "tests.faults", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def processes_tagged(marker: str) -> list[int]:
    """Live processes whose environment holds CWGRPO_TEST_MARKER=marker."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"CWGRPO_TEST_MARKER={marker}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def load_evaluate():
    """evaluate.py as a module under a name of its own: `import evaluate` is Hugging Face's
    package name, which nothing of ours imports."""
    spec = importlib.util.spec_from_file_location("cwgrpo_evaluate", ROOT / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
