"""What metrics.jsonl records of a training step, computed from cwgrpo.py's tensors: the rollout
batch's figures (rewards, lengths, grading problems) and each update's, averaged over the valid
tokens of every micro-batch (entropy, KL, clipping, the method's weights, the sampler-trainer
mismatch). cwgrpo.py computes what is algorithm (the KL, the clipped tokens) and hands it in."""

from typing import Any, NamedTuple

import torch

from cwgrpo_utils.options.cli import warn_once

# metrics.jsonl's counts of completions that scored 0 whatever they said: the run warns of them
GRADING_PROBLEMS = {
    "gold_unparseable": "completions graded against a gold math-verify cannot parse",
    "grading_timeouts": "gradings cut off (--reward-timeout-s or math-verify's own 5 s)",
}


def rollout_metrics(samples, rewards, grades: list, group_size: int) -> dict:
    """A graded batch's figures, from its samples and rewards (cwgrpo.py's Samples and Rewards);
    completions that scored 0 unread (an unparseable gold, a grading cut off) are said once and
    counted."""
    group_std = rewards.total.view(-1, group_size).std(1)
    metrics = {
        "reward_mean": rewards.total.mean().item(),
        "reward_std": rewards.total.std().item(),
        "accuracy_mean": rewards.accuracy.mean().item(),
        "format_mean": rewards.format.mean().item(),
        "frac_zero_std_groups": (group_std == 0).float().mean().item(),
        "completion_len_mean": samples.completion_mask.sum(1).mean().item(),
        "truncated_frac": samples.truncated.float().mean().item(),
        "gold_unparseable": sum(not g.gold_parsed for g in grades),
        "grading_timeouts": sum(g.timed_out for g in grades),
    }
    warn_of_grading_problems(metrics)  # said once, summed at the end
    return metrics


def warn_of_grading_problems(metrics: dict) -> None:
    """The first time a rollout batch has completions that scored 0 unread, one line says so."""
    for key, problem in GRADING_PROBLEMS.items():
        if metrics[key]:
            warn_once(key, f"warning: {metrics[key]} {problem} (scored 0); counted in '{key}'")


class LossParts(NamedTuple):
    """A micro-batch's loss per token, and what of it the metrics read; each (rows, T)."""

    per_token: torch.Tensor  # w pg r + extra + beta k3, times active
    terms: Any  # the method's TokenTerms (cwgrpo.py, section 5)
    tokens: Any  # the Group the loss read: log-probs, the rollout policy's, entropies, the mask
    kl: torch.Tensor | None  # k3, without gradient; None without a reference (beta 0)
    clipped: torch.Tensor  # tokens whose PG term PPO's clip holds constant


def touched_tokens(terms) -> torch.Tensor:
    """Tokens whose loss a method's TokenTerms changed: weighted other than 1, left out of the
    pass, or given an extra term."""
    touched = terms.pg_weight.detach() != 1
    if terms.active is not None:
        touched |= terms.active == 0
    if terms.extra is not None:
        touched |= terms.extra.detach() != 0
    return touched


def token_values(parts: LossParts, sampler_logp: torch.Tensor) -> dict:
    """Per valid token of a micro-batch, what update_metrics averages, from its loss's parts and
    the sampler's log-probs s: the entropy, the KL (k3; 0 without a reference), the PPO-clipped
    tokens, the method's weights and the tokens they touch, and the trainer's log-prob l (the
    rollout policy's) against s."""
    terms, tokens = parts.terms, parts.tokens
    w = terms.pg_weight.detach()
    active = torch.ones_like(w) if terms.active is None else terms.active
    log_r = tokens.old_logp - sampler_logp  # the sampler correction r, in log space
    per_token = {
        "entropy": tokens.entropy,
        "kl": torch.zeros_like(w) if parts.kl is None else parts.kl,
        "clipped": parts.clipped,
        "w": w,
        "touched": touched_tokens(terms),
        "pg_on": (w != 0) & (active != 0),
        "sampler_diff": log_r.abs(),
        "correction": log_r.exp(),
    }
    return {name: values[tokens.mask.bool()].float() for name, values in per_token.items()}


def update_metrics(per_token: list[dict], loss: float, grad_norm: float, lr: float) -> dict:
    """An update's metrics.jsonl figures from its micro-batches' per-token values (token_values:
    entropy, kl, clipped, w, touched, pg_on, sampler_diff, correction; one a valid token)."""
    token = {name: torch.cat([part[name] for part in per_token]) for name in per_token[0]}
    if not len(token["w"]):  # every completion masked (--mask-truncated-completions): a 0 step
        token = {name: torch.zeros(1) for name in token}
    w = token["w"]
    return {
        "loss": loss,
        "grad_norm": grad_norm,
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
        **{
            f"sampler_ratio_{f}": getattr(token["correction"], f)().item()
            for f in ("min", "mean", "max")
        },
    }
