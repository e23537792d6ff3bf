"""The fast drop-in for cwgrpo.py's completion_logprobs (section 3), which a run uses by default:
the same log-probs, entropies and states to floating-point rounding (tests/test_shared_prompts.py,
test_cwgrpo.py), in a fraction of the memory and time.

- shared_states: each group's prompt encoded once, its G completions attending to its keys and
  values (shared_prompt.py), instead of every row encoding the prompt again (--share-prompts);
- completion_logprobs: the LM head over those states (or cwgrpo.py's plain ones) a chunk of
  positions at a time, recomputed in backward, never holding vocab x length logits (lm_head.py).
"""

import torch

from cwgrpo_utils.lm_head import chunked_logprobs
from cwgrpo_utils.shared_prompt import completion_states


def shared_states(model, rows, group_size: int) -> torch.Tensor:
    """= cwgrpo.completion_states(model, rows), each group of group_size rows' prompt once."""
    return completion_states(model.get_decoder(), rows, group_size)


def completion_logprobs(model, rows, temperature: float, states, chunk_elements: int):
    """= cwgrpo.completion_logprobs(model, rows, temperature) over states(model, rows): (rows, T)
    log-probs and entropies, 0 on padding, and the (rows, T, hidden) states that predict them;
    chunk_elements logits at once (0: every position's)."""
    hidden = states(model, rows)  # (rows, T, hidden)
    valid = rows.completion_mask.bool()
    head = model.get_output_embeddings().weight  # (vocab, hidden)
    targets = rows.completion_ids[valid]
    chunk = chunk_elements or valid.sum().item() * head.shape[0]
    logp_valid, entropy_valid = chunked_logprobs(
        hidden[valid], head, targets, temperature=temperature, chunk_elements=chunk
    )  # (valid tokens,) each
    logp = torch.zeros(valid.shape, device=hidden.device, dtype=logp_valid.dtype)  # (rows, T)
    entropy = torch.zeros_like(logp)
    logp[valid] = logp_valid
    entropy[valid] = entropy_valid
    return logp, entropy, hidden
