"""cwgrpo.py: CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
Reweighting", Wang et al., ACL 2026) and the token-weighting methods it is compared with, in one
file that reads in the order a training step runs; docs/math.md has every formula.

    Config, then one step's sections:  1 sampling  2 reward  3 log-probs  4 group advantages
    5 the methods' token weights  6 the loss  7 the optimizer;  then the training loop, which runs
    them in that order, and main

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
from cwgrpo_utils.run_config import RunConfig, check_output_dir, micro_batch_rows, parse_run

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
    the command line, the --preset's values as defaults; `hidden` options stay out of --help."""
    parsed = parse_run(
        Config,
        sys.argv[1:] if argv is None else list(argv),
        *extra,
        method_options=METHOD_OPTIONS,
        readings=CW_READINGS,
        hidden=hidden,
        description=__doc__.split("\n\n")[0],
        prog=prog,
    )
    if parsed[0].method == "kl_cov" and parsed[0].num_iterations == 1:
        note = "note: kl_cov's |logp - old_logp| is 0 with one update per batch: it trains as GRPO"
        cli.warn_once(note, note + "; use --num-iterations 2")
    return parsed


if __name__ == "__main__":  # --help and bad options answer here, before the heavy imports below
    CONFIG, RUN_CONFIG = parse_config()
    if not RUN_CONFIG.plan:  # a folder that holds a run, refused at once
        check_output_dir(RUN_CONFIG.output_dir, RUN_CONFIG.resume, RUN_CONFIG.overwrite_output_dir)

# What a run needs once its command line is known (pyproject.toml lets these follow the Config)
import math
import random
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from cwgrpo_utils import loading, lora, metrics, shared_prompt
from cwgrpo_utils.batch import Rows, per_row, whole_batch
from cwgrpo_utils.grading_pool import Grader, LogCounter
from cwgrpo_utils.lm_head import ict_divergence, valid_logprobs
from cwgrpo_utils.run import Run


# 1. Sampling --------------------------------------------------------------------------------------
@dataclass
class Samples(Rows):
    """What sampling gives: N = prompts x G completions, consecutive rows a group (select and
    micro_batches, cwgrpo_utils/batch.py, give a part of its rows, itself Samples)."""

    prompt_ids: torch.Tensor = per_row("left", token_ids=True)  # (N, P) left-padded
    prompt_mask: torch.Tensor = per_row("left", mask=True)  # (N, P)
    completion_ids: torch.Tensor = per_row("right", token_ids=True)  # (N, T) right-padded
    completion_mask: torch.Tensor = per_row("right", mask=True)  # (N, T) 1 to the first EOS
    truncated: torch.Tensor = per_row()  # (N,) bool, no EOS within the limit
    texts: list = per_row()  # (N,) the completions, decoded
    sampler_logp: torch.Tensor = per_row("right")  # (N, T) the sampler's log-probs of its tokens


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
def sample(model, tokenizer, prompts: list[list[int]], cfg, chunk=0, share=False, engine=None):
    """G completions of each prompt (token ids, through the chat template: prompts.py), by the
    token loop below or, given one, a vLLM engine that samples from `model`'s weights; `chunk`
    prompts at a time (0: all) and with `share` each group's prompt prefilled once."""
    model.eval()
    limit = cfg.max_completion_length
    how = Sampling(
        cfg.group_size,
        cfg.temperature,
        cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=limit,
        max_total=limit if cfg.length_limit == "total" else None,  # prompt + completion
    )
    samples = generate_completions(
        model, tokenizer, prompts, how=how, chunk=chunk, engine=engine, share=share
    )
    if cfg.mask_truncated_completions:  # out of the loss, not out of the reward
        samples.completion_mask = samples.completion_mask * (~samples.truncated)[:, None]
    return samples


@torch.no_grad()
def generate_completions(
    model, tokenizer, prompts, how: Sampling, chunk=0, engine=None, share=False
) -> Samples:
    """how.n completions of each prompt. With chunk, that many prompts are sampled at a time, each
    chunk as if alone, which bounds the KV cache. With an engine, vLLM samples (model None: an
    engine with weights of its own, evaluate.py's); else this section's loop, with share each
    prompt prefilled once for its n rows."""
    if chunk and engine is None and chunk < len(prompts):  # a KV cache of `chunk` prompts at once
        parts = [
            generate_completions(model, tokenizer, prompts[i : i + chunk], how, share=share)
            for i in range(0, len(prompts), chunk)
        ]
        return Samples.joined(parts, pad=tokenizer.pad_token_id)  # as if sampled in one batch
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
    return Samples(
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
    gold_parsed: bool  # False: the gold could not be parsed, so the accuracy is 0 by rule
    timed_out: bool  # grading was cut off (ours or math-verify's own limit), so the accuracy is 0


TIMED_OUT = Grade(0.0, gold_parsed=True, timed_out=True)  # a grading the pool's time limit cut off
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


class Rewards(NamedTuple):
    """A batch's rewards, each (N,)."""

    total: torch.Tensor  # accuracy_weight x accuracy + format_weight x format
    accuracy: torch.Tensor  # 1 where math-verify finds the answer right
    format: torch.Tensor  # 1 where the completion closes its thinking once


def rewards_of(texts: list[str], grades: list[Grade], cfg: Config) -> Rewards:
    accuracy = torch.tensor([g.accuracy for g in grades])  # (N,)
    formats = torch.tensor([format_reward(text) for text in texts])  # (N,)
    total = cfg.accuracy_weight * accuracy + cfg.format_weight * formats
    return Rewards(total, accuracy, formats)


# 3. Log-probs and entropy -------------------------------------------------------------------------
class Passes(NamedTuple):
    """How this section's passes compute (the run's options), not what: the same values to
    rounding (tests/test_shared_prompts.py)."""

    micro_batch_rows: int  # rows a forward (and backward) holds: whole groups
    share_prompts: bool  # each group's prompt encoded once
    logit_chunk_elements: int  # logits the LM head holds at once; 0: every position's

    @classmethod
    def of(cls, cfg: Config, run_cfg: RunConfig) -> "Passes":
        per_group = run_cfg.groups_per_micro_batch
        rows = micro_batch_rows(per_group, cfg.prompts_per_step, cfg.group_size)
        return cls(rows, run_cfg.share_prompts, run_cfg.logit_chunk_elements)


def completion_states(model, rows: Samples, group_size: int, share_prompts: bool) -> torch.Tensor:
    """(rows, T, hidden): the decoder's last states at the positions that predict each completion
    token, from one forward over each row's prompt + completion; with share_prompts, each group's
    prompt once (rows in groups of group_size, each group one prompt)."""
    decoder = model.get_decoder()
    prompt_width = rows.prompt_ids.shape[1]
    if share_prompts:  # Prefix Grouper (arXiv 2506.05433): the same states to rounding
        # each group's prompt encoded once: its last state, each layer's keys and values
        prompts = shared_prompt.prompt_pass(decoder, rows, group_size)
        # the prompt's last state predicts each of its rows' first token; their completions
        # attend to its keys and values as they would to their own prompt's
        return shared_prompt.completion_pass(decoder, rows, prompts, group_size)
    input_ids = torch.cat([rows.prompt_ids, rows.completion_ids], 1)  # (rows, P + T)
    attention_mask_2d = torch.cat([rows.prompt_mask, rows.completion_mask.long()], 1)
    position_ids = (attention_mask_2d.cumsum(1) - 1).clamp(min=0)  # as in sampling
    hidden = decoder(
        input_ids=input_ids,
        # = attention_mask_2d, as a mask no fully padded query row can turn into NaN (loading.py)
        attention_mask=loading.attention_mask(model, attention_mask_2d),
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state  # (rows, P + T, hidden)
    return hidden[:, prompt_width - 1 : -1]  # (rows, T, hidden): position t predicts token t


def completion_logprobs(model, rows: Samples, cfg: Config, passes: Passes):
    """(rows, T) log-probs of the sampled completion tokens under softmax(logits / temperature),
    the distribution they were sampled from, and the entropies there, 0 on padding; and the
    (rows, T, hidden) states that predict them."""
    hidden = completion_states(model, rows, cfg.group_size, share_prompts=passes.share_prompts)
    head = model.get_output_embeddings()
    if passes.logit_chunk_elements:  # memory: the LM head a chunk of valid positions at a time,
        # recomputed in backward, never vocab x T logits at once (lm_head.py); the same values
        logp, entropy = valid_logprobs(
            hidden,
            head.weight,
            rows.completion_ids,
            rows.completion_mask,
            temperature=cfg.temperature,
            chunk_elements=passes.logit_chunk_elements,
        )
        return logp, entropy, hidden
    logits = head(hidden).float() / cfg.temperature  # (rows, T, vocab)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, rows.completion_ids[..., None]).squeeze(-1)  # (rows, T)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (rows, T)
    return logp * rows.completion_mask, entropy * rows.completion_mask, hidden


class TokenStats(NamedTuple):
    """A batch's tokens under a model, without gradient, 0 on padding; each (N, T)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    divergence: torch.Tensor | None  # ict's u, JS(p || the group's mean p), where asked for


@torch.no_grad()
def token_stats(model, samples: Samples, cfg, passes: Passes, divergence=False) -> TokenStats:
    """The log-probs and entropies of the batch's tokens under `model` (the rollout policy, or the
    reference), a micro-batch at a time, and on request ict's divergence in the same pass."""
    logp, entropy = (
        torch.zeros_like(samples.completion_mask),
        torch.zeros_like(samples.completion_mask),
    )
    divergences = torch.zeros_like(logp) if divergence else None
    for block, rows in samples.micro_batches(passes.micro_batch_rows):
        logp[block], entropy[block], hidden = completion_logprobs(model, rows, cfg, passes)
        if divergence:  # streamed over positions (lm_head.py)
            divergences[block] = ict_divergence(
                hidden,
                model.get_output_embeddings().weight,
                rows.completion_mask,
                temperature=cfg.temperature,
                chunk_elements=passes.logit_chunk_elements,
                group_size=cfg.group_size,
            )
    return TokenStats(logp, entropy, divergences)


def reference_logprobs(model, reference, samples: Samples, cfg, passes: Passes) -> torch.Tensor:
    """(N, T) the batch's log-probs under the KL's reference: a frozen copy of the starting model,
    or under LoRA the base itself (the adapter off)."""
    with lora.reference_of(model, reference) as frozen:
        return token_stats(frozen, samples, cfg, passes).logp


# 4. Group advantages ------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + 1e-4) within each group, Bessel std (GRPO; math.md)."""
    per_group = rewards.view(-1, group_size)  # (prompts, G)
    advantages = (per_group - per_group.mean(1, keepdim=True)) / (
        per_group.std(1, keepdim=True) + 1e-4
    )
    return advantages.view(-1)  # (N,)


@dataclass
class Batch(Samples):
    """The samples as the update reads them, every phase's values beside them; None where a phase
    did not run (the training loop says when it does)."""

    rewards: torch.Tensor = per_row()  # (N,) section 2's total
    accuracy: torch.Tensor = per_row()  # (N,)
    advantages: torch.Tensor = per_row()  # (N,) section 4's
    old_logp: torch.Tensor | None = per_row("right")  # (N, T) section 3's, the rollout policy's
    old_entropy: torch.Tensor | None = per_row("right")  # (N, T)
    divergence: torch.Tensor | None = per_row("right")  # (N, T) ict's
    ref_logp: torch.Tensor | None = per_row("right")  # (N, T) the reference's, where beta > 0
    entropies: torch.Tensor | None = whole_batch()  # the batch's valid tokens' entropies, sorted

    @classmethod
    def of(cls, samples: Samples, rewards: Rewards, advantages, old: TokenStats | None, ref_logp):
        """The step's values side by side: old the rollout policy's stats, or None."""
        return cls(
            **vars(samples),
            rewards=rewards.total,
            accuracy=rewards.accuracy,
            advantages=advantages.to(samples.completion_ids.device),
            old_logp=None if old is None else old.logp,
            old_entropy=None if old is None else old.entropy,
            divergence=None if old is None else old.divergence,
            ref_logp=ref_logp,
            entropies=None
            if old is None
            else old.entropy[samples.completion_mask.bool()].sort()[0],
        )


# 5. The methods' token weights: how each one changes the per-token loss (math.md, "Methods") ------
class Group(NamedTuple):
    """What a method sees of one group of G responses (T = the micro-batch's longest response);
    the same of a micro-batch's rows, whose groups method_terms hands the methods one by one."""

    logp: torch.Tensor  # (G, T) current policy, with gradient
    old_logp: torch.Tensor  # (G, T) rollout policy, no gradient
    advantages: torch.Tensor  # (G,)
    mask: torch.Tensor  # (G, T) 0/1
    entropy: torch.Tensor  # (G, T) rollout policy's entropy, no gradient
    batch_entropy: torch.Tensor | None  # sorted entropies of the batch's valid tokens
    divergence: torch.Tensor | None  # (G, T) ict's JS divergence, for the methods that ask for it
    update_pass: int  # 0; lopti's second (high-probability) pass is 1

    @classmethod
    def of(cls, rows, logp, entropy, update_pass: int) -> "Group":
        """A micro-batch's tokens (Batch rows) as the methods read them, logp and entropy the
        policy's, with gradient: beside the rollout policy's where measured, else beside these
        (detached: with one update a batch the rollout policy is the policy)."""
        measured = rows.old_logp is not None
        return cls(
            logp,
            old_logp=rows.old_logp if measured else logp.detach(),
            advantages=rows.advantages,
            mask=rows.completion_mask,
            entropy=rows.old_entropy if measured else entropy,
            batch_entropy=rows.entropies,
            divergence=rows.divergence,
            update_pass=update_pass,
        )

    def groups(self, size: int) -> list["Group"]:
        """This micro-batch's groups of `size` consecutive rows (the batch's entropies and the
        pass are every group's)."""
        spans = [slice(start, start + size) for start in range(0, len(self.logp), size)]
        return [
            self._replace(
                logp=self.logp[rows],
                old_logp=self.old_logp[rows],
                advantages=self.advantages[rows],
                mask=self.mask[rows],
                entropy=self.entropy[rows],
                divergence=None if self.divergence is None else self.divergence[rows],
            )
            for rows in spans
        ]


class TokenTerms(NamedTuple):
    """How a method changes the per-token loss w * pg + beta * k3."""

    pg_weight: torch.Tensor  # w (G, T); 0 drops a token's PG term, not its share of the denominator
    extra: torch.Tensor | None = None  # (G, T) a per-token term added to the loss (kl_cov)
    active: torch.Tensor | None = None  # (G, T) tokens whose PG and KL terms count in this pass

    @classmethod
    def joined(cls, per_group: list["TokenTerms"]) -> "TokenTerms":
        """Groups' terms side by side, as their micro-batch's (rows, T) ones."""
        pg_weight = torch.cat([terms.pg_weight for terms in per_group])
        first = per_group[0]
        extra = None if first.extra is None else torch.cat([t.extra for t in per_group])
        active = None if first.active is None else torch.cat([t.active for t in per_group])
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


def method_terms(tokens: Group, cfg: Config) -> TokenTerms:
    """The --method's token terms of a micro-batch's tokens, group by group (each method reads one
    group of G responses), side by side."""
    method = METHODS[cfg.method].token_terms
    return TokenTerms.joined([method(group, cfg) for group in tokens.groups(cfg.group_size)])


@torch.no_grad()
def every_methods_weights(model, rows: Batch, cfg: Config, passes: Passes) -> dict:
    """What every method's every update pass makes of the same rows, side by side (the run's
    tokens.html shows its first group's): (method, pass) -> (w x active, tokens touched), each
    token's log-prob and its covariance score (cw step 3); each (rows, T)."""
    stats = token_stats(model, rows, cfg, passes, divergence=True)
    mask = rows.completion_mask
    entropies = stats.entropy[mask.bool()].sort().values
    out = {"logp": stats.logp, "score": covariance_score(stats.logp, rows.advantages, mask)}
    for name, method in METHODS.items():
        for update_pass in range(method.update_passes):
            tokens = Group(
                stats.logp,
                old_logp=stats.logp,
                advantages=rows.advantages,
                mask=mask,
                entropy=stats.entropy,
                batch_entropy=entropies,
                divergence=stats.divergence,
                update_pass=update_pass,
            )
            terms = method_terms(tokens, dataclasses.replace(cfg, method=name))
            active = 1 if terms.active is None else terms.active
            out[name, update_pass] = (terms.pg_weight * active, metrics.touched_tokens(terms))
    return out


# 6. The loss --------------------------------------------------------------------------------------
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    return torch.exp(ref_logp - logp) - (ref_logp - logp) - 1


def sampler_correction(old_logp, sampler_logp, mask, cfg: Config) -> torch.Tensor | None:
    """The sampler correction r (math.md, "Sampler-trainer mismatch"), as TRL's: exp(l - s) per
    token, or per sequence summed in log space (a long sum neither overflows nor gives 0 x inf);
    truncate: min(r, r_max); mask: r, but 0 outside [r_min, r_max]. None: none, the released
    recipe."""
    if cfg.sampler_correction == "none":
        return None
    log_r = (old_logp - sampler_logp) * mask  # (N, T)
    if cfg.sampler_correction.startswith("sequence"):
        log_r = log_r.sum(1, keepdim=True)  # (N, 1)
    correction = log_r.clamp(max=math.log(cfg.sampler_correction_cap)).exp()
    if cfg.sampler_correction.endswith("truncate"):
        return correction
    inside = log_r <= math.log(cfg.sampler_correction_cap)
    return correction * (inside & (correction >= cfg.sampler_correction_min))


class LossParts(NamedTuple):
    """A micro-batch's loss per token, and what of it the metrics read; each (rows, T)."""

    per_token: torch.Tensor  # w pg r + extra + beta k3, times active
    terms: TokenTerms  # the method's
    tokens: Group  # what the loss read: log-probs, the rollout policy's, its entropies, the mask
    kl: torch.Tensor | None  # k3, without gradient; None without a reference (beta 0)
    clipped: torch.Tensor  # tokens whose PG term PPO's clip holds constant


def policy_loss(
    tokens: Group,
    terms: TokenTerms,
    cfg: Config,
    sampler_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    n_responses: int,
    n_tokens: int,
):
    """The loss of a micro-batch of whole groups, in docs/math.md's symbols ("Loss"): per token
    w * max(-rho A, -clip(rho, 1 - eps_low, 1 + eps_high) A) * r + beta * k3, w the method's
    weight (terms, section 5), rho = pi / pi_old, A the response's advantage, r the sampler
    correction; averaged over each response's tokens, then over the step's n_responses (GRPO's),
    or over the step's n_tokens (DAPO's token-mean). Divided by the step's totals, the
    micro-batches' losses and gradients add up to the step's. Returns the loss and its LossParts."""
    mask = tokens.mask  # (rows, T)
    correction = sampler_correction(tokens.old_logp, sampler_logp, mask, cfg)  # (rows, T or 1)
    ratio = torch.exp(tokens.logp - tokens.old_logp)  # rho: exactly 1 with one update per batch
    adv = tokens.advantages[:, None]  # (rows, 1): a response's advantage, on each of its tokens
    pg = -ratio * adv  # -rho A
    clip = METHODS[cfg.method].clip
    if clip:  # PPO's clipped surrogate
        pg = torch.max(pg, -ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    per_token = terms.pg_weight * pg if correction is None else terms.pg_weight * pg * correction
    if terms.extra is not None:  # kl_cov's penalty
        per_token = per_token + terms.extra
    kl = k3(tokens.logp, ref_logp) if cfg.beta > 0 else None  # (rows, T)
    if cfg.beta > 0:
        per_token = per_token + cfg.beta * kl
    if terms.active is not None:  # lopti's pass: only its tokens count
        per_token = per_token * terms.active
    # a response's token mean, then the mean over the step's responses (GRPO's)
    if cfg.loss_aggregation == "seq-mean-token-mean":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / n_responses
    else:  # every token of the step alike (DAPO)
        loss = (per_token * mask).sum() / n_tokens
    clipped = ppo_clipped(ratio.detach(), tokens.advantages, cfg) & clip
    kl = None if kl is None else kl.detach()
    return loss, LossParts(per_token, terms, tokens, kl=kl, clipped=clipped)


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
    """The paper's algorithm, rollout step after rollout step, each step's phases in the order
    they run, numbered as the sections that define them; the run keeps the records, checkpoints
    and pictures."""
    method = METHODS[cfg.method]
    updates = cfg.num_iterations * method.update_passes  # optimizer steps per rollout batch
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = optimizer_and_schedule(trained, cfg, updates)
    scaler = run.precision.scaler()  # fp16's loss scaler; in any other precision, one doing nothing
    # the rollout step to start at: 0, or a checkpoint's, with the state of each as it saved them
    start = run.begin(optimizer, scheduler, scaler=scaler, prompts=prompts)
    if start == 0:  # TRY NOT TO MODIFY: seeding (a resumed run continues its checkpoint's RNG)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    autocast = run.precision.autocast  # bf16 or fp16 compute over fp32 weights; fp32: none
    passes = Passes.of(cfg, run_cfg)  # how the log-prob passes compute: micro-batches, memory
    # the update reads the rollout policy's own log-probs where it can differ from the policy
    # being trained (more than one update a batch) or the method reads them before the update
    rollout_policy = cfg.num_iterations > 1 or method.needs_stats
    for rollout_step in range(start + 1, cfg.steps + 1):
        questions = prompts.next_batch(cfg.prompts_per_step)  # (prompt ids, gold) pairs
        golds = [gold for _, gold in questions for _ in range(cfg.group_size)]  # (N,)
        with autocast():
            # 1. Sample G completions of each of the step's prompts
            with run.phase("sampling", rollout_step):
                samples = sample(
                    model,
                    tokenizer,
                    [ids for ids, _ in questions],
                    cfg,
                    chunk=run_cfg.rollout_chunk,
                    share=run_cfg.share_prompts,
                    engine=engine,
                )
            # 2. Grade them, in worker processes that go on while the passes below run
            grading = grader.submit([(t, gold, "default") for t, gold in zip(samples.texts, golds)])
            # 3. Their log-probs without gradient, under the rollout policy where the update
            # reads them, and under the reference for the KL
            with run.phase("the log-prob passes", rollout_step):
                old = None
                if rollout_policy:
                    divergence = method.needs_divergence
                    old = token_stats(model, samples, cfg, passes, divergence=divergence)
                ref_logp = None
                if cfg.beta > 0:
                    ref_logp = reference_logprobs(model, reference, samples, cfg, passes)
            # 2. Their rewards, once graded; 4. each response's advantage within its group
            grades = grading.result()
            rewards = rewards_of(samples.texts, grades, cfg)
            advantages = group_advantages(rewards.total, cfg.group_size)
        batch = Batch.of(samples, rewards, advantages, old=old, ref_logp=ref_logp)
        rollout_figures = metrics.rollout_metrics(samples, rewards, grades, cfg.group_size)
        run.rollout_scored(rollout_step, model=model, batch=batch)  # the token page; tools' hook
        n_responses = len(batch.texts)
        n_tokens = int(batch.completion_mask.sum().clamp(min=1))
        for update_index in range(updates):
            step = (rollout_step - 1) * updates + update_index + 1  # the optimizer step
            update_pass = update_index % method.update_passes  # lopti: low-probability tokens first
            model.train()
            loss_sum, token_values = 0.0, []
            with run.phase("the update", rollout_step):
                for _, rows in batch.micro_batches(passes.micro_batch_rows):
                    with autocast():
                        # 3. The micro-batch's log-probs under the policy trained, with gradient
                        logp, entropy, _ = completion_logprobs(model, rows, cfg, passes)
                        # 5. The method's token terms, group by group, of the tokens as the
                        # methods read them: beside the rollout policy's log-probs and entropies,
                        # or with none measured (one update a batch), the policy's own, detached
                        tokens = Group.of(rows, logp, entropy, update_pass=update_pass)
                        terms = method_terms(tokens, cfg)
                        # 6. The loss, and its backward: the micro-batches' gradients add up
                        loss, parts = policy_loss(
                            tokens,
                            terms,
                            cfg,
                            sampler_logp=rows.sampler_logp,
                            ref_logp=rows.ref_logp,
                            n_responses=n_responses,
                            n_tokens=n_tokens,
                        )
                    scaler.scale(loss).backward()  # fp16: scaled up, so no gradient underflows
                    loss_sum += loss.item()
                    token_values.append(metrics.token_values(parts, rows.sampler_logp))
            # 7. Clip the gradient's norm, then AdamW and the schedule's next learning rate (a
            # linear warm-up, then a cosine down to min_lr_ratio x the peak); unless the gradient
            # is not finite: then nothing changes, and the step counts as skipped
            with run.phase("the optimizer step", rollout_step):
                grad_norm, lr, finite = optimizer_step(
                    trained, optimizer, scheduler, scaler=scaler, max_grad_norm=cfg.max_grad_norm
                )
            update_figures = metrics.update_metrics(
                token_values, loss_sum, grad_norm=grad_norm.item(), lr=lr
            )
            run.log_update(
                step, rollout_step, update_pass, rollout_figures | update_figures, finite
            )
        run.end_step(rollout_step, model, tokenizer)  # progress; a checkpoint every --save-every
    run.finish(model, tokenizer)  # the final model, LoRA's merged


def main(cfg: Config, run_cfg: RunConfig, on_rollout: Callable | None = None) -> Path | None:
    """python cwgrpo.py: the run made ready, what it trains loaded, the training loop, what it
    did; --plan: its memory and disk instead. on_rollout(rollout_step, model, batch, autocast), a
    hook for tools/diagnose.py, sees each scored batch before its update."""
    if run_cfg.plan:  # before anything loads
        print(Run.plan(cfg, run_cfg))
        return None
    # the folder locked, Ctrl-C a stop after the step, the device, precision and threads set, the
    # model and its fit on the GPU checked: one line and an exit for whatever is wrong
    with Run(cfg, run_cfg) as run:
        if run.finished():
            return run.path
        with Grader(
            grade_accuracy,
            on_timeout=TIMED_OUT,
            timeout_s=cfg.reward_timeout_s,
            workers=run_cfg.reward_workers,
        ) as grader:
            run.start(grader)  # run_config.json; on resume, the records after its checkpoint go
            model, reference, tokenizer, prompts, engine = run.load()
            passes = Passes.of(run.cfg, run_cfg)
            run.show_tokens(tokenizer, METHODS, every_methods_weights, passes, hook=on_rollout)
            training_loop(
                run.cfg,
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
    main(CONFIG, RUN_CONFIG)
