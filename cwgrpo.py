"""cwgrpo.py: CW-GRPO and GRPO for math reasoning, in one file that reads like the paper.

CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage Reweighting",
Wang et al., ACL 2026) reweights each token's advantage with a Gaussian kernel of its covariance score.
Every formula cites its section of SPEC.md (the project's math reference, kept beside this repo).

    python cwgrpo.py --method cw                 # the paper's 1.5B recipe (one CUDA GPU)
    python cwgrpo.py --method cw --preset tiny   # a tiny model on a synthetic task, on a laptop CPU
    python cwgrpo.py ablate --methods all --seeds 3 --preset tiny   # every method side by side
    python cwgrpo.py diagnose --preset tiny --model runs/cw-tiny-seed0/final-model   # the papers' measurements

Sections: 1 config, 2 data, 3 reward, 4 sampling, 5 log-probs, 6 advantages, 7 token weights (the
methods), 8 loss, 9 checkpoints, 10 the tiny preset, 11 the training loop, 12 ablation, 13 diagnostics.
"""

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import datasets
import torch
import torch.nn.functional as F
import transformers
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from tqdm import tqdm
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, HfArgumentParser,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer)

# ----------------------------------------------------------------------------------------------------
# 1. Config
# ----------------------------------------------------------------------------------------------------

# SPEC "Base recipe": the system prompt Open-RS trains with.
OPEN_RS_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer, and put your final answer within \\boxed{} . The reasoning process and answer are enclosed "
    "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
    "here </think> <answer> answer here </answer>. Note that respond by English, NOT use other languages."
)

METHODS: dict = {}  # name -> Method; the table is filled in section 7, and --method reads it


@dataclass
class Config:
    # The defaults are the released 1.5B recipe (SPEC "Base recipe"); PRESETS below override some.
    preset: Literal["paper-1.5b", "paper-7b", "tiny"] = field(default="paper-1.5b", metadata={
        "help": "a whole recipe: paper-1.5b (SPEC base recipe), paper-7b, or tiny (a CPU demo with a "
                "tiny Qwen2 built in code); any other option overrides the preset's value"})
    method: str = field(default="cw", metadata={
        "choices": METHODS, "help": "token-weighting method (see the table in section 7 of cwgrpo.py)"})
    model: str = field(default="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", metadata={
        "help": "policy model: a Hugging Face hub id, a local folder, or 'tiny' (built in code)"})
    dataset: str = field(default="knoveleng/open-rs", metadata={
        "help": "training data: a hub dataset id, a local .json/.jsonl/.parquet/.csv file, or "
                "'tiny-arithmetic' (the synthetic task of the tiny preset)"})
    dataset_split: str = field(default="train", metadata={"help": "split of a hub dataset"})
    question_column: str = field(default="problem", metadata={"help": "dataset column with the question"})
    gold_column: str = field(default="solution", metadata={
        "help": "dataset column with the reference solution (parsed by math-verify)"})
    system_prompt: str = field(default=OPEN_RS_SYSTEM_PROMPT, metadata={
        "help": "system message of the chat template; empty for none (default: Open-RS's prompt)"})
    group_size: int = field(default=12, metadata={"help": "G, completions sampled per prompt"})
    prompts_per_step: int = field(default=12, metadata={
        "help": "prompts per optimizer step; one step sees prompts_per_step x G completions"})
    groups_per_micro_batch: int = field(default=1, metadata={
        "help": "whole groups per forward/backward pass (gradient accumulation covers the rest)"})
    max_prompt_length: int = field(default=512, metadata={
        "help": "prompts longer than this many tokens are skipped (and counted)"})
    max_completion_length: int = field(default=4096, metadata={"help": "generation limit in tokens"})
    temperature: float = field(default=0.7, metadata={
        "help": "sampling temperature; log-probs use logits divided by it too (SPEC notation)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling; 1.0 is off (paper)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling; 0 is off (paper)"})
    mask_truncated_completions: bool = field(default=False, metadata={
        "help": "drop completions cut at the length limit from the loss"})
    accuracy_weight: float = field(default=1.0, metadata={"help": "weight of the math-verify accuracy reward"})
    format_weight: float = field(default=1.0, metadata={
        "help": "weight of the format reward ('\\n</think>\\n' exactly once)"})
    reward_timeout_s: float = field(default=10.0, metadata={
        "help": "hard wall-clock limit on grading one completion; a hang scores 0"})
    reward_workers: int = field(default=0, metadata={
        "help": "processes grading completions in parallel; 0 is one per CPU core, at most 8"})
    beta: float = field(default=0.04, metadata={
        "help": "k3 KL coefficient; 0 skips loading the reference model"})
    eps_low: float = field(default=0.2, metadata={"help": "PPO clip range below 1"})
    eps_high: float = field(default=0.2, metadata={"help": "PPO clip range above 1"})
    loss_aggregation: Literal["seq-mean-token-mean", "token-mean"] = field(
        default="seq-mean-token-mean", metadata={
            "help": "seq-mean-token-mean (original GRPO, the paper) or token-mean (DAPO)"})
    num_iterations: int = field(default=1, metadata={
        "help": "policy updates per rollout batch (1 in the paper: on-policy, ratio == 1)"})
    cw_norm: Literal["padded", "valid"] = field(default="padded", metadata={
        "help": "CW weight normalisation: padded (released code, mean 1 over padded positions) or "
                "valid (paper wording, mean 1 over real tokens)"})
    cw_detach: bool = field(default=False, metadata={
        "help": "stop the gradient through the CW weights (the clean reading; the released code does not)"})
    clip_cov_ratio: float = field(default=2e-4, metadata={
        "help": "clip_cov: share of valid tokens whose loss is zeroed (Cui et al. 2025)"})
    clip_cov_lb: float = field(default=1.0, metadata={"help": "clip_cov: candidates have covariance above this"})
    clip_cov_ub: float = field(default=5.0, metadata={"help": "clip_cov: candidates have covariance below this"})
    kl_cov_ratio: float = field(default=2e-3, metadata={
        "help": "kl_cov: share of valid tokens, top by covariance, that get the penalty (Cui et al. 2025)"})
    kl_cov_coef: float = field(default=1.0, metadata={"help": "kl_cov: coefficient of |logp - old_logp|"})
    ar_alpha: float | None = field(default=None, metadata={
        "help": "ar: alpha of w = alpha * p_old + 1 - alpha; default 0.2, 0.3 with ar_lopti (Yang et al. 2025)"})
    lopti_eta: float | None = field(default=None, metadata={
        "help": "lopti: probability threshold of the low pass; default 0.4, 0.5 with ar_lopti (Yang et al. 2025)"})
    ict_keep_frac: float = field(default=0.1, metadata={
        "help": "ict: share of each response's positions kept, top by JS divergence (Beyond Entropy, 2026)"})
    entropy_top_frac: float = field(default=0.2, metadata={
        "help": "entropy20: share of the batch's tokens, top by entropy, that keep the PG term (Wang et al. 2025)"})
    stapo_max_prob: float = field(default=0.01, metadata={
        "help": "stapo: silenced tokens have probability below this (from a secondary source)"})
    stapo_entropy_percentile: float = field(default=5.0, metadata={
        "help": "stapo: silenced tokens have entropy below this batch percentile (from a secondary source)"})
    learning_rate: float = field(default=1e-6, metadata={"help": "peak AdamW learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine schedule ends at this fraction of the peak"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "share of steps with linear warmup"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    steps: int = field(default=300, metadata={"help": "rollout batches to train on"})
    save_every: int = field(default=50, metadata={"help": "write checkpoint-<step> every this many steps"})
    seed: int = field(default=2025, metadata={"help": "seed of data order, sampling and initialisation"})
    gradient_checkpointing: bool = field(default=True, metadata={
        "help": "recompute activations in backward to save memory"})
    logit_chunk_elements: int = field(default=2**26, metadata={
        "help": "positions x vocab logits computed at once by the chunked LM head (and ict's divergence), so "
                "memory does not grow with vocab x length; 2**26 is 256 MiB of float32, 441 positions at "
                "Qwen's vocab"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if present), cuda or cpu"})
    output_dir: str = field(default="", metadata={
        "help": "where metrics, checkpoints and the final model go (default runs/<method>-<preset>-seed<seed>)"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the newest complete checkpoint in --output-dir"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "start afresh in an --output-dir that already holds a run"})
    diagnose_every: int = field(default=0, metadata={
        "help": "append the diagnostics (covariance concentration, probability quartiles) to diagnostics.jsonl "
                "every this many steps; 0 is off"})
    warmstart_steps: int = field(default=0, metadata={
        "help": "supervised steps on the synthetic task before RL (model 'tiny' only)"})

    def __post_init__(self):
        if self.group_size < 2:
            raise SystemExit(f"error: --group-size must be at least 2 (group advantages need two samples); "
                             f"got {self.group_size}")
        self.groups_per_micro_batch = min(self.groups_per_micro_batch, self.prompts_per_step)
        if self.prompts_per_step % self.groups_per_micro_batch:
            raise SystemExit(f"error: --prompts-per-step ({self.prompts_per_step}) must be a multiple of "
                             f"--groups-per-micro-batch ({self.groups_per_micro_batch})")
        if not self.output_dir:
            self.output_dir = f"runs/{self.method}-{self.preset}-seed{self.seed}"


PRESETS = {
    "paper-1.5b": {},  # the Config defaults are this recipe
    "paper-7b": dict(model="Qwen/Qwen2.5-Math-7B-Instruct", format_weight=0.0, steps=150,
                     # Qwen2.5-Math-7B has 4,096 positions: prompt + completion must fit in them
                     max_completion_length=3584),
    "tiny": dict(model="tiny", dataset="tiny-arithmetic", system_prompt="", group_size=8,
                 prompts_per_step=8, groups_per_micro_batch=8, max_prompt_length=64,
                 max_completion_length=40, temperature=1.0, learning_rate=5e-4, warmup_ratio=0.05,
                 steps=150, save_every=50, seed=0, gradient_checkpointing=False, warmstart_steps=250),
}
GPU_PRESETS = ("paper-1.5b", "paper-7b")


def parse_config(argv=None, *extra_dataclasses):
    """The run's Config (and any extra dataclasses a subcommand adds), the preset's values as defaults."""
    argv = sys.argv[1:] if argv is None else list(argv)
    preset_parser = argparse.ArgumentParser(add_help=False)
    preset_parser.add_argument("--preset", default=Config.preset, choices=list(PRESETS))
    preset = preset_parser.parse_known_args(argv)[0].preset
    parser = HfArgumentParser((Config, *extra_dataclasses), description=__doc__.split("\n\n")[0], epilog=(
        "methods: " + "; ".join(f"{k}: {m.description}" for k, m in METHODS.items())
        + ". Subcommands (each with --help): ablate (methods x seeds, a table and a plot), diagnose (the papers' "
          "measurements on one batch), plot-diagnostics (entropy and covariance over steps)."))
    parser.set_defaults(**PRESETS[preset])
    parsed = parser.parse_args_into_dataclasses(argv)
    return parsed if extra_dataclasses else parsed[0]


def bf16_autocast(device: torch.device):
    """A factory of autocast contexts: bf16 on CUDA (the weights stay fp32 masters), nothing on CPU."""
    return lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device == "auto":
        if cfg.preset in GPU_PRESETS and not torch.cuda.is_available():
            raise SystemExit(f"error: --preset {cfg.preset} is a GPU recipe and no CUDA GPU was found; "
                             f"run the CPU demo with --preset tiny (or force --device cpu)")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU was found; use --device cpu or --preset tiny")
    return torch.device(cfg.device)


# ----------------------------------------------------------------------------------------------------
# 2. Data
# ----------------------------------------------------------------------------------------------------

LOCAL_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(name: str, split: str, question_column: str, gold_column: str) -> datasets.Dataset:
    """A hub dataset or a local file, checked to have the question and gold columns."""
    path = Path(name)
    try:
        if path.suffix in LOCAL_DATA_FORMATS:
            if not path.is_file():
                raise SystemExit(f"error: dataset file {name} does not exist")
            rows = datasets.load_dataset(LOCAL_DATA_FORMATS[path.suffix], data_files=str(path), split="train")
        else:
            rows = datasets.load_dataset(name, split=split)
    except (ConnectionError, OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise SystemExit(f"error: cannot load dataset '{name}' (split '{split}'): {first_line(e)}. "
                         f"Check the name, or download it while online (it is then read from the cache), "
                         f"or pass a local .json/.jsonl/.parquet/.csv file") from None
    missing = [c for c in (question_column, gold_column) if c not in rows.column_names]
    if missing:
        raise SystemExit(f"error: dataset '{name}' has no column {', '.join(map(repr, missing))}; "
                         f"columns found: {', '.join(rows.column_names)}. "
                         f"Set --question-column and --gold-column")
    return rows


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def chat_prompt_ids(tokenizer, question: str, system_prompt: str) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


class PromptStream:
    """Tokenised prompts served in seeded shuffled order, epoch after epoch.

    The position is a plain count of prompts served, so a checkpoint stores one integer.
    """

    def __init__(self, rows: datasets.Dataset, tokenizer, cfg: Config):
        self.items, self.skipped = [], 0
        for question, gold in zip(rows[cfg.question_column], rows[cfg.gold_column]):
            ids = chat_prompt_ids(tokenizer, str(question), cfg.system_prompt)
            if len(ids) > cfg.max_prompt_length:
                self.skipped += 1
            else:
                self.items.append((ids, str(gold)))
        if not self.items:
            raise SystemExit(f"error: every prompt is longer than --max-prompt-length {cfg.max_prompt_length}")
        self.seed, self.position, self.epoch_order = cfg.seed, 0, {}

    def next_batch(self, n: int) -> list[tuple[list[int], str]]:
        batch = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.items))
            if epoch not in self.epoch_order:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self.epoch_order = {epoch: torch.randperm(len(self.items), generator=generator).tolist()}
            batch.append(self.items[self.epoch_order[epoch][index]])
            self.position += 1
        return batch


# ----------------------------------------------------------------------------------------------------
# 3. Reward (SPEC "Base recipe", Rewards)
# ----------------------------------------------------------------------------------------------------

class Grade(NamedTuple):
    accuracy: float
    gold_parsed: bool  # False: the gold could not be parsed, so the score is 0 by rule
    timed_out: bool


def grade_accuracy(completion: str, gold: str, gold_format: str = "default") -> Grade:
    """math-verify accuracy, gold first (verify is not symmetric). Runs inside the grading worker.

    gold_format: "default" is math-verify's default extraction (LaTeX, then plain expressions), the
    training reward's; the benchmarks of evaluate.py parse their gold as "expr" or "latex".
    """
    gold_targets = {"default": [LatexExtractionConfig(), ExprExtractionConfig()], "expr": [ExprExtractionConfig()],
                    "latex": [LatexExtractionConfig()]}[gold_format]
    gold_parsed = parse(gold, extraction_config=gold_targets)
    if not gold_parsed:
        return Grade(0.0, False, False)
    prediction = parse(completion, extraction_mode="first_match", extraction_config=[LatexExtractionConfig(
        normalization_config=NormalizationConfig(basic_latex=True, units=True, malformed_operators=False,
                                                 nits=False, boxed="all", equations=False),
        boxed_match_priority=0, try_extract_without_anchor=False)])
    return Grade(float(verify(gold_parsed, prediction)), True, False)


def grading_worker(conn) -> None:
    import logging
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeout warnings, one per hang
    while True:
        try:
            completion, gold, gold_format = conn.recv()
        except EOFError:
            return
        try:
            conn.send(grade_accuracy(completion, gold, gold_format))
        except Exception:  # noqa: BLE001 - any failure inside the grader is a wrong answer, not a crash
            conn.send(Grade(0.0, True, False))


class GradingWorker:
    """A child process that grades, killed and replaced when one grading overruns the time limit.

    math-verify's own timeout uses SIGALRM, which works only on a main thread and cannot interrupt a long
    C-level computation (sympy evaluating 9^9^9^9); killing a process always works.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s, self.process = timeout_s, None
        self.context = multiprocessing.get_context(
            "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")

    def grade(self, key: tuple[str, str, str]) -> Grade:
        if self.process is None:
            self.conn, child_conn = self.context.Pipe()
            self.process = self.context.Process(target=grading_worker, args=(child_conn,), daemon=True)
            self.process.start()
            child_conn.close()
        self.conn.send(key)
        try:
            result = self.conn.recv() if self.conn.poll(self.timeout_s) else None
        except EOFError:  # the worker died (a crash inside sympy, say): a wrong answer
            result = Grade(0.0, True, False)
        if result is None or not self.process.is_alive():
            self.process.kill()
            self.process.join()
            self.process = None
        return result or Grade(0.0, True, True)


class Grader:
    """Grades (completion, gold) pairs on a few worker processes at once, with a hard time limit on each.

    Results are cached, which never changes a score: grading is a pure function of its inputs.
    """

    def __init__(self, timeout_s: float = 10.0, workers: int = 1, max_cache: int = 200_000):
        self.timeout_s, self.max_cache, self.cache = timeout_s, max_cache, {}
        self.workers = [GradingWorker(timeout_s) for _ in range(max(1, workers))]
        self.threads = ThreadPoolExecutor(len(self.workers)) if len(self.workers) > 1 else None

    def grade(self, completion: str, gold: str, gold_format: str = "default") -> Grade:
        return self.grade_many([(completion, gold, gold_format)])[0]

    def grade_many(self, items: list[tuple[str, str, str]]) -> list[Grade]:
        """Grades of (completion, gold, gold_format) triples; the uncached ones are shared among the workers."""
        todo = list(dict.fromkeys(key for key in items if key not in self.cache))
        if len(self.cache) + len(todo) > self.max_cache:
            self.cache.clear()
            todo = list(dict.fromkeys(items))
        shares = [todo[i::len(self.workers)] for i in range(len(self.workers))]

        def grade_share(worker, share):
            return [worker.grade(key) for key in share]
        graded = self.threads.map(grade_share, self.workers, shares) if self.threads else [grade_share(
            self.workers[0], shares[0])]
        for share, grades in zip(shares, graded):
            self.cache.update(zip(share, grades))
        return [self.cache[key] for key in items]


def reward_worker_count(requested: int) -> int:
    return requested or min(8, os.cpu_count() or 1)


_default_grader = None


def math_reward(completion: str, gold: str, timeout_s: float = 10.0) -> float:
    """The accuracy reward of SPEC: 1.0 if math-verify finds the completion's answer equal to the gold."""
    global _default_grader
    if _default_grader is None or _default_grader.timeout_s != timeout_s:
        _default_grader = Grader(timeout_s)
    return _default_grader.grade(completion, gold).accuracy


def format_reward(completion: str) -> float:
    return float(completion.count("\n</think>\n") == 1)  # SPEC Rewards: format


# ----------------------------------------------------------------------------------------------------
# 4. Sampling
# ----------------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    """One rollout batch: N = prompts x G completions, consecutive rows forming a group."""
    prompt_ids: torch.Tensor       # (N, P) left-padded
    prompt_mask: torch.Tensor      # (N, P)
    completion_ids: torch.Tensor   # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    truncated: torch.Tensor        # (N,) bool, no EOS within the limit
    texts: list
    golds: list
    rewards: torch.Tensor = None
    advantages: torch.Tensor = None
    # from the no-grad pass after sampling, when the update needs them (num_iterations > 1, or the method)
    old_logp: torch.Tensor = None    # (N, T) else old == current, detached
    entropy: torch.Tensor = None     # (N, T) else taken from the update's own forward pass
    divergence: torch.Tensor = None  # (N, T) ict's score
    ref_logp: torch.Tensor = None    # (N, T) only when beta > 0
    active: torch.Tensor = None      # (N, T) tokens whose loss terms count; the diagnostics mask the rest
    batch_entropy: torch.Tensor = None  # the entropies of all valid tokens of the batch (not per row)

    def rows(self, start: int, stop: int) -> "Rollout":
        """Rows [start, stop) with their all-padding columns trimmed off."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in out.items():
            if value is not None and name != "batch_entropy":
                out[name] = value[start:stop]
        prompt_keep = out["prompt_mask"].any(0).nonzero()[0, 0]
        completion_len = int(out["completion_mask"].sum(1).max())
        for name in ("prompt_ids", "prompt_mask"):
            out[name] = out[name][:, prompt_keep:]
        for name in ("completion_ids", "completion_mask", "old_logp", "entropy", "divergence", "ref_logp", "active"):
            if out[name] is not None:
                out[name] = out[name][:, :completion_len]
        return Rollout(**out)


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return ids or [tokenizer.eos_token_id]


@torch.no_grad()
def sample(model, tokenizer, batch: list[tuple[list[int], str]], cfg: Config) -> Rollout:
    """G completions per prompt with HF generate, left padding, plain temperature sampling."""
    generation = GenerationConfig(
        do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
        max_new_tokens=cfg.max_completion_length, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos_token_ids(model, tokenizer))
    model.eval()
    prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts = generate_completions(
        model, tokenizer, [ids for ids, _ in batch], cfg.group_size, generation)
    golds = [gold for _, gold in batch for _ in range(cfg.group_size)]
    if cfg.mask_truncated_completions:  # out of the loss, not out of the reward
        completion_mask = completion_mask * (~truncated)[:, None]
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, golds)


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: list[list[int]], n: int, generation: GenerationConfig):
    """n completions of each prompt, prompts left-padded into one batch: the prompt ids and mask, the
    completion ids, mask and truncation flags (section 4's masking after EOS), and the decoded texts."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device).repeat_interleave(n, 0)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                               device=device).repeat_interleave(n, 0)
    output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation)
    completion_ids = output[:, width:]
    completion_mask, truncated = completion_mask_after_eos(completion_ids, generation.eos_token_id)
    texts = tokenizer.batch_decode([ids[: int(k)] for ids, k in zip(completion_ids, completion_mask.sum(1))],
                                   skip_special_tokens=True)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts


def completion_mask_after_eos(completion_ids: torch.Tensor, eos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """1 for every token up to and including the first EOS, 0 after; and which rows never hit EOS."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device))
    truncated = ~is_eos.any(1)
    first_eos = torch.where(truncated, completion_ids.shape[1], is_eos.int().argmax(1))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return (positions[None, :] <= first_eos[:, None]).float(), truncated


# ----------------------------------------------------------------------------------------------------
# 5. Log-probs and entropy, chunked over positions
# ----------------------------------------------------------------------------------------------------

def scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits divided by the sampling temperature (SPEC notation)."""
    return F.linear(hidden, weight).float().div_(temperature)


class ChunkedLogProbs(torch.autograd.Function):
    """log p(target) and the entropy at each position, from hidden states and the LM head, chunk by chunk
    of positions (SPEC notation: temperature-scaled logits). Backward recomputes each chunk's softmax and
    turns it into the logits' gradient in place, so at most about two (chunk, vocab) float32 blocks are
    alive at any time, whatever the vocabulary and length, and no logits are kept between the passes."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, targets, temperature, width):
        logp = torch.empty(hidden.shape[0], device=hidden.device)
        entropy = torch.empty_like(logp)
        for start in range(0, hidden.shape[0], width):
            rows = slice(start, start + width)
            logp_all = scaled_logits(hidden[rows], weight, temperature).log_softmax(-1)
            logp[rows] = logp_all.gather(-1, targets[rows, None]).squeeze(-1)
            entropy[rows] = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.width = temperature, width
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, device=weight.device) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.width):
            rows = slice(start, start + ctx.width)
            grad_logits = scaled_logits(hidden[rows], weight, ctx.temperature).softmax(-1)
            g = grad_logp[rows, None]
            grad_logits.mul_(-g).scatter_add_(1, targets[rows, None], g).div_(ctx.temperature)  # (onehot - p) g / T
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits.to(hidden.dtype) @ weight.to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_logits.T.to(hidden.dtype) @ hidden[rows]).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions,) log-probs of `targets` and entropies, never more than chunk_elements logits at once."""
    return ChunkedLogProbs.apply(hidden, weight, targets, temperature, max(1, chunk_elements // weight.shape[0]))


def completion_logprobs(model, rollout: Rollout, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, T) log-probs of the sampled completion tokens and the entropies there, 0 on padding; and the
    (N, T, hidden) states that predict them."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state
    prompt_width = rollout.prompt_ids.shape[1]
    hidden = hidden[:, prompt_width - 1:-1]  # the state at position t predicts completion token t
    valid = rollout.completion_mask.bool()
    logp_valid, entropy_valid = chunked_logprobs(hidden[valid], model.get_output_embeddings().weight,
                                                 rollout.completion_ids[valid], cfg.temperature,
                                                 cfg.logit_chunk_elements)
    logp = torch.zeros(valid.shape, device=hidden.device, dtype=logp_valid.dtype)
    entropy = torch.zeros_like(logp)
    logp[valid] = logp_valid
    entropy[valid] = entropy_valid
    return logp, entropy, hidden


# ----------------------------------------------------------------------------------------------------
# 6. Advantages
# ----------------------------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """SPEC notation: A = (R - mean(R)) / (std(R) + 1e-4) within each group, Bessel std."""
    groups = rewards.view(-1, group_size)
    advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    return advantages.view(-1)


# ----------------------------------------------------------------------------------------------------
# 7. Token weights: the methods
# ----------------------------------------------------------------------------------------------------

class Group(NamedTuple):
    """What a method sees of one group of G responses (T = the micro-batch's longest response)."""
    logp: torch.Tensor        # (G, T) current policy, with gradient
    old_logp: torch.Tensor    # (G, T) rollout policy, no gradient
    advantages: torch.Tensor  # (G,)
    mask: torch.Tensor        # (G, T) 0/1
    entropy: torch.Tensor     # (G, T) rollout policy's entropy, no gradient
    batch_entropy: torch.Tensor | None  # entropies of all valid tokens of the rollout batch, sorted (entropy20, stapo)
    divergence: torch.Tensor | None     # (G, T) ict's JS score, for methods that ask for it
    update_pass: int          # 0; lopti's second (high-probability) pass is 1


class TokenTerms(NamedTuple):
    """How a method changes the per-token loss w * pg + beta * k3 (SPEC notation)."""
    pg_weight: torch.Tensor            # w (G, T); 0 drops a token's PG term, not its share of the denominator
    extra: torch.Tensor | None = None  # a per-token term added to the loss (kl_cov)
    clip: bool = True                  # False: the PG term without PPO clipping (kl_cov)
    active: torch.Tensor | None = None  # tokens whose PG and KL terms count in this update pass (lopti)


def grpo(group: Group, cfg) -> TokenTerms:
    return TokenTerms(group.mask)  # SPEC "grpo": w = 1


def covariance_score(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CW-GRPO's per-token covariance score for one group (SPEC "cw", steps 1-3)."""
    mu = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)                      # 1. own mean log-prob
    centred_adv = adv - adv.mean()                                           # 2.
    return (logp - mu[:, None]) * centred_adv[:, None] * mask                # 3.


def cw_weights(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *, norm: str = "padded",
               detach: bool = False) -> torch.Tensor:
    """CW-GRPO's Gaussian-kernel covariance weights for one group (SPEC "cw", steps 1-8)."""
    score = covariance_score(logp, adv, mask)                                # 1-3.
    n_valid = mask.sum()
    score_mean = score.sum() / n_valid
    variance = ((score - score_mean) ** 2 * mask).sum() / n_valid             # 4. ddof=0, valid tokens
    # sqrt'(0) is infinite: when every score is 0 (equal rewards) take sigma = 1e-8 with zero gradient
    sigma = torch.where(variance > 0, variance, 1.0).sqrt() * (variance > 0) + 1e-8
    kernel = torch.exp(-score ** 2 / (2 * sigma ** 2)) * mask                # 5.
    if norm == "padded":                                                     # 6. released code
        total = mask.shape[0] * mask.sum(1).max()
    elif norm == "valid":                                                    # 6. paper wording
        total = n_valid
    else:
        raise ValueError(f"cw_weights: norm must be 'padded' or 'valid', got {norm!r}")
    weights = kernel * total / kernel.sum()
    return weights.detach() if detach else weights                           # 7.


def cw(group: Group, cfg) -> TokenTerms:
    return TokenTerms(cw_weights(group.logp, group.advantages, group.mask, norm=cfg.cw_norm, detach=cfg.cw_detach))


def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SPEC clip_cov/kl_cov: C = (logp - mean logp) * (A - mean A), means over the scope's valid tokens."""
    logp, adv = logp.detach(), adv[:, None].expand_as(logp)
    n_valid = mask.sum()
    return (logp - (logp * mask).sum() / n_valid) * (adv - (adv * mask).sum() / n_valid) * mask


def ppo_clipped(ratio: torch.Tensor, adv: torch.Tensor, cfg) -> torch.Tensor:
    """Tokens whose PG term PPO's clip holds constant (no gradient)."""
    return ((ratio < 1 - cfg.eps_low) & (adv[:, None] < 0)) | ((ratio > 1 + cfg.eps_high) & (adv[:, None] > 0))


def clip_cov(group: Group, cfg) -> TokenTerms:
    """SPEC clip_cov (Cui et al. 2025): zero the loss of a few random tokens with 1 < C < 5."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    ratio = torch.exp(group.logp.detach() - group.old_logp)
    candidates = (group.mask > 0) & ~ppo_clipped(ratio, group.advantages, cfg) & \
        (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    n_select = max(int(cfg.clip_cov_ratio * group.mask.sum()), 1)
    positions = candidates.nonzero()
    chosen = positions[torch.randperm(len(positions), device=positions.device)[:n_select]]  # the run's seed
    weight = group.mask.clone()
    weight[chosen[:, 0], chosen[:, 1]] = 0
    return TokenTerms(weight)


def kl_cov(group: Group, cfg) -> TokenTerms:
    """SPEC kl_cov (Cui et al. 2025): no clipping; |logp - old_logp| on the top-k tokens by covariance."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    k = max(1, int(cfg.kl_cov_ratio * group.mask.sum()))
    top = torch.zeros_like(group.mask, dtype=torch.bool).view(-1)
    top[cov.masked_fill(group.mask == 0, -torch.inf).view(-1).topk(k).indices] = True
    extra = cfg.kl_cov_coef * (group.logp - group.old_logp).abs() * top.view_as(group.mask)
    return TokenTerms(group.mask, extra=extra, clip=False)


def ar_weights(old_logp: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """SPEC ar (Yang et al. 2025): w = alpha * p_old + 1 - alpha, both signs of A, no renormalisation."""
    return (alpha * old_logp.exp() + 1 - alpha) * mask


def lopti_active(old_logp: torch.Tensor, mask: torch.Tensor, eta: float, update_pass: int) -> torch.Tensor:
    """SPEC lopti: pass 0 updates the tokens with p_old < eta, pass 1 the rest."""
    low = old_logp.exp() < eta
    return mask * (low if update_pass == 0 else ~low)


def ar(group: Group, cfg) -> TokenTerms:
    return TokenTerms(ar_weights(group.old_logp, group.mask, cfg.ar_alpha or 0.2))


def lopti(group: Group, cfg) -> TokenTerms:
    return TokenTerms(group.mask, active=lopti_active(group.old_logp, group.mask, cfg.lopti_eta or 0.4,
                                                      group.update_pass))


def ar_lopti(group: Group, cfg) -> TokenTerms:
    return TokenTerms(ar_weights(group.old_logp, group.mask, cfg.ar_alpha or 0.3),
                      active=lopti_active(group.old_logp, group.mask, cfg.lopti_eta or 0.5, group.update_pass))


def renormalised(keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weights that make a response's token mean of the PG term run over its kept tokens only."""
    return keep * mask.sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)


@torch.no_grad()
def ict_divergence(hidden: torch.Tensor, head_weight: torch.Tensor, mask: torch.Tensor, temperature: float,
                   chunk_elements: int) -> torch.Tensor:
    """SPEC ict: u[i,t] = JS(p[i,t] || pbar[t]) in nats, pbar the mean next-token distribution of the group's
    responses still running at t. Streams over positions, never holding more than G x chunk x vocab."""
    group_size, length = mask.shape
    divergence = torch.zeros(mask.shape, device=hidden.device)
    width = max(1, chunk_elements // (group_size * head_weight.shape[0]))
    for start in range(0, length, width):
        stop = start + width
        p = scaled_logits(hidden[:, start:stop], head_weight, temperature).softmax(-1)
        running = mask[:, start:stop, None]
        p_bar = (p * running).sum(0) / running.sum(0).clamp(min=1)
        middle = (p + p_bar) / 2
        js = 0.5 * (torch.xlogy(p, p) - torch.xlogy(p, middle)).sum(-1) + \
            0.5 * (torch.xlogy(p_bar, p_bar) - torch.xlogy(p_bar, middle)).sum(-1)
        divergence[:, start:stop] = js * mask[:, start:stop]
    return divergence


def ict(group: Group, cfg) -> TokenTerms:
    """SPEC ict (Beyond Entropy, 2026): keep each response's top 10% of positions by JS divergence."""
    lengths = group.mask.sum(1)
    keep_counts = (cfg.ict_keep_frac * lengths).ceil().clamp(min=1)
    ranks = group.divergence.masked_fill(group.mask == 0, -1).argsort(1, descending=True).argsort(1)
    keep = (ranks < keep_counts[:, None]).float() * group.mask
    return TokenTerms(renormalised(keep, group.mask))


def sorted_quantile(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's linear interpolation, on values sorted once per batch rather than once per group."""
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def entropy20(group: Group, cfg) -> TokenTerms:
    """SPEC entropy20 (Wang et al. 2025): PG only on tokens at or above the batch's 80th entropy percentile."""
    threshold = sorted_quantile(group.batch_entropy, 1 - cfg.entropy_top_frac)
    return TokenTerms(group.mask * (group.entropy >= threshold))


def stapo(group: Group, cfg) -> TokenTerms:
    """SPEC stapo: silence positive-advantage tokens that are rare (p < 0.01) and low-entropy (< 5th pct)."""
    threshold = sorted_quantile(group.batch_entropy, cfg.stapo_entropy_percentile / 100)
    spurious = (group.advantages[:, None] > 0) & (group.old_logp.exp() < cfg.stapo_max_prob) & \
        (group.entropy < threshold)
    return TokenTerms(renormalised(group.mask * ~spurious, group.mask))


class Method(NamedTuple):
    terms: Callable[[Group, "Config"], TokenTerms]
    description: str
    update_passes: int = 1            # lopti: a low-probability pass, then a high-probability one
    needs_rollout_pass: bool = False  # old log-probs and entropies of the whole batch before the update
    needs_divergence: bool = False    # ict's JS score, computed in the rollout pass


METHODS.update({
    "grpo": Method(grpo, "GRPO baseline, every token weight 1 (SPEC grpo)"),
    "cw": Method(cw, "CW-GRPO, Gaussian-kernel covariance weights (Wang et al. 2026; SPEC cw)"),
    "clip_cov": Method(clip_cov, "zero the loss of a few random high-covariance tokens (Cui et al. 2025)"),
    "kl_cov": Method(kl_cov, "no clipping, |logp - old_logp| penalty on top-covariance tokens (Cui et al. 2025)"),
    "ar": Method(ar, "advantage reweighting by alpha * p + 1 - alpha (Yang et al. 2025)"),
    "lopti": Method(lopti, "update low-probability tokens first, then the rest: 2 steps per batch (Yang et al. 2025)",
                    update_passes=2, needs_rollout_pass=True),
    "ar_lopti": Method(ar_lopti, "ar and lopti together (Yang et al. 2025)", update_passes=2,
                       needs_rollout_pass=True),
    "ict": Method(ict, "PG only on each response's top 10% positions by JS divergence from the group (2026)",
                  needs_rollout_pass=True, needs_divergence=True),
    "entropy20": Method(entropy20, "PG only on the top 20% highest-entropy tokens (Wang et al. 2025)",
                        needs_rollout_pass=True),
    "stapo": Method(stapo, "silence rare, low-entropy positive tokens, renormalise (STAPO, 2026)",
                    needs_rollout_pass=True),
})


# ----------------------------------------------------------------------------------------------------
# 8. Loss
# ----------------------------------------------------------------------------------------------------

def token_losses(logp, old_logp, ref_logp, advantages, terms: TokenTerms, cfg: Config) -> dict:
    """SPEC notation: per-token loss w * pg + beta * k3 (+ a method's extra term); the KL is never weighted."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = -ratio * adv
    if terms.clip:
        pg = torch.max(pg, -ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    loss = terms.pg_weight * pg
    if terms.extra is not None:
        loss = loss + terms.extra
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        loss = loss + cfg.beta * kl
    active = terms.active if terms.active is not None else torch.ones_like(logp)
    touched = (terms.pg_weight != 1) | (active == 0)
    if terms.extra is not None:
        touched |= terms.extra.detach() != 0
    return {"loss": loss * active, "kl": kl.detach(), "clipped": ppo_clipped(ratio, advantages, cfg) & terms.clip,
            "w": terms.pg_weight.detach(), "touched": touched, "pg_on": (terms.pg_weight != 0) & (active != 0)}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, n_responses: int, n_tokens: int):
    """The step's loss summed over micro-batches: divide by step-wide totals, not micro-batch ones."""
    if mode == "seq-mean-token-mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_responses
    return (per_token * mask).sum() / n_tokens


def micro_batch_loss(model, rollout: Rollout, cfg: Config, n_responses: int, n_tokens: int, update_pass: int = 0):
    logp, entropy, _ = completion_logprobs(model, rollout, cfg)
    old_logp = rollout.old_logp if rollout.old_logp is not None else logp.detach()
    entropy = rollout.entropy if rollout.entropy is not None else entropy
    mask = rollout.completion_mask
    method = METHODS[cfg.method]
    parts = []
    for g in (slice(i, i + cfg.group_size) for i in range(0, len(mask), cfg.group_size)):
        group = Group(logp[g], old_logp[g], rollout.advantages[g], mask[g], entropy[g], rollout.batch_entropy,
                      rollout.divergence[g] if rollout.divergence is not None else None, update_pass)
        ref_logp = rollout.ref_logp[g] if rollout.ref_logp is not None else None
        terms = method.terms(group, cfg)
        if rollout.active is not None:
            terms = terms._replace(active=rollout.active[g] * (1 if terms.active is None else terms.active))
        parts.append(token_losses(logp[g], old_logp[g], ref_logp, rollout.advantages[g], terms, cfg))
    terms = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    loss = aggregate(terms["loss"], mask, cfg.loss_aggregation, n_responses, n_tokens)
    valid = mask.bool()
    return loss, {"entropy": entropy[valid], **{k: terms[k][valid].float() for k in ("kl", "clipped", "w", "touched",
                                                                                   "pg_on")}}


# ----------------------------------------------------------------------------------------------------
# 9. Checkpoints
# ----------------------------------------------------------------------------------------------------

def save_checkpoint(output_dir: Path, name: str, model, tokenizer, trainer_state: dict | None = None) -> Path:
    """Written under a temporary name and renamed at the end: a crash mid-save leaves no complete-looking
    checkpoint."""
    final, partial = output_dir / name, output_dir / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if trainer_state is not None:
        torch.save(trainer_state, partial / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final


def latest_checkpoint(output_dir: Path) -> Path | None:
    steps = [int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*")
             if p.name.split("-")[1].isdigit() and (p / "trainer_state.pt").is_file()]
    return output_dir / f"checkpoint-{max(steps)}" if steps else None


def rng_states() -> dict:
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ----------------------------------------------------------------------------------------------------
# 10. The tiny preset: a tiny Qwen2, a synthetic task in \boxed{} form, a supervised warm-start
# ----------------------------------------------------------------------------------------------------

CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_qwen2_tokenizer() -> Qwen2Tokenizer:
    """Qwen2's byte-level BPE with no merges: 256 byte tokens plus the ChatML specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               unk_token=None, additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_qwen2(tokenizer, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def tiny_arithmetic(seed: int, n: int = 2000) -> datasets.Dataset:
    """Two-number sums; the gold is written in \\boxed{} like a MATH solution, so math_reward grades it."""
    rng = random.Random(seed)
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]
    return datasets.Dataset.from_dict({"problem": [f"{a}+{b}" for a, b in pairs],
                                       "solution": [f"\\boxed{{{a + b}}}" for a, b in pairs]})


def tiny_targets(question: str) -> list[str]:
    """The completions the warm-start imitates, half of them with the think-close tag off format, so
    the model starts at about 50% format reward and RL has a first thing to learn; then the sums."""
    a, b = map(int, question.split("+"))
    return [f"{a}+{b}={a + b}\n</think>\n\\boxed{{{a + b}}}", f"{a}+{b}={a + b} </think> \\boxed{{{a + b}}}"]


def warm_start(model, tokenizer, rows: datasets.Dataset, cfg: Config) -> None:
    """Next-token cross-entropy on reference completions for a few seconds: the format, some of the sums."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    examples = []
    for question in rows[cfg.question_column]:
        prompt = chat_prompt_ids(tokenizer, question, cfg.system_prompt)
        for target in tiny_targets(question):
            answer = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            examples.append((prompt + answer, len(prompt)))
    model.train()
    for _ in range(cfg.warmstart_steps):
        batch = random.sample(examples, 32)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[-100] * n + ids[n:] + [-100] * (width - len(ids)) for ids, n in batch])
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def prepare_tiny_base_model(output_dir: Path, cfg: Config) -> Path:
    """Build, warm-start and save the tiny base model once; the run then treats it like a hub model."""
    path = output_dir / "base-model"
    if not (path / "config.json").is_file():
        tokenizer = byte_level_qwen2_tokenizer()
        model = tiny_qwen2(tokenizer, cfg.seed)
        random.seed(cfg.seed)
        warm_start(model, tokenizer, load_training_rows(cfg), cfg)
        save_checkpoint(output_dir, "base-model", model, tokenizer)
    return path


# ----------------------------------------------------------------------------------------------------
# 11. The training loop
# ----------------------------------------------------------------------------------------------------

def load_training_rows(cfg: Config) -> datasets.Dataset:
    if cfg.dataset == "tiny-arithmetic":
        return tiny_arithmetic(cfg.seed)
    return load_rows(cfg.dataset, cfg.dataset_split, cfg.question_column, cfg.gold_column)


def load_model(path: str, dtype: torch.dtype, device: torch.device):
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as e:
        raise SystemExit(f"error: cannot load model '{path}': {first_line(e)} Download it while online "
                         f"(huggingface-cli download {path}) or pass a local folder with --model") from None
    return model.to(device)


def load_reference(path: str, device: torch.device):
    """The frozen KL reference model, held in bf16 on CUDA."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_model(path, dtype, device).eval().requires_grad_(False)


def load_tokenizer(path: str):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    except OSError as e:
        raise SystemExit(f"error: cannot load the tokenizer of '{path}': {first_line(e)}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare_output_dir(cfg: Config) -> Path:
    output_dir = Path(cfg.output_dir)
    if (output_dir / "metrics.jsonl").exists() and not cfg.resume:
        if not cfg.overwrite_output_dir:
            raise SystemExit(f"error: {output_dir} already holds a run; pass --resume to continue it, "
                             f"--overwrite-output-dir to start afresh, or choose another --output-dir")
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "run_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    return output_dir


@torch.no_grad()
def score_rollout(rollout: Rollout, grader: Grader, cfg: Config) -> dict:
    grades = grader.grade_many([(text, gold, "default") for text, gold in zip(rollout.texts, rollout.golds)])
    accuracy = torch.tensor([g.accuracy for g in grades])
    formats = torch.tensor([format_reward(text) for text in rollout.texts])
    rollout.rewards = cfg.accuracy_weight * accuracy + cfg.format_weight * formats
    rollout.advantages = group_advantages(rollout.rewards, cfg.group_size).to(rollout.completion_ids.device)
    group_std = rollout.rewards.view(-1, cfg.group_size).std(1)
    return {"reward_mean": rollout.rewards.mean().item(), "reward_std": rollout.rewards.std().item(),
            "accuracy_mean": accuracy.mean().item(), "format_mean": formats.mean().item(),
            "frac_zero_std_groups": (group_std == 0).float().mean().item(),
            "completion_len_mean": rollout.completion_mask.sum(1).mean().item(),
            "truncated_frac": rollout.truncated.float().mean().item(),
            "gold_unparseable": sum(not g.gold_parsed for g in grades),
            "grading_timeouts": sum(g.timed_out for g in grades)}


@torch.no_grad()
def rollout_pass(model, rollout: Rollout, cfg: Config, divergence: bool = False,
                 squared_mass: bool = False) -> dict:
    """Per-token statistics of a whole rollout batch under `model` (the rollout policy or the reference),
    micro-batch by micro-batch, without gradient: logp and entropy, and on request ict's divergence and the
    diagnostics' squared probability mass. Each is (N, T), 0 on padding."""
    rows = cfg.groups_per_micro_batch * cfg.group_size
    names = ["logp", "entropy"] + ["divergence"] * divergence + ["squared_mass"] * squared_mass
    out = {name: torch.zeros_like(rollout.completion_mask) for name in names}
    head = model.get_output_embeddings().weight
    for start in range(0, len(rollout.texts), rows):
        part = rollout.rows(start, start + rows)
        block = (slice(start, start + rows), slice(0, part.completion_ids.shape[1]))
        out["logp"][block], out["entropy"][block], hidden = completion_logprobs(model, part, cfg)
        if divergence:
            for g in range(0, len(part.texts), cfg.group_size):
                group = slice(g, g + cfg.group_size)
                out["divergence"][block][group] = ict_divergence(
                    hidden[group], head, part.completion_mask[group], cfg.temperature, cfg.logit_chunk_elements)
        if squared_mass:
            valid = part.completion_mask.bool()
            out["squared_mass"][block][valid] = squared_probability_mass(hidden[valid], head, cfg.temperature,
                                                                         cfg.logit_chunk_elements)
    return out


def accumulate_gradients(model, rollout: Rollout, cfg: Config, autocast, update_pass: int = 0):
    """The gradient of the step's loss into .grad, micro-batch of whole groups by micro-batch."""
    model.train()
    n_responses = len(rollout.texts)
    n_tokens = int(rollout.completion_mask.sum().clamp(min=1))
    rows = cfg.groups_per_micro_batch * cfg.group_size
    total_loss, parts = 0.0, []
    for start in range(0, n_responses, rows):
        with autocast():
            loss, stats = micro_batch_loss(model, rollout.rows(start, start + rows), cfg, n_responses, n_tokens,
                                           update_pass)
        loss.backward()
        total_loss += loss.item()
        parts.append(stats)
    return total_loss, parts


def update(model, optimizer, scheduler, rollout: Rollout, cfg: Config, autocast, update_pass: int = 0) -> dict:
    """One optimizer step over the rollout batch."""
    total_loss, parts = accumulate_gradients(model, rollout, cfg, autocast, update_pass)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    stat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    w = stat["w"]
    return {"loss": total_loss, "grad_norm": grad_norm.item(), "lr": lr,
            "entropy_mean": stat["entropy"].mean().item(), "kl_mean": stat["kl"].mean().item(),
            "clip_frac": stat["clipped"].mean().item(), "w_mean": w.mean().item(),
            "w_std": w.std().item() if len(w) > 1 else 0.0, "w_min": w.min().item(), "w_max": w.max().item(),
            "w_frac_below_half": (w < 0.5).float().mean().item(), "w_frac_above_2": (w > 2).float().mean().item(),
            "touched_frac": stat["touched"].mean().item(), "pg_active_frac": stat["pg_on"].mean().item()}


def train(cfg: Config) -> Path:
    device = resolve_device(cfg)
    output_dir = prepare_output_dir(cfg)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    base_model = str(prepare_tiny_base_model(output_dir, cfg)) if cfg.model == "tiny" else cfg.model
    resume_from = latest_checkpoint(output_dir) if cfg.resume else None

    tokenizer = load_tokenizer(str(resume_from or base_model))
    model = load_model(str(resume_from or base_model), torch.float32, device)  # fp32 master weights
    reference = load_reference(base_model, device) if cfg.beta > 0 else None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    prompts = PromptStream(load_training_rows(cfg), tokenizer, cfg)
    if prompts.skipped:
        print(f"skipped {prompts.skipped} prompts longer than --max-prompt-length {cfg.max_prompt_length}")
    grader = Grader(cfg.reward_timeout_s, reward_worker_count(cfg.reward_workers))
    background = ThreadPoolExecutor(1)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    method = METHODS[cfg.method]
    if cfg.method == "kl_cov" and cfg.num_iterations == 1:
        print("note: kl_cov does nothing with one update per rollout batch: logp == old_logp, so its penalty "
              "|logp - old_logp| is 0 and it trains as GRPO; use --num-iterations 2 or more")
    updates_per_rollout = cfg.num_iterations * method.update_passes
    total_updates = cfg.steps * updates_per_rollout
    scheduler = transformers.get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, int(cfg.warmup_ratio * total_updates), total_updates, min_lr_rate=cfg.min_lr_ratio)
    start_step = 0
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_states(state["rng"])
        start_step, prompts.position = state["step"], state["data_position"]
        print(f"resumed from {resume_from}")
    else:
        torch.manual_seed(cfg.seed)
    metrics_path = output_dir / "metrics.jsonl"
    keep_metrics_until(metrics_path, start_step)
    keep_metrics_until(output_dir / "diagnostics.jsonl", start_step)

    autocast = bf16_autocast(device)
    progress = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, desc=cfg.method)
    for step in progress:
        t0 = time.perf_counter()
        with autocast():
            rollout = sample(model, tokenizer, prompts.next_batch(cfg.prompts_per_step), cfg)
            # grading runs on the worker processes while the passes below use the model
            grading = background.submit(score_rollout, rollout, grader, cfg)
            if cfg.num_iterations > 1 or method.needs_rollout_pass:
                stats = rollout_pass(model, rollout, cfg, divergence=method.needs_divergence)
                rollout.old_logp, rollout.entropy, rollout.divergence = \
                    stats["logp"], stats["entropy"], stats.get("divergence")
                rollout.batch_entropy = rollout.entropy[rollout.completion_mask.bool()].sort().values
            if reference is not None:
                rollout.ref_logp = rollout_pass(reference, rollout, cfg)["logp"]
            rollout_metrics = grading.result()
        rollout_s = time.perf_counter() - t0
        if cfg.diagnose_every and (step + 1) % cfg.diagnose_every == 0:
            with (output_dir / "diagnostics.jsonl").open("a") as f:
                f.write(json.dumps({"rollout_step": step + 1, **diagnose_rollout(model, rollout, cfg, autocast)}) + "\n")
        for update_index in range(updates_per_rollout):
            t1 = time.perf_counter()
            update_pass = update_index % method.update_passes
            record = {"step": step * updates_per_rollout + update_index + 1, "rollout_step": step + 1,
                      "update_pass": update_pass,
                      **rollout_metrics, **update(model, optimizer, scheduler, rollout, cfg, autocast, update_pass),
                      "prompts_skipped": prompts.skipped, "rollout_s": rollout_s,
                      "update_s": time.perf_counter() - t1}
            tokens = rollout.completion_mask.sum().item()
            record["tokens_per_s"] = tokens / (record["rollout_s"] + record["update_s"])
            record["time"] = time.time()
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        progress.set_postfix(reward=f"{record['reward_mean']:.3f}", entropy=f"{record['entropy_mean']:.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(output_dir, f"checkpoint-{step + 1}", model, tokenizer, {
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_states(),
                "step": step + 1, "data_position": prompts.position})
    save_checkpoint(output_dir, "final-model", model, tokenizer)
    return output_dir


def keep_metrics_until(metrics_path: Path, rollout_step: int) -> None:
    """On resume, drop the records of steps after the checkpoint: they are about to be redone."""
    if metrics_path.exists():
        kept = [line for line in metrics_path.read_text().splitlines()
                if line and json.loads(line)["rollout_step"] <= rollout_step]
        metrics_path.write_text("".join(line + "\n" for line in kept))


# ----------------------------------------------------------------------------------------------------
# 12. Ablation: methods x seeds on one preset, a table and a plot
# ----------------------------------------------------------------------------------------------------

@dataclass
class AblationConfig:
    methods: str = field(default="all", metadata={"help": "comma-separated method names, or all"})
    seeds: int = field(default=3, metadata={"help": "runs per method, with seeds 0 .. seeds-1"})
    preset: Literal["paper-1.5b", "paper-7b", "tiny"] = field(default="tiny", metadata={
        "help": "the recipe every run uses; options after -- go to every run (e.g. -- --steps 300)"})
    output_dir: str = field(default="runs/ablation", metadata={
        "help": "gets <method>-seed<seed>/ per run, ablation.md and ablation.png; rerunning resumes"})
    workers: int = field(default=0, metadata={"help": "runs at a time; 0 is one per CPU core"})
    threshold: float = field(default=1.2, metadata={
        "help": "reward level for 'steps to threshold' (first step where the 10-step mean reaches it)"})
    plot: bool = field(default=True, metadata={"help": "draw ablation.png (needs matplotlib)"})


def moving_average(values: list, window: int = 10) -> list:
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def run_summary(run_dir: Path, threshold: float) -> dict:
    """Per rollout step: reward and entropy; and the run's final figures over its last 10% of steps."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["rollout_step"], []).append(record)
    steps = sorted(by_step)
    reward = [by_step[s][0]["reward_mean"] for s in steps]
    entropy = [by_step[s][0]["entropy_mean"] for s in steps]
    tail = max(1, len(steps) // 10)
    reached = [s for s, r in zip(steps, moving_average(reward)) if r >= threshold]
    records = [r for s in steps for r in by_step[s]]
    return {"reward": reward, "entropy": entropy, "final_reward": sum(reward[-tail:]) / tail,
            "final_entropy": sum(entropy[-tail:]) / tail, "steps_to_threshold": reached[0] if reached else None,
            "touched_frac": sum(r["touched_frac"] for r in records) / len(records),
            "wall_s": json.loads((run_dir / "wall_time.json").read_text())["wall_s"]}


def mean_std(values: list, digits: int = 3) -> str:
    t = torch.tensor(values, dtype=torch.float64)
    return f"{t.mean():.{digits}f} ± {t.std():.{digits}f}" if len(values) > 1 else f"{t.mean():.{digits}f}"


def ablate(argv: list) -> Path:
    split = argv.index("--") if "--" in argv else len(argv)
    own, run_args = argv[:split], argv[split + 1:]
    (acfg,) = HfArgumentParser(AblationConfig, prog="cwgrpo.py ablate").parse_args_into_dataclasses(own)
    methods = list(METHODS) if acfg.methods == "all" else acfg.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"error: unknown method {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if acfg.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("error: ablation.png needs matplotlib: pip install matplotlib, or pass --no-plot") from None
    output_dir = Path(acfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    workers = acfg.workers or os.cpu_count() or 1
    runs = [(m, seed, output_dir / f"{m}-seed{seed}") for m in methods for seed in range(acfg.seeds)]

    def run_one(job):
        method, seed, run_dir = job
        if (run_dir / "wall_time.json").is_file():
            return  # finished by an earlier invocation
        cores_per_run = str(max(1, (os.cpu_count() or 1) // workers))
        command = [sys.executable, os.path.abspath(__file__), "--preset", acfg.preset, "--method", method,
                   "--seed", str(seed), "--output-dir", str(run_dir), "--reward-workers", cores_per_run, *run_args]
        if (run_dir / "metrics.jsonl").exists():
            command.append("--resume")
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": cores_per_run}
        start = time.perf_counter()
        with (run_dir / "log.txt").open("w") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        if done.returncode:
            raise SystemExit(f"error: {method} seed {seed} failed; see {run_dir / 'log.txt'}")
        (run_dir / "wall_time.json").write_text(json.dumps({"wall_s": time.perf_counter() - start}))

    with ThreadPoolExecutor(workers) as pool:
        for _ in tqdm(pool.map(run_one, runs), total=len(runs), desc="ablation"):
            pass
    summaries = {m: [run_summary(d, acfg.threshold) for mm, _, d in runs if mm == m] for m in methods}
    write_ablation_table(output_dir / "ablation.md", summaries, acfg, run_args)
    if acfg.plot:
        plot_ablation(output_dir / "ablation.png", summaries, acfg)
    return output_dir


def write_ablation_table(path: Path, summaries: dict, acfg: AblationConfig, run_args: list) -> None:
    lines = [f"Preset `{acfg.preset}`{' with ' + ' '.join(run_args) if run_args else ''}, {acfg.seeds} seeds per "
             f"method (mean ± std over seeds). Final figures are means over the last 10% of rollout steps; "
             f"'steps to {acfg.threshold}' is the first rollout step whose 10-step mean reward reaches it "
             f"(seeds that never do are left out, counted in brackets); 'touched' is the share of valid tokens "
             f"the method weighted, masked or penalised differently from GRPO.", "",
             f"| method | final reward | final entropy | steps to {acfg.threshold} | wall s | touched |",
             "|---|---|---|---|---|---|"]
    for method, runs in summaries.items():
        reached = [r["steps_to_threshold"] for r in runs if r["steps_to_threshold"] is not None]
        never = len(runs) - len(reached)
        lines.append(f"| {method} | {mean_std([r['final_reward'] for r in runs])} | "
                     f"{mean_std([r['final_entropy'] for r in runs])} | "
                     f"{(mean_std(reached, 0) + (f' ({never} never)' if never else '')) if reached else 'never'} | "
                     f"{mean_std([r['wall_s'] for r in runs], 0)} | "
                     f"{100 * sum(r['touched_frac'] for r in runs) / len(runs):.1f}% |")
    path.write_text("\n".join(lines) + "\n")


def plot_ablation(path: Path, summaries: dict, acfg: AblationConfig) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for method, runs in summaries.items():
        for axis, key in zip(axes, ("reward", "entropy")):
            length = min(len(r[key]) for r in runs)
            curves = torch.tensor([moving_average(r[key][:length]) for r in runs])
            mean, std = curves.mean(0), curves.std(0) if len(runs) > 1 else torch.zeros(length)
            steps = range(1, length + 1)
            line, = axis.plot(steps, mean, label=method, linewidth=1.2)
            axis.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.12)
    for axis, label in zip(axes, ("reward (10-step mean)", "entropy (10-step mean)")):
        axis.set_xlabel("rollout step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2)
    figure.suptitle(f"preset {acfg.preset}: mean over {acfg.seeds} seeds, band ± 1 std")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------------
# 13. Diagnostics the papers argue from (SPEC "Diagnostics the papers argue from")
# ----------------------------------------------------------------------------------------------------

CONCENTRATION_CUTOFFS = (0.0001, 0.001, 0.01, 0.1, 1.0)  # top 0.01% ... 100% of one side's tokens
PAPER_CONCENTRATION = {0.0001: (11.5, -13.6), 1.0: (0.06, -0.04)}  # CW-GRPO paper, R1-Distill-Qwen-1.5B


@dataclass
class DiagnoseConfig:
    reference_model: str = field(default="", metadata={
        "help": "diagnose: the KL reference (a tiny run's base-model/, say); default the model itself, which "
                "makes the KL part of the token weight 0"})
    diagnostics_dir: str = field(default="", metadata={
        "help": "diagnose: where diagnostics.md and diagnostics.json go (default <model>/diagnostics)"})


def concentration(scores: torch.Tensor) -> dict:
    """Mean covariance score of the top X% of the positive (negative) scores for each cutoff X: how much of
    the covariance a few tokens carry (the layout of the CW-GRPO paper's table)."""
    out = {}
    for side, sign in (("positive", 1.0), ("negative", -1.0)):
        magnitudes = (scores[scores * sign > 0] * sign).sort(descending=True).values
        out[side] = {cut: (sign * magnitudes[:max(1, math.ceil(cut * len(magnitudes)))].mean()).item()
                     if len(magnitudes) else 0.0 for cut in CONCENTRATION_CUTOFFS}
    return out


def quantile_masks(values: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """`parts` boolean masks that split `values` at its quantiles; together they partition it."""
    edges = torch.quantile(values.float(), torch.arange(1, parts, device=values.device) / parts)
    bucket = torch.bucketize(values.float(), edges)  # a value equal to an edge goes to the lower part
    return [bucket == q for q in range(parts)]


@torch.no_grad()
def squared_probability_mass(hidden: torch.Tensor, weight: torch.Tensor, temperature: float,
                             chunk_elements: int) -> torch.Tensor:
    """sum_v p_v^2 per position, streamed like the log-probs, for ||onehot - p||^2 = 1 - 2 p_y + sum_v p_v^2."""
    width = max(1, chunk_elements // weight.shape[0])
    return torch.cat([scaled_logits(hidden[s:s + width], weight, temperature).softmax(-1).pow(2).sum(-1)
                      for s in range(0, hidden.shape[0], width)])


def quartile_gradients(model, rollout: Rollout, cfg: Config, autocast, quartiles: list[torch.Tensor]) -> dict:
    """L2 norm of the parameter gradient of the step's loss with only one quartile's tokens active (their PG
    and KL terms; the rest masked), and its cosine with the full gradient (SPEC diagnostics)."""
    def gradient(active: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, dataclasses.replace(rollout, active=active), cfg, autocast)
        return torch.cat([torch.zeros(p.numel(), device=p.device) if p.grad is None else p.grad.flatten()
                          for p in model.parameters()])
    full = gradient(rollout.completion_mask)
    per_quartile = [gradient(q.float()) for q in quartiles]
    model.zero_grad(set_to_none=True)
    return {"full_norm": full.norm().item(), "norm": [g.norm().item() for g in per_quartile],
            "cosine_with_full": [F.cosine_similarity(g, full, dim=0).item() for g in per_quartile]}


def diagnose_rollout(model, rollout: Rollout, cfg: Config, autocast) -> dict:
    """The papers' measurements on one scored rollout batch (ref_logp set when beta > 0), through the
    training code's loss path. Restores the RNG and leaves no gradient, so training goes on unchanged."""
    rng = rng_states()
    stats = rollout_pass(model, rollout, cfg, squared_mass=True)
    logp, mask, valid = stats["logp"], rollout.completion_mask, rollout.completion_mask.bool()
    groups = [slice(i, i + cfg.group_size) for i in range(0, len(rollout.texts), cfg.group_size)]
    score = torch.cat([covariance_score(logp[g], rollout.advantages[g], mask[g]) for g in groups])[valid]
    cw = torch.cat([cw_weights(logp[g], rollout.advantages[g], mask[g], norm=cfg.cw_norm) for g in groups])[valid]
    prob = logp.exp()[valid]
    quartiles = quantile_masks(prob, 4)
    logit_grad_unit = (1 - 2 * prob + stats["squared_mass"][valid]).clamp(min=0).sqrt()  # ||onehot - p||
    report = {"tokens": int(valid.sum()), "concentration": concentration(score), "quartiles": [
        {"prob_min": prob[q].min().item(), "prob_max": prob[q].max().item(), "tokens": int(q.sum()),
         "cw_weight_mean": cw[q].mean().item()} for q in quartiles],
        "cw_weight_by_covariance_decile": [cw[d].mean().item() for d in quantile_masks(score, 10)]}
    adv = rollout.advantages[:, None].expand_as(logp)[valid]
    for beta in sorted({0.0, cfg.beta}):
        # Yang et al.'s token weight, on-policy (ratio 1, nothing clipped): A + beta * (pi_ref / pi - 1)
        weight = adv.clone()
        if beta > 0 and rollout.ref_logp is not None:
            weight += beta * ((rollout.ref_logp - logp)[valid].exp() - 1)
        key = f"beta={beta:g}"
        gradients = quartile_gradients(model, dataclasses.replace(rollout, ref_logp=rollout.ref_logp if beta else None),
                                       dataclasses.replace(cfg, beta=beta), autocast,
                                       [scatter_valid(q, valid) for q in quartiles])
        report.setdefault("full_gradient_norm", {})[key] = gradients["full_norm"]
        for i, q in enumerate(quartiles):
            report["quartiles"][i][key] = {
                "abs_weight_mean": weight[q].abs().mean().item(), "abs_weight_median": weight[q].abs().median().item(),
                "logit_grad_norm_mean": (weight[q].abs() * logit_grad_unit[q]).mean().item(),
                "param_grad_norm": gradients["norm"][i], "cosine_with_full": gradients["cosine_with_full"][i]}
    set_rng_states(rng)
    return report


def scatter_valid(flat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A (N, T) tensor holding `flat` at the valid positions, 0 elsewhere."""
    out = torch.zeros(valid.shape, device=valid.device)
    out[valid] = flat.float()
    return out


def diagnostics_markdown(report: dict, cfg: Config, source: str) -> str:
    cut_names = [f"{100 * c:g}%" for c in CONCENTRATION_CUTOFFS]
    lines = [f"# Diagnostics of {source}", "",
             f"One rollout batch of `--preset {cfg.preset}`: {cfg.prompts_per_step} prompts x G = {cfg.group_size}, "
             f"{report['tokens']} valid tokens, method `{cfg.method}` for the gradients.", "",
             "## Covariance concentration", "",
             "Mean CW covariance score (SPEC cw step 3) of the top X% of the positive (negative) scores.", "",
             "| side | " + " | ".join(cut_names) + " |", "|---|" + "---|" * len(cut_names)]
    for side in ("positive", "negative"):
        lines.append(f"| {side} (measured) | " + " | ".join(f"{report['concentration'][side][c]:.4g}"
                                                          for c in CONCENTRATION_CUTOFFS) + " |")
    for i, side in enumerate(("positive", "negative")):
        lines.append(f"| {side} (paper, 1.5B) | " + " | ".join(
            f"{PAPER_CONCENTRATION[c][i]:g}" if c in PAPER_CONCENTRATION else "-" for c in CONCENTRATION_CUTOFFS) + " |")
    betas = [k for k in report["full_gradient_norm"]]
    lines += ["", "## Probability-quartile accounting", "",
              "Valid tokens split at the quartiles of their probability. |w| is the token weight A x ratio + "
              "beta (pi_ref / pi - 1); the logit-gradient norm is |w| ||onehot - p||; the parameter-gradient norm "
              "is that of the step's loss with only the quartile's tokens active; cos is its cosine with the full "
              "gradient (full norms: " + ", ".join(f"{b}: {report['full_gradient_norm'][b]:.4g}" for b in betas) + ").",
              "", "| quartile | p range | tokens | " + " | ".join(
                  f"mean \\|w\\| {b} | median \\|w\\| {b} | logit grad {b} | param grad {b} | cos {b}" for b in betas)
              + " | CW weight |", "|---|---|---|" + "---|" * (5 * len(betas) + 1)]
    for i, q in enumerate(report["quartiles"]):
        cells = [f"{q[b]['abs_weight_mean']:.4g} | {q[b]['abs_weight_median']:.4g} | {q[b]['logit_grad_norm_mean']:.4g} | "
                 f"{q[b]['param_grad_norm']:.4g} | {q[b]['cosine_with_full']:.3f}" for b in betas]
        lines.append(f"| Q{i + 1} | {q['prob_min']:.3g} - {q['prob_max']:.3g} | {q['tokens']} | " + " | ".join(cells)
                     + f" | {q['cw_weight_mean']:.3f} |")
    lines += ["", "## CW weights by covariance decile", "",
              "| decile | " + " | ".join(f"D{i + 1}" for i in range(10)) + " |", "|---|" + "---|" * 10,
              "| mean CW weight | " + " | ".join(f"{w:.3f}" for w in report["cw_weight_by_covariance_decile"]) + " |"]
    return "\n".join(lines) + "\n"


def diagnose(argv: list) -> Path:
    cfg, dcfg = parse_config(argv, DiagnoseConfig)
    if cfg.model == "tiny":
        raise SystemExit("error: diagnose needs a trained model: --model PATH (e.g. runs/cw-tiny-seed0/final-model)")
    device = resolve_device(cfg)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, torch.float32, device)
    reference = load_reference(dcfg.reference_model or cfg.model, device) if cfg.beta > 0 else None

    autocast = bf16_autocast(device)
    torch.manual_seed(cfg.seed)
    prompts = PromptStream(load_training_rows(cfg), tokenizer, cfg)
    with autocast():
        rollout = sample(model, tokenizer, prompts.next_batch(cfg.prompts_per_step), cfg)
        score_rollout(rollout, Grader(cfg.reward_timeout_s, reward_worker_count(cfg.reward_workers)), cfg)
        if reference is not None:
            rollout.ref_logp = rollout_pass(reference, rollout, cfg)["logp"]
    report = diagnose_rollout(model, rollout, cfg, autocast)
    out = Path(dcfg.diagnostics_dir or Path(cfg.model) / "diagnostics")
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostics.json").write_text(json.dumps(report, indent=1))
    (out / "diagnostics.md").write_text(diagnostics_markdown(report, cfg, cfg.model))
    return out


@dataclass
class PlotConfig:
    runs: list[str] = field(metadata={"help": "run folders holding metrics.jsonl and diagnostics.jsonl"})
    output: str = field(default="diagnostics.png", metadata={"help": "the figure to write"})


def plot_diagnostics(argv: list) -> Path:
    """Entropy and the top-0.01% covariance over training steps, several runs on one figure."""
    (pcfg,) = HfArgumentParser(PlotConfig, prog="cwgrpo.py plot-diagnostics").parse_args_into_dataclasses(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: plot-diagnostics needs matplotlib: pip install matplotlib") from None
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in map(Path, pcfg.runs):
        if not (run / "diagnostics.jsonl").is_file():
            raise SystemExit(f"error: {run} has no diagnostics.jsonl; train it with --diagnose-every N")
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        left.plot([r["step"] for r in metrics], [r["entropy_mean"] for r in metrics], label=run.name)
        diagnostics = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
        steps = [d["rollout_step"] for d in diagnostics]
        line, = right.plot(steps, [d["concentration"]["positive"][str(CONCENTRATION_CUTOFFS[0])] for d in diagnostics],
                           marker="o", label=f"{run.name} +")
        right.plot(steps, [d["concentration"]["negative"][str(CONCENTRATION_CUTOFFS[0])] for d in diagnostics],
                   marker="v", linestyle="--", color=line.get_color(), label=f"{run.name} -")
    left.set(xlabel="step", ylabel="entropy_mean")
    right.set(xlabel="rollout step", ylabel="mean covariance score of the top 0.01%")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(pcfg.output, dpi=120)
    return Path(pcfg.output)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    subcommands = {"ablate": ablate, "diagnose": diagnose, "plot-diagnostics": plot_diagnostics}
    if argv[:1] and argv[0] in subcommands:
        print(f"done: {subcommands[argv[0]](argv[1:])}")
        return
    cfg = parse_config(argv)
    output_dir = train(cfg)
    print(f"done: metrics in {output_dir / 'metrics.jsonl'}, model in {output_dir / 'final-model'}")


if __name__ == "__main__":
    main()
