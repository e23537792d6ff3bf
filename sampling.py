"""sampling.py: the rollout engine of cwgrpo's reference loop: a token-by-token sampler with a KV
cache that draws from exactly softmax(logits / temperature), cut to top-k and the top-p nucleus only
where set. cwgrpo.py and evaluate.py sample through it; it knows nothing of cwgrpo.

generate() would add whatever a model's generation_config.json ships (a repetition penalty, top-k,
suppressed tokens), so the tokens would not come from the distribution whose log-probs the loss
uses; this loop applies nothing else.
"""

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from loading import eos_token_ids


class Completions(NamedTuple):
    """n completions of each prompt as one batch, consecutive rows sharing a prompt."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded
    completion_mask: torch.Tensor  # (N, T) float, 1 up to and including the first EOS
    truncated: torch.Tensor  # (N,) bool, no EOS within the limit
    texts: list
    sampler_logp: torch.Tensor  # (N, T) each token's log-prob under the distribution it came from


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: list[list[int]],
    n: int,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    max_total: int | None,
    chunk: int = 0,
):
    """n completions of each prompt, the prompts left-padded into one batch. With max_total,
    each prompt + completion holds at most max_total tokens (as vLLM's max model length). With
    chunk, `chunk` prompts are sampled at a time, which bounds the KV cache; the results are
    padded into one batch as if sampled together."""
    if 0 < chunk < len(prompts):
        parts = [
            generate_completions(
                model,
                tokenizer,
                prompts[i : i + chunk],
                n,
                temperature,
                top_p,
                top_k,
                max_new_tokens,
                max_total,
            )
            for i in range(0, len(prompts), chunk)
        ]
        return joined(parts, tokenizer.pad_token_id)
    device = next(model.parameters()).device
    width, pad = max(map(len, prompts)), tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    prompt_mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
    )
    prompt_ids, prompt_mask = (
        prompt_ids.repeat_interleave(n, 0),
        prompt_mask.repeat_interleave(n, 0),
    )
    limits = (
        torch.full((len(prompt_ids),), max_new_tokens, device=device)
        if max_total is None
        else max_total - prompt_mask.sum(1)
    )
    eos = eos_token_ids(model.generation_config, tokenizer)
    completion_ids, sampler_logp = sample_tokens(
        model, prompt_ids, prompt_mask, int(limits.max()), temperature, top_p, top_k, eos, pad
    )
    completion_mask, truncated = completion_mask_after_eos(completion_ids, eos, limits)
    texts = decoded(tokenizer, completion_ids, completion_mask)
    sampler_logp = sampler_logp * completion_mask
    return Completions(
        prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, sampler_logp
    )


def decoded(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
    """Each completion's text, up to and including its first EOS (special tokens skipped)."""
    lengths = completion_mask.sum(1).long().tolist()
    return tokenizer.batch_decode(
        [ids[:k] for ids, k in zip(completion_ids.tolist(), lengths)], skip_special_tokens=True
    )


def joined(parts: list[Completions], pad: int) -> Completions:
    """generate_completions' results for consecutive chunks of prompts, as one batch: prompts
    left-padded and completions right-padded to the widest."""
    prompt_width = max(part[0].shape[1] for part in parts)
    completion_width = max(part[2].shape[1] for part in parts)

    def padded(tensors, width, value, left):
        sides = [(width - t.shape[1], 0) if left else (0, width - t.shape[1]) for t in tensors]
        return torch.cat([F.pad(t, side, value=value) for t, side in zip(tensors, sides)])

    prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, logp = zip(*parts)
    return Completions(
        padded(prompt_ids, prompt_width, pad, left=True),
        padded(prompt_mask, prompt_width, 0, left=True),
        padded(completion_ids, completion_width, pad, left=False),
        padded(completion_mask, completion_width, 0, left=False),
        torch.cat(truncated),
        [text for part in texts for text in part],
        padded(logp, completion_width, 0, left=False),
    )


class KVCache(DynamicCache):
    """A DynamicCache that holds keys and values in one dtype. Under bf16 autocast the keys come
    out of the rotary embedding in fp32 (its cos and sin are fp32) and the values in bf16, so the
    plain cache holds fp32 keys: half as large again. Attention reads both as bf16 under autocast,
    so storing them in bf16 changes nothing it computes."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.store_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = key_states.to(self.store_dtype), value_states.to(self.store_dtype)
        return super().update(keys, values, layer_idx, *args, **kwargs)


def cache_dtype(model) -> torch.dtype:
    """bf16 under CUDA autocast (what attention reads), else the model's own dtype."""
    device = next(model.parameters()).device
    if device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return next(model.parameters()).dtype


def attention_mask(model, mask: torch.Tensor) -> torch.Tensor | None:
    """What to pass as attention_mask for a full forward pass over a batch whose 2D mask is `mask`
    (1: a real token). No row starts with padding: None, since right padding cannot reach a real
    token under causal attention and SDPA's causal kernel then needs no mask. Else, for SDPA, a
    (B, 1, L, L) causal mask on real keys in which every position also sees itself, so that no
    query row is fully masked: a left pad sees nothing in the plain mask, some CUDA SDPA kernels
    return NaN for such a row, and 0 x NaN reaches real tokens through V in the next layer."""
    if bool(mask[:, 0].all()):
        return None
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
        return mask  # other attention implementations take the 2D mask
    length = mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    seen = mask.bool()[:, None, None, :] | torch.eye(length, dtype=torch.bool, device=mask.device)
    return causal & seen


@torch.no_grad()
def sample_tokens(
    model,
    prompt_ids,
    prompt_mask,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    eos: list[int],
    pad: int,
    cache: DynamicCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache: softmax(logits / temperature), cut to the top-k
    tokens and the top-p nucleus only where set. Nothing else shapes the distribution, so the
    tokens come from the one whose log-probs the loss uses (generate() would add whatever the
    model's generation_config.json ships, such as a repetition penalty). Rows stop at EOS.
    Returns the (B, T) tokens and their log-probs under the distribution they were drawn from
    (after the cut, renormalised), 0 after a row's EOS."""
    attention = prompt_mask.clone()
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    cache = KVCache(cache_dtype(model)) if cache is None else cache  # a caller's: to inspect it
    input_ids, tokens, logps = prompt_ids, [], []
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)
    eos = torch.tensor(eos, device=prompt_ids.device)
    cache_argument = {cache_keyword(model): cache}
    for step in range(max_new_tokens):
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask(model, attention) if step == 0 else attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_argument,
        ).logits[:, -1]
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
        drawn = probs.gather(1, token[:, None]).squeeze(1) / cdf[:, -1]
        tokens.append(token)
        logps.append(drawn.log().masked_fill(finished, 0))
        finished |= torch.isin(token, eos)
        if finished.all():
            break
        input_ids, positions = token[:, None], positions[:, -1:] + 1
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
    return torch.stack(tokens, 1), torch.stack(logps, 1)


def completion_mask_after_eos(completion_ids: torch.Tensor, eos: list[int], limits: torch.Tensor):
    """1 for every token up to and including the first EOS within each row's limit (in tokens),
    0 after; and which rows have no EOS within it (truncated)."""
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device)) & (
        positions[None, :] < limits[:, None]
    )
    truncated = ~is_eos.any(1)
    last = torch.where(truncated, limits - 1, is_eos.int().argmax(1))
    return (positions[None, :] <= last[:, None]).float(), truncated


def cache_keyword(model) -> str:
    """transformers renamed forward's `past_key_values` to `cache` (5.2x, with a deprecation
    warning on the old name); older 5.x releases, which vLLM pins, know only the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
