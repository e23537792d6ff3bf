"""cwgrpo.py: CW-GRPO and the token-weighting methods it is compared with, in one file that reads
like the paper.

CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
Reweighting", Wang et al., ACL 2026) scales each token's advantage by a Gaussian kernel of its
covariance score. docs/math.md has every formula, with the papers' equation and section numbers.

    python tiny.py                               # once: the tiny preset's model and data (a CPU)
    python cwgrpo.py --method cw --preset tiny   # CW-GRPO on that tiny model, in a minute on a CPU
    python cwgrpo.py --method cw                 # the paper's 1.5B recipe (one CUDA GPU)

Sections: 1 config, 2 data and prompts, 3 reward, 4 sampling, 5 log-probs, 6 group advantages,
7 the methods, 8 the loss, 9 the training loop and checkpoints.
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import torch
import transformers
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from tqdm import tqdm
from transformers import DynamicCache, HfArgumentParser

from lm_head import chunked_logprobs, ict_divergence
from loading import load_dataset, load_model, load_reference, load_tokenizer
import plots
from runtime import (CachedTimeoutPool, LogCounter, RunLock, StopRequest, keep_records_until,
                     latest_checkpoint, resume_command, rng_states, save_checkpoint,
                     set_rng_states)

# 1. Config --------------------------------------------------------------------------------------

# The system prompt Open-RS trains with (the paper's training data).
OPEN_RS_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer, and put your final answer within \\boxed{} . The reasoning process and "
    "answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>. Note that respond by "
    "English, NOT use other languages."
)

def arg(default, help: str, **metadata):
    """A Config field with its --help text."""
    return field(default=default, metadata={"help": help, **metadata})

@dataclass
class Config:
    """The defaults are the released 1.5B recipe (docs/math.md, "Recipe"); PRESETS override some."""
    preset: Literal["paper-1.5b", "paper-7b", "tiny"] = arg("paper-1.5b",
        "a whole recipe: paper-1.5b, paper-7b, or tiny (the CPU demo built by tiny.py); any "
        "option given overrides the preset's value")
    method: str = arg("cw",
        "token-weighting method: one of the METHODS table (section 7, listed below)")
    model: str = arg("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "policy model: a Hugging Face hub id or a local folder")
    dataset: str = arg("knoveleng/open-rs",
        "training data: a hub dataset id or a local .json/.jsonl/.parquet/.csv file")
    dataset_split: str = arg("train", "split of a hub dataset")
    question_column: str = arg("problem", "column of the question")
    gold_column: str = arg("solution", "column of the reference solution (parsed by math-verify)")
    system_prompt: str = arg(OPEN_RS_SYSTEM_PROMPT,
        "system message of the chat template; empty for none (default: Open-RS's)")
    group_size: int = arg(12, "G, completions sampled per prompt")
    prompts_per_step: int = arg(12,
        "prompts per rollout batch; one step sees prompts_per_step x G completions")
    groups_per_micro_batch: int = arg(1,
        "whole groups per forward/backward pass (gradient accumulation does the rest)")
    max_prompt_length: int = arg(512,
        "prompts longer than this many tokens are skipped (and counted)")
    max_completion_length: int = arg(4096, "generation limit in tokens; see --length-limit")
    length_limit: Literal["total", "new"] = arg("total",
        "total: prompt + completion at most --max-completion-length tokens (the released recipe's "
        "vLLM max model length); new: that many new tokens after each prompt")
    temperature: float = arg(0.7, "sampling temperature; the log-probs divide the logits by it too")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 is off (paper)")
    top_k: int = arg(0, "top-k sampling; 0 is off (paper)")
    mask_truncated_completions: bool = arg(False,
        "drop completions cut at the length limit from the loss")
    accuracy_weight: float = arg(1.0, "weight of the accuracy reward")
    format_weight: float = arg(1.0, "weight of the format reward ('\\n</think>\\n' exactly once)")
    reward_timeout_s: float = arg(10.0,
        "hard wall-clock limit on grading one completion; a cutoff scores 0")
    reward_workers: int = arg(0,
        "processes grading completions in parallel; 0 is one per CPU core, at most 8")
    beta: float = arg(0.04, "k3 KL coefficient; 0 loads no reference model")
    eps_low: float = arg(0.2, "PPO clip range below 1")
    eps_high: float = arg(0.2, "PPO clip range above 1")
    loss_aggregation: Literal["seq-mean-token-mean", "token-mean"] = arg("seq-mean-token-mean",
        "seq-mean-token-mean (original GRPO, the paper) or token-mean (DAPO)")
    num_iterations: int = arg(1,
        "policy updates per rollout batch (1 in the paper: on-policy, ratio == 1)")
    cw_norm: Literal["padded", "valid"] = arg("padded",
        "cw: weights of mean 1 over padded positions (released code) or over real tokens")
    cw_detach: bool = arg(False,
        "cw: no gradient through the weights (the released code lets it flow)")
    cw_reading: Literal["released", "paper"] = arg("released",
        "cw: released (the code's --cw-norm padded, weights not detached) or paper (the text's "
        "most natural reading: --cw-norm valid --cw-detach); overrides both flags")
    clip_cov_ratio: float = arg(2e-4, "clip_cov: share of valid tokens whose loss is zeroed")
    clip_cov_lb: float = arg(1.0, "clip_cov: candidates have covariance above this")
    clip_cov_ub: float = arg(5.0, "clip_cov: candidates have covariance below this")
    kl_cov_ratio: float = arg(2e-3,
        "kl_cov: share of valid tokens, top by covariance, that get the penalty")
    kl_cov_coef: float = arg(1.0, "kl_cov: coefficient of |logp - old_logp|")
    ar_alpha: float = arg(0.2, "ar: alpha of w = alpha p + 1 - alpha")
    lopti_eta: float = arg(0.4,
        "lopti: tokens with old probability below this go in the first pass")
    ar_lopti_alpha: float = arg(0.3, "ar_lopti: ar's alpha")
    ar_lopti_eta: float = arg(0.5, "ar_lopti: lopti's eta")
    ict_keep_frac: float = arg(0.1,
        "ict: share of each response's positions kept, top by JS divergence")
    entropy_top_frac: float = arg(0.2,
        "entropy20: share of the batch's tokens, top by entropy, that keep the PG term")
    stapo_max_prob: float = arg(0.01,
        "stapo: silenced tokens have probability below this (secondary source)")
    stapo_entropy_percentile: float = arg(5.0,
        "stapo: silenced tokens have entropy below this batch percentile")
    learning_rate: float = arg(1e-6, "peak AdamW learning rate")
    min_lr_ratio: float = arg(0.1, "the cosine schedule ends at this fraction of the peak")
    warmup_ratio: float = arg(0.1, "share of steps with linear warmup")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping norm")
    steps: int = arg(300, "rollout batches to train on")
    save_every: int = arg(50, "write checkpoint-<step> this often")
    seed: int = arg(2025, "seed of data order and sampling")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward to save memory")
    logit_chunk_elements: int = arg(2**26,
        "positions x vocab logits computed at once by the chunked LM head, so memory does not "
        "grow with vocab x length (2**26: 441 positions at Qwen's vocab)")
    device: str = arg("auto", "auto (cuda if present), cuda or cpu")
    output_dir: str = arg("",
        "metrics, checkpoints and the final model (default runs/<method>-<preset>-seed<seed>)")
    resume: bool = arg(False, "continue from the newest complete checkpoint in --output-dir")
    overwrite_output_dir: bool = arg(False,
        "start afresh in an --output-dir that already holds a run")

    def __post_init__(self):
        """Every option is checked here, at parse time, before any slow work."""
        if self.method not in METHODS:
            raise SystemExit(f"error: unknown --method {self.method!r}; choose from "
                             f"{', '.join(METHODS)}")
        for name, (low, high, why) in OPTION_RANGES.items():
            value = getattr(self, name)
            if (low is not None and value < low) or (high is not None and value > high) or \
                    (why in ("> 0", "in (0, 1]") and value <= 0):
                raise SystemExit(f"error: --{name.replace('_', '-')} must be {why}; got {value}")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise SystemExit(f"error: --clip-cov-lb ({self.clip_cov_lb}) must be below "
                             f"--clip-cov-ub ({self.clip_cov_ub})")
        if self.cw_reading == "paper":
            self.cw_norm, self.cw_detach = "valid", True
        self.groups_per_micro_batch = min(self.groups_per_micro_batch, self.prompts_per_step)
        if self.prompts_per_step % self.groups_per_micro_batch:
            raise SystemExit(f"error: --prompts-per-step ({self.prompts_per_step}) must be a "
                             f"multiple of --groups-per-micro-batch ({self.groups_per_micro_batch})")
        if not self.output_dir:
            self.output_dir = f"runs/{self.method}-{self.preset}-seed{self.seed}"


# name: (lowest, highest, the rule in words); None is unbounded
OPTION_RANGES = {
    "group_size": (2, None, ">= 2 (group advantages need two samples)"),
    **{name: (None, None, "> 0") for name in (
        "prompts_per_step", "groups_per_micro_batch", "max_prompt_length", "max_completion_length",
        "temperature", "reward_timeout_s", "learning_rate", "max_grad_norm", "steps", "save_every",
        "num_iterations", "logit_chunk_elements")},
    **{name: (0, None, ">= 0") for name in (
        "top_k", "reward_workers", "beta", "eps_low", "eps_high", "weight_decay", "kl_cov_coef",
        "accuracy_weight", "format_weight", "seed", "stapo_max_prob")},
    **{name: (0, 1, "in (0, 1]") for name in (
        "top_p", "clip_cov_ratio", "kl_cov_ratio", "ict_keep_frac", "entropy_top_frac",
        "lopti_eta", "ar_lopti_eta")},
    **{name: (0, 1, "in [0, 1]") for name in (
        "min_lr_ratio", "warmup_ratio", "ar_alpha", "ar_lopti_alpha")},
    "stapo_entropy_percentile": (0, 100, "in [0, 100]"),
}

PRESETS = {
    "paper-1.5b": {},  # the Config defaults are this recipe
    # Qwen2.5-Math-7B has 4,096 positions: prompt + completion fit in them with --length-limit total
    "paper-7b": dict(model="Qwen/Qwen2.5-Math-7B-Instruct", format_weight=0.0, steps=150),
    "tiny": dict(model="runs/tiny-base/model", dataset="runs/tiny-base/arithmetic.jsonl",
                 system_prompt="", group_size=8, prompts_per_step=8, groups_per_micro_batch=8,
                 max_prompt_length=64, max_completion_length=40, length_limit="new", temperature=1.0,
                 learning_rate=5e-4, warmup_ratio=0.05, steps=150, save_every=50, seed=0,
                 gradient_checkpointing=False),
}
GPU_PRESETS = ("paper-1.5b", "paper-7b")

def parse_config(argv=None, *extra_dataclasses):
    """The run's Config (and those of extra dataclasses a tool adds): the preset's values as
    defaults, then the command line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    preset_parser = argparse.ArgumentParser(add_help=False)
    preset_parser.add_argument("--preset", default=Config.preset, choices=list(PRESETS))
    preset = preset_parser.parse_known_args(argv)[0].preset
    parser = HfArgumentParser((Config, *extra_dataclasses), description=__doc__.split("\n\n")[0],
                              epilog="methods: " + "; ".join(
                                  f"{name}: {m.description}" for name, m in METHODS.items()))
    parser.set_defaults(**PRESETS[preset])
    parsed = parser.parse_args_into_dataclasses(argv)
    return parsed if extra_dataclasses else parsed[0]

def resolve_device(cfg: Config) -> torch.device:
    if cfg.device == "auto":
        if cfg.preset in GPU_PRESETS and not torch.cuda.is_available():
            raise SystemExit(f"error: --preset {cfg.preset} is a GPU recipe and no CUDA GPU was "
                             f"found; run the CPU demo with --preset tiny (or force --device cpu)")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU was found; use --device cpu")
    return torch.device(cfg.device)

def bf16_autocast(device: torch.device):
    """A factory of autocast contexts: bf16 on CUDA (weights stay fp32 masters), none on CPU."""
    return lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


# 2. Data and prompts ----------------------------------------------------------------------------

def chat_prompt_ids(tokenizer, question: str, system_prompt: str) -> list[int]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]

class PromptStream:
    """Tokenised (prompt, gold) pairs in seeded shuffled order, epoch after epoch.

    The position is a count of prompts served, so a checkpoint stores one integer.
    """

    def __init__(self, dataset, tokenizer, cfg: Config):
        self.items, self.skipped = [], 0
        for question, gold in zip(dataset[cfg.question_column], dataset[cfg.gold_column]):
            ids = chat_prompt_ids(tokenizer, str(question), cfg.system_prompt)
            if len(ids) > cfg.max_prompt_length:
                self.skipped += 1
            else:
                self.items.append((ids, str(gold)))
        if not self.items:
            raise SystemExit(f"error: every prompt is longer than --max-prompt-length "
                             f"{cfg.max_prompt_length}")
        self.seed, self.position, self.epoch_order = cfg.seed, 0, {}

    def next_batch(self, n: int) -> list[tuple[list[int], str]]:
        batch = []
        for _ in range(n):
            epoch, index = divmod(self.position, len(self.items))
            if epoch not in self.epoch_order:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(len(self.items), generator=generator).tolist()
                self.epoch_order = {epoch: order}
            batch.append(self.items[self.epoch_order[epoch][index]])
            self.position += 1
        return batch


# 3. Reward: math-verify accuracy + format (docs/math.md, "Reward") ------------------------------

class Grade(NamedTuple):
    accuracy: float
    gold_parsed: bool  # False: the gold could not be parsed, so the score is 0 by rule
    timed_out: bool    # grading was cut off (ours or math-verify's own limit), so the score is 0

GOLD_EXTRACTION = {"default": [LatexExtractionConfig(), ExprExtractionConfig()],
                   "expr": [ExprExtractionConfig()], "latex": [LatexExtractionConfig()]}
PREDICTION_EXTRACTION = [LatexExtractionConfig(
    normalization_config=NormalizationConfig(basic_latex=True, units=True, malformed_operators=False,
                                             nits=False, boxed="all", equations=False),
    boxed_match_priority=0, try_extract_without_anchor=False)]

def grade_accuracy(completion: str, gold: str, gold_format: str = "default") -> Grade:
    """1.0 if math-verify finds the completion's answer equal to the gold, checked gold first
    (verify is not symmetric). gold_format "default" is math-verify's default extraction, the
    training reward's; evaluate.py's benchmarks parse their gold as "expr" or "latex"."""
    gold_parsed = parse(gold, extraction_mode="first_match",  # as the released reward
                        extraction_config=GOLD_EXTRACTION[gold_format])
    if not gold_parsed:
        return Grade(0.0, False, False)
    prediction = parse(completion, extraction_mode="first_match",
                       extraction_config=PREDICTION_EXTRACTION)
    return Grade(float(verify(gold_parsed, prediction)), True, False)

def format_reward(completion: str) -> float:
    return float(completion.count("\n</think>\n") == 1)

class Grader(CachedTimeoutPool):
    """Grades (completion, gold, gold_format) triples on worker processes, each under a hard time
    limit (math-verify's own limit uses SIGALRM, which works only on a main thread). Results are
    cached, which never changes a score: grading is a pure function of its inputs."""

    def __init__(self, timeout_s: float = 10.0, workers: int = 1):
        super().__init__(grade_in_worker, workers, timeout_s, Grade(0.0, True, True))

    def grade(self, completion: str, gold: str, gold_format: str = "default") -> Grade:
        return self.map([(completion, gold, gold_format)])[0]

def grade_in_worker(completion: str, gold: str, gold_format: str) -> Grade:
    """grade_accuracy inside a grading worker. math-verify's own cutoffs (5 s per parse or
    comparison) score 0 as ours do, and count as cutoffs too; any failure is a wrong answer."""
    cutoffs = LogCounter.installed("math_verify", "Timeout during")
    before = cutoffs.count
    try:
        grade = grade_accuracy(completion, gold, gold_format)
    except Exception:  # noqa: BLE001
        grade = Grade(0.0, True, False)
    return grade._replace(timed_out=True) if cutoffs.count > before else grade

def reward_worker_count(requested: int) -> int:
    return requested or min(8, os.cpu_count() or 1)


# 4. Sampling ------------------------------------------------------------------------------------

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
    # From a no-grad pass after sampling, when the update needs them (num_iterations > 1, or the
    # method asks); otherwise old == current (detached) and the update's own entropy is used.
    old_logp: torch.Tensor = None    # (N, T)
    entropy: torch.Tensor = None     # (N, T)
    divergence: torch.Tensor = None  # (N, T) ict's score
    ref_logp: torch.Tensor = None    # (N, T) only when beta > 0
    active: torch.Tensor = None      # (N, T) tokens whose loss counts; all when None (diagnose.py)
    batch_entropy: torch.Tensor = None  # the sorted entropies of all the batch's valid tokens

    def select(self, start: int, stop: int) -> "Rollout":
        """Rows [start, stop), with their all-padding columns trimmed off."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in out.items():
            if value is not None and name != "batch_entropy":
                out[name] = value[start:stop]
        first_prompt_column = out["prompt_mask"].any(0).nonzero()[0, 0]
        completion_len = int(out["completion_mask"].sum(1).max())
        for name in ("prompt_ids", "prompt_mask"):
            out[name] = out[name][:, first_prompt_column:]
        for name in ("completion_ids", "completion_mask", "old_logp", "entropy", "divergence",
                     "ref_logp", "active"):
            if out[name] is not None:
                out[name] = out[name][:, :completion_len]
        return Rollout(**out)

    def micro_batches(self, cfg: "Config"):
        """(block, part) for each micro-batch of whole groups: the part's rows with padding
        columns trimmed, and the (rows, columns) block of this batch's (N, T) tensors it fills."""
        rows = cfg.groups_per_micro_batch * cfg.group_size
        for start in range(0, len(self.texts), rows):
            part = self.select(start, start + rows)
            yield (slice(start, start + rows), slice(0, part.completion_ids.shape[1])), part

def eos_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return ids or [tokenizer.eos_token_id]

@torch.no_grad()
def sample(model, tokenizer, batch: list[tuple[list[int], str]], cfg: Config) -> Rollout:
    """G completions per prompt with plain temperature sampling (top-p/top-k only where set)."""
    model.eval()
    total = cfg.max_completion_length if cfg.length_limit == "total" else None
    prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts = \
        generate_completions(model, tokenizer, [ids for ids, _ in batch], cfg.group_size,
                             cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_completion_length,
                             total)
    golds = [gold for _, gold in batch for _ in range(cfg.group_size)]
    if cfg.mask_truncated_completions:  # out of the loss, not out of the reward
        completion_mask = completion_mask * (~truncated)[:, None]
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts,
                   golds)

@torch.no_grad()
def generate_completions(model, tokenizer, prompts: list[list[int]], n: int, temperature: float,
                         top_p: float, top_k: int, max_new_tokens: int, max_total: int | None):
    """n completions of each prompt, the prompts left-padded into one batch: the prompt ids and
    mask, the completion ids, mask and truncation flags, and the decoded texts. With max_total,
    each prompt + completion holds at most max_total tokens (as vLLM's max model length)."""
    device = next(model.parameters()).device
    width, pad = max(map(len, prompts)), tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                               device=device)
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
    limits = torch.full((len(prompt_ids),), max_new_tokens, device=device) if max_total is None \
        else max_total - prompt_mask.sum(1)
    eos = eos_token_ids(model, tokenizer)
    completion_ids = sample_tokens(model, prompt_ids, prompt_mask, int(limits.max()), temperature,
                                   top_p, top_k, eos, pad)
    completion_mask, truncated = completion_mask_after_eos(completion_ids, eos, limits)
    lengths = completion_mask.sum(1).long().tolist()
    texts = tokenizer.batch_decode([ids[:k] for ids, k in zip(completion_ids, lengths)],
                                   skip_special_tokens=True)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts

@torch.no_grad()
def sample_tokens(model, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float,
                  top_p: float, top_k: int, eos: list[int], pad: int) -> torch.Tensor:
    """Autoregressive sampling with a KV cache: softmax(logits / temperature), cut to the top-k
    tokens and the top-p nucleus only where set. Nothing else shapes the distribution, so the
    tokens come from the one whose log-probs the loss uses (generate() would add whatever the
    model's generation_config.json ships, such as a repetition penalty). Rows stop at EOS."""
    attention = prompt_mask.clone()
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    cache, input_ids, tokens = DynamicCache(), prompt_ids, []
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)
    eos = torch.tensor(eos, device=prompt_ids.device)
    for _ in range(max_new_tokens):
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        probs = (logits.float() / temperature).softmax(-1)
        if top_k:
            probs = probs * (probs >= probs.topk(top_k, -1).values[:, -1:])
        if top_p < 1:  # keep the most probable tokens until their mass reaches top_p
            sorted_probs, order = probs.sort(-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p * probs.sum(-1, True)
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
        cdf = probs.cumsum(-1)  # inverse-CDF draw: much cheaper than torch.multinomial on CPU
        token = torch.searchsorted(cdf, torch.rand_like(cdf[:, :1]) * cdf[:, -1:]).squeeze(1)
        token = token.clamp(max=probs.shape[-1] - 1).masked_fill(finished, pad)
        tokens.append(token)
        finished |= torch.isin(token, eos)
        if finished.all():
            break
        input_ids, positions = token[:, None], positions[:, -1:] + 1
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
    return torch.stack(tokens, 1)

def completion_mask_after_eos(completion_ids: torch.Tensor, eos: list[int],
                              limits: torch.Tensor | None = None):
    """1 for every token up to and including the first EOS within each row's limit, 0 after; and
    which rows have no EOS within it (truncated)."""
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    limits = torch.full((len(completion_ids),), completion_ids.shape[1],
                        device=completion_ids.device) if limits is None else limits
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device)) \
        & (positions[None, :] < limits[:, None])
    truncated = ~is_eos.any(1)
    last = torch.where(truncated, limits - 1, is_eos.int().argmax(1))
    return (positions[None, :] <= last[:, None]).float(), truncated


# 5. Log-probs and entropy, chunked over positions -----------------------------------------------

def completion_logprobs(model, rollout: Rollout, cfg: Config):
    """(N, T) log-probs of the sampled completion tokens and the entropies there, 0 on padding;
    and the (N, T, hidden) states that predict them."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # as generate() numbers them
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False).last_hidden_state
    prompt_width = rollout.prompt_ids.shape[1]
    hidden = hidden[:, prompt_width - 1:-1]  # the state at position t predicts completion token t
    valid = rollout.completion_mask.bool()
    logp_valid, entropy_valid = chunked_logprobs(
        hidden[valid], model.get_output_embeddings().weight, rollout.completion_ids[valid],
        cfg.temperature, cfg.logit_chunk_elements)
    logp = torch.zeros(valid.shape, device=hidden.device, dtype=logp_valid.dtype)
    entropy = torch.zeros_like(logp)
    logp[valid] = logp_valid
    entropy[valid] = entropy_valid
    return logp, entropy, hidden


# 6. Group advantages ----------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + 1e-4) within each group, Bessel std (GRPO; math.md)."""
    groups = rewards.view(-1, group_size)
    advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    return advantages.view(-1)


# 7. The methods: how each one changes the per-token loss (docs/math.md, "Methods") --------------

class Group(NamedTuple):
    """What a method sees of one group of G responses (T = the micro-batch's longest response)."""
    logp: torch.Tensor        # (G, T) current policy, with gradient
    old_logp: torch.Tensor    # (G, T) rollout policy, no gradient
    advantages: torch.Tensor  # (G,)
    mask: torch.Tensor        # (G, T) 0/1
    entropy: torch.Tensor     # (G, T) rollout policy's entropy, no gradient
    batch_entropy: torch.Tensor | None  # sorted entropies of the batch's valid tokens
    divergence: torch.Tensor | None     # (G, T) ict's JS score, for the methods that ask for it
    update_pass: int          # 0; lopti's second (high-probability) pass is 1

class TokenTerms(NamedTuple):
    """How a method changes the per-token loss w * pg + beta * k3."""
    pg_weight: torch.Tensor  # w (G, T); 0 drops a token's PG term, not its share of the denominator
    extra: torch.Tensor | None = None   # a per-token term added to the loss (kl_cov)
    clip: bool = True                   # False: the PG term without PPO clipping (kl_cov)
    active: torch.Tensor | None = None  # tokens whose PG and KL terms count in this pass (lopti)

def grpo(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(group.mask)  # w = 1 (Shao et al. 2024)

def covariance_score(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CW-GRPO's per-token covariance score of one group (math.md "cw", steps 1-3)."""
    mu = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)       # 1. each response's mean log-prob
    centred_adv = adv - adv.mean()                               # 2.
    return (logp - mu[:, None]) * centred_adv[:, None] * mask    # 3.

def cw_weights(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
               norm: str = "padded", detach: bool = False) -> torch.Tensor:
    """CW-GRPO's Gaussian-kernel weights of one group (Wang et al. 2026, the method section;
    math.md "cw", steps 1-8)."""
    score = covariance_score(logp, adv, mask)                              # 1-3.
    n_valid = mask.sum().clamp(min=1)  # a group with no valid token gets weights 0, not NaN
    score_mean = score.sum() / n_valid
    variance = ((score - score_mean) ** 2 * mask).sum() / n_valid          # 4. ddof=0
    # sqrt'(0) is infinite: when every score is 0 (equal rewards) sigma = 1e-8 with zero gradient
    sigma = torch.where(variance > 0, variance, 1.0).sqrt() * (variance > 0) + 1e-8
    kernel = torch.exp(-score ** 2 / (2 * sigma ** 2)) * mask              # 5.
    if norm == "padded":                                                   # 6. released code
        total = mask.shape[0] * mask.sum(1).max()
    elif norm == "valid":                                                  # 6. paper wording
        total = n_valid
    else:
        raise ValueError(f"cw_weights: norm must be 'padded' or 'valid', got {norm!r}")
    weights = kernel * total / kernel.sum().clamp(min=1e-30)
    return weights.detach() if detach else weights                         # 7.

def cw(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(cw_weights(group.logp, group.advantages, group.mask, norm=cfg.cw_norm,
                                 detach=cfg.cw_detach))

def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s C = (logp - mean logp) (A - mean A), means over the valid tokens (math.md)."""
    logp, adv = logp.detach(), adv[:, None].expand_as(logp)
    n_valid = mask.sum().clamp(min=1)
    return (logp - (logp * mask).sum() / n_valid) * (adv - (adv * mask).sum() / n_valid) * mask

def ppo_clipped(ratio: torch.Tensor, adv: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Tokens whose PG term PPO's clip holds constant (no gradient)."""
    return (((ratio < 1 - cfg.eps_low) & (adv[:, None] < 0))
            | ((ratio > 1 + cfg.eps_high) & (adv[:, None] > 0)))

def clip_cov(group: Group, cfg: Config) -> TokenTerms:
    """Clip-Cov (Cui et al. 2025): zero the loss of a few random tokens with lb < C < ub."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    ratio = torch.exp(group.logp.detach() - group.old_logp)
    candidates = ((group.mask > 0) & ~ppo_clipped(ratio, group.advantages, cfg)
                  & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub))
    n_select = max(int(cfg.clip_cov_ratio * group.mask.sum()), 1)
    positions = candidates.nonzero()
    chosen = positions[torch.randperm(len(positions), device=positions.device)[:n_select]]
    weight = group.mask.clone()
    weight[chosen[:, 0], chosen[:, 1]] = 0
    return TokenTerms(weight)

def kl_cov(group: Group, cfg: Config) -> TokenTerms:
    """KL-Cov (Cui et al. 2025): no clipping; |logp - old_logp| on the top-k tokens by C."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    k = max(1, int(cfg.kl_cov_ratio * group.mask.sum()))
    top = torch.zeros_like(group.mask, dtype=torch.bool).view(-1)
    top[cov.masked_fill(group.mask == 0, -torch.inf).view(-1).topk(k).indices] = True
    extra = cfg.kl_cov_coef * (group.logp - group.old_logp).abs() * top.view_as(group.mask)
    return TokenTerms(group.mask, extra=extra, clip=False)

def ar_weights(old_logp: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """Advantage reweighting (Yang et al. 2025, Eq. 4): w = alpha p_old + 1 - alpha, constant."""
    return (alpha * old_logp.exp() + 1 - alpha) * mask

def lopti_active(old_logp: torch.Tensor, mask: torch.Tensor, eta: float, update_pass: int):
    """Lopti (Yang et al. 2025): pass 0 updates the tokens with p_old < eta, pass 1 the rest."""
    low = old_logp.exp() < eta
    return mask * (low if update_pass == 0 else ~low)

def ar(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(ar_weights(group.old_logp, group.mask, cfg.ar_alpha))

def lopti(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(group.mask, active=lopti_active(group.old_logp, group.mask, cfg.lopti_eta,
                                                      group.update_pass))

def ar_lopti(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(ar_weights(group.old_logp, group.mask, cfg.ar_lopti_alpha),
                      active=lopti_active(group.old_logp, group.mask, cfg.ar_lopti_eta,
                                          group.update_pass))

def renormalised(keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weights that make a response's token mean of the PG term run over its kept tokens only."""
    return keep * mask.sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)

def ict(group: Group, cfg: Config) -> TokenTerms:
    """ICT (Beyond Entropy, 2026): keep each response's top positions by JS divergence."""
    keep_counts = (cfg.ict_keep_frac * group.mask.sum(1)).ceil().clamp(min=1)
    by_divergence = group.divergence.masked_fill(group.mask == 0, -1)
    ranks = by_divergence.argsort(1, descending=True).argsort(1)
    keep = (ranks < keep_counts[:, None]).float() * group.mask
    return TokenTerms(renormalised(keep, group.mask))

def sorted_quantile(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's linear interpolation, on values sorted once per batch."""
    if len(sorted_values) == 0:  # a batch with no valid token: no token passes any threshold
        return torch.tensor(torch.inf)
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)

def entropy20(group: Group, cfg: Config) -> TokenTerms:
    """80/20 (Wang et al. 2025): PG only on tokens at or above the batch's 80th entropy pct."""
    threshold = sorted_quantile(group.batch_entropy, 1 - cfg.entropy_top_frac)
    return TokenTerms(group.mask * (group.entropy >= threshold))

def stapo(group: Group, cfg: Config) -> TokenTerms:
    """STAPO (2026): silence positive-advantage tokens that are rare and low-entropy."""
    threshold = sorted_quantile(group.batch_entropy, cfg.stapo_entropy_percentile / 100)
    spurious = ((group.advantages[:, None] > 0) & (group.old_logp.exp() < cfg.stapo_max_prob)
                & (group.entropy < threshold))
    return TokenTerms(renormalised(group.mask * ~spurious, group.mask))

class Method(NamedTuple):
    token_terms: Callable[[Group, Config], TokenTerms]
    description: str
    update_passes: int = 1             # lopti: a low-probability pass, then a high one
    needs_old_policy_pass: bool = False  # old log-probs and entropies of the whole batch first
    needs_divergence: bool = False     # ict's JS score, computed in that pass

METHODS = {
    "grpo": Method(grpo, "GRPO baseline, every token weight 1"),
    "cw": Method(cw, "CW-GRPO, Gaussian-kernel covariance weights (Wang et al. 2026)"),
    "clip_cov": Method(clip_cov, "zero the loss of a few random high-covariance tokens "
                                 "(Cui et al. 2025)"),
    "kl_cov": Method(kl_cov, "no clipping, |logp - old_logp| on top-covariance tokens "
                             "(Cui et al. 2025)"),
    "ar": Method(ar, "advantage reweighting by alpha p + 1 - alpha (Yang et al. 2025)"),
    "lopti": Method(lopti, "low-probability tokens first, then the rest: 2 steps per batch "
                           "(Yang et al. 2025)", update_passes=2, needs_old_policy_pass=True),
    "ar_lopti": Method(ar_lopti, "ar and lopti together (Yang et al. 2025)", update_passes=2,
                       needs_old_policy_pass=True),
    "ict": Method(ict, "PG only on each response's top 10% positions by JS divergence from the "
                       "group (2026)", needs_old_policy_pass=True, needs_divergence=True),
    "entropy20": Method(entropy20, "PG only on the top 20% highest-entropy tokens "
                                   "(Wang et al. 2025)", needs_old_policy_pass=True),
    "stapo": Method(stapo, "silence rare, low-entropy positive tokens, renormalise (2026)",
                    needs_old_policy_pass=True),
}


# 8. The loss ------------------------------------------------------------------------------------

def token_loss(logp, old_logp, ref_logp, advantages, terms: TokenTerms, cfg: Config):
    """Per-token loss w * pg + beta * k3 (+ a method's extra term); the KL is never weighted."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = -ratio * adv
    if terms.clip:  # PPO's clipped surrogate
        pg = torch.max(pg, -ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    loss = terms.pg_weight * pg
    if terms.extra is not None:
        loss = loss + terms.extra
    if ref_logp is not None:
        loss = loss + cfg.beta * k3(logp, ref_logp)
    return loss if terms.active is None else loss * terms.active

def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    return torch.exp(ref_logp - logp) - (ref_logp - logp) - 1

def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, n_responses: int,
              n_tokens: int) -> torch.Tensor:
    """The step's loss summed over micro-batches: divide by step-wide totals."""
    if mode == "seq-mean-token-mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_responses
    return (per_token * mask).sum() / n_tokens

def micro_batch_terms(logp, old_logp, entropy, rollout: Rollout, cfg: Config,
                      update_pass: int) -> TokenTerms:
    """The method's token terms, group by group, concatenated over the micro-batch."""
    token_terms, parts = METHODS[cfg.method].token_terms, []
    for g in (slice(i, i + cfg.group_size) for i in range(0, len(logp), cfg.group_size)):
        divergence = None if rollout.divergence is None else rollout.divergence[g]
        parts.append(token_terms(Group(
            logp=logp[g], old_logp=old_logp[g], advantages=rollout.advantages[g],
            mask=rollout.completion_mask[g], entropy=entropy[g],
            batch_entropy=rollout.batch_entropy, divergence=divergence, update_pass=update_pass),
            cfg))
    pg_weight = torch.cat([p.pg_weight for p in parts])
    extra = None if parts[0].extra is None else torch.cat([p.extra for p in parts])
    active = None if parts[0].active is None else torch.cat([p.active for p in parts])
    if rollout.active is not None:
        active = rollout.active if active is None else rollout.active * active
    return TokenTerms(pg_weight, extra, parts[0].clip, active)

def micro_batch_loss(model, rollout: Rollout, cfg: Config, n_responses: int, n_tokens: int,
                     update_pass: int = 0):
    """The micro-batch's share of the step's loss, and what the metrics read: the log-probs, the
    old log-probs, the entropies and the method's token terms."""
    logp, entropy, _ = completion_logprobs(model, rollout, cfg)
    old_logp = rollout.old_logp if rollout.old_logp is not None else logp.detach()
    entropy = rollout.entropy if rollout.entropy is not None else entropy
    terms = micro_batch_terms(logp, old_logp, entropy, rollout, cfg, update_pass)
    per_token = token_loss(logp, old_logp, rollout.ref_logp, rollout.advantages, terms, cfg)
    loss = aggregate(per_token, rollout.completion_mask, cfg.loss_aggregation, n_responses,
                     n_tokens)
    return loss, (logp.detach(), old_logp, entropy, terms)

def token_metrics(logp, old_logp, ref_logp, entropy, advantages, mask, terms: TokenTerms,
                  cfg: Config) -> dict:
    """Per valid token, what the step's metrics average: entropy, KL, PPO clipping, the PG weight,
    whether the method touched the token's loss, and whether its PG term is on."""
    valid = mask.bool()
    active = torch.ones_like(logp) if terms.active is None else terms.active
    kl = torch.zeros_like(logp) if ref_logp is None else k3(logp, ref_logp)
    clipped = ppo_clipped(torch.exp(logp - old_logp), advantages, cfg) & terms.clip
    weight = terms.pg_weight.detach()
    per_token = {"entropy": entropy, "kl": kl, "clipped": clipped, "w": weight,
                 "touched": touched_tokens(terms), "pg_on": (weight != 0) & (active != 0)}
    return {name: values[valid].float() for name, values in per_token.items()}

def touched_tokens(terms: TokenTerms) -> torch.Tensor:
    """Tokens whose loss the method changed: weighted other than 1, outside the pass, penalised."""
    touched = terms.pg_weight.detach() != 1
    if terms.active is not None:
        touched |= terms.active == 0
    if terms.extra is not None:
        touched |= terms.extra.detach() != 0
    return touched


# 9. The training loop and checkpoints -----------------------------------------------------------

@torch.no_grad()
def policy_token_stats(model, rollout: Rollout, cfg: Config, divergence: bool = False) -> dict:
    """(N, T) log-probs and entropies of the batch's tokens under `model` (the rollout policy or
    the reference), micro-batch by micro-batch, without gradient; and ict's divergence on
    request. 0 on padding."""
    names = ["logp", "entropy"] + ["divergence"] * divergence
    out = {name: torch.zeros_like(rollout.completion_mask) for name in names}
    head = model.get_output_embeddings().weight
    for block, part in rollout.micro_batches(cfg):
        out["logp"][block], out["entropy"][block], hidden = completion_logprobs(model, part, cfg)
        for g in range(0, len(part.texts) if divergence else 0, cfg.group_size):
            group = slice(g, g + cfg.group_size)
            out["divergence"][block][group] = ict_divergence(
                hidden[group], head, part.completion_mask[group], cfg.temperature,
                cfg.logit_chunk_elements)
    return out

def rollout_rewards(rollout: Rollout, grades: list[Grade], cfg: Config) -> dict:
    """Sets the batch's rewards and group advantages; returns the rollout's metrics."""
    accuracy = torch.tensor([g.accuracy for g in grades])
    formats = torch.tensor([format_reward(text) for text in rollout.texts])
    rollout.rewards = cfg.accuracy_weight * accuracy + cfg.format_weight * formats
    rollout.advantages = group_advantages(rollout.rewards, cfg.group_size).to(
        rollout.completion_ids.device)
    group_std = rollout.rewards.view(-1, cfg.group_size).std(1)
    return {"reward_mean": rollout.rewards.mean().item(),
            "reward_std": rollout.rewards.std().item(),
            "accuracy_mean": accuracy.mean().item(), "format_mean": formats.mean().item(),
            "frac_zero_std_groups": (group_std == 0).float().mean().item(),
            "completion_len_mean": rollout.completion_mask.sum(1).mean().item(),
            "truncated_frac": rollout.truncated.float().mean().item(),
            "gold_unparseable": sum(not g.gold_parsed for g in grades),
            "grading_timeouts": sum(g.timed_out for g in grades)}

def accumulate_gradients(model, rollout: Rollout, cfg: Config, autocast, update_pass: int = 0):
    """The gradient of the step's loss into .grad, micro-batch of whole groups by micro-batch;
    the loss, and the per-token metrics of each micro-batch."""
    model.train()
    n_responses = len(rollout.texts)
    n_tokens = int(rollout.completion_mask.sum().clamp(min=1))
    total_loss, metrics = 0.0, []
    for _, part in rollout.micro_batches(cfg):
        with autocast():
            loss, (logp, old_logp, entropy, terms) = micro_batch_loss(
                model, part, cfg, n_responses, n_tokens, update_pass)
        loss.backward()
        total_loss += loss.item()
        metrics.append(token_metrics(logp, old_logp, part.ref_logp, entropy, part.advantages,
                                     part.completion_mask, terms, cfg))
    return total_loss, metrics

def update(model, optimizer, scheduler, rollout: Rollout, cfg: Config, autocast,
           update_pass: int = 0) -> dict:
    """One optimizer step over the rollout batch; returns its metrics."""
    loss, metrics = accumulate_gradients(model, rollout, cfg, autocast, update_pass)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    token = {name: torch.cat([m[name] for m in metrics]) for name in metrics[0]}
    if not len(token["w"]):  # every completion masked (--mask-truncated-completions): a 0 step
        token = {name: torch.zeros(1) for name in token}
    w = token["w"]
    return {"loss": loss, "grad_norm": grad_norm.item(), "lr": lr,
            "entropy_mean": token["entropy"].mean().item(), "kl_mean": token["kl"].mean().item(),
            "clip_frac": token["clipped"].mean().item(), "w_mean": w.mean().item(),
            "w_std": w.std().item() if len(w) > 1 else 0.0, "w_min": w.min().item(),
            "w_max": w.max().item(), "w_frac_below_half": (w < 0.5).float().mean().item(),
            "w_frac_above_2": (w > 2).float().mean().item(),
            "touched_frac": token["touched"].mean().item(),
            "pg_active_frac": token["pg_on"].mean().item()}

def collect_rollout(model, reference, tokenizer, prompts: PromptStream, grader: Grader,
                    cfg: Config) -> tuple[Rollout, dict]:
    """Sample a batch, score it and compute its advantages. The old-policy and reference passes
    run while the worker processes grade."""
    method = METHODS[cfg.method]
    rollout = sample(model, tokenizer, prompts.next_batch(cfg.prompts_per_step), cfg)
    grades = grader.submit([(text, gold, "default")
                            for text, gold in zip(rollout.texts, rollout.golds)])
    if cfg.num_iterations > 1 or method.needs_old_policy_pass:
        stats = policy_token_stats(model, rollout, cfg, method.needs_divergence)
        rollout.old_logp, rollout.entropy = stats["logp"], stats["entropy"]
        rollout.divergence = stats.get("divergence")
        rollout.batch_entropy = rollout.entropy[rollout.completion_mask.bool()].sort().values
    if reference is not None:
        rollout.ref_logp = policy_token_stats(reference, rollout, cfg)["logp"]
    return rollout, rollout_rewards(rollout, grades(), cfg)

@torch.no_grad()
def token_view(model, tokenizer, rollout: Rollout, cfg: Config, label: str, shown: int = 4):
    """What tokens.html shows of the batch's first group: a few completions, token by token, with
    each token's probability, covariance score (cw step 3), and the weight every method gives it.
    The RNG is restored (clip_cov draws), so training goes on unchanged."""
    rng, group_rows = rng_states(), rollout.select(0, cfg.group_size)
    stats = policy_token_stats(model, group_rows, cfg, divergence=True)
    mask = group_rows.completion_mask
    group = Group(logp=stats["logp"], old_logp=stats["logp"], advantages=group_rows.advantages,
                  mask=mask, entropy=stats["entropy"], divergence=stats["divergence"],
                  batch_entropy=stats["entropy"][mask.bool()].sort().values, update_pass=0)
    weights, touched = {}, {}
    for name, method in METHODS.items():
        terms = method.token_terms(group, cfg)
        active = 1 if terms.active is None else terms.active
        weights[name], touched[name] = terms.pg_weight * active, touched_tokens(terms).int()
    set_rng_states(rng)
    lengths = mask.sum(1).long().tolist()[:shown]

    def rows(values, digits=4):  # per shown completion, its valid tokens' values
        return [[float(f"{v:.{digits}g}") for v in row[:n].tolist()] for row, n in zip(values,
                                                                                      lengths)]
    return {"label": label, "adv": [round(a, 4) for a in group_rows.advantages[:shown].tolist()],
            "tokens": [[tokenizer.decode([t]) for t in ids[:n].tolist()]
                       for ids, n in zip(group_rows.completion_ids, lengths)],
            "prob": rows(stats["logp"].exp()), "cov": rows(covariance_score(
                stats["logp"], group_rows.advantages, mask)),
            "weights": {k: rows(w) for k, w in weights.items()},
            "touched": {k: rows(t) for k, t in touched.items()}}

def draw(output_dir: Path, cfg: Config, views: list[dict]) -> None:
    """The run's curves (curves.png) and its tokens (tokens.html), redrawn from what it holds."""
    title = f"{cfg.method} on {cfg.model}, seed {cfg.seed}"
    plots.plot_run(output_dir / "metrics.jsonl", output_dir / "curves.png", title)
    (output_dir / "token_views.json").write_text(json.dumps(views))
    plots.token_page(output_dir / "tokens.html", title, cfg.method,
                     {name: m.description for name, m in METHODS.items()}, views)

def closing_lines(output_dir: Path, cfg: Config) -> list[str]:
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name[11:]))
    evaluate = f"python evaluate.py --model {output_dir / 'final-model'}" + (
        " --benchmarks benchmarks/tiny-arithmetic.jsonl --gold-format expr --prompt-template "
        "'{question}' --temperature 1.0 --top-p 1.0 --max-new-tokens 40"
        if cfg.preset == "tiny" else "")
    return [f"checkpoints: {', '.join(str(p) for p in checkpoints)}",
            f"final model: {output_dir / 'final-model'}",
            f"pictures:    {output_dir / 'curves.png'} and {output_dir / 'tokens.html'}",
            f"evaluate it: {evaluate}"]

def check_paths(cfg: Config) -> None:
    """The model and the checkpoint to resume from exist as asked, or one line says what is
    wrong, before anything slow starts."""
    output_dir, model = Path(cfg.output_dir), cfg.model
    if not Path(model).exists() and (model.startswith((".", "/", "~")) or model.count("/") > 1):
        build = " (build it with: python tiny.py)" if cfg.preset == "tiny" else ""
        raise SystemExit(f"error: --model {model}: no such folder{build}")
    if cfg.resume and latest_checkpoint(output_dir) is None:
        raise SystemExit(f"error: --resume, but {output_dir} holds no complete checkpoint; "
                         f"drop --resume to start afresh")
    if cfg.length_limit == "total" and cfg.max_prompt_length >= cfg.max_completion_length:
        raise SystemExit(f"error: --max-prompt-length ({cfg.max_prompt_length}) leaves no room "
                         f"for a completion within --max-completion-length "
                         f"({cfg.max_completion_length}) under --length-limit total")

def prepare_output_dir(cfg: Config) -> Path:
    """Called holding the folder's lock."""
    output_dir = Path(cfg.output_dir)
    if (output_dir / "metrics.jsonl").exists() and not cfg.resume:
        if not cfg.overwrite_output_dir:
            raise SystemExit(f"error: {output_dir} already holds a run; pass --resume to continue "
                             f"it, --overwrite-output-dir to start afresh, or choose another "
                             f"--output-dir")
        for entry in output_dir.iterdir():
            if entry.name != ".lock":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    (output_dir / "run_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    return output_dir

def train(cfg: Config, on_rollout: Callable | None = None) -> Path:
    """GRPO with cfg.method's token terms. on_rollout(step, model, rollout, autocast), if given,
    sees each scored rollout batch before the update (diagnose.py uses it)."""
    start, device = time.perf_counter(), resolve_device(cfg)
    print(f"cwgrpo: --method {cfg.method} on {cfg.model}, data {cfg.dataset}\n"
          f"  {cfg.prompts_per_step} prompts x G = {cfg.group_size} per step, {cfg.steps} steps, "
          f"beta {cfg.beta:g}, lr {cfg.learning_rate:g}; output {cfg.output_dir}", flush=True)
    plots.pyplot()  # fail now, not at the first checkpoint, if matplotlib is missing
    with RunLock(Path(cfg.output_dir)), StopRequest() as stop:  # a live run's folder: stop here
        check_paths(cfg)
        dataset = load_dataset(cfg.dataset, cfg.dataset_split, cfg.question_column,
                               cfg.gold_column)
        output_dir = run(cfg, device, dataset, on_rollout, stop)
    print(plots.run_summary(output_dir / "metrics.jsonl", time.perf_counter() - start,
                            closing_lines(output_dir, cfg)))
    return output_dir

def run(cfg: Config, device: torch.device, dataset, on_rollout: Callable | None,
        stop: StopRequest) -> Path:
    """The loop of train(), inside the output folder's lock: sample, score, advantages, update,
    log, save."""
    output_dir = prepare_output_dir(cfg)
    transformers.utils.logging.disable_progress_bar()
    resume_from = latest_checkpoint(output_dir) if cfg.resume else None
    print(f"loading {resume_from or cfg.model} ...", flush=True)
    tokenizer = load_tokenizer(str(resume_from or cfg.model))
    prompts = PromptStream(dataset, tokenizer, cfg)
    model = load_model(str(resume_from or cfg.model), torch.float32, device)  # fp32 masters
    reference = load_reference(cfg.model, device) if cfg.beta > 0 else None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if prompts.skipped:
        print(f"skipped {prompts.skipped} prompts longer than --max-prompt-length "
              f"{cfg.max_prompt_length}")
    grader = Grader(cfg.reward_timeout_s, reward_worker_count(cfg.reward_workers))
    method = METHODS[cfg.method]
    if cfg.method == "kl_cov" and cfg.num_iterations == 1:
        print("note: kl_cov does nothing with one update per rollout batch: logp == old_logp, so "
              "its penalty |logp - old_logp| is 0 and it trains as GRPO; use --num-iterations 2")
    updates_per_rollout = cfg.num_iterations * method.update_passes
    total_updates = cfg.steps * updates_per_rollout
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    scheduler = transformers.get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, int(cfg.warmup_ratio * total_updates), total_updates,
        min_lr_rate=cfg.min_lr_ratio)
    start_step, views = 0, []
    if resume_from is not None:
        state = torch.load(resume_from / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_states(state["rng"])
        start_step, prompts.position = state["step"], state["data_position"]
        views = json.loads((output_dir / "token_views.json").read_text())[:1]
    else:
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    metrics_path = output_dir / "metrics.jsonl"
    keep_records_until(metrics_path, start_step)

    autocast = bf16_autocast(device)
    progress = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps,
                    desc=cfg.method)
    for step in progress:
        t0 = time.perf_counter()
        with autocast():
            rollout, rollout_metrics = collect_rollout(model, reference, tokenizer, prompts,
                                                       grader, cfg)
            if step == 0 or step + 1 == cfg.steps:
                views.append(token_view(model, tokenizer, rollout, cfg, f"step {step + 1}"))
        rollout_s = time.perf_counter() - t0
        if on_rollout is not None:
            on_rollout(step + 1, model, rollout, autocast)
        for update_index in range(updates_per_rollout):
            t1 = time.perf_counter()
            update_pass = update_index % method.update_passes
            record = {"step": step * updates_per_rollout + update_index + 1,
                      "rollout_step": step + 1, "update_pass": update_pass, **rollout_metrics,
                      **update(model, optimizer, scheduler, rollout, cfg, autocast, update_pass),
                      "prompts_skipped": prompts.skipped, "rollout_s": rollout_s,
                      "update_s": time.perf_counter() - t1}
            tokens = rollout.completion_mask.sum().item()
            record["tokens_per_s"] = tokens / (record["rollout_s"] + record["update_s"])
            record["time"] = time.time()
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        progress.set_postfix(reward=f"{record['reward_mean']:.3f}",
                             entropy=f"{record['entropy_mean']:.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or stop.requested:
            save_checkpoint(output_dir, f"checkpoint-{step + 1}", model, tokenizer, {
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng_states(), "step": step + 1, "data_position": prompts.position})
            draw(output_dir, cfg, views)
        if stop.requested:
            grader.close()
            raise SystemExit(f"stopped after step {step + 1} (saved checkpoint-{step + 1}); "
                             f"resume with: {resume_command()}")
    grader.close()
    save_checkpoint(output_dir, "final-model", model, tokenizer)
    return output_dir

def main(argv=None) -> None:
    cfg = parse_config(argv)
    try:
        train(cfg)
    except KeyboardInterrupt:
        raise SystemExit(f"interrupted: the step under way is lost; resume from the last "
                         f"checkpoint with: {resume_command()}") from None


if __name__ == "__main__":
    main()
