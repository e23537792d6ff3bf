"""Training speed of cwgrpo.py against TRL's GRPOTrainer on the same tiny model, task, reward and
batch.

    pip install trl==1.16.0    # not a project requirement; TRL 1.16 was measured
    python -m benchmarks.vs_trl --steps 30 --rounds 2 --betas 0,0.04
    python -m benchmarks.vs_trl --rollouts hf,vllm    # also cwgrpo --rollout vllm (vLLM installed)
    python -m benchmarks.vs_trl --also ../cwgrpo-old  # another checkout, in the same rounds

Both start from the same warm-started tiny Qwen2 (the tiny preset's base model), train GRPO on the
tiny arithmetic task with the same reward (cwgrpo's math-verify accuracy + format), prompts x G
completions per step, the same generation limit, temperature, learning rate and one update per
batch, at each beta (0: no reference model; 0.04, the paper's: a reference model and the k3 KL on
both sides). Runs alternate (cwgrpo, TRL, cwgrpo, TRL, ...), each in its own process with the same
threads. Speed counts steps 2 to N from per-step timestamps (set-up and the first step left out, for
both); the script prints steps/s of each, the ratio, and each process's peak resident memory.
With --rollouts hf,vllm, cwgrpo runs with each of its samplers in turn (TRL with its own, generate).
With --also DIR, another checkout of cwgrpo (a git worktree of an earlier commit, say) runs in the
same rounds, through that checkout's own copy of this script, so a change's speed is measured side
by side with what it changed.
"""

import argparse
import importlib.metadata
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import cwgrpo
from cwgrpo_utils.machine.grading_pool import Grader
from cwgrpo_utils.models import tiny
from cwgrpo_utils.options.cli import require

ROOT = Path(__file__).resolve().parent.parent


def shared_settings(args) -> dict:
    return dict(
        group_size=args.group_size,
        prompts_per_step=args.prompts,
        max_completion_length=40,
        temperature=1.0,
        learning_rate=5e-4,
        seed=0,
    )


def run_cwgrpo(args, base_model: Path, out: Path) -> list[float]:
    s = shared_settings(args)
    cfg, run_cfg = cwgrpo.parse_config(
        [
            "--preset",
            "tiny",
            "--method",
            "grpo",
            "--model",
            str(base_model),
            "--dataset",
            str(base_model.parent / "arithmetic.jsonl"),
            "--beta",
            str(args.beta),
            "--steps",
            str(args.steps),
            "--save-every",
            str(10**9),
            "--group-size",
            str(s["group_size"]),
            "--prompts-per-step",
            str(s["prompts_per_step"]),
            "--groups-per-micro-batch",
            str(s["prompts_per_step"]),
            "--output-dir",
            str(out / "cwgrpo"),
            "--rollout",
            args.rollout,
            "--threads",  # TRL's: torch's default, where cwgrpo's --threads 0 chooses for the model
            str(torch.get_num_threads()),
        ]
    )
    cwgrpo.main(cfg, run_cfg)
    return [
        json.loads(line)["time"]
        for line in (out / "cwgrpo" / "metrics.jsonl").read_text().splitlines()
    ]


def run_trl(args, base_model: Path, out: Path) -> list[float]:
    from trl import GRPOConfig, GRPOTrainer  # optional: TRL is no requirement of the project

    s = shared_settings(args)
    grader = Grader(cwgrpo.grade_accuracy, cwgrpo.TIMED_OUT, workers=args.trl_reward_workers)

    def reward(completions, solution, **_):  # cwgrpo's reward, as a TRL reward function
        texts = [c[0]["content"] for c in completions]
        grades = grader.map([(t, g, "default") for t, g in zip(texts, solution)])
        return [grade.accuracy + cwgrpo.format_reward(t) for grade, t in zip(grades, texts)]

    rows = tiny.arithmetic_dataset(0)
    data = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": q}] for q in rows["problem"]],
            "solution": rows["solution"],
        }
    )
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=s["prompts_per_step"] * s["group_size"],
        gradient_accumulation_steps=1,
        num_generations=s["group_size"],
        max_completion_length=s["max_completion_length"],
        temperature=s["temperature"],
        top_k=0,
        top_p=1.0,
        learning_rate=s["learning_rate"],
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        beta=args.beta,
        num_iterations=1,
        loss_type="grpo",
        max_grad_norm=1.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        seed=s["seed"],
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(base_model, padding_side="left")
    step_ends = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.time())

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(base_model),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    trainer.train()
    return step_ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both trainers")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--trl-reward-workers",
        type=int,
        default=1,
        help="grading processes for TRL's reward function (cwgrpo uses --reward-workers' default: "
        "one per core); 1 is how a TRL reward function grades, one completion after another",
    )
    parser.add_argument(
        "--betas", default="0,0.04", help="KL coefficients to measure, each in turn"
    )
    parser.add_argument(
        "--rollouts", default="hf", help="cwgrpo's samplers to measure: hf, vllm or hf,vllm"
    )
    parser.add_argument(
        "--also", default="", help="another checkout of cwgrpo, measured (hf) in the same rounds"
    )
    parser.add_argument("--beta", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--rollout", default="hf", help=argparse.SUPPRESS)
    parser.add_argument("--trainer", choices=["cwgrpo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--base-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    require("trl", "benchmarks/vs_trl.py")
    if "vllm" in args.rollouts.split(","):
        require("vllm", "benchmarks/vs_trl.py --rollouts vllm")
    cwgrpo.transformers.utils.logging.set_verbosity_error()
    if args.trainer:
        with tempfile.TemporaryDirectory() as tmp:
            step_ends = (run_cwgrpo if args.trainer == "cwgrpo" else run_trl)(
                args, Path(args.base_model), Path(tmp)
            )
        # steps 2..N: the first step and all set-up (loading, tokenising, compiling) are left out
        print(
            json.dumps(
                {
                    "seconds": step_ends[-1] - step_ends[0],
                    "steps": len(step_ends) - 1,
                    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                }
            )
        )
        return

    with tempfile.TemporaryDirectory() as tmp:
        base_model = tiny.build(tmp) / "model"
        print(
            f"{args.steps} steps of {args.prompts} prompts x G = {args.group_size}, "
            f"up to 40 new tokens, "
            f"one update per batch, {os.cpu_count()} CPU threads, TRL {version('trl')}, "
            f"transformers {version('transformers')}, torch {version('torch')}"
        )
        ratios = {}
        ours = [f"cwgrpo-{rollout}" for rollout in args.rollouts.split(",")]
        ours += ["also-hf"] * bool(args.also)
        for beta in map(float, args.betas.split(",")):
            results = {name: [] for name in [*ours, "trl"]}
            for round_index in range(args.rounds):
                for name in results:
                    trainer, _, rollout = name.partition("-")
                    checkout = Path(args.also) if trainer == "also" else ROOT
                    done = subprocess.run(
                        [
                            *script(checkout),
                            "--trainer",
                            "cwgrpo" if trainer == "also" else trainer,
                            "--base-model",
                            str(base_model),
                            "--steps",
                            str(args.steps),
                            "--prompts",
                            str(args.prompts),
                            "--group-size",
                            str(args.group_size),
                            "--trl-reward-workers",
                            str(args.trl_reward_workers),
                            "--beta",
                            str(beta),
                            *(["--rollout", rollout] if rollout not in ("", "hf") else []),
                        ],
                        capture_output=True,
                        text=True,
                        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                        cwd=checkout,
                    )
                    if done.returncode:
                        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    results[name].append(result)
                    print(
                        f"beta {beta:g} round {round_index + 1} {name:11s}: "
                        f"{result['steps'] / result['seconds']:.3f} steps/s "
                        f"({result['seconds']:.1f} s), "
                        f"peak RSS {result['peak_rss_mib']:.0f} MiB"
                    )
            speed = {
                k: sum(r["steps"] for r in v) / sum(r["seconds"] for r in v)
                for k, v in results.items()
            }
            for name in ours:
                ratios[beta, name] = [
                    c["steps"] / c["seconds"] / (t["steps"] / t["seconds"])
                    for c, t in zip(results[name], results["trl"])
                ]
                print(
                    f"beta {beta:g}: {name} {speed[name]:.3f} steps/s, "
                    f"TRL {speed['trl']:.3f} steps/s: "
                    f"{name} / TRL = {speed[name] / speed['trl']:.2f} (per round: "
                    f"{', '.join(f'{r:.2f}' for r in ratios[beta, name])}; goal >= 1.5)"
                )


def script(checkout: Path) -> list[str]:
    """How a checkout runs its own copy of this script: as a module where benchmarks/ is a
    package (this layout), else by its path (earlier checkouts put themselves on sys.path)."""
    if (checkout / "benchmarks" / "__init__.py").is_file():
        return [sys.executable, "-m", "benchmarks.vs_trl"]
    return [sys.executable, str(checkout / "benchmarks" / "vs_trl.py")]


def version(package: str) -> str:
    return importlib.metadata.version(package)


if __name__ == "__main__":
    main()
