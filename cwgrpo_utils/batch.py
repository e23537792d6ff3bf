"""A batch of rows of tensors, as cwgrpo.py's Rollout holds one: rows selected with their padding
columns trimmed, and micro-batches of whole groups of consecutive rows."""

import dataclasses

import torch
import torch.nn.functional as F


class Rows:
    """For a dataclass whose tensors have one row per completion: prompt_ids and prompt_mask
    (N, P) left-padded, completion_mask and every other 2-D tensor (N, T) right-padded, 1-D tensors
    and lists (N,); batch_entropy, a whole batch's, is never sliced."""

    @classmethod
    def joined(cls, parts: list, pad: int):
        """The parts' rows, in order, as one batch: the prompts left-padded to the widest (ids
        with `pad`, mask 0), the per-token tensors right-padded to the longest (completion_ids
        with `pad`, the rest with 0)."""
        out = {}
        for f in dataclasses.fields(cls):
            values = [getattr(part, f.name) for part in parts]
            if values[0] is None:
                out[f.name] = None
            elif isinstance(values[0], list):
                out[f.name] = [item for value in values for item in value]
            elif values[0].dim() == 1:
                out[f.name] = torch.cat(values)
            else:
                width = max(value.shape[1] for value in values)
                fill = pad if f.name in ("prompt_ids", "completion_ids") else 0
                left = f.name in ("prompt_ids", "prompt_mask")
                sides = [
                    (width - v.shape[1], 0) if left else (0, width - v.shape[1]) for v in values
                ]
                padded = [F.pad(v, side, value=fill) for v, side in zip(values, sides)]
                out[f.name] = torch.cat(padded)
        return cls(**out)

    @classmethod
    def scored(cls, advantages: torch.Tensor, completion_mask: torch.Tensor, **tensors):
        """Scored rows as the loss reads them, for callers that hold no prompt (verl, a benchmark,
        the tests): each row's advantage, the (N, T) mask and the (N, T) tensors given (old_logp,
        ref_logp, sampler_logp: 0 if not given, ...); an empty prompt and zero ids, which the loss
        never reads."""
        n, t = completion_mask.shape
        device = completion_mask.device
        return cls(
            prompt_ids=torch.zeros(n, 0, dtype=torch.long, device=device),
            prompt_mask=torch.zeros(n, 0, dtype=torch.long, device=device),
            completion_ids=torch.zeros(n, t, dtype=torch.long, device=device),
            completion_mask=completion_mask,
            truncated=torch.zeros(n, dtype=torch.bool, device=device),
            texts=[""] * n,
            sampler_logp=tensors.pop("sampler_logp", torch.zeros_like(completion_mask)),
            advantages=advantages,
            **tensors,
        )

    def select(self, start: int, stop: int):
        """Rows [start, stop), with their all-padding columns trimmed off."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in out.items():
            if value is not None and name != "batch_entropy":  # the batch's, not a row's
                out[name] = value[start:stop]
        first_prompt_column = int(out["prompt_mask"].any(0).nonzero()[0, 0])
        completion_len = int(out["completion_mask"].sum(1).max())
        for name, value in out.items():
            if name in ("prompt_ids", "prompt_mask"):
                out[name] = value[:, first_prompt_column:]
            elif isinstance(value, torch.Tensor) and value.dim() == 2:  # (N, T): per token
                out[name] = value[:, :completion_len]
        return type(self)(**out)

    def micro_batches(self, rows: int):
        """(block, part) for each micro-batch of `rows` consecutive rows (whole groups): the part's
        rows with their padding columns trimmed, and the (rows, columns) block of this batch's
        (N, T) tensors it fills."""
        for start in range(0, len(self.completion_mask), rows):
            part = self.select(start, start + rows)
            yield (slice(start, start + rows), slice(0, part.completion_mask.shape[1])), part
