"""cwgrpo.py: CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
Reweighting", Wang et al., ACL 2026) and the token-weighting methods it is compared with, in one
file that reads in the order a training step runs; docs/math.md has every formula.

    Config, then one step's sections:  1 sampling  2 reward  3 log-probs  4 group advantages
    5 the methods' token weights  6 the loss  7 the optimizer;  then the training loop, which runs
    them in that order

    python cwgrpo.py --method cw --preset tiny   # CW-GRPO on a tiny model, in a minute on a CPU
    python cwgrpo.py --method cw                 # the paper's 1.5B recipe (one CUDA GPU)

How and where a run runs (its folder and checkpoints, the device and precision, memory and speed,
the vLLM sampler, LoRA) is cwgrpo_utils/'s business: RunConfig holds its options, Run its work.
"""

import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, Literal

from cwgrpo_utils import OPEN_RS_SYSTEM_PROMPT, cli
from cwgrpo_utils.cli import arg
from cwgrpo_utils.presets import PRESETS
from cwgrpo_utils.run_config import RunConfig, check_output_dir

# Config -------------------------------------------------------------------------------------------
# --method's choices, in the order section 5 defines them, and the Config fields each reads
METHOD_OPTIONS = {
    "grpo": (),
    "cw": ("cw_reading", "cw_norm", "cw_detach", "cw_gradient_only"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "kl_cov_coef"),
    "ar": ("ar_alpha",),
    "lopti": ("lopti_eta",),
    "ar_lopti": ("ar_lopti_alpha", "ar_lopti_eta"),
    "ict": ("ict_keep_frac",),
    "entropy20": ("entropy_top_frac",),
    "stapo": ("stapo_max_prob", "stapo_entropy_percentile"),
}
# What each --cw-reading means (docs/fidelity.md). gradient-only is a control: weights of value
# exactly 1 that carry the released weights' gradient
CW_READINGS = {
    "released": dict(cw_norm="padded", cw_detach=False, cw_gradient_only=False),
    "paper": dict(cw_norm="valid", cw_detach=True, cw_gradient_only=False),
    "gradient-only": dict(cw_norm="padded", cw_detach=False, cw_gradient_only=True),
}
CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean")


@dataclass
class Config:
    """The algorithm's options. The defaults are the released 1.5B recipe (docs/math.md, "Recipe");
    PRESETS (cwgrpo_utils/presets.py) override some. --help shows the defaults of the --preset
    given (paper-1.5b when none is)."""

    _argument_group_name = "the algorithm (what a run computes)"

    preset: Literal[tuple(PRESETS)] = arg("paper-1.5b", "a recipe whose values are the defaults")
    method: Literal[tuple(METHOD_OPTIONS)] = arg("cw", "token-weighting method (section 5)")
    # Model and data
    model: str = arg("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "hub id or local folder")
    dataset: str = arg("knoveleng/open-rs", "hub id or local .json/.jsonl/.parquet/.csv file")
    dataset_split: str = arg("train", "split of a hub dataset")
    question_column: str = arg("problem", "column of the question")
    gold_column: str = arg("solution", "column of the reference solution (parsed by math-verify)")
    system_prompt: str = arg(OPEN_RS_SYSTEM_PROMPT, "system message (Open-RS's); empty: none")
    max_prompt_length: int = arg(512, "longer prompts are skipped (and counted)", "> 0")
    # Sampling (section 1)
    group_size: int = arg(12, "G, completions sampled per prompt", ">= 2")
    prompts_per_step: int = arg(12, "prompts per rollout batch", "> 0")
    max_completion_length: int = arg(4096, "generation limit; see --length-limit", "> 0")
    length_limit: Literal["total", "new"] = arg("total", "of prompt + completion, or new tokens")
    temperature: float = arg(0.7, "sampling temperature; log-probs use it too", "> 0")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 is off (paper)", "in (0, 1]")
    top_k: int = arg(0, "top-k sampling; 0 is off (paper)", ">= 0")
    # Reward (section 2)
    accuracy_weight: float = arg(1.0, "weight of the accuracy reward", ">= 0")
    format_weight: float = arg(1.0, "weight of the format reward", ">= 0")
    reward_timeout_s: float = arg(10.0, "hard limit on grading one completion", "> 0")
    # The loss (section 6)
    beta: float = arg(0.04, "k3 KL coefficient; 0 loads no reference model", ">= 0")
    eps_low: float = arg(0.2, "PPO clip range below 1", ">= 0")
    eps_high: float = arg(0.2, "PPO clip range above 1", ">= 0")
    loss_aggregation: Literal[AGGREGATIONS] = arg(AGGREGATIONS[0], "GRPO's (paper), or DAPO's")
    num_iterations: int = arg(1, "policy updates per rollout batch (paper: 1)", "> 0")
    mask_truncated_completions: bool = arg(False, "drop completions cut at the limit from the loss")
    sampler_correction: Literal[CORRECTIONS] = arg("none", "for the sampler-trainer mismatch")
    sampler_correction_cap: float = arg(3.0, "C: truncate the ratio at it, or mask above it", "> 0")
    sampler_correction_min: float = arg(0.0, "C_min: *_mask also masks ratios below it", ">= 0")
    # Each method's options (section 5; METHOD_OPTIONS)
    cw_reading: Literal[tuple(CW_READINGS)] = arg("released", "cw: a reading (CW_READINGS)")
    cw_norm: Literal["padded", "valid"] = arg("padded", "cw: mean 1 over padded or real tokens")
    cw_detach: bool = arg(False, "cw: no gradient through the weights (released code: it flows)")
    cw_gradient_only: bool = arg(False, "cw: weights of value 1 with the weights' gradient")
    clip_cov_ratio: float = arg(2e-4, "clip_cov: share of tokens zeroed", "in (0, 1]")
    clip_cov_lb: float = arg(1.0, "clip_cov: candidates have covariance above this")
    clip_cov_ub: float = arg(5.0, "clip_cov: candidates have covariance below this")
    kl_cov_ratio: float = arg(2e-3, "kl_cov: share of tokens penalised", "in (0, 1]")
    kl_cov_coef: float = arg(1.0, "kl_cov: coefficient of |logp - old_logp|", ">= 0")
    ar_alpha: float = arg(0.2, "ar: alpha of w = alpha p + 1 - alpha", "in [0, 1]")
    lopti_eta: float = arg(0.4, "lopti: probability threshold of the first pass", "in (0, 1]")
    ar_lopti_alpha: float = arg(0.3, "ar_lopti: ar's alpha", "in [0, 1]")
    ar_lopti_eta: float = arg(0.5, "ar_lopti: lopti's eta", "in (0, 1]")
    ict_keep_frac: float = arg(0.1, "ict: share of positions kept", "in (0, 1]")
    entropy_top_frac: float = arg(0.2, "entropy20: share of tokens kept", "in (0, 1]")
    stapo_max_prob: float = arg(0.01, "stapo: silence tokens with p below this ...", ">= 0")
    stapo_entropy_percentile: float = arg(5.0, "... and entropy below this pct", "in [0, 100]")
    # The optimizer and its schedule (section 7)
    learning_rate: float = arg(1e-6, "peak AdamW learning rate", "> 0")
    min_lr_ratio: float = arg(0.1, "the cosine schedule ends at this x peak", "in [0, 1]")
    warmup_ratio: float = arg(0.1, "share of steps with linear warmup", "in [0, 1]")
    weight_decay: float = arg(0.0, "AdamW weight decay", ">= 0")
    max_grad_norm: float = arg(1.0, "gradient clipping norm", "> 0")
    steps: int = arg(300, "rollout batches to train on", "> 0")
    seed: int = arg(2025, "seed of data order and sampling", ">= 0")

    def __post_init__(self):
        """Every value is checked here, at parse time, before any slow work."""
        cli.check_ranges(self)
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        cli.check(lb < ub, f"--clip-cov-lb ({lb}) must be below --clip-cov-ub ({ub})")
        cli.check(
            self.length_limit == "new" or self.max_prompt_length < self.max_completion_length,
            f"--max-prompt-length ({self.max_prompt_length}) leaves no room for a completion "
            f"within --max-completion-length ({self.max_completion_length}) under --length-limit "
            "total",
        )
        if self.cw_reading != "released":  # the one place a reading is resolved
            for name, value in CW_READINGS[self.cw_reading].items():
                setattr(self, name, value)


def parse_config(argv=None, *extra, hidden: tuple = (), prog: str | None = None) -> list:
    """[the algorithm's Config, the run's RunConfig, and one of each dataclass a tool adds] from
    the command line, the --preset's values as defaults; `hidden` options are left out of a tool's
    --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    about = __doc__.split("\n\n")[0]
    parsed, given = cli.parse_dataclasses(
        [Config, RunConfig, *extra],
        argv,
        presets=PRESETS,
        hidden=hidden,
        description=about,
        prog=prog,
    )
    cfg, run_cfg = parsed[:2]
    cli.check_implied(given, "cw_reading", CW_READINGS)  # a reading names three choices
    cli.note_unused(given, "method", cfg.method, options_of=METHOD_OPTIONS)
    groups, per_micro_batch = cfg.prompts_per_step, run_cfg.groups_per_micro_batch
    cli.check(
        groups % (per_micro_batch or groups) == 0,
        f"--prompts-per-step ({groups}) must be a multiple of --groups-per-micro-batch "
        f"({per_micro_batch})",
    )
    if cfg.method == "kl_cov" and cfg.num_iterations == 1:
        note = "note: kl_cov's |logp - old_logp| is 0 with one update per batch: it trains as GRPO"
        cli.warn_once(note, note + "; use --num-iterations 2")
    run_cfg.output_dir = run_cfg.output_dir or f"runs/{cfg.method}-{cfg.preset}-seed{cfg.seed}"
    return parsed


if __name__ == "__main__":  # --help and bad options answer here, before the heavy imports below
    CONFIG, RUN_CONFIG = parse_config()
    if not RUN_CONFIG.plan:  # a folder that holds a run, refused at once
        check_output_dir(RUN_CONFIG.output_dir, RUN_CONFIG.resume, RUN_CONFIG.overwrite_output_dir)

# What a run needs once its command line is known (pyproject.toml lets these follow the Config)
import functools
import math
import os
import random
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from cwgrpo_utils import fast_logprobs, loading, lora, metrics
from cwgrpo_utils.batch import Rows
from cwgrpo_utils.grading_pool import CachedTimeoutPool, LogCounter
from cwgrpo_utils.lm_head import ict_divergence
from cwgrpo_utils.prompts import PromptStream
from cwgrpo_utils.run import Run
from cwgrpo_utils.vllm_engine import Engine


# 1. Sampling --------------------------------------------------------------------------------------
@dataclass
class Rollout(Rows):
    """One rollout batch: N = prompts x G completions, consecutive rows forming a group; select and
    micro_batches (cwgrpo_utils/batch.py) give a part of its rows, itself a Rollout."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within the limit
    texts: list
    sampler_logp: torch.Tensor  # (N, T) log-probs of the sampled tokens by the sampler's kernels
    golds: list = None
    rewards: torch.Tensor = None  # (N,)
    accuracy: torch.Tensor = None  # (N,) 1 where math-verify finds the answer right
    advantages: torch.Tensor = None  # (N,)
    # From a no-grad pass after sampling, when the update needs them (num_iterations > 1, or the
    # method asks); otherwise old == current (detached) and the update's own entropy is used.
    old_logp: torch.Tensor = None  # (N, T)
    entropy: torch.Tensor = None  # (N, T)
    divergence: torch.Tensor = None  # (N, T) ict's score
    ref_logp: torch.Tensor = None  # (N, T) only when beta > 0
    batch_entropy: torch.Tensor = None  # the sorted entropies of all the batch's valid tokens
    # A hook for tools/diagnose.py alone: only these tokens' loss counts (None: every valid token)
    diagnose_tokens: torch.Tensor = None  # (N, T)


class Sampling(NamedTuple):
    """How completions are drawn: n of each prompt from softmax(logits / temperature), cut to the
    top_k tokens and the top_p nucleus where set (0 and 1: off), each at most max_new_tokens long
    or, with max_total, at most max_total tokens with its prompt (as vLLM's max model length)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    max_total: int | None = None


@torch.no_grad()
def sample(model, tokenizer, batch: list[tuple[list[int], str]], cfg, run_cfg, engine=None):
    """G completions per prompt, by the token loop below or, given one, a vLLM engine that
    samples from `model`'s weights; --rollout-chunk prompts at a time and each group's prompt
    prefilled once (--share-prompts), as the run asks."""
    model.eval()
    limit = cfg.max_completion_length
    total = limit if cfg.length_limit == "total" else None  # prompt + completion within the limit
    how = Sampling(
        cfg.group_size,
        cfg.temperature,
        cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=limit,
        max_total=total,
    )
    prompts = [ids for ids, _ in batch]
    rollout = generate_completions(
        model,
        tokenizer,
        prompts,
        how=how,
        chunk=run_cfg.rollout_chunk,
        engine=engine,
        share=run_cfg.share_prompts,
    )
    rollout.golds = [gold for _, gold in batch for _ in range(cfg.group_size)]
    if cfg.mask_truncated_completions:  # out of the loss, not out of the reward
        rollout.completion_mask = rollout.completion_mask * (~rollout.truncated)[:, None]
    return rollout


@torch.no_grad()
def generate_completions(
    model, tokenizer, prompts, how: Sampling, chunk=0, engine=None, share=False
):
    """how.n completions of each prompt as one Rollout. With chunk, that many prompts are sampled
    at a time, each chunk as if alone, which bounds the KV cache. With an engine, vLLM samples
    (model None: an engine with weights of its own, evaluate.py's); else this section's loop, with
    share each prompt prefilled once for its n rows."""
    if chunk and engine is None and chunk < len(prompts):  # a KV cache of `chunk` prompts at once
        parts = [
            generate_completions(model, tokenizer, prompts[i : i + chunk], how, share=share)
            for i in range(0, len(prompts), chunk)
        ]
        return Rollout.joined(parts, pad=tokenizer.pad_token_id)  # as if sampled in one batch
    eos = (model or engine).generation_config.eos_token_id  # the tokens a completion ends at
    eos = [eos] if isinstance(eos, int) else list(eos or []) or [tokenizer.eos_token_id]
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    prompt_ids = prompt_ids.repeat_interleave(how.n, 0)  # (N, P): n rows per prompt, left-padded
    prompt_mask = prompt_mask.to(device).repeat_interleave(how.n, 0)
    limits = [how.max_total - len(p) if how.max_total else how.max_new_tokens for p in prompts]
    row_limits = torch.tensor(limits, device=device).repeat_interleave(how.n)  # (N,)
    if engine is not None:
        ids, logp = engine.generate(model, prompts, how, limits=limits, eos=eos, pad=pad)
    else:  # this section's token loop
        steps = max(limits)
        ids, logp = sample_tokens(
            model, prompt_ids, prompt_mask, how=how, steps=steps, eos=eos, pad=pad, share=share
        )
    ids = ids.to(device)  # (N, T), right-padded
    logp = logp.to(device)
    # each row's mask holds its tokens up to and including the first EOS within its limit
    positions = torch.arange(ids.shape[1], device=device)
    is_eos = torch.isin(ids, torch.tensor(eos, device=device)) & (positions < row_limits[:, None])
    truncated = ~is_eos.any(1)
    last = torch.where(truncated, row_limits - 1, is_eos.int().argmax(1))
    mask = (positions[None, :] <= last[:, None]).float()  # (N, T)
    sequences = [row[:k] for row, k in zip(ids.tolist(), mask.sum(1).long().tolist())]
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask,
        truncated=truncated,
        texts=tokenizer.batch_decode(sequences, skip_special_tokens=True),
        sampler_logp=logp * mask,
    )


@torch.no_grad()
def sample_tokens(model, prompt_ids, prompt_mask, how, steps, eos, pad, cache=None, share=False):
    """Autoregressive sampling with a KV cache for `steps` tokens at most, rows stopping at an EOS
    id. Only the temperature and the cuts shape the distribution, so the tokens come from the one
    whose log-probs the loss uses: generate() would add what the model's generation_config.json
    ships (a repetition penalty, say). The (B, T) tokens and their log-probs, 0 after an EOS.
    With share, each group of how.n rows (one prompt) is prefilled once. `cache` is for the tests
    alone, which read what it held."""
    attention = prompt_mask.clone()  # (B, P), then one column more each step
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    # = DynamicCache(), keeping keys and values in bf16 under CUDA autocast (loading.py)
    cache = loading.KVCache.for_model(model) if cache is None else cache
    cache_argument = loading.cache_argument(model, cache)  # {"cache": cache}, by version
    input_ids = prompt_ids
    tokens = []
    logps = []
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)  # (B,)
    eos = torch.tensor(eos, device=prompt_ids.device)
    for step in range(steps):
        prefill = step == 0
        fed = slice(None, None, how.n) if prefill and share else slice(None)  # = every row
        logits = model(
            input_ids=input_ids[fed],
            attention_mask=loading.attention_mask(model, attention[fed]) if prefill else attention,
            position_ids=positions[fed],
            use_cache=True,
            logits_to_keep=1,
            **cache_argument,
        ).logits[:, -1]  # (B, vocab): the next token's
        if prefill and share:  # each prompt's cache and first logits, repeated for its n rows
            cache.batch_repeat_interleave(how.n)
            logits = logits.repeat_interleave(how.n, 0)
        probs = (logits.float() / how.temperature).softmax(-1)
        if how.top_k:
            probs = probs * (probs >= probs.topk(how.top_k, -1).values[:, -1:])
        if how.top_p < 1:  # keep the most probable tokens until their mass reaches top_p
            sorted_probs, order = probs.sort(-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= how.top_p * probs.sum(-1, True)
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
        cdf = probs.cumsum(-1)  # inverse-CDF draw: much cheaper than torch.multinomial on CPU
        token = torch.searchsorted(cdf, torch.rand_like(cdf[:, :1]) * cdf[:, -1:]).squeeze(1)
        token = token.clamp(max=probs.shape[-1] - 1).masked_fill(finished, pad)  # (B,)
        drawn = probs.gather(1, token[:, None]).squeeze(1) / cdf[:, -1]
        tokens.append(token)
        logps.append(drawn.log().masked_fill(finished, 0))
        finished |= torch.isin(token, eos)
        if finished.all():
            break
        input_ids = token[:, None]
        positions = positions[:, -1:] + 1
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
    return torch.stack(tokens, 1), torch.stack(logps, 1)


# 2. Reward: math-verify accuracy + format (docs/math.md, "Reward") --------------------------------
class Grade(NamedTuple):
    accuracy: float
    gold_parsed: bool  # False: the gold could not be parsed, so the score is 0 by rule
    timed_out: bool  # grading was cut off (ours or math-verify's own limit), so the score is 0


GOLD_EXTRACTION = {
    "default": [LatexExtractionConfig(), ExprExtractionConfig()],
    "expr": [ExprExtractionConfig()],
    "latex": [LatexExtractionConfig()],
}
RELEASED_NORMALISATION = NormalizationConfig(basic_latex=True, units=True, boxed="all")  # rest off
# The released reward's: no match without an anchor (False), \\boxed{} first (priority 0)
PREDICTION_EXTRACTION = [LatexExtractionConfig(False, 0, RELEASED_NORMALISATION)]


def grade_accuracy(completion: str, gold: str, gold_format: str = "default") -> Grade:
    """1.0 if math-verify finds the completion's answer equal to the gold, checked gold first
    (verify is not symmetric). gold_format "default" is math-verify's default extraction, the
    training reward's; evaluate.py's benchmarks parse their gold as "expr" or "latex".
    math-verify's own cutoffs (5 s a parse or comparison) score 0 and count as cutoffs."""
    cutoffs = LogCounter.installed("math_verify", "Timeout during")
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


class Grader(CachedTimeoutPool):
    """grade_accuracy (or another grade of the same signature: evaluate.py's paper protocol's) in
    worker processes under a hard time limit (cwgrpo_utils/grading_pool.py), cached since grading
    is pure; workers 0: one per core, at most 8."""

    def __init__(self, timeout_s: float = 10.0, workers: int = 1, grade: Callable = grade_accuracy):
        workers = workers or min(8, os.cpu_count() or 1)
        super().__init__(grade, workers, timeout_s, on_timeout=Grade(0.0, True, True))

    def grade(self, completion: str, gold: str, gold_format: str = "default") -> Grade:
        return self.map([(completion, gold, gold_format)])[0]


# 3. Log-probs and entropy -------------------------------------------------------------------------
def completion_states(model, rows: Rollout) -> torch.Tensor:
    """(rows, T, hidden): the decoder's last states at the positions that predict each completion
    token, from one forward over each row's prompt + completion."""
    input_ids = torch.cat([rows.prompt_ids, rows.completion_ids], 1)  # (rows, P + T)
    attention_mask_2d = torch.cat([rows.prompt_mask, rows.completion_mask.long()], 1)
    position_ids = (attention_mask_2d.cumsum(1) - 1).clamp(min=0)  # as in sampling
    hidden = model.get_decoder()(
        input_ids=input_ids,
        # = attention_mask_2d, as a mask no fully padded query row can turn into NaN (loading.py)
        attention_mask=loading.attention_mask(model, attention_mask_2d),
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state  # (rows, P + T, hidden)
    prompt_width = rows.prompt_ids.shape[1]
    return hidden[:, prompt_width - 1 : -1]  # (rows, T, hidden): position t predicts token t


def completion_logprobs(model, rows: Rollout, temperature: float):
    """(rows, T) log-probs of the sampled completion tokens under softmax(logits / temperature),
    the distribution they were sampled from, and the entropies there, 0 on padding; and the
    (rows, T, hidden) states that predict them."""
    hidden = completion_states(model, rows)  # (rows, T, hidden)
    logits = model.get_output_embeddings()(hidden).float() / temperature  # (rows, T, vocab)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, rows.completion_ids[..., None]).squeeze(-1)  # (rows, T)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (rows, T)
    return logp * rows.completion_mask, entropy * rows.completion_mask, hidden


def logprobs_of_run(run_cfg: RunConfig, group_size: int) -> Callable:
    """completion_logprobs above or, where the run turns them on (the default), its fast drop-in:
    each group's prompt encoded once (--share-prompts), the LM head a chunk of positions at a
    time (--logit-chunk-elements), the same values to rounding in a fraction of the memory
    (cwgrpo_utils/fast_logprobs.py; tested equal)."""
    if not run_cfg.share_prompts and not run_cfg.logit_chunk_elements:
        return completion_logprobs
    shared = functools.partial(fast_logprobs.shared_states, group_size=group_size)
    return functools.partial(
        fast_logprobs.completion_logprobs,
        states=shared if run_cfg.share_prompts else completion_states,
        chunk_elements=run_cfg.logit_chunk_elements,
    )


def micro_batch_rows(cfg: Config, run_cfg: RunConfig) -> int:
    """The rows a forward (and backward) pass holds: --groups-per-micro-batch whole groups."""
    return (run_cfg.groups_per_micro_batch or cfg.prompts_per_step) * cfg.group_size


@torch.no_grad()
def policy_token_stats(model, rollout: Rollout, cfg, run_cfg, divergence: bool = False) -> dict:
    """(N, T) log-probs and entropies of the batch's tokens under `model` (policy or reference),
    without gradient, a micro-batch at a time, and ict's divergence on request; 0 on padding."""
    logprobs = logprobs_of_run(run_cfg, cfg.group_size)
    names = ["logp", "entropy", "divergence"] if divergence else ["logp", "entropy"]
    out = {name: torch.zeros_like(rollout.completion_mask) for name in names}
    for block, rows in rollout.micro_batches(micro_batch_rows(cfg, run_cfg)):
        logp, entropy, hidden = logprobs(model, rows, cfg.temperature)
        out["logp"][block] = logp
        out["entropy"][block] = entropy
        if divergence:  # = JS(p[i,t] || mean of the group's p[., t]), streamed (lm_head.py)
            out["divergence"][block] = ict_divergence(
                hidden,
                model.get_output_embeddings().weight,
                rows.completion_mask,
                temperature=cfg.temperature,
                chunk_elements=run_cfg.logit_chunk_elements,
                group_size=cfg.group_size,
            )
    return out


def old_and_reference_logprobs(model, reference, rollout: Rollout, cfg, run_cfg) -> None:
    """Into the rollout, without gradient: the rollout policy's log-probs and entropies where the
    update needs them (more than one update per batch, or a method that reads them), and the
    frozen reference's log-probs for the KL (beta > 0)."""
    method = METHODS[cfg.method]
    if cfg.num_iterations > 1 or method.needs_stats:
        stats = policy_token_stats(model, rollout, cfg, run_cfg, divergence=method.needs_divergence)
        rollout.old_logp = stats["logp"]
        rollout.entropy = stats["entropy"]
        rollout.divergence = stats.get("divergence")
        rollout.batch_entropy = rollout.entropy[rollout.completion_mask.bool()].sort().values
    if cfg.beta > 0:  # the KL reference: a frozen copy, or under LoRA the base (adapter off)
        with lora.reference_of(model, reference) as frozen:
            rollout.ref_logp = policy_token_stats(frozen, rollout, cfg, run_cfg)["logp"]


# 4. Group advantages ------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + 1e-4) within each group, Bessel std (GRPO; math.md)."""
    groups = rewards.view(-1, group_size)  # (prompts, G)
    advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    return advantages.view(-1)  # (N,)


def rollout_rewards(rollout: Rollout, grades: list[Grade], cfg: Config) -> dict:
    """Sets the batch's rewards and group advantages; returns the rollout's figures."""
    accuracy = torch.tensor([g.accuracy for g in grades])  # (N,)
    formats = torch.tensor([format_reward(text) for text in rollout.texts])  # (N,)
    rollout.rewards = cfg.accuracy_weight * accuracy + cfg.format_weight * formats
    rollout.accuracy = accuracy
    advantages = group_advantages(rollout.rewards, cfg.group_size)
    rollout.advantages = advantages.to(rollout.completion_ids.device)
    return metrics.rollout_metrics(rollout, formats, grades, group_size=cfg.group_size)


# 5. The methods' token weights: how each one changes the per-token loss (math.md, "Methods") ------
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

    @classmethod
    def split(cls, rows: Rollout, logp, old_logp, entropy, update_pass: int, size: int) -> list:
        """The groups of `size` rows of a micro-batch, each with its rows of the (rows, T) ones."""
        groups = [slice(start, start + size) for start in range(0, len(logp), size)]
        return [
            cls(
                logp=logp[g],
                old_logp=old_logp[g],
                advantages=rows.advantages[g],
                mask=rows.completion_mask[g],
                entropy=entropy[g],
                batch_entropy=rows.batch_entropy,
                divergence=None if rows.divergence is None else rows.divergence[g],
                update_pass=update_pass,
            )
            for g in groups
        ]


class TokenTerms(NamedTuple):
    """How a method changes the per-token loss w * pg + beta * k3."""

    pg_weight: torch.Tensor  # w (G, T); 0 drops a token's PG term, not its share of the denominator
    extra: torch.Tensor | None = None  # (G, T) a per-token term added to the loss (kl_cov)
    active: torch.Tensor | None = None  # (G, T) tokens whose PG and KL terms count in this pass

    @classmethod
    def joined(cls, groups: list["TokenTerms"]) -> "TokenTerms":
        """Groups' terms side by side, as their micro-batch's (rows, T) ones."""
        pg_weight = torch.cat([terms.pg_weight for terms in groups])
        extra = None if groups[0].extra is None else torch.cat([terms.extra for terms in groups])
        active = None if groups[0].active is None else torch.cat([t.active for t in groups])
        return cls(pg_weight, extra, active)


@dataclass
class Method:
    """A token-weighting method of this section: its token terms, and what the loop does for it."""

    token_terms: Callable  # (Group, Config) -> TokenTerms
    description: str
    clip: bool = True  # PPO's clipped surrogate (kl_cov: off)
    update_passes: int = 1  # lopti: a pass on the low-probability tokens, then one on the rest
    needs_stats: bool = False  # the batch's old log-probs and entropies, before the update
    needs_divergence: bool = False  # and ict's divergence, in the same pass

    @property
    def options(self) -> tuple[str, ...]:
        """The Config fields it reads."""
        return METHOD_OPTIONS[self.token_terms.__name__]


METHODS: dict[str, Method] = {}  # --method's choices, each registered where it is defined


def register_method(description: str, **needs) -> Callable:
    """Registers the token-terms function it decorates under its own name, with what it needs of
    the loop (Method's fields), as verl's register_policy_loss does."""

    def register(token_terms: Callable) -> Callable:
        METHODS[token_terms.__name__] = Method(token_terms, description, **needs)
        return token_terms

    return register


@register_method("GRPO baseline, every token weight 1")
def grpo(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(group.mask)  # w = 1 (Shao et al. 2024)


def covariance_score(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CW-GRPO's per-token covariance score of one group (math.md "cw", steps 1-3)."""
    mu = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)  # 1. each response's mean log-prob (G,)
    centred_adv = adv - adv.mean()  # 2. (G,)
    return (logp - mu[:, None]) * centred_adv[:, None] * mask  # 3. (G, T)


def cw_weights(logp, adv, mask, *, norm: str = "padded", detach: bool = False) -> torch.Tensor:
    """CW-GRPO's weights of one group (Wang et al. 2026, method; docs/math.md "cw", steps 1-8):
    a Gaussian kernel of each token's covariance score c, exp(-c^2 / (2 sigma^2)), normalised to
    mean 1 over the group's padded positions (the released code) or over its real tokens.

    G = 2 responses, the first of two tokens (its third position is padding), the second of three;
    the first is right (advantage above the group's mean), the second wrong:

    >>> logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]])  # (G, T)
    >>> mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    >>> adv = torch.tensor([1.0, -1.0])
    >>> covariance_score(logp, adv, mask)  # (logp - its response's mean) x centred advantage
    tensor([[ 0.5000, -0.5000,  0.0000],
            [-0.5000,  0.5000, -0.0000]])

    The scores have mean 0 and variance 0.2 over the five real tokens, so the kernel is
    exp(-0.25 / 0.4) where |c| = 0.5 and 1 where c = 0: the extreme tokens are turned down.

    >>> cw_weights(logp, adv, mask, norm="valid")  # mean 1 over the 5 real tokens
    tensor([[0.8520, 0.8520, 0.0000],
            [0.8520, 0.8520, 1.5918]])
    >>> cw_weights(logp, adv, mask)  # mean 1 over the 2 x 3 padded positions: 1.2 over real ones
    tensor([[1.0225, 1.0225, 0.0000],
            [1.0225, 1.0225, 1.9102]])
    """
    score = covariance_score(logp, adv, mask)  # 1-3. (G, T)
    n_valid = mask.sum().clamp(min=1)  # a group with no valid token gets weights 0, not NaN
    score_mean = score.sum() / n_valid
    variance = ((score - score_mean) ** 2 * mask).sum() / n_valid  # 4. ddof=0
    # sqrt'(0) is infinite: where every score is 0 (equal rewards), sigma is 1e-8 with no gradient
    if variance > 0:
        sigma = variance.sqrt() + 1e-8
    else:
        sigma = torch.full_like(variance, 1e-8)
    kernel = torch.exp(-(score**2) / (2 * sigma**2)) * mask  # 5. (G, T)
    if norm == "padded":  # 6. released code
        total = mask.shape[0] * mask.sum(1).max()
    elif norm == "valid":  # 6. paper wording
        total = n_valid
    else:
        raise ValueError(f"cw_weights: norm must be 'padded' or 'valid', got {norm!r}")
    weights = kernel * total / kernel.sum().clamp(min=1e-30)
    return weights.detach() if detach else weights  # 7.


@register_method("CW-GRPO, Gaussian-kernel covariance weights (Wang et al. 2026)")
def cw(group: Group, cfg: Config) -> TokenTerms:
    weights = cw_weights(
        group.logp, group.advantages, group.mask, norm=cfg.cw_norm, detach=cfg.cw_detach
    )
    if cfg.cw_gradient_only:  # value exactly 1, gradient that of the weights
        weights = group.mask + (weights - weights.detach())
    return TokenTerms(weights)


def token_covariance(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s C = (logp - mean logp) (A - mean A), means over the valid tokens (math.md)."""
    logp = logp.detach()
    adv = adv[:, None].expand_as(logp)
    n_valid = mask.sum().clamp(min=1)
    return (logp - (logp * mask).sum() / n_valid) * (adv - (adv * mask).sum() / n_valid) * mask


def ppo_clipped(ratio: torch.Tensor, adv: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Tokens whose PG term PPO's clip holds constant (no gradient)."""
    low = (ratio < 1 - cfg.eps_low) & (adv[:, None] < 0)
    high = (ratio > 1 + cfg.eps_high) & (adv[:, None] > 0)
    return low | high


@register_method("zero a few random high-covariance tokens (Cui et al. 2025)")
def clip_cov(group: Group, cfg: Config) -> TokenTerms:
    """Clip-Cov (Cui et al. 2025): zero the loss of a few random tokens with lb < C < ub."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    ratio = torch.exp(group.logp.detach() - group.old_logp)
    candidates = (group.mask > 0) & ~ppo_clipped(ratio, group.advantages, cfg)
    candidates &= (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    n_select = max(int(cfg.clip_cov_ratio * group.mask.sum()), 1)
    positions = candidates.nonzero()
    chosen = positions[torch.randperm(len(positions), device=positions.device)[:n_select]]
    weight = group.mask.clone()
    weight[chosen[:, 0], chosen[:, 1]] = 0
    return TokenTerms(weight)


@register_method("|logp - old_logp| on top-covariance tokens (Cui 2025)", clip=False)
def kl_cov(group: Group, cfg: Config) -> TokenTerms:
    """KL-Cov (Cui et al. 2025): no clipping; |logp - old_logp| on the top-k tokens by C."""
    cov = token_covariance(group.logp, group.advantages, group.mask)
    n_valid = int(group.mask.sum())  # k: at least 1, at most the valid tokens (0 in an empty group)
    k = min(max(1, int(cfg.kl_cov_ratio * n_valid)), n_valid)
    top = torch.zeros_like(group.mask, dtype=torch.bool).view(-1)
    top[cov.masked_fill(group.mask == 0, -torch.inf).view(-1).topk(k).indices] = True
    extra = cfg.kl_cov_coef * (group.logp - group.old_logp).abs() * top.view_as(group.mask)
    return TokenTerms(group.mask, extra=extra)


@register_method("advantage reweighting by alpha p + 1 - alpha (Yang et al. 2025)")
def ar(group: Group, cfg: Config, alpha: float | None = None) -> TokenTerms:
    """Advantage reweighting (Yang et al. 2025, Eq. 4): w = alpha p_old + 1 - alpha, constant."""
    alpha = cfg.ar_alpha if alpha is None else alpha
    return TokenTerms((alpha * group.old_logp.exp() + 1 - alpha) * group.mask)


@register_method(
    "low-probability tokens first, then the rest (Yang 2025)", update_passes=2, needs_stats=True
)
def lopti(group: Group, cfg: Config, eta: float | None = None, w=None) -> TokenTerms:
    """Lopti (Yang et al. 2025): pass 0 updates the tokens with p_old < eta, pass 1 the rest."""
    low = group.old_logp.exp() < (cfg.lopti_eta if eta is None else eta)
    active = group.mask * (low if group.update_pass == 0 else ~low)
    return TokenTerms(group.mask if w is None else w, active=active)


@register_method("ar and lopti together (Yang et al. 2025)", update_passes=2, needs_stats=True)
def ar_lopti(group: Group, cfg: Config) -> TokenTerms:
    weights = ar(group, cfg, alpha=cfg.ar_lopti_alpha).pg_weight
    return lopti(group, cfg, eta=cfg.ar_lopti_eta, w=weights)


def renormalised(keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weights that make a response's token mean of the PG term run over its kept tokens only."""
    return keep * mask.sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)


@register_method(
    "PG only on the top-10% positions by JS divergence (2026)",
    needs_stats=True,
    needs_divergence=True,
)
def ict(group: Group, cfg: Config) -> TokenTerms:
    """ICT (Beyond Entropy, 2026): keep each response's top positions by JS divergence."""
    keep_counts = (cfg.ict_keep_frac * group.mask.sum(1)).ceil().clamp(min=1)  # (G,)
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
    high = min(int(position) + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


@register_method("PG only on the top-20% entropy tokens (Wang 2025)", needs_stats=True)
def entropy20(group: Group, cfg: Config) -> TokenTerms:
    """80/20 (Wang et al. 2025): PG only on tokens at or above the batch's 80th entropy pct."""
    threshold = sorted_quantile(group.batch_entropy, 1 - cfg.entropy_top_frac)
    return TokenTerms(group.mask * (group.entropy >= threshold))


@register_method("silence rare, low-entropy positive tokens (STAPO, 2026)", needs_stats=True)
def stapo(group: Group, cfg: Config) -> TokenTerms:
    """STAPO (2026): silence positive-advantage tokens that are rare and low-entropy."""
    threshold = sorted_quantile(group.batch_entropy, cfg.stapo_entropy_percentile / 100)
    spurious = (group.advantages[:, None] > 0) & (group.old_logp.exp() < cfg.stapo_max_prob)
    spurious &= group.entropy < threshold
    return TokenTerms(renormalised(group.mask * ~spurious, group.mask))


@torch.no_grad()
def every_methods_weights(model, rows: Rollout, cfg, run_cfg) -> dict:
    """What every method's every update pass makes of the same scored rows, side by side (the
    run's tokens.html shows its first group's): (method, pass) -> (w x active, tokens touched),
    each token's log-prob and its covariance score (cw step 3); each (rows, T)."""
    stats = policy_token_stats(model, rows, cfg, run_cfg, divergence=True)
    logp = stats["logp"]
    entropy = stats["entropy"]
    batch_entropy = entropy[rows.completion_mask.bool()].sort().values
    rows = dataclasses.replace(rows, divergence=stats["divergence"], batch_entropy=batch_entropy)
    out = {"logp": logp, "score": covariance_score(logp, rows.advantages, rows.completion_mask)}
    for name, method in METHODS.items():
        for update_pass in range(method.update_passes):
            one = dataclasses.replace(cfg, method=name)
            groups = Group.split(rows, logp, logp, entropy, update_pass, size=cfg.group_size)
            terms = TokenTerms.joined([method.token_terms(group, one) for group in groups])
            active = 1 if terms.active is None else terms.active
            out[name, update_pass] = (terms.pg_weight * active, metrics.touched_tokens(terms))
    return out


# 6. The loss --------------------------------------------------------------------------------------
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    return torch.exp(ref_logp - logp) - (ref_logp - logp) - 1


def sampler_correction(old_logp, sampler_logp, mask, cfg: Config) -> torch.Tensor | None:
    """The sampler correction c (math.md, "Sampler-trainer mismatch"), as TRL's: exp(l - s) per
    token, or per sequence summed in log space (a long sum neither overflows nor gives 0 x inf);
    truncate: min(c, C); mask: c, but 0 outside [C_min, C]. None: none, the released recipe."""
    if cfg.sampler_correction == "none":
        return None
    log_c = (old_logp - sampler_logp) * mask  # (N, T)
    if cfg.sampler_correction.startswith("sequence"):
        log_c = log_c.sum(1, keepdim=True)  # (N, 1)
    correction = log_c.clamp(max=math.log(cfg.sampler_correction_cap)).exp()
    if cfg.sampler_correction.endswith("truncate"):
        return correction
    inside = log_c <= math.log(cfg.sampler_correction_cap)
    return correction * (inside & (correction >= cfg.sampler_correction_min))


class LossParts(NamedTuple):
    """A micro-batch's loss per token, and what of it the metrics read; each (rows, T)."""

    per_token: torch.Tensor  # w pg c + extra + beta k3, times active
    terms: TokenTerms  # the method's
    old_logp: torch.Tensor
    entropy: torch.Tensor  # the rollout policy's where measured, else the update's own
    kl: torch.Tensor | None  # k3, without gradient; None without a reference
    clipped: torch.Tensor  # tokens whose PG term PPO's clip holds constant


def policy_loss(
    logp, entropy, rows: Rollout, cfg, update_pass: int, n_responses: int, n_tokens: int
):
    """The loss of a micro-batch of whole groups, in docs/math.md's symbols ("Loss"): per token
    w * max(-rho A, -clip(rho, 1 - eps_low, 1 + eps_high) A) * c + beta * k3, w the method's
    weight (section 5), rho = pi / pi_old, A the response's advantage, c the sampler correction;
    averaged over each response's tokens, then over the step's n_responses (GRPO's), or over the
    step's n_tokens (DAPO's token-mean). Divided by the step's totals, the micro-batches' losses
    and gradients add up to the step's. Returns the loss and its LossParts."""
    mask = rows.completion_mask  # (rows, T)
    # one update per batch (the paper): the rollout policy is the current one, detached
    old_logp = logp.detach() if rows.old_logp is None else rows.old_logp  # (rows, T)
    entropy = entropy if rows.entropy is None else rows.entropy  # (rows, T)
    # the method's token terms (section 5), group by group: w, and its extra term and pass
    groups = Group.split(rows, logp, old_logp, entropy, update_pass, size=cfg.group_size)
    terms = TokenTerms.joined([METHODS[cfg.method].token_terms(group, cfg) for group in groups])
    if rows.diagnose_tokens is not None:  # tools/diagnose.py's tokens
        active = rows.diagnose_tokens
        terms = terms._replace(active=active if terms.active is None else active * terms.active)
    correction = sampler_correction(old_logp, rows.sampler_logp, mask, cfg)  # (rows, T or 1)
    ratio = torch.exp(logp - old_logp)  # rho: exactly 1 with one update per batch
    adv = rows.advantages[:, None]  # (rows, 1): a response's advantage, on each of its tokens
    pg = -ratio * adv  # -rho A
    clip = METHODS[cfg.method].clip
    if clip:  # PPO's clipped surrogate
        pg = torch.max(pg, -ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    per_token = terms.pg_weight * pg if correction is None else terms.pg_weight * pg * correction
    if terms.extra is not None:  # kl_cov's penalty
        per_token = per_token + terms.extra
    kl = None if rows.ref_logp is None else k3(logp, rows.ref_logp)  # (rows, T)
    if kl is not None:
        per_token = per_token + cfg.beta * kl
    if terms.active is not None:  # lopti's pass: only its tokens count
        per_token = per_token * terms.active
    # a response's token mean, then the mean over the step's responses (GRPO's)
    if cfg.loss_aggregation == "seq-mean-token-mean":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_responses
    else:  # every token of the step alike (DAPO)
        loss = (per_token * mask).sum() / n_tokens
    clipped = ppo_clipped(ratio.detach(), rows.advantages, cfg) & clip
    kl = None if kl is None else kl.detach()
    return loss, LossParts(per_token, terms, old_logp, entropy, kl=kl, clipped=clipped)


# 7. The optimizer ---------------------------------------------------------------------------------
def optimizer_and_schedule(trained: list, cfg: Config, updates: int):
    """AdamW over what is trained (all the weights, or LoRA's adapter), fused: one kernel, no
    foreach temporaries (on a CPU 6x faster, 0.11 s against 0.68 s a SmolLM2 step:
    docs/performance.md). Its learning rate warms up linearly, then decays along a cosine to
    min_lr_ratio x its peak, over the run's steps x `updates` optimizer steps a rollout batch."""
    optimizer = torch.optim.AdamW(
        trained, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True
    )
    scheduler = transformers.get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(cfg.warmup_ratio * cfg.steps * updates),
        num_training_steps=cfg.steps * updates,
        min_lr_rate=cfg.min_lr_ratio,
    )
    return optimizer, scheduler


def optimizer_step(trained: list, optimizer, scheduler, scaler, max_grad_norm: float):
    """The step's gradient applied: its norm clipped to max_grad_norm (under fp16, unscaled
    first), then AdamW and the schedule's next learning rate; unless the norm is not finite (fp16's
    overflow, or a NaN): then no weight, AdamW moment or learning rate changes, and under fp16 the
    loss scale halves. Returns the norm, the learning rate the step used, and whether it ran."""
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        scaler.step(optimizer)  # optimizer.step(), but in fp16 the scaler's check
        scheduler.step()
    scaler.update()  # fp16: the loss scale halves after an overflow
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr, finite


# The training loop --------------------------------------------------------------------------------
def training_loop(cfg, run_cfg, model, reference, tokenizer, prompts, grader, engine, run: Run):
    """The paper's algorithm, step after step, each step's phases in the order they run, numbered
    as the sections that define them; the run keeps the records, checkpoints and pictures."""
    method = METHODS[cfg.method]
    updates = cfg.num_iterations * method.update_passes  # optimizer steps per rollout batch
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optimizer_and_schedule(trained, cfg, updates)
    scaler = run.precision.scaler()  # fp16's loss scaler; in any other precision, one doing nothing
    # the step to start at: 0, or a checkpoint's, with the state of each of these as it saved them
    start = run.begin(
        optimizer, scheduler, scaler=scaler, prompts=prompts, updates_per_step=updates
    )
    if start == 0:  # TRY NOT TO MODIFY: seeding (a resumed run continues its checkpoint's RNG)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    autocast = run.precision.autocast  # bf16 or fp16 compute over fp32 weights; fp32: none
    logprobs = logprobs_of_run(run_cfg, cfg.group_size)  # section 3's, or its fast drop-in
    for step in range(start + 1, cfg.steps + 1):  # rollout steps, numbered from 1
        with autocast():
            # 1. Sample G completions of each of the step's prompts (section 1)
            batch = prompts.next_batch(cfg.prompts_per_step)
            with run.phase("sampling", step):
                rollout = sample(model, tokenizer, batch, cfg, run_cfg, engine=engine)
            # 2. Grade them (section 2): the workers grade while the passes below run
            grades = grader.submit(
                [(t, gold, "default") for t, gold in zip(rollout.texts, rollout.golds)]
            )
            # 3. The old and the reference log-probs, where the update needs them (section 3)
            with run.phase("the log-prob passes", step):
                old_and_reference_logprobs(model, reference, rollout, cfg, run_cfg)
            # 4. Rewards, and each response's advantage within its group (section 4)
            rollout_figures = rollout_rewards(rollout, grades.result(), cfg)
        run.rollout_scored(step, model=model, rollout=rollout)  # the token page; a tool's hook
        n_responses = len(rollout.texts)
        n_tokens = int(rollout.completion_mask.sum().clamp(min=1))
        for update_index in range(updates):
            update_pass = update_index % method.update_passes  # lopti: low-probability tokens first
            # 5-6. Each micro-batch's log-probs (with gradient), the method's token weights in its
            # loss, and its backward pass: the micro-batches' gradients add up to the step's
            model.train()
            loss_sum, token_values = 0.0, []
            with run.phase("the update", step):
                for _, rows in rollout.micro_batches(micro_batch_rows(cfg, run_cfg)):
                    with autocast():
                        logp, entropy, _ = logprobs(model, rows, cfg.temperature)  # (rows, T)
                        loss, parts = policy_loss(
                            logp,
                            entropy,
                            rows,
                            cfg,
                            update_pass=update_pass,
                            n_responses=n_responses,
                            n_tokens=n_tokens,
                        )
                    scaler.scale(loss).backward()  # fp16: scaled up, so no gradient underflows
                    loss_sum += loss.item()
                    token_values.append(metrics.token_values(rows, parts))
            # 7. Clip the gradient's norm, then AdamW and the schedule's next learning rate;
            # unless the gradient is not finite: then nothing changes, and the step is skipped
            with run.phase("the optimizer step", step):
                grad_norm, lr, finite = optimizer_step(
                    trained, optimizer, scheduler, scaler=scaler, max_grad_norm=cfg.max_grad_norm
                )
            update_figures = metrics.update_metrics(
                token_values, loss_sum, grad_norm=grad_norm.item(), lr=lr
            )
            run.log_update(
                step, update_index, update_pass, rollout_figures | update_figures, finite
            )
        run.end_step(step, model, tokenizer)  # progress; a checkpoint every --save-every steps
    run.finish(model, tokenizer)  # the final model, LoRA's merged


def train(cfg: Config, run_cfg: RunConfig, on_rollout: Callable | None = None) -> Path | None:
    """Everything a run needs, then the training loop (--plan: its memory and disk instead).
    on_rollout(step, model, rollout, autocast), a hook for tools/diagnose.py, sees each scored
    rollout batch before the update."""
    if run_cfg.plan:  # before anything loads
        print(Run.plan(cfg, run_cfg))
        return None
    # the folder locked, Ctrl-C a stop after the step, the device, precision and threads set, the
    # model and its fit on the GPU checked: one line and an exit for whatever is wrong
    with Run(cfg, run_cfg) as run:
        cfg = run.cfg  # a CPU preset's model built here on first use
        if run.finished():
            return run.path
        dataset = loading.load_dataset(
            cfg.dataset, cfg.dataset_split, cfg.question_column, gold_column=cfg.gold_column
        )
        with Grader(cfg.reward_timeout_s, run_cfg.reward_workers) as grader:
            run.start(grader)  # run_config.json; on resume, the records after its checkpoint go
            tokenizer = loading.load_tokenizer(run.weights)
            prompts = PromptStream(dataset, tokenizer, cfg)
            model = loading.load_policy(cfg, run_cfg, run.resume_from, run.precision)
            frozen_copy = cfg.beta > 0 and not run_cfg.lora_rank  # LoRA's reference: the base
            reference = loading.load_reference(cfg.model, run.precision) if frozen_copy else None
            engine = (
                Engine.for_run(cfg, run_cfg, run.precision) if run_cfg.rollout == "vllm" else None
            )
            weigh = functools.partial(every_methods_weights, cfg=cfg, run_cfg=run_cfg)
            run.show_tokens(tokenizer, methods=METHODS, weigh=weigh, hook=on_rollout)
            training_loop(
                cfg,
                run_cfg,
                model,
                reference,
                tokenizer=tokenizer,
                prompts=prompts,
                grader=grader,
                engine=engine,
                run=run,
            )
    print(run.summary())
    return run.path


if __name__ == "__main__":
    train(CONFIG, RUN_CONFIG)
