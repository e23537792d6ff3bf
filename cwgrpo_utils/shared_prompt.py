"""Each group's prompt encoded once (--share-prompts): a group's G completions attend to their
prompt's keys and values, computed once, instead of every row encoding the prompt again (Prefix
Grouper, arXiv 2506.05433). The same computation as the decoder over each row's [prompt,
completion], to floating-point rounding (tested): each completion query sees exactly the keys it
would, and the gradient reaching the shared prompt's states is the sum over its group of what
each row's copy of it would get.

    hidden = completion_states(model.get_decoder(), rollout, group_size)   # (N, T, hidden)

Under gradient checkpointing transformers turns a layer's cache off in training (its recompute
would write the cache a second time). Here the completions read the prompt's keys and values
from a cache that stores nothing (PromptCache), so each layer is checkpointed with it as usual;
the prompt pass itself runs under one checkpoint of its own, keeping only its keys and values and
recomputing it in backward, so the checkpointing saving holds.
"""

import contextlib

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

from cwgrpo_utils import loading


class PromptCache(DynamicCache):
    """The prompts' keys and values (one row a group) for the completions' pass, read-only:
    update returns each layer's, repeated for the group's rows and followed by the completions'
    own, and stores nothing, so a checkpointed layer's recompute reads what its first pass read."""

    def __init__(self, layers: list, group_size: int):
        super().__init__()
        self.layers = layers  # the prompt pass's, (prompts, KV heads, P, head dim) each
        self.group_size = group_size

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        keys = torch.cat([layer.keys.repeat_interleave(self.group_size, 0), key_states], -2)
        values = torch.cat([layer.values.repeat_interleave(self.group_size, 0), value_states], -2)
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


def prompt_pass(decoder, prompt_ids, prompt_mask):
    """The prompts' last states (prompts, hidden) and each layer's keys and values, the layers
    run whole (a layer checkpointed in training keeps no cache)."""
    cache = DynamicCache()
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)  # left padding: real tokens only
    with layer_checkpointing(decoder, gradient_checkpointing=False):
        hidden = decoder(
            input_ids=prompt_ids,
            attention_mask=loading.attention_mask(decoder, prompt_mask),
            position_ids=positions,
            use_cache=True,
            **loading.cache_argument(decoder, cache),  # {"cache": cache}, by version
        ).last_hidden_state
    keys = tuple(layer.keys for layer in cache.layers)
    values = tuple(layer.values for layer in cache.layers)
    return hidden[:, -1], keys, values


def completion_states(decoder, rollout, group_size: int) -> torch.Tensor:
    """(N, T, hidden) states that predict each completion token of a rollout (rows in groups of
    group_size sharing their prompt: prompt_ids, prompt_mask (N, P) left-padded, completion_ids,
    completion_mask (N, T)), the prompt encoded once a group."""
    prompt_ids = rollout.prompt_ids[::group_size]  # (prompts, P): one row a group
    prompt_mask = rollout.prompt_mask[::group_size]
    checkpointed = any(
        m.gradient_checkpointing
        for m in decoder.modules()
        if isinstance(m, GradientCheckpointingLayer)
    )
    if checkpointed and decoder.training and torch.is_grad_enabled():  # keep only its keys, values
        last, keys, values = checkpoint(
            prompt_pass, decoder, prompt_ids, prompt_mask, use_reentrant=False
        )
    else:
        last, keys, values = prompt_pass(decoder, prompt_ids, prompt_mask)
    cache = DynamicCache()
    for layer, (layer_keys, layer_values) in enumerate(zip(keys, values)):
        cache.update(layer_keys, layer_values, layer)
    shared = PromptCache(cache.layers, group_size)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)  # (N, P + T)
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, prompt_ids.shape[1] :]  # as the plain pass
    with layer_checkpointing(decoder, _can_checkpoint_with_cache=True):
        hidden = decoder(
            input_ids=rollout.completion_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **loading.cache_argument(decoder, shared),
        ).last_hidden_state  # (N, T, hidden): completion position t predicts token t + 1
    first = last.repeat_interleave(group_size, 0)[:, None]  # (N, 1, hidden): predicts token 0
    return torch.cat([first, hidden[:, :-1]], 1)
