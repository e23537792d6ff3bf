"""cwgrpo.py: CW-GRPO and the token-weighting methods it is compared with, in one file that reads
like the paper.

CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
Reweighting", Wang et al., ACL 2026) scales each token's advantage by a Gaussian kernel of its
covariance score. docs/math.md has every formula, with the papers' equation and section numbers.

    python cwgrpo.py --method cw --preset tiny   # CW-GRPO on a tiny model, in a minute on a CPU
    python cwgrpo.py --method cw                 # the paper's 1.5B recipe (one CUDA GPU)
"""

import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import torch
import transformers
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

import loading
import memory_plan
import plots
import runtime
import tiny
import vllm_engine
from lm_head import chunked_logprobs, ict_divergence
from runtime import arg
from sampling import attention_mask, generate_completions

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


# The range of every numeric option, checked when the command line is parsed: (rule, options)
RULES = [
    (">= 2", "group_size"),
    ("> 0", "prompts_per_step groups_per_micro_batch max_prompt_length max_completion_length"),
    ("> 0", "temperature reward_timeout_s num_iterations learning_rate max_grad_norm steps"),
    ("> 0", "save_every logit_chunk_elements log_every sampler_correction_cap"),
    ("in (0, 1]", "top_p clip_cov_ratio kl_cov_ratio lopti_eta ar_lopti_eta ict_keep_frac"),
    ("in (0, 1]", "entropy_top_frac vllm_gpu_memory_utilization"),
    (">= 0", "top_k accuracy_weight format_weight reward_workers beta eps_low eps_high"),
    (">= 0", "kl_cov_coef stapo_max_prob weight_decay seed threads"),
    (">= 0", "rollout_chunk save_total_limit sampler_correction_min"),
    ("in [0, 1]", "ar_alpha ar_lopti_alpha min_lr_ratio warmup_ratio"),
    ("in [0, 100]", "stapo_entropy_percentile"),
]


@dataclass
class Config:
    """The defaults are the released 1.5B recipe (docs/math.md, "Recipe"); PRESETS override some.
    --help shows the defaults of the --preset given (paper-1.5b when none is)."""

    preset: Literal["paper-1.5b", "paper-7b", "qwen0.5b-24gb", "tiny"] = arg(
        "paper-1.5b", "PRESETS"
    )
    method: str = arg("cw", "token-weighting method: one of METHODS (section 7, listed below)")
    model: str = arg("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "hub id or local folder")
    dataset: str = arg("knoveleng/open-rs", "hub id or local .json/.jsonl/.parquet/.csv file")
    dataset_split: str = arg("train", "split of a hub dataset")
    question_column: str = arg("problem", "column of the question")
    gold_column: str = arg("solution", "column of the reference solution (parsed by math-verify)")
    system_prompt: str = arg(OPEN_RS_SYSTEM_PROMPT, "system message; empty for none")
    group_size: int = arg(12, "G, completions sampled per prompt")
    prompts_per_step: int = arg(12, "prompts per rollout batch")
    groups_per_micro_batch: int = arg(1, "whole groups per forward/backward pass")
    max_prompt_length: int = arg(512, "longer prompts are skipped (and counted)")
    max_completion_length: int = arg(4096, "generation limit; see --length-limit")
    length_limit: Literal["total", "new"] = arg(
        "total", "total: prompt + completion (released: vLLM's max length); new: new tokens"
    )
    rollout: Literal["hf", "vllm"] = arg("hf", "sampler: hf (sampling.py) or vllm (vllm_engine.py)")
    vllm_gpu_memory_utilization: float = arg(0.3, "vllm on CUDA: share of the GPU while it samples")
    temperature: float = arg(0.7, "sampling temperature; log-probs use it too")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 is off (paper)")
    top_k: int = arg(0, "top-k sampling; 0 is off (paper)")
    mask_truncated_completions: bool = arg(False, "drop completions cut at the limit from the loss")
    accuracy_weight: float = arg(1.0, "weight of the accuracy reward")
    format_weight: float = arg(1.0, "weight of the format reward")
    reward_timeout_s: float = arg(10.0, "hard limit on grading one completion")
    reward_workers: int = arg(0, "grading processes; 0: one per core, at most 8")
    beta: float = arg(0.04, "k3 KL coefficient; 0 loads no reference model")
    eps_low: float = arg(0.2, "PPO clip range below 1")
    eps_high: float = arg(0.2, "PPO clip range above 1")
    sampler_correction: Literal[
        "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = arg("none", "importance weights for the sampler-trainer mismatch (none: as released)")
    sampler_correction_cap: float = arg(3.0, "C: truncate the ratio at it, or mask above it")
    sampler_correction_min: float = arg(0.0, "C_min: the *_mask modes also mask ratios below it")
    loss_aggregation: Literal["seq-mean-token-mean", "token-mean"] = arg(
        "seq-mean-token-mean", "seq-mean-token-mean (GRPO, the paper) or token-mean (DAPO)"
    )
    num_iterations: int = arg(1, "policy updates per rollout batch (paper: 1)")
    cw_norm: Literal["padded", "valid"] = arg(
        "padded", "cw: weights of mean 1 over padded positions (released code) or real tokens"
    )
    cw_detach: bool = arg(False, "cw: no gradient through the weights (released code: it flows)")
    cw_reading: Literal["released", "paper", "gradient-only"] = arg(
        "released", "cw: released, paper (valid, detached) or gradient-only (w = 1, its gradient)"
    )
    clip_cov_ratio: float = arg(2e-4, "clip_cov: share of tokens zeroed")
    clip_cov_lb: float = arg(1.0, "clip_cov: candidates have covariance above this")
    clip_cov_ub: float = arg(5.0, "clip_cov: candidates have covariance below this")
    kl_cov_ratio: float = arg(2e-3, "kl_cov: share of tokens penalised")
    kl_cov_coef: float = arg(1.0, "kl_cov: coefficient of |logp - old_logp|")
    ar_alpha: float = arg(0.2, "ar: alpha of w = alpha p + 1 - alpha")
    lopti_eta: float = arg(0.4, "lopti: probability threshold of the first pass")
    ar_lopti_alpha: float = arg(0.3, "ar_lopti: ar's alpha")
    ar_lopti_eta: float = arg(0.5, "ar_lopti: lopti's eta")
    ict_keep_frac: float = arg(0.1, "ict: share of positions kept")
    entropy_top_frac: float = arg(0.2, "entropy20: share of tokens kept")
    stapo_max_prob: float = arg(0.01, "stapo: silence tokens with p below this ...")
    stapo_entropy_percentile: float = arg(5.0, "stapo: ... and entropy below this percentile")
    learning_rate: float = arg(1e-6, "peak AdamW learning rate")
    min_lr_ratio: float = arg(0.1, "the cosine schedule ends at this x peak")
    warmup_ratio: float = arg(0.1, "share of steps with linear warmup")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping norm")
    steps: int = arg(300, "rollout batches to train on")
    save_every: int = arg(50, "write checkpoint-<step> this often")
    seed: int = arg(2025, "seed of data order and sampling")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward to save memory")
    logit_chunk_elements: int = arg(2**26, "logits held at once (lm_head.py)")
    device: str = arg("auto", "auto (cuda if present), cuda or cpu")
    threads: int = arg(0, "CPU threads of torch; 0: torch's default")
    output_dir: str = arg("", "default runs/<method>-<preset>-seed<seed>")
    resume: bool = arg(False, "continue from the newest complete checkpoint in --output-dir")
    overwrite_output_dir: bool = arg(False, "start afresh in an --output-dir that holds a run")
    log_every: int = arg(10, "without a terminal, print a progress line every this many steps")
    rollout_chunk: int = arg(0, "prompts sampled at once, which bounds the KV cache; 0: all")
    save_total_limit: int = arg(0, "keep only the newest this many checkpoints; 0: all")
    plan: bool = arg(False, "print the memory and disk plan (memory_plan.py) and exit")

    def __post_init__(self):
        """Every option is checked here, at parse time, before any slow work."""
        if self.method not in METHODS:
            raise SystemExit(
                f"error: unknown --method {self.method!r}; choose from {', '.join(METHODS)}"
            )
        runtime.check_rules(self, RULES)
        if self.rollout == "vllm" and not self.plan:  # a plan needs no engine
            vllm_engine.check_installed()
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise SystemExit(
                f"error: --clip-cov-lb ({self.clip_cov_lb}) must be below "
                f"--clip-cov-ub ({self.clip_cov_ub})"
            )
        if self.cw_reading != "released":  # the control takes the released weights' gradient
            self.cw_norm, self.cw_detach = (
                ("valid", True) if self.cw_reading == "paper" else ("padded", False)
            )
        self.groups_per_micro_batch = min(self.groups_per_micro_batch, self.prompts_per_step)
        if self.prompts_per_step % self.groups_per_micro_batch:
            raise SystemExit(
                f"error: --prompts-per-step ({self.prompts_per_step}) must be a "
                f"multiple of --groups-per-micro-batch ({self.groups_per_micro_batch})"
            )
        if self.length_limit == "total" and self.max_prompt_length >= self.max_completion_length:
            raise SystemExit(
                f"error: --max-prompt-length ({self.max_prompt_length}) leaves no "
                f"room for a completion within --max-completion-length "
                f"({self.max_completion_length}) under --length-limit total"
            )
        if not self.output_dir:
            self.output_dir = f"runs/{self.method}-{self.preset}-seed{self.seed}"


PRESETS = {
    "paper-1.5b": {},  # the Config defaults are this recipe
    # Qwen2.5-Math-7B has 4,096 positions: prompt + completion fit in them with --length-limit total
    "paper-7b": dict(model="Qwen/Qwen2.5-Math-7B-Instruct", format_weight=0.0, steps=150),
    # The 1.5B recipe on one 24 GB card: TRL's quick-start model, 3,072 positions, 4 prompts at once
    "qwen0.5b-24gb": dict(model="Qwen/Qwen2.5-0.5B-Instruct", max_completion_length=3072)
    | dict(rollout_chunk=4),
    "tiny": dict(model="runs/tiny-base/model", dataset="runs/tiny-base/arithmetic.jsonl")
    | dict(system_prompt="", group_size=8, prompts_per_step=8, groups_per_micro_batch=8)
    | dict(max_prompt_length=64, max_completion_length=40, length_limit="new", temperature=1.0)
    | dict(learning_rate=7e-4, warmup_ratio=0.05, steps=200, save_every=50, seed=0)
    | dict(gradient_checkpointing=False),
}
GPU_PRESETS = ("paper-1.5b", "paper-7b", "qwen0.5b-24gb")
EVALUATE_OPTIONS = {
    "tiny": " --benchmarks benchmarks/tiny-arithmetic.jsonl --gold-format expr "
    "--prompt-template '{question}' --top-p 1.0 --max-new-tokens 40"
}


def parse_config(argv=None, *extra_dataclasses, hidden: tuple = ()):
    """The run's Config (and those of extra dataclasses a tool adds): the --preset's values as
    defaults, then the command line; `hidden` options are left out of --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    methods = "methods: " + "; ".join(f"{name}: {m.description}" for name, m in METHODS.items())
    about = dict(epilog=methods, description=__doc__.split("\n\n")[0])
    parsed = runtime.parse_dataclasses((Config, *extra_dataclasses), argv, PRESETS, hidden, **about)
    return parsed if extra_dataclasses else parsed[0]


# 2. Data and prompts ----------------------------------------------------------------------------
# Each question goes into the model's chat template, with --system-prompt; loading.PromptStream
# serves them in a seeded order reshuffled each epoch, skipping those over --max-prompt-length.


# 3. Reward: math-verify accuracy + format (docs/math.md, "Reward") ------------------------------
class Grade(NamedTuple):
    accuracy: float
    gold_parsed: bool  # False: the gold could not be parsed, so the score is 0 by rule
    timed_out: bool  # grading was cut off (ours or math-verify's own limit), so the score is 0


GOLD_EXTRACTION = {
    "default": [LatexExtractionConfig(), ExprExtractionConfig()],
    "expr": [ExprExtractionConfig()],
    "latex": [LatexExtractionConfig()],
}
PREDICTION_NORMALISATION = NormalizationConfig(
    basic_latex=True,
    units=True,
    malformed_operators=False,
    nits=False,
    boxed="all",
    equations=False,
)
# No match without an anchor, \\boxed{} first (priority 0), the released normalisation
PREDICTION_EXTRACTION = [LatexExtractionConfig(False, 0, PREDICTION_NORMALISATION)]


def grade_accuracy(completion: str, gold: str, gold_format: str = "default") -> Grade:
    """1.0 if math-verify finds the completion's answer equal to the gold, checked gold first
    (verify is not symmetric). gold_format "default" is math-verify's default extraction, the
    training reward's; evaluate.py's benchmarks parse their gold as "expr" or "latex".
    math-verify's own cutoffs (5 s a parse or comparison) score 0 and count as cutoffs."""
    cutoffs = runtime.LogCounter.installed("math_verify", "Timeout during")
    before = cutoffs.count
    try:
        gold_parsed = parse(gold, GOLD_EXTRACTION[gold_format], extraction_mode="first_match")
        if not gold_parsed:
            return Grade(0.0, False, False)
        prediction = parse(completion, PREDICTION_EXTRACTION, extraction_mode="first_match")
        accuracy = float(verify(gold_parsed, prediction))
    except Exception:  # noqa: BLE001 - a failure inside the grader is a wrong answer
        accuracy = 0.0
    return Grade(accuracy, True, cutoffs.count > before)


def format_reward(completion: str) -> float:
    return float(completion.count("\n</think>\n") == 1)


class Grader(runtime.CachedTimeoutPool):
    """grade_accuracy in worker processes under a hard time limit; cached (grading is pure)."""

    def __init__(self, timeout_s: float = 10.0, workers: int = 1):
        super().__init__(grade_accuracy, workers, timeout_s, Grade(0.0, True, True))

    def grade(self, completion: str, gold: str, gold_format: str = "default") -> Grade:
        return self.map([(completion, gold, gold_format)])[0]


def reward_worker_count(cfg: Config) -> int:
    return cfg.reward_workers or min(8, os.cpu_count() or 1)


# 4. Sampling ------------------------------------------------------------------------------------
# The (N, T) tensors of a Rollout, one value per completion token
PER_TOKEN = ("completion_ids", "completion_mask", "old_logp", "entropy", "divergence", "ref_logp")
PER_TOKEN += ("active", "sampler_logp")


@dataclass
class Rollout:
    """One rollout batch: N = prompts x G completions, consecutive rows forming a group."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within the limit
    texts: list
    sampler_logp: torch.Tensor  # (N, T) log-probs of the sampled tokens by the sampler's kernels
    golds: list
    rewards: torch.Tensor = None
    advantages: torch.Tensor = None
    # From a no-grad pass after sampling, when the update needs them (num_iterations > 1, or the
    # method asks); otherwise old == current (detached) and the update's own entropy is used.
    old_logp: torch.Tensor = None  # (N, T)
    entropy: torch.Tensor = None  # (N, T)
    divergence: torch.Tensor = None  # (N, T) ict's score
    ref_logp: torch.Tensor = None  # (N, T) only when beta > 0
    active: torch.Tensor = None  # (N, T) tokens whose loss counts; all when None (diagnose.py)
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
        for name in PER_TOKEN:
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


@torch.no_grad()
def sample(model, tokenizer, batch: list[tuple[list[int], str]], cfg: Config, engine=None):
    """G completions per prompt with plain temperature sampling (top-p/top-k only where set), by
    sampling.py's loop or, given one, a vLLM engine that samples from `model`'s weights."""
    model.eval()
    limit = cfg.max_completion_length
    total = limit if cfg.length_limit == "total" else None
    distribution = (cfg.group_size, cfg.temperature, cfg.top_p, cfg.top_k, limit, total)
    prompts = [ids for ids, _ in batch]
    if engine is None:
        out = generate_completions(model, tokenizer, prompts, *distribution, cfg.rollout_chunk)
    else:
        out = engine.generate(model, tokenizer, prompts, *distribution)
    golds = [gold for _, gold in batch for _ in range(cfg.group_size)]
    if cfg.mask_truncated_completions:  # out of the loss, not out of the reward
        out = out._replace(completion_mask=out.completion_mask * (~out.truncated)[:, None])
    return Rollout(**out._asdict(), golds=golds)


# 5. Log-probs and entropy, chunked over positions -----------------------------------------------
def completion_logprobs(model, rollout: Rollout, cfg: Config):
    """(N, T) log-probs of the sampled completion tokens and the entropies there, 0 on padding;
    and the (N, T, hidden) states that predict them."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask_2d = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    position_ids = (attention_mask_2d.cumsum(1) - 1).clamp(min=0)  # as generate() numbers them
    mask = attention_mask(model, attention_mask_2d)  # None without left padding: causal alone
    inputs = dict(input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    prompt_width = rollout.prompt_ids.shape[1]
    hidden = hidden[:, prompt_width - 1 : -1]  # the state at position t predicts completion token t
    valid = rollout.completion_mask.bool()
    head, targets = model.get_output_embeddings().weight, rollout.completion_ids[valid]
    logp_valid, entropy_valid = chunked_logprobs(
        hidden[valid], head, targets, cfg.temperature, cfg.logit_chunk_elements
    )
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

    logp: torch.Tensor  # (G, T) current policy, with gradient
    old_logp: torch.Tensor  # (G, T) rollout policy, no gradient
    advantages: torch.Tensor  # (G,)
    mask: torch.Tensor  # (G, T) 0/1
    entropy: torch.Tensor  # (G, T) rollout policy's entropy, no gradient
    batch_entropy: torch.Tensor | None  # sorted entropies of the batch's valid tokens
    divergence: torch.Tensor | None  # (G, T) ict's JS score, for the methods that ask for it
    update_pass: int  # 0; lopti's second (high-probability) pass is 1


class TokenTerms(NamedTuple):
    """How a method changes the per-token loss w * pg + beta * k3."""

    pg_weight: torch.Tensor  # w (G, T); 0 drops a token's PG term, not its share of the denominator
    extra: torch.Tensor | None = None  # a per-token term added to the loss (kl_cov)
    clip: bool = True  # False: the PG term without PPO clipping (kl_cov)
    active: torch.Tensor | None = None  # tokens whose PG and KL terms count in this pass (lopti)


def grpo(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(group.mask)  # w = 1 (Shao et al. 2024)


def covariance_score(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CW-GRPO's per-token covariance score of one group (math.md "cw", steps 1-3)."""
    mu = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)  # 1. each response's mean log-prob
    centred_adv = adv - adv.mean()  # 2.
    return (logp - mu[:, None]) * centred_adv[:, None] * mask  # 3.


def cw_weights(logp, adv, mask, *, norm: str = "padded", detach: bool = False) -> torch.Tensor:
    """CW-GRPO's weights of one group (Wang et al. 2026, method; docs/math.md "cw", steps 1-8)."""
    score = covariance_score(logp, adv, mask)  # 1-3.
    n_valid = mask.sum().clamp(min=1)  # a group with no valid token gets weights 0, not NaN
    score_mean = score.sum() / n_valid
    variance = ((score - score_mean) ** 2 * mask).sum() / n_valid  # 4. ddof=0
    # sqrt'(0) is infinite: when every score is 0 (equal rewards) sigma = 1e-8 with zero gradient
    sigma = torch.where(variance > 0, variance, 1.0).sqrt() * (variance > 0) + 1e-8
    kernel = torch.exp(-(score**2) / (2 * sigma**2)) * mask  # 5.
    if norm == "padded":  # 6. released code
        total = mask.shape[0] * mask.sum(1).max()
    elif norm == "valid":  # 6. paper wording
        total = n_valid
    else:
        raise ValueError(f"cw_weights: norm must be 'padded' or 'valid', got {norm!r}")
    weights = kernel * total / kernel.sum().clamp(min=1e-30)
    return weights.detach() if detach else weights  # 7.


def cw(group: Group, cfg: Config) -> TokenTerms:
    weights = cw_weights(
        group.logp, group.advantages, group.mask, norm=cfg.cw_norm, detach=cfg.cw_detach
    )
    if cfg.cw_reading == "gradient-only":  # value exactly 1, gradient that of the weights
        weights = group.mask + (weights - weights.detach())
    return TokenTerms(weights)


def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s C = (logp - mean logp) (A - mean A), means over the valid tokens (math.md)."""
    logp, adv = logp.detach(), adv[:, None].expand_as(logp)
    n_valid = mask.sum().clamp(min=1)
    return (logp - (logp * mask).sum() / n_valid) * (adv - (adv * mask).sum() / n_valid) * mask


def ppo_clipped(ratio: torch.Tensor, adv: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Tokens whose PG term PPO's clip holds constant (no gradient)."""
    return ((ratio < 1 - cfg.eps_low) & (adv[:, None] < 0)) | (
        (ratio > 1 + cfg.eps_high) & (adv[:, None] > 0)
    )


def clip_cov(group: Group, cfg: Config) -> TokenTerms:
    """Clip-Cov (Cui et al. 2025): zero the loss of a few random tokens with lb < C < ub."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    ratio = torch.exp(group.logp.detach() - group.old_logp)
    candidates = (
        (group.mask > 0)
        & ~ppo_clipped(ratio, group.advantages, cfg)
        & (cov > cfg.clip_cov_lb)
        & (cov < cfg.clip_cov_ub)
    )
    n_select = max(int(cfg.clip_cov_ratio * group.mask.sum()), 1)
    positions = candidates.nonzero()
    chosen = positions[torch.randperm(len(positions), device=positions.device)[:n_select]]
    weight = group.mask.clone()
    weight[chosen[:, 0], chosen[:, 1]] = 0
    return TokenTerms(weight)


def kl_cov(group: Group, cfg: Config) -> TokenTerms:
    """KL-Cov (Cui et al. 2025): no clipping; |logp - old_logp| on the top-k tokens by C."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    n_valid = int(group.mask.sum())  # k: at least 1, at most the valid tokens (0 in an empty group)
    k = min(max(1, int(cfg.kl_cov_ratio * n_valid)), n_valid)
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
    return TokenTerms(
        group.mask,
        active=lopti_active(group.old_logp, group.mask, cfg.lopti_eta, group.update_pass),
    )


def ar_lopti(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(
        ar_weights(group.old_logp, group.mask, cfg.ar_lopti_alpha),
        active=lopti_active(group.old_logp, group.mask, cfg.ar_lopti_eta, group.update_pass),
    )


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
    spurious = (
        (group.advantages[:, None] > 0)
        & (group.old_logp.exp() < cfg.stapo_max_prob)
        & (group.entropy < threshold)
    )
    return TokenTerms(renormalised(group.mask * ~spurious, group.mask))


class Method(NamedTuple):
    token_terms: Callable[[Group, Config], TokenTerms]
    description: str
    update_passes: int = 1  # lopti: a low-probability pass, then a high one
    needs_old_policy_pass: bool = False  # old log-probs and entropies of the whole batch first
    needs_divergence: bool = False  # ict's JS score, computed in that pass


METHODS = {
    "grpo": Method(grpo, "GRPO baseline, every token weight 1"),
    "cw": Method(cw, "CW-GRPO, Gaussian-kernel covariance weights (Wang et al. 2026)"),
    "clip_cov": Method(clip_cov, "zero a few random high-covariance tokens (Cui et al. 2025)"),
    "kl_cov": Method(kl_cov, "|logp - old_logp| on top-covariance tokens (Cui et al. 2025)"),
    "ar": Method(ar, "advantage reweighting by alpha p + 1 - alpha (Yang et al. 2025)"),
    # (method, what it does, update passes, needs an old-policy pass, needs ict's divergence)
    "lopti": Method(lopti, "low-probability tokens first, then the rest (Yang 2025)", 2, True),
    "ar_lopti": Method(ar_lopti, "ar and lopti together (Yang et al. 2025)", 2, True),
    "ict": Method(ict, "PG only on the top-10% positions by JS divergence (2026)", 1, True, True),
    "entropy20": Method(entropy20, "PG only on the top-20% entropy tokens (Wang 2025)", 1, True),
    "stapo": Method(stapo, "silence rare, low-entropy positive tokens (2026)", 1, True),
}


# 8. The loss ------------------------------------------------------------------------------------
def sampler_correction(old_logp, sampler_logp, mask, cfg: Config):
    """Importance weights for the sampler-trainer mismatch, as TRL's (math.md "Sampler-trainer
    mismatch"): rho = exp(l - s) per token, or per sequence summed in log space, so that a long
    completion's sum neither overflows nor gives 0 x inf; truncate: min(rho, C); mask: rho, but 0
    outside [C_min, C]. none (the released recipe): 1."""
    if cfg.sampler_correction == "none":
        return 1.0
    log_rho = (old_logp - sampler_logp) * mask
    if cfg.sampler_correction.startswith("sequence"):
        log_rho = log_rho.sum(1, keepdim=True)
    rho = log_rho.clamp(max=math.log(cfg.sampler_correction_cap)).exp()
    if cfg.sampler_correction.endswith("truncate"):
        return rho
    inside = (log_rho <= math.log(cfg.sampler_correction_cap)) & (rho >= cfg.sampler_correction_min)
    return rho * inside


def token_loss(logp, old_logp, ref_logp, advantages, terms: TokenTerms, cfg: Config, rho=1.0):
    """Per-token loss rho w pg + beta k3 (+ a method's extra term); the KL is never weighted."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = -ratio * adv
    if terms.clip:  # PPO's clipped surrogate
        pg = torch.max(pg, -ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    loss = terms.pg_weight * pg * rho
    if terms.extra is not None:
        loss = loss + terms.extra
    if ref_logp is not None:
        loss = loss + cfg.beta * k3(logp, ref_logp)
    return loss if terms.active is None else loss * terms.active


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    return torch.exp(ref_logp - logp) - (ref_logp - logp) - 1


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, n_responses: int, n_tokens: int
) -> torch.Tensor:
    """The step's loss summed over micro-batches: divide by step-wide totals."""
    if mode == "seq-mean-token-mean":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_responses
    return (per_token * mask).sum() / n_tokens


def micro_batch_terms(
    logp, old_logp, entropy, rollout: Rollout, cfg: Config, update_pass: int
) -> TokenTerms:
    """The method's token terms, group by group, concatenated over the micro-batch."""
    token_terms, parts = METHODS[cfg.method].token_terms, []
    for g in (slice(i, i + cfg.group_size) for i in range(0, len(logp), cfg.group_size)):
        divergence = None if rollout.divergence is None else rollout.divergence[g]
        adv, mask = rollout.advantages[g], rollout.completion_mask[g]
        stats = (entropy[g], rollout.batch_entropy, divergence, update_pass)
        parts.append(token_terms(Group(logp[g], old_logp[g], adv, mask, *stats), cfg))

    def joined(values):  # the groups' tensors side by side; None and clip are the method's
        return torch.cat(values) if isinstance(values[0], torch.Tensor) else values[0]

    pg_weight, extra, clip, active = map(joined, zip(*parts))
    if rollout.active is not None:
        active = rollout.active if active is None else rollout.active * active
    return TokenTerms(pg_weight, extra, clip, active)


def micro_batch_loss(
    model, rollout: Rollout, cfg: Config, n_responses: int, n_tokens: int, update_pass: int = 0
):
    """The micro-batch's share of the step's loss, and what its metrics read."""
    logp, entropy, _ = completion_logprobs(model, rollout, cfg)
    old_logp = rollout.old_logp if rollout.old_logp is not None else logp.detach()
    entropy = rollout.entropy if rollout.entropy is not None else entropy
    terms = micro_batch_terms(logp, old_logp, entropy, rollout, cfg, update_pass)
    mask = rollout.completion_mask
    rho = sampler_correction(old_logp, rollout.sampler_logp, mask, cfg)
    per_token = token_loss(logp, old_logp, rollout.ref_logp, rollout.advantages, terms, cfg, rho)
    loss = aggregate(per_token, mask, cfg.loss_aggregation, n_responses, n_tokens)
    return loss, (logp.detach(), old_logp, entropy, terms)


def token_metrics(
    logp, old_logp, ref_logp, entropy, advantages, mask, sampler_logp, terms: TokenTerms, cfg
) -> dict:
    """Per valid token, what the step's metrics average (entropy, KL, clipping, the weights, and
    the sampler-trainer mismatch: the trainer's log-prob l against the sampler's s)."""
    valid = mask.bool()
    active = torch.ones_like(logp) if terms.active is None else terms.active
    kl = torch.zeros_like(logp) if ref_logp is None else k3(logp, ref_logp)
    clipped = ppo_clipped(torch.exp(logp - old_logp), advantages, cfg) & terms.clip
    weight = terms.pg_weight.detach()
    per_token = dict(entropy=entropy, kl=kl, clipped=clipped, w=weight)
    per_token |= dict(touched=touched_tokens(terms), pg_on=(weight != 0) & (active != 0))
    log_rho = old_logp - sampler_logp
    per_token |= dict(sampler_diff=log_rho.abs(), rho=log_rho.exp())
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
    """(N, T) log-probs and entropies of the batch's tokens under `model` (policy or reference),
    without gradient, and ict's divergence on request; 0 on padding."""
    names = ["logp", "entropy"] + ["divergence"] * divergence
    out = {name: torch.zeros_like(rollout.completion_mask) for name in names}
    for block, part in rollout.micro_batches(cfg):
        out["logp"][block], out["entropy"][block], hidden = completion_logprobs(model, part, cfg)
        if divergence:
            head, mask = model.get_output_embeddings().weight, part.completion_mask
            chunking = (cfg.temperature, cfg.logit_chunk_elements, cfg.group_size)
            out["divergence"][block] = ict_divergence(hidden, head, mask, *chunking)
    return out


def rollout_rewards(rollout: Rollout, grades: list[Grade], cfg: Config) -> dict:
    """Sets the batch's rewards and group advantages; returns the rollout's metrics."""
    accuracy = torch.tensor([g.accuracy for g in grades])
    formats = torch.tensor([format_reward(text) for text in rollout.texts])
    rollout.rewards = cfg.accuracy_weight * accuracy + cfg.format_weight * formats
    advantages = group_advantages(rollout.rewards, cfg.group_size)
    rollout.advantages = advantages.to(rollout.completion_ids.device)
    group_std = rollout.rewards.view(-1, cfg.group_size).std(1)
    return {
        "reward_mean": rollout.rewards.mean().item(),
        "reward_std": rollout.rewards.std().item(),
        "accuracy_mean": accuracy.mean().item(),
        "format_mean": formats.mean().item(),
        "frac_zero_std_groups": (group_std == 0).float().mean().item(),
        "completion_len_mean": rollout.completion_mask.sum(1).mean().item(),
        "truncated_frac": rollout.truncated.float().mean().item(),
        "gold_unparseable": sum(not g.gold_parsed for g in grades),
        "grading_timeouts": sum(g.timed_out for g in grades),
    }


def accumulate_gradients(model, rollout: Rollout, cfg: Config, autocast, update_pass: int = 0):
    """The step's loss gradient into .grad, micro-batch by micro-batch; the loss, the metrics."""
    model.train()
    n_responses = len(rollout.texts)
    n_tokens = int(rollout.completion_mask.sum().clamp(min=1))
    total_loss, metrics = 0.0, []
    for _, part in rollout.micro_batches(cfg):
        with autocast():
            loss, (logp, old_logp, entropy, terms) = micro_batch_loss(
                model, part, cfg, n_responses, n_tokens, update_pass
            )
        loss.backward()
        total_loss += loss.item()
        tokens = (part.ref_logp, entropy, part.advantages, part.completion_mask, part.sampler_logp)
        metrics.append(token_metrics(logp, old_logp, *tokens, terms, cfg))
    return total_loss, metrics


def update(
    model, optimizer, scheduler, rollout: Rollout, cfg: Config, autocast, update_pass: int = 0
) -> dict:
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
    return {
        "loss": loss,
        "grad_norm": grad_norm.item(),
        "lr": lr,
        **{f"{name}_mean": token[name].mean().item() for name in ("entropy", "kl", "w")},
        "clip_frac": token["clipped"].mean().item(),
        "touched_frac": token["touched"].mean().item(),
        "pg_active_frac": token["pg_on"].mean().item(),
        "w_min": w.min().item(),
        "w_std": w.std().item() if len(w) > 1 else 0.0,
        "w_max": w.max().item(),
        "w_frac_below_half": (w < 0.5).float().mean().item(),
        "w_frac_above_2": (w > 2).float().mean().item(),
        "sampler_logp_diff_mean": token["sampler_diff"].mean().item(),
        "sampler_logp_diff_max": token["sampler_diff"].max().item(),
        **{f"sampler_ratio_{f}": getattr(token["rho"], f)().item() for f in ("min", "mean", "max")},
    }


def collect_rollout(
    model, reference, tokenizer, prompts, grader: Grader, cfg: Config, engine=None
) -> tuple[Rollout, dict]:
    """Sample a batch, score it, compute its advantages (grading runs during the passes)."""
    method = METHODS[cfg.method]
    rollout = sample(model, tokenizer, prompts.next_batch(cfg.prompts_per_step), cfg, engine)
    grades = grader.submit(
        [(text, gold, "default") for text, gold in zip(rollout.texts, rollout.golds)]
    )
    if cfg.num_iterations > 1 or method.needs_old_policy_pass:
        stats = policy_token_stats(model, rollout, cfg, method.needs_divergence)
        rollout.old_logp, rollout.entropy = stats["logp"], stats["entropy"]
        rollout.divergence = stats.get("divergence")
        rollout.batch_entropy = rollout.entropy[rollout.completion_mask.bool()].sort().values
    if reference is not None:
        rollout.ref_logp = policy_token_stats(reference, rollout, cfg)["logp"]
    return rollout, rollout_rewards(rollout, grades(), cfg)


def method_passes():
    """(name shown, method, update pass, description) of every method's every update pass: the
    token page shows lopti's two passes as two views."""
    for name, method in METHODS.items():
        yield name, method, 0, method.description + " (pass 1)" * (method.update_passes > 1)
        for update_pass in range(1, method.update_passes):
            about = f"{name}'s pass {update_pass + 1}, on the tokens pass 1 left out"
            yield f"{name}, pass {update_pass + 1}", method, update_pass, about


@torch.no_grad()
def token_view(model, tokenizer, rollout: Rollout, cfg: Config, label: str, shown: int = 4):
    """What tokens.html shows of the batch's first group: a few completions, token by token, with
    each token's probability, covariance score (cw step 3), and the weight every method gives it.
    The RNG is restored (clip_cov draws), so training goes on unchanged."""
    rng, rows = runtime.rng_states(), rollout.select(0, cfg.group_size)
    try:
        stats, mask = policy_token_stats(model, rows, cfg, divergence=True), rows.completion_mask
        logp, entropy, divergence = stats["logp"], stats["entropy"], stats["divergence"]
        batch_entropy = entropy[mask.bool()].sort().values
        group = Group(logp, logp, rows.advantages, mask, entropy, batch_entropy, divergence, 0)
        terms = {
            name: method.token_terms(group._replace(update_pass=update_pass), cfg)
            for name, method, update_pass, _ in method_passes()
        }
    finally:
        runtime.set_rng_states(rng)
    weights = {k: t.pg_weight * (1 if t.active is None else t.active) for k, t in terms.items()}
    cov = covariance_score(logp, rows.advantages, mask)
    touched = {k: touched_tokens(t) for k, t in terms.items()}
    view = (rows.completion_ids[:shown], mask, logp, cov, rows.advantages, weights, touched)
    return plots.token_view(label, tokenizer, *view)


def draw(output_dir: Path, cfg: Config, views: list[dict]) -> None:
    """The run's curves (curves.png) and its tokens (tokens.html), redrawn from what it holds."""
    about = {name: text for name, _, _, text in method_passes()}
    note = "cw as released normalises its weights over padded positions, so their mean over real "
    note += "tokens is above 1 and most tokens show orange."
    title = f"{cfg.method} on {cfg.model}, seed {cfg.seed}"
    plots.draw_run(output_dir, title, cfg.method, about, views, note * (cfg.cw_norm == "padded"))


# Options a resumed run may change, none of them its recipe: more --steps extend it (the cosine
# schedule is then recomputed over the new total), the rest say where and how often it reports.
RESUME_MAY_CHANGE = ("steps", "save_every", "log_every", "reward_workers", "output_dir")


def build_tiny_model(cfg: Config) -> None:
    if cfg.model == PRESETS["tiny"]["model"] and not Path(cfg.model).exists():
        tiny.build(str(Path(cfg.model).parent))  # the demo's model, built on first use


def train(cfg: Config, on_rollout: Callable | None = None) -> Path:
    """GRPO with cfg.method's token terms. on_rollout(step, model, rollout, autocast), if given,
    sees each scored rollout batch before the update (diagnose.py uses it)."""
    start = time.perf_counter()
    device = runtime.resolve_device(cfg.device, cfg.preset if cfg.preset in GPU_PRESETS else "")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    print(
        f"cwgrpo: --method {cfg.method} on {cfg.model}, data {cfg.dataset}\n"
        f"  {cfg.prompts_per_step} prompts x G = {cfg.group_size} per step, {cfg.steps} steps, "
        f"beta {cfg.beta:g}, lr {cfg.learning_rate:g}, temperature {cfg.temperature:g}; "
        f"output {cfg.output_dir}",
        flush=True,
    )
    plots.pyplot()  # fail now, not at the first checkpoint, if matplotlib is missing
    output_dir = Path(cfg.output_dir)
    lock = runtime.RunLock(output_dir)  # a folder a live run holds: stop here
    with lock, runtime.StopRequest() as stop:
        build_tiny_model(cfg)
        loading.check_model_path(cfg.model)
        options = dataclasses.asdict(cfg)
        if device.type == "cuda":  # before anything loads: a run that cannot fit stops here
            memory_plan.check_fit(cfg.model, options, *torch.cuda.mem_get_info())
        resume_from = runtime.check_resumable(output_dir, cfg.resume)
        if resume_from and runtime.check_resume(resume_from, options, cfg.steps, RESUME_MAY_CHANGE):
            return output_dir
        columns = (cfg.question_column, cfg.gold_column)
        dataset = loading.load_dataset(cfg.dataset, cfg.dataset_split, *columns)
        with Grader(cfg.reward_timeout_s, reward_worker_count(cfg)) as grader:
            run(cfg, device, dataset, resume_from, grader, on_rollout, stop)
    evaluate = f"python evaluate.py --model {output_dir / 'final-model'}"
    evaluate += EVALUATE_OPTIONS.get(cfg.preset, "")
    print(plots.run_summary(output_dir, time.perf_counter() - start, cfg.temperature, evaluate))
    return output_dir


def run(cfg: Config, device, dataset, resume_from, grader: Grader, on_rollout, stop) -> None:
    """The loop of train(), inside the output folder's lock: sample, score, advantages, update,
    log, save."""
    config, output_dir = dataclasses.asdict(cfg), Path(cfg.output_dir)
    used = {"torch_threads": torch.get_num_threads(), "reward_workers_used": grader.size}
    runtime.prepare_output_dir(output_dir, resume_from, cfg.overwrite_output_dir, config | used)
    transformers.utils.logging.disable_progress_bar()
    print(f"loading {resume_from or cfg.model} ...", flush=True)
    tokenizer = loading.load_tokenizer(str(resume_from or cfg.model))
    prompts = loading.PromptStream(dataset, tokenizer, cfg)
    model = loading.load_model(str(resume_from or cfg.model), torch.float32, device)  # fp32 masters
    reference = loading.load_reference(cfg.model, device) if cfg.beta > 0 else None
    if cfg.gradient_checkpointing:
        loading.enable_checkpointing(model)
    engine = vllm_engine.for_run(config, device) if cfg.rollout == "vllm" else None
    method = METHODS[cfg.method]
    if cfg.method == "kl_cov" and cfg.num_iterations == 1:
        note = "note: kl_cov's |logp - old_logp| is 0 with one update per batch: it trains as GRPO"
        print(note + "; use --num-iterations 2")
    updates_per_rollout = cfg.num_iterations * method.update_passes
    total_updates = cfg.steps * updates_per_rollout
    fused = device.type == "cuda"  # one kernel, no foreach temporaries (params x 4 bytes)
    optimizer = torch.optim.AdamW(
        model.parameters(), cfg.learning_rate, weight_decay=cfg.weight_decay, fused=fused
    )
    warmup, min_lr = int(cfg.warmup_ratio * total_updates), cfg.min_lr_ratio
    scheduler = transformers.get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, warmup, total_updates, min_lr_rate=min_lr
    )
    start_step, views = 0, []
    if resume_from is not None:
        state = runtime.load_trainer_state(resume_from)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        runtime.set_rng_states(state["rng"])
        start_step, prompts.position = state["step"], state["data_position"]
        views = state.get("token_views", [])[:1]  # the first step's; older checkpoints have none
    else:
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    metrics_path = output_dir / "metrics.jsonl"
    runtime.keep_records_until(metrics_path, start_step)

    autocast = runtime.bf16_autocast(device)
    progress = runtime.Progress(start_step, cfg.steps, cfg.method, cfg.log_every)
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        with autocast():
            rollout, rollout_metrics = collect_rollout(
                model, reference, tokenizer, prompts, grader, cfg, engine
            )
            if step == 0 or step + 1 == cfg.steps:
                with runtime.never_fatal("draw the token page"):
                    views.append(token_view(model, tokenizer, rollout, cfg, f"step {step + 1}"))
        rollout_s = time.perf_counter() - t0
        if on_rollout is not None:
            on_rollout(step + 1, model, rollout, autocast)
        for update_index in range(updates_per_rollout):
            t1 = time.perf_counter()
            update_pass = update_index % method.update_passes
            record = {
                "step": step * updates_per_rollout + update_index + 1,
                "rollout_step": step + 1,
                "update_pass": update_pass,
                **rollout_metrics,
                **update(model, optimizer, scheduler, rollout, cfg, autocast, update_pass),
                "prompts_skipped": prompts.skipped,
                "rollout_s": rollout_s,
                "update_s": time.perf_counter() - t1,
                "time": time.time(),
            }
            seconds = rollout_s + record["update_s"]
            record["tokens_per_s"] = rollout.completion_mask.sum().item() / seconds
            runtime.append_record(metrics_path, record)
        progress.step(**{k: f"{record[k + '_mean']:.3f}" for k in ("reward", "entropy")})
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or stop.requested:
            trainer_state = dict(optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict())
            trainer_state |= dict(rng=runtime.rng_states(), step=step + 1, token_views=views)
            trainer_state["data_position"] = prompts.position
            files = {"run_config.json": json.dumps(config, indent=2)}
            name = f"checkpoint-{step + 1}"
            keep = cfg.save_total_limit
            runtime.save_checkpoint(output_dir, name, model, tokenizer, trainer_state, files, keep)
            draw(output_dir, cfg, views)
        if stop.requested:
            raise SystemExit(
                f"stopped after step {step + 1} (saved checkpoint-{step + 1}); "
                f"resume with: {runtime.resume_command()}"
            )
    progress.close()
    runtime.save_checkpoint(output_dir, "final-model", model, tokenizer)


def main(argv=None) -> None:
    cfg = parse_config(argv)
    if cfg.plan:
        build_tiny_model(cfg)
        return print(memory_plan.report(cfg.model, dataclasses.asdict(cfg)))
    try:
        train(cfg)
    except KeyboardInterrupt:
        raise SystemExit(
            f"interrupted: the step under way is lost; resume from the last "
            f"checkpoint with: {runtime.resume_command()}"
        ) from None


if __name__ == "__main__":
    main()
