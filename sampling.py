"""sampling.py: the rollout engine of cwgrpo's reference loop: a token-by-token sampler with a KV
cache that draws from exactly softmax(logits / temperature), cut to top-k and the top-p nucleus only
where set. cwgrpo.py and evaluate.py sample through it; it knows nothing of cwgrpo.

generate() would add whatever a model's generation_config.json ships (a repetition penalty, top-k,
suppressed tokens), so the tokens would not come from the distribution whose log-probs the loss
uses; this loop applies nothing else.
"""

import inspect

import torch
from transformers import DynamicCache

from loading import eos_token_ids


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
):
    """n completions of each prompt, the prompts left-padded into one batch: the prompt ids and
    mask, the completion ids, mask and truncation flags, and the decoded texts. With max_total,
    each prompt + completion holds at most max_total tokens (as vLLM's max model length)."""
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
    eos = eos_token_ids(model, tokenizer)
    completion_ids = sample_tokens(
        model, prompt_ids, prompt_mask, int(limits.max()), temperature, top_p, top_k, eos, pad
    )
    completion_mask, truncated = completion_mask_after_eos(completion_ids, eos, limits)
    lengths = completion_mask.sum(1).long().tolist()
    texts = tokenizer.batch_decode(
        [ids[:k] for ids, k in zip(completion_ids, lengths)], skip_special_tokens=True
    )
    return prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts


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
) -> torch.Tensor:
    """Autoregressive sampling with a KV cache: softmax(logits / temperature), cut to the top-k
    tokens and the top-p nucleus only where set. Nothing else shapes the distribution, so the
    tokens come from the one whose log-probs the loss uses (generate() would add whatever the
    model's generation_config.json ships, such as a repetition penalty). Rows stop at EOS."""
    attention = prompt_mask.clone()
    positions = (attention.cumsum(1) - 1).clamp(min=0)  # left padding: count real tokens only
    cache, input_ids, tokens = DynamicCache(), prompt_ids, []
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)
    eos = torch.tensor(eos, device=prompt_ids.device)
    cache_argument = {cache_keyword(model): cache}
    for _ in range(max_new_tokens):
        logits = model(
            input_ids=input_ids,
            attention_mask=attention,
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
        tokens.append(token)
        finished |= torch.isin(token, eos)
        if finished.all():
            break
        input_ids, positions = token[:, None], positions[:, -1:] + 1
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
    return torch.stack(tokens, 1)


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
