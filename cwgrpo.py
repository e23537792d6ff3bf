"""cwgrpo.py: CW-GRPO ("Taming Extreme Tokens: Covariance-Aware GRPO with Gaussian-Kernel Advantage
Reweighting", Wang et al., ACL 2026) and the token-weighting methods it is compared with, in one
file that reads in the order a training step runs; docs/math.md has every formula.

    python cwgrpo.py --method cw --preset tiny   # CW-GRPO on a tiny model, in a minute on a CPU
    python cwgrpo.py --method cw                 # the paper's 1.5B recipe (one CUDA GPU)

Sections 1 sampling, 2 reward, 3 log-probs, 4 group advantages, 5 the methods' token weights, 6
the loss, 7 the optimizer; then the training loop that runs them, and main. Options: Config's
(cwgrpo_utils/options/config.py); how and where a run runs is cwgrpo_utils's (RunConfig, Run).
"""

import dataclasses
from typing import Callable

# The algorithm's options and the run's, read before the heavy imports below (options/config.py)
from cwgrpo_utils.options.config import (
    METHODS,
    Config,
    Passes,
    Sampling,
    parse_config,
    register_method,
)
from cwgrpo_utils.options.run_config import RunConfig, check_output_dir

if __name__ == "__main__":  # --help and bad options answer here, before the heavy imports below
    CONFIG, RUN_CONFIG = parse_config()
    if not RUN_CONFIG.plan:  # a folder that holds a run, refused at once
        check_output_dir(RUN_CONFIG.output_dir, RUN_CONFIG.resume, RUN_CONFIG.overwrite_output_dir)

# What a run needs once its command line is known (pyproject.toml lets these follow the guard)
import math
import random
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from latex2sympy2_extended import NormalizationConfig
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from cwgrpo_utils.fast import shared_prompt
from cwgrpo_utils.fast.lm_head import ict_divergence, valid_logprobs
from cwgrpo_utils.machine.grading_pool import TIMED_OUT, Grade, LogCounter
from cwgrpo_utils.models import loading, lora
from cwgrpo_utils.models.batch import Rows, per_row, whole_batch
from cwgrpo_utils.run import metrics
from cwgrpo_utils.run.run import Loaded, Run


# 1. Sampling --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Samples(Rows):
    """N = prompts x G completions, a group's rows consecutive (their parts: models/batch.py)."""

    prompt_ids: torch.Tensor = per_row("left", token_ids=True)  # (N, P) left-padded
    prompt_mask: torch.Tensor = per_row("left", mask=True)  # (N, P)
    completion_ids: torch.Tensor = per_row("right", token_ids=True)  # (N, T) right-padded
    completion_mask: torch.Tensor = per_row("right", mask=True)  # (N, T) 1 to the first EOS
    truncated: torch.Tensor = per_row()  # (N,) bool, no EOS within the limit
    texts: list = per_row()  # (N,) the completions, decoded
    sampler_logp: torch.Tensor = per_row("right")  # (N, T) the sampler's log-probs of its tokens


@torch.no_grad()
def sample(model, tokenizer, prompts: list[list[int]], cfg, passes: Passes, engine=None):
    """G completions of each prompt (token ids, through the chat template: models/prompts.py), by
    the token loop below or a vLLM engine with `model`'s weights; passes.rollout_chunk prompts at
    a time (0: all), with passes.share_prompts each group's prompt prefilled once."""
    model.eval()
    how = Sampling.of(cfg)  # G completions a prompt at the temperature, within the length limit
    chunk, share = passes.rollout_chunk, passes.share_prompts
    samples = generate_completions(
        model, tokenizer, prompts, how=how, chunk=chunk, engine=engine, share=share
    )
    if cfg.mask_truncated_completions:  # out of the loss, not out of the reward
        samples.completion_mask = samples.completion_mask * (~samples.truncated)[:, None]
    return samples


@torch.no_grad()
def generate_completions(model, tokenizer, prompts, how, chunk=0, engine=None, share=False):
    """how.n completions a prompt, `chunk` prompts at a time, by vLLM or this section's loop."""
    if chunk and engine is None and chunk < len(prompts):  # a KV cache of `chunk` prompts at once
        parts = [
            generate_completions(model, tokenizer, prompts[i : i + chunk], how, share=share)
            for i in range(0, len(prompts), chunk)
        ]
        return Samples.joined(parts, pad=tokenizer.pad_token_id)  # as if sampled in one batch
    eos = loading.eos_ids(model or engine, tokenizer)  # the tokens a completion ends at
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
        limit = max(limits)
        ids, logp = sample_tokens(
            model, prompt_ids, prompt_mask, how=how, limit=limit, eos=eos, pad=pad, share=share
        )
    ids, logp = ids.to(device), logp.to(device)  # (N, T), right-padded
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
def sample_tokens(model, prompt_ids, prompt_mask, how, limit, eos, pad, cache=None, share=False):
    """At most `limit` tokens a row with a KV cache, a row stopping at an EOS: (B, T) tokens and
    log-probs, 0 after it. Only the temperature and the cuts shape the distribution the loss reads
    (generate() adds generation_config's penalties). share: a prompt's how.n rows prefilled once."""
    attention = prompt_mask.clone()  # (B, P), then one column more each step
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    # = DynamicCache(), keeping keys and values in bf16 under CUDA autocast (loading.py)
    cache = loading.KVCache.for_model(model) if cache is None else cache
    cache_argument = loading.cache_argument(model, cache)  # {"cache": cache}, by version
    input_ids = prompt_ids
    tokens, logps = [], []
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)  # (B,)
    eos = torch.tensor(eos, device=prompt_ids.device)
    for t in range(limit):
        prefill = t == 0
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
GOLD_EXTRACTION = {
    "default": [LatexExtractionConfig(), ExprExtractionConfig()],
    "expr": [ExprExtractionConfig()],
    "latex": [LatexExtractionConfig()],
}
RELEASED_NORMALISATION = NormalizationConfig(basic_latex=True, units=True, boxed="all")  # rest off
# The released reward's: no match without an anchor (False), \\boxed{} first (priority 0)
PREDICTION_EXTRACTION = [LatexExtractionConfig(False, 0, RELEASED_NORMALISATION)]


def grade_accuracy(completion: str, gold: str, gold_format: str = "default") -> Grade:
    """1.0 if math-verify finds the completion's answer equal to the gold, gold first (verify is
    not symmetric); evaluate.py's golds are "expr" or "latex". A cutoff scores 0 and is counted."""
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
def completion_states(model, rows: Samples, group_size: int, share_prompts: bool) -> torch.Tensor:
    """(rows, T, hidden): the last states at the positions that predict each completion token."""
    decoder = model.get_decoder()
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
    return hidden[:, rows.prompt_ids.shape[1] - 1 : -1]  # (rows, T, hidden): t predicts token t


def completion_logprobs(model, rows: Samples, cfg: Config, passes: Passes):
    """(rows, T) log-probs of the completion tokens under softmax(logits / temperature), the
    distribution they were drawn from, and the entropies there, 0 on padding; and the states."""
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
    """The batch under `model`, a micro-batch at a time; on request ict's divergence too."""
    logp = torch.zeros_like(samples.completion_mask)
    entropy = torch.zeros_like(logp)
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
    """(N, T) log-probs under the KL's reference: a frozen copy, or LoRA's base (adapter off)."""
    with lora.reference_of(model, reference) as frozen:
        return token_stats(frozen, samples, cfg, passes).logp


# 4. Group advantages ------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + 1e-4) within each group, Bessel std (GRPO; math.md)."""
    per_group = rewards.view(-1, group_size)  # (prompts, G)
    std = per_group.std(1, keepdim=True)
    return ((per_group - per_group.mean(1, keepdim=True)) / (std + 1e-4)).view(-1)  # (N,)


@dataclasses.dataclass
class Batch(Samples):
    """The samples and each phase's values, as the update reads them; None: a phase not run."""

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
        """The step's values side by side; old: the rollout policy's stats, or None."""
        old_logp, old_entropy, divergence = old or (None, None, None)
        valid = samples.completion_mask.bool()
        return cls(
            **vars(samples),
            rewards=rewards.total,
            accuracy=rewards.accuracy,
            advantages=advantages.to(samples.completion_ids.device),
            old_logp=old_logp,
            old_entropy=old_entropy,
            divergence=divergence,
            ref_logp=ref_logp,
            entropies=None if old is None else old_entropy[valid].sort().values,
        )


# 5. The methods' token weights: how each one changes the per-token loss (math.md, "Methods") ------
class Group(NamedTuple):
    """What a method sees of one group of G responses (T: the longest), or of a micro-batch."""

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
        """A micro-batch's rows, logp and entropy the policy's, beside the rollout policy's."""
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
        """This micro-batch's groups of `size` consecutive rows (batch_entropy and update_pass are
        every group's)."""
        per_row = ("logp", "old_logp", "advantages", "mask", "entropy", "divergence")
        values = {name: getattr(self, name) for name in per_row}
        spans = [slice(start, start + size) for start in range(0, len(self.logp), size)]
        return [
            self._replace(**{k: v[rows] for k, v in values.items() if v is not None})
            for rows in spans
        ]


class TokenTerms(NamedTuple):
    """How a method changes the per-token loss w * pg + beta * k3."""

    pg_weight: torch.Tensor  # w (G, T); 0 drops a token's PG term, not its share of the denominator
    extra: torch.Tensor | None = None  # (G, T) a per-token term added to the loss (kl_cov)
    active: torch.Tensor | None = None  # (G, T) tokens whose PG and KL terms count in this pass


@register_method("GRPO baseline, every token weight 1")
def grpo(group: Group, cfg: Config) -> TokenTerms:
    return TokenTerms(group.mask)  # w = 1 (Shao et al. 2024)


def covariance_score(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CW-GRPO's per-token covariance score of one group (math.md "cw", steps 1-3)."""
    mu = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)  # 1. each response's mean log-prob (G,)
    centred_adv = adv - adv.mean()  # 2. (G,)
    return (logp - mu[:, None]) * centred_adv[:, None] * mask  # 3. (G, T)


def kernel_bandwidth(score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sigma: the std (ddof 0) of a group's scores over its valid tokens + 1e-8 (math.md cw, 4);
    where every score is 0 (equal rewards), 1e-8 with no gradient (sqrt'(0) is infinite)."""
    n_valid = mask.sum().clamp(min=1)
    variance = ((score - score.sum() / n_valid) ** 2 * mask).sum() / n_valid
    return variance.sqrt() + 1e-8 if variance > 0 else torch.full_like(variance, 1e-8)


def gaussian_kernel(score: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """exp(-c^2 / (2 sigma^2)) (math.md cw, 5): 1 at c = 0, small for extreme scores."""
    return torch.exp(-(score**2) / (2 * sigma**2))


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
    kernel = gaussian_kernel(score, kernel_bandwidth(score, mask)) * mask  # 4-5. (G, T)
    n_valid = mask.sum().clamp(min=1)  # a group with no valid token gets weights 0, not NaN
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
    """The --method's token terms of a micro-batch, group by group, side by side."""
    method = METHODS[cfg.method].token_terms
    per_group = [method(group, cfg) for group in tokens.groups(cfg.group_size)]
    # each field of the groups' terms concatenated, (rows, T); None where the method sets none
    return TokenTerms(*(None if part[0] is None else torch.cat(part) for part in zip(*per_group)))


@torch.no_grad()
def every_methods_weights(model, rows: Batch, cfg: Config, passes: Passes) -> dict:
    """(method, pass) -> (w x active, touched), "logp", cw's "score" on the rows (tokens.html)."""
    stats = token_stats(model, rows, cfg, passes, divergence=True)
    mask = rows.completion_mask
    batch_entropy = stats.entropy[mask.bool()].sort().values  # every method's and pass's
    out = {"logp": stats.logp, "score": covariance_score(stats.logp, rows.advantages, mask)}
    for name, method in METHODS.items():
        for update_pass in range(method.update_passes):
            tokens = Group(
                stats.logp,
                old_logp=stats.logp,
                advantages=rows.advantages,
                mask=mask,
                entropy=stats.entropy,
                batch_entropy=batch_entropy,
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
    """r (math.md, "Sampler-trainer mismatch"), TRL's: exp(l - s) a token or a sequence (in log
    space); truncate: min(r, r_max); mask: 0 outside [r_min, r_max]; none (released): None."""
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


def policy_loss(tokens: Group, terms, cfg: Config, sampler_logp, ref_logp, n_responses, n_tokens):
    """A micro-batch's loss, in math.md's symbols ("Loss"): per token w max(-rho A, -clip(rho, 1 -
    eps_low, 1 + eps_high) A) r + beta k3, w the method's weight, rho = pi / pi_old, r the sampler
    correction; averaged over each response's tokens, then over the step's n_responses (GRPO), or
    over its n_tokens (DAPO), so the micro-batches' gradients add up to the step's. The loss, and
    the parts the metrics read."""
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
    return loss, metrics.LossParts(per_token, terms, tokens, kl=kl, clipped=clipped)


# 7. The optimizer ---------------------------------------------------------------------------------
def optimizer_and_schedule(trained: list, cfg: Config, updates: int):
    """Fused AdamW over what is trained (docs/performance.md); its learning rate warms up linearly,
    then follows a cosine to min_lr_ratio x the peak, over steps x `updates` optimizer steps."""
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
    """The gradient's norm clipped (fp16's unscaled first), AdamW, the next learning rate; where
    the norm is not finite, none of it, but fp16's loss scale halves. Norm, lr, whether it ran."""
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
def training_loop(cfg: Config, run_cfg: RunConfig, loaded: Loaded, grader, run: Run):
    """The paper's algorithm, step after step, each phase numbered as the section that defines it;
    the run keeps the records, checkpoints and pictures."""
    model, reference, tokenizer, prompts, engine = loaded  # run.load()'s
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
    passes = Passes.of(cfg, run_cfg)  # how the passes compute: micro-batches, chunks, memory
    # the rollout policy's log-probs, where they can differ from the policy's or a method reads them
    rollout_policy = cfg.num_iterations > 1 or method.needs_stats
    for rollout_step in range(start + 1, cfg.steps + 1):
        questions = prompts.next_batch(cfg.prompts_per_step)  # (prompt ids, gold) pairs
        prompt_ids = [ids for ids, _ in questions]
        golds = [gold for _, gold in questions for _ in range(cfg.group_size)]  # (N,)
        with autocast():
            # 1. Sample G completions of each of the step's prompts
            with run.phase("sampling", rollout_step):
                samples = sample(model, tokenizer, prompt_ids, cfg, passes=passes, engine=engine)
            # 2. Grade them, in worker processes that go on while the passes below run
            grading = grader.submit([(t, gold, "default") for t, gold in zip(samples.texts, golds)])
            # 3. Their log-probs without gradient: the rollout policy's where read, the reference's
            with run.phase("the log-prob passes", rollout_step):
                old = None
                if rollout_policy:  # with ict's divergence in the same pass
                    divergence = method.needs_divergence
                    old = token_stats(model, samples, cfg, passes, divergence=divergence)
                ref_logp = None
                if cfg.beta > 0:
                    ref_logp = reference_logprobs(model, reference, samples, cfg, passes)
            # 2. Their rewards, once graded
            grades = grading.result()
            rewards = rewards_of(samples.texts, grades, cfg)
            # 4. Each response's advantage within its group
            advantages = group_advantages(rewards.total, cfg.group_size)
        batch = Batch.of(samples, rewards, advantages, old=old, ref_logp=ref_logp)
        rollout_figures = metrics.rollout_metrics(samples, rewards, grades, cfg.group_size)
        run.rollout_scored(rollout_step, model=model, batch=batch)  # the token page; tools' hook
        n_responses, n_tokens = len(batch.texts), int(batch.completion_mask.sum().clamp(min=1))
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
                            n_responses=n_responses,  # the step's, so micro-batches add up
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
            figures = metrics.update_metrics(
                token_values, loss_sum, grad_norm=grad_norm.item(), lr=lr
            )
            run.log_update(step, rollout_step, update_pass, rollout_figures | figures, finite)
        run.end_step(rollout_step, model, tokenizer)  # progress; a checkpoint every --save-every
    run.finish(model, tokenizer)  # the final model, LoRA's merged


def main(cfg: Config, run_cfg: RunConfig, on_rollout: Callable | None = None) -> Path | None:
    """python cwgrpo.py (--plan: the plan instead); on_rollout: tools/diagnose.py's batch hook."""
    if run_cfg.plan:  # before anything loads
        print(Run.plan(cfg, run_cfg))
        return None
    # locked, Ctrl-C a stop after the step, device, precision, threads, the model's fit checked
    with Run(cfg, run_cfg) as run:
        if run.finished():
            return run.path
        with run.grader(grade_accuracy, on_timeout=TIMED_OUT) as grader:  # section 2's processes
            run.start(grader)  # run_config.json; on resume, the records after its checkpoint go
            loaded = run.load()  # the policy, the reference, the tokenizer, prompts, vLLM engine
            # tokens.html: every method's weights on the same tokens; and a tool's hook
            run.show_tokens(loaded.tokenizer, METHODS, every_methods_weights, hook=on_rollout)
            training_loop(run.cfg, run_cfg, loaded, grader=grader, run=run)
    print(run.summary())
    return run.path


if __name__ == "__main__":
    main(CONFIG, RUN_CONFIG)
