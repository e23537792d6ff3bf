"""A batch of rows of tensors, as cwgrpo.py's Samples and Batch hold one: rows selected with their
padding columns trimmed, micro-batches of whole groups of consecutive rows, batches joined. Each
field says on its own how it is padded (per_row, whole_batch), so nothing here knows a name.

    @dataclass
    class Samples(Rows):
        prompt_ids: torch.Tensor = per_row("left", token_ids=True)  # (N, P)
        truncated: torch.Tensor = per_row()  # (N,)
"""

import dataclasses

import torch
import torch.nn.functional as F


def per_row(padded: str = "", token_ids: bool = False, mask: bool = False):
    """A field of one entry a row: a (N,) tensor or a list (padded ""), or (N, columns) padded on
    the "left" (prompts) or the "right" (completions), with the pad token where it holds token ids
    and with 0 elsewhere; `mask`: the side's mask, 1 where a row's real entries are."""
    return dataclasses.field(metadata={"padded": padded, "token_ids": token_ids, "mask": mask})


def whole_batch():
    """A field of the whole batch (a statistic over all its rows), never sliced."""
    return dataclasses.field(metadata={"whole_batch": True})


class Rows:
    """For a dataclass whose fields are per_row or whole_batch ones."""

    @classmethod
    def joined(cls, parts: list, pad: int):
        """The parts' rows, in order, as one batch, each 2-D field padded to the widest on its
        side (token ids with `pad`, the rest with 0)."""
        out = {}
        for f in dataclasses.fields(cls):
            values = [getattr(part, f.name) for part in parts]
            if values[0] is None or f.metadata.get("whole_batch"):
                out[f.name] = values[0]
            elif isinstance(values[0], list):
                out[f.name] = [item for value in values for item in value]
            elif not f.metadata["padded"]:
                out[f.name] = torch.cat(values)
            else:
                width = max(value.shape[1] for value in values)
                fill = pad if f.metadata["token_ids"] else 0
                left = f.metadata["padded"] == "left"
                sides = [
                    (width - v.shape[1], 0) if left else (0, width - v.shape[1]) for v in values
                ]
                padded = [F.pad(v, side, value=fill) for v, side in zip(values, sides)]
                out[f.name] = torch.cat(padded)
        return cls(**out)

    def select(self, start: int, stop: int):
        """Rows [start, stop), with their all-padding columns trimmed off: on the left those where
        no row's prompt has begun, on the right those after the longest completion."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for f in dataclasses.fields(self):
            if out[f.name] is not None and not f.metadata.get("whole_batch"):
                out[f.name] = out[f.name][start:stop]
        first_prompt_column = int(out[self.mask("left")].any(0).nonzero()[0, 0])
        completion_len = int(out[self.mask("right")].sum(1).max())
        for f in dataclasses.fields(self):
            if out[f.name] is not None and f.metadata.get("padded") == "left":
                out[f.name] = out[f.name][:, first_prompt_column:]
            elif out[f.name] is not None and f.metadata.get("padded") == "right":
                out[f.name] = out[f.name][:, :completion_len]
        return type(self)(**out)

    @classmethod
    def mask(cls, side: str) -> str:
        """The name of the mask of the fields padded on `side`."""
        fields = dataclasses.fields(cls)
        return next(
            f.name for f in fields if f.metadata.get("mask") and f.metadata["padded"] == side
        )

    def micro_batches(self, n_rows: int):
        """(block, part) for each micro-batch of n_rows consecutive rows (whole groups): the part's
        rows with their padding columns trimmed, and the (rows, columns) block of this batch's
        right-padded (N, T) tensors it fills."""
        total = len(getattr(self, self.mask("right")))
        for start in range(0, total, n_rows):
            part = self.select(start, start + n_rows)
            width = getattr(part, self.mask("right")).shape[1]
            yield (slice(start, start + n_rows), slice(0, width)), part
