"""The run's options: everything of a cwgrpo.py run that is not the algorithm (config.py's Config)
but how and where it runs: its output and checkpoints, trackers, the device and precision, the
memory and speed options, the vLLM sampler and LoRA. The command line is one flat set of flags;
--help shows these in a group of their own. Light on purpose: read before torch is imported."""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cwgrpo_utils import PRECISIONS
from cwgrpo_utils.options.cli import arg, check_ranges, require, require_engine_in_process
from cwgrpo_utils.run import trackers


@dataclass
class RunConfig:
    _argument_group_name = "the run (how and where it runs, not what it computes)"

    # Output, checkpoints and resume
    output_dir: str = arg("", "default runs/<method>-<preset>-seed<seed>")
    save_every: int = arg(50, "write checkpoint-<step> this often", "> 0")
    save_total_limit: int = arg(0, "keep only the newest this many checkpoints; 0: all", ">= 0")
    resume: bool = arg(False, "continue from the newest complete checkpoint in --output-dir")
    overwrite_output_dir: bool = arg(False, "start afresh in an --output-dir that holds a run")
    log_every: int = arg(10, "without a terminal, a progress line every this many steps", "> 0")
    report_to: list[str] = arg(["none"], "none, or trackers: tensorboard wandb trackio")
    plan: bool = arg(
        False, "print the memory and disk plan (cwgrpo_utils/machine/memory_plan.py), exit"
    )
    max_skipped_steps: int = arg(
        10, "stop after this many steps in a row skipped as not finite", "> 0"
    )
    # Device, precision, threads
    device: str = arg("auto", "auto (cuda if present), cuda or cpu")
    precision: Literal[PRECISIONS] = arg("auto", "auto: bf16 on CUDA 8.0+, fp16 on 7.x, CPU fp32")
    threads: int = arg(0, "CPU threads of torch; 0: chosen for the model and idle cores", ">= 0")
    reward_workers: int = arg(0, "grading processes; 0: one per core, at most 8", ">= 0")
    # Memory and speed: how much is computed at once, not what
    groups_per_micro_batch: int = arg(1, "whole groups per forward/backward; 0: all", ">= 0")
    rollout_chunk: int = arg(0, "prompts sampled at once (bounds the KV cache); 0: all", ">= 0")
    share_prompts: bool = arg(True, "encode each group's prompt once, not once for each completion")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward to save memory")
    logit_chunk_elements: int = arg(
        2**26, "logits the LM head holds at once; 0: the whole vocabulary at every position", ">= 0"
    )
    # The vLLM sampler and LoRA
    rollout: Literal["hf", "vllm"] = arg("hf", "sampler: hf (cwgrpo.py's loop) or vllm")
    vllm_gpu_memory_utilization: float = arg(0.3, "vllm on CUDA: its share of the GPU", "in (0, 1]")
    lora_rank: int = arg(0, "LoRA rank r; 0: full fine-tuning, as the paper", ">= 0")
    lora_alpha: float = arg(32.0, "LoRA: the adapter's update is scaled by alpha / r", "> 0")
    lora_target_modules: str = arg("all-linear", "LoRA: the layers it adapts, comma-separated")

    def __post_init__(self):
        """Every value is checked here, at parse time, before any slow work."""
        check_ranges(self)
        if self.rollout == "vllm" and not self.plan:  # a plan needs no engine
            require("vllm", "--rollout vllm")
            require_engine_in_process("--rollout vllm")
        trackers.check(self.report_to)


def check_output_dir(output_dir: str, resume: bool, overwrite: bool) -> None:
    """A folder that holds a run takes no new one: one line, before anything loads, unless
    --resume continues it or --overwrite-output-dir starts afresh."""
    if (Path(output_dir) / "metrics.jsonl").exists() and not resume and not overwrite:
        raise SystemExit(
            f"error: {output_dir} already holds a run; pass --resume to continue it, "
            "--overwrite-output-dir to start afresh, or choose another --output-dir"
        )


def micro_batch_rows(groups_per_micro_batch: int, prompts_per_step: int, group_size: int) -> int:
    """The rows a forward (and backward) pass holds: --groups-per-micro-batch whole groups (0: all
    of a step's)."""
    return (groups_per_micro_batch or prompts_per_step) * group_size
