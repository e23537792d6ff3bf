"""Each group's prompt encoded once (--share-prompts): a group's G completions attend to their
prompt's keys and values, computed once, instead of every row encoding the prompt again (Prefix
Grouper, arXiv 2506.05433). The same computation as the decoder over each row's [prompt,
completion], to floating-point rounding (tested): each completion query sees exactly the keys it
would, and the gradient reaching the shared prompt's states is the sum over its group of what
each row's copy of it would get.

    prompts = prompt_pass(decoder, rows, group_size)  # a group's prompt once: last state, K, V
    hidden = completion_pass(decoder, rows, prompts, group_size)  # (N, T, hidden)

cwgrpo.py's section 3 (completion_states) calls these two where --share-prompts is on.

The completions' pass runs over rows sorted by length in buckets, each padded only to its own
longest row (length_buckets): a batch's one truncated completion no longer pads every other row
to the length limit. Rows are independent there, so this changes nothing but rounding.

Under gradient checkpointing transformers turns a layer's cache off in training (its recompute
would write the cache a second time). Here the completions read the prompt's keys and values
from a cache that stores nothing (PromptCache), so each layer is checkpointed with it as usual;
the prompt pass itself runs under one checkpoint of its own, keeping only its keys and values and
recomputing it in backward, so the checkpointing saving holds.
"""

import contextlib
import math

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

from cwgrpo_utils.models import loading


class PromptCache(DynamicCache):
    """The prompts' keys and values (one row a group) for the completions' pass, read-only:
    update returns each layer's, one row a completion row (its group's), followed by the
    completions' own, and stores nothing, so a checkpointed layer's recompute reads what its first
    pass read."""

    def __init__(self, layers: list, row_prompts: torch.Tensor):
        super().__init__()
        self.layers = layers  # the prompt pass's, (prompts, KV heads, P, head dim) each
        self.row_prompts = row_prompts  # (rows,): each completion row's prompt

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        # index_select, not layer.keys[self.row_prompts]: its backward sums a group's rows in a
        # fixed order, where the indexing's adds atomically across threads and a run stops
        # repeating
        keys = torch.cat([layer.keys.index_select(0, self.row_prompts), key_states], -2)
        values = torch.cat([layer.values.index_select(0, self.row_prompts), value_states], -2)
        return keys, values


@contextlib.contextmanager
def layer_checkpointing(decoder, **settings):
    """The decoder's checkpointed layers with attributes set (gradient_checkpointing: whether
    each layer is recomputed; _can_checkpoint_with_cache: whether it keeps a cache when it is),
    as they were after."""
    layers = [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
    before = [{name: getattr(layer, name) for name in settings} for layer in layers]
    try:
        for layer in layers:
            for name, value in settings.items():
                setattr(layer, name, value)
        yield
    finally:
        for layer, values in zip(layers, before):
            for name, value in values.items():
                setattr(layer, name, value)


def encoded_prompts(decoder, prompt_ids, prompt_mask):
    """The prompts' last states (prompts, hidden) and each layer's keys and values, the layers
    run whole (a layer checkpointed in training keeps no cache)."""
    cache = DynamicCache()
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)  # left padding: real tokens only
    with layer_checkpointing(decoder, gradient_checkpointing=False):
        hidden = decoder(
            input_ids=prompt_ids,
            attention_mask=loading.attention_mask(decoder, prompt_mask),
            position_ids=positions,
            use_cache=False,  # the layers fill the cache they are handed
            **loading.cache_argument(decoder, cache),  # {"cache": cache}, by version
        ).last_hidden_state
    keys = tuple(layer.keys for layer in cache.layers)
    values = tuple(layer.values for layer in cache.layers)
    return hidden[:, -1], keys, values


def prompt_pass(decoder, rows, group_size: int):
    """Each group's prompt encoded once (rows in groups of group_size, each group one prompt:
    prompt_ids, prompt_mask (N, P) left-padded): its last state (prompts, hidden) and each layer's
    keys and values (prompts, KV heads, P, head dim). Under gradient checkpointing in training
    the pass keeps only its keys and values, and is recomputed in backward."""
    prompt_ids = rows.prompt_ids[::group_size]  # (prompts, P): one row a group
    prompt_mask = rows.prompt_mask[::group_size]
    if not torch.equal(prompt_ids.repeat_interleave(group_size, 0), rows.prompt_ids):
        raise ValueError(
            f"share_prompts: rows of a group of {group_size} hold different prompts; "
            "share them only where each group of rows answers one prompt (--no-share-prompts)"
        )
    checkpointed = any(
        m.gradient_checkpointing
        for m in decoder.modules()
        if isinstance(m, GradientCheckpointingLayer)
    )
    if checkpointed and decoder.training and torch.is_grad_enabled():  # keep only its keys, values
        return checkpoint(encoded_prompts, decoder, prompt_ids, prompt_mask, use_reentrant=False)
    return encoded_prompts(decoder, prompt_ids, prompt_mask)


def completion_pass(decoder, rows, prompts: tuple, group_size: int) -> torch.Tensor:
    """(N, T, hidden): the states that predict each completion token: its group's prompt's last
    state (prompt_pass's, the first token's), then those of the row's own tokens, each attending
    to the prompt's keys and values before its own; rows of like lengths pass together, each
    bucket padded only to its own longest row (length_buckets)."""
    last, keys, values = prompts
    first = last.repeat_interleave(group_size, 0)[:, None]  # (N, 1, hidden): predicts token 0
    cache = DynamicCache()
    for layer, (layer_keys, layer_values) in enumerate(zip(keys, values)):
        cache.update(layer_keys, layer_values, layer)
    prompt_width = rows.prompt_ids.shape[1]
    fed = rows.completion_ids[:, :-1]  # (N, T - 1): the last token predicts nothing
    mask = torch.cat([rows.prompt_mask, rows.completion_mask[:, :-1].long()], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, prompt_width:]  # as the plain pass
    needed = (rows.completion_mask.sum(1).long() - 1).clamp(min=0)  # (N,) fed tokens that count
    parts, order = [], []
    for bucket in length_buckets(needed):  # rows of like lengths, each padded to its own longest
        width = int(needed[bucket].max())
        states = first[bucket, :0]  # (rows, 0, hidden): no token to feed
        if width:
            states = decoder_states(
                decoder,
                fed[bucket, :width],
                attention_mask=mask[bucket, : prompt_width + width],
                position_ids=positions[bucket, :width],
                cache=PromptCache(cache.layers, row_prompts=bucket // group_size),
            )  # (rows, width, hidden): completion token t predicts token t + 1
        parts.append(torch.nn.functional.pad(states, (0, 0, 0, fed.shape[1] - width)))
        order.append(bucket)
    hidden = torch.cat(parts)[torch.cat(order).argsort()]  # (N, T - 1, hidden), rows in order
    return torch.cat([first, hidden], 1)[:, : rows.completion_ids.shape[1]]


def decoder_states(decoder, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    """The decoder's last hidden states over completion tokens that attend to the prompts' keys
    and values in `cache`."""
    with layer_checkpointing(decoder, _can_checkpoint_with_cache=True):
        return decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,  # (rows, P + width)
            position_ids=position_ids,
            use_cache=False,  # the layers read the cache they are handed; it keeps nothing
            **loading.cache_argument(decoder, cache),
        ).last_hidden_state


PASS_POSITIONS = 256  # what one more pass costs, in padded positions (on a CPU: far less)


def length_buckets(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Rows sorted by length, split into buckets that minimise the padded positions computed,
    each bucket counting PASS_POSITIONS more (one bucket where splitting saves less): the row
    indices of each. Exact dynamic programming over the sorted lengths."""
    order = lengths.argsort(stable=True)
    ordered = lengths[order].tolist()
    n = len(ordered)
    best = [0] + [math.inf] * n  # best[j]: the cheapest split of the first j sorted rows
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last bucket holds sorted rows i .. j - 1, as wide as row j - 1
            cost = best[i] + (j - i) * ordered[j - 1] + PASS_POSITIONS
            if cost < best[j]:
                best[j], start[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[start[j] : j])
        j = start[j]
    return buckets[::-1]
