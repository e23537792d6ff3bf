"""A batch of rows of tensors, as cwgrpo.py's Rollout holds one: rows selected with their padding
columns trimmed, and micro-batches of whole groups of consecutive rows."""

import dataclasses

import torch


class Rows:
    """For a dataclass whose tensors have one row per completion: prompt_ids and prompt_mask
    (N, P) left-padded, completion_mask and every other 2-D tensor (N, T) right-padded, 1-D tensors
    and lists (N,); batch_entropy, a whole batch's, is never sliced."""

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

    def micro_batches(self, cfg):
        """(block, part) for each micro-batch of cfg.groups_per_micro_batch whole groups (0: all
        cfg.prompts_per_step of them) of cfg.group_size rows: the part's rows with padding columns
        trimmed, and the (rows, columns) block of this batch's (N, T) tensors it fills."""
        rows = (cfg.groups_per_micro_batch or cfg.prompts_per_step) * cfg.group_size
        for start in range(0, len(self.completion_mask), rows):
            part = self.select(start, start + rows)
            yield (slice(start, start + rows), slice(0, part.completion_mask.shape[1])), part
