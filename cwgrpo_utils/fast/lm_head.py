"""lm_head.py: log-probs and entropies through the LM head without holding vocab x length logits.

cwgrpo.py's section 3 computes its log-probs here where --logit-chunk-elements is set (the
default). At Qwen's vocabulary (151,936) a 4,096-token completion has 622M logits, 2.5 GB in
float32, and backward needs as much again; computing them chunk of positions by chunk, and
recomputing each chunk in backward, keeps two chunks alive at most. ICT's divergence streams over
the same distributions. This module knows nothing of cwgrpo.
"""

import torch
import torch.nn.functional as F


def scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits divided by the sampling temperature: the distribution that was sampled. The
    head is cast to the states' dtype, as autocast casts both; outside it (a CPU backward, where
    custom_bwd restores only CUDA's autocast) fp16 states and an fp32 head would not multiply."""
    return F.linear(hidden, weight.to(hidden.dtype)).float().div_(temperature)


class ChunkedLogProbs(torch.autograd.Function):
    """log p(target) and the entropy at each position from hidden states and the LM head, chunk by
    chunk of positions. Backward recomputes each chunk's softmax and turns it into the logits'
    gradient in place, so at most about two (chunk, vocab) float32 blocks are alive at once,
    whatever the vocabulary and length, and no logits are kept between the passes."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, targets, temperature, width):
        logp = torch.empty(hidden.shape[0], device=hidden.device)
        entropy = torch.empty_like(logp)
        for start in range(0, hidden.shape[0], width):
            chunk = slice(start, start + width)
            logp_all = scaled_logits(hidden[chunk], weight, temperature).log_softmax(-1)
            logp[chunk] = logp_all.gather(-1, targets[chunk, None]).squeeze(-1)
            entropy[chunk] = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.width = temperature, width
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for start in range(0, hidden.shape[0], ctx.width):
            chunk = slice(start, start + ctx.width)
            grad_logits = scaled_logits(hidden[chunk], weight, ctx.temperature).softmax(-1)
            g = grad_logp[chunk, None]
            # d logp / d logits = (onehot - p) / temperature
            grad_logits.mul_(-g).scatter_add_(1, targets[chunk, None], g).div_(ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[chunk] = grad_logits.to(hidden.dtype) @ weight.to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_logits.T.to(hidden.dtype) @ hidden[chunk]).float()
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_elements: int,
):
    """(positions,) log-probs of `targets` and entropies, never more than chunk_elements logits
    at once."""
    width = max(1, chunk_elements // weight.shape[0])
    return ChunkedLogProbs.apply(hidden, weight, targets, temperature, width)


def valid_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    chunk_elements: int,
):
    """(rows, T) log-probs of the tokens `ids` and the entropies, from the (rows, T, hidden) states
    that predict them, at the valid positions (mask) only, chunk_elements logits at once; 0 on
    padding."""
    valid = mask.bool()
    logp_valid, entropy_valid = chunked_logprobs(
        hidden[valid], weight, ids[valid], temperature=temperature, chunk_elements=chunk_elements
    )  # (valid tokens,) each
    logp = torch.zeros(valid.shape, device=hidden.device, dtype=logp_valid.dtype)  # (rows, T)
    entropy = torch.zeros_like(logp)
    logp[valid] = logp_valid
    entropy[valid] = entropy_valid
    return logp, entropy


@torch.no_grad()
def ict_divergence(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    chunk_elements: int,
    group_size: int,
) -> torch.Tensor:
    """ICT's u[i,t] = JS(p[i,t] || pbar[t]) in nats, pbar the mean next-token distribution of the
    responses of i's group still running at t; groups are consecutive rows of group_size. Streams
    over positions: never more than G x chunk x vocab probabilities at once (0: every position)."""
    divergence = torch.zeros(mask.shape, device=hidden.device)
    width = max(1, chunk_elements // (group_size * head_weight.shape[0]))
    width = width if chunk_elements else mask.shape[1]
    for rows in (slice(g, g + group_size) for g in range(0, len(mask), group_size)):
        for start in range(0, mask.shape[1], width):
            columns = slice(start, start + width)
            p = scaled_logits(hidden[rows, columns], head_weight, temperature).softmax(-1)
            running = mask[rows, columns, None]
            p_bar = (p * running).sum(0) / running.sum(0).clamp(min=1)
            middle = (p + p_bar) / 2
            js = 0.5 * (torch.xlogy(p, p) - torch.xlogy(p, middle)).sum(-1) + 0.5 * (
                torch.xlogy(p_bar, p_bar) - torch.xlogy(p_bar, middle)
            ).sum(-1)
            divergence[rows, columns] = js * mask[rows, columns]
    return divergence


@torch.no_grad()
def squared_probability_mass(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, chunk_elements: int
) -> torch.Tensor:
    """sum_v p_v^2 at each position, streamed like the log-probs (chunk_elements 0: at once)."""
    width = max(1, chunk_elements // weight.shape[0]) if chunk_elements else len(hidden)
    return torch.cat(
        [
            scaled_logits(hidden[s : s + width], weight, temperature).softmax(-1).pow(2).sum(-1)
            for s in range(0, hidden.shape[0], width)
        ]
    )
