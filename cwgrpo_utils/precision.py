"""The precision a run computes in (--precision), and what guards its optimizer steps.

auto chooses by the card (docs/gpu.md): bf16 autocast over fp32 master weights on a CUDA card of
compute capability 8.0 or more; fp16 autocast with a dynamic loss scaler on 7.x (a T4, a V100:
no bf16 tensor cores, where bf16 runs emulated and far slower; since PyTorch 2.4
is_bf16_supported() counts emulation, so the capability decides); fp32 on a CPU. A card below 7.0
has no kernels in current PyTorch wheels. An explicit value runs where torch allows it: fp16 and
bf16 autocast on a CPU too, the CPU twins of the GPU's paths.

One mechanism skips an optimizer step whose gradient is not finite, in every precision: fp16's
scaler finds an overflow and halves its scale, and a NaN from anywhere (a pathological batch, an
overflow in bf16) is caught by the same finiteness check of the gradient's norm. A skipped step
changes no weight, no AdamW moment and no learning rate; SkippedSteps counts them, and a run of
them in a row stops the run before it trains on nothing.
"""

import dataclasses

import torch

from cwgrpo_utils import checkpoints

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "half", "fp32": "float32"}


def capability_choice(major: int, minor: int, card: str) -> tuple[str, str]:
    """auto's choice on a CUDA card, and why; a card below 7.0 is one line naming what to do."""
    if major < 7:
        raise SystemExit(
            f"error: {card} (compute capability {major}.{minor}) has no kernels in current PyTorch "
            "wheels, which need 7.0 or more (a T4, V100 or newer); use another GPU, or the CPU "
            "demo: --preset tiny --device cpu"
        )
    if major >= 8:
        return "bf16", f"bf16: {card} has bf16 (compute capability {major}.{minor})"
    return "fp16", f"fp16: {card} has no bf16 (compute capability {major}.{minor})"


@dataclasses.dataclass
class Precision:
    """What a run computes in on `device`: name (bf16, fp16 or fp32), and why (the run header)."""

    name: str
    reason: str
    device: torch.device

    @classmethod
    def choose(cls, requested: str, device: torch.device, capability=None, card: str = ""):
        """--precision on `device`; capability and card default to the CUDA card's own."""
        if device.type != "cuda":
            if requested == "auto":
                return cls("fp32", "fp32: no CUDA GPU", device)
            if requested == "fp32":
                return cls("fp32", "fp32: as asked", device)
            return cls(requested, f"{requested}: as asked, autocast on the {device.type}", device)
        card = card or torch.cuda.get_device_name(device)
        major, minor = capability or torch.cuda.get_device_capability(device)
        name, reason = capability_choice(major, minor, card)
        if requested != "auto":
            name, reason = requested, f"{requested}: as asked"
            if requested == "bf16" and major < 8:
                reason += (
                    f" (emulated on {card}, compute capability {major}.{minor}: fp16 is faster)"
                )
        return cls(name, reason, device)

    @property
    def dtype(self) -> torch.dtype:
        """What the reference model, the KV cache, a LoRA run's frozen base and the vLLM engine
        hold: the autocast dtype, or fp32."""
        return DTYPES[self.name]

    @property
    def vllm_dtype(self) -> str:
        return VLLM_DTYPES[self.name]

    def autocast(self):
        """A context of autocast in this precision (none for fp32): compute in bf16 or fp16 over
        the fp32 master weights; the log-softmax, the ratios, k3 and the methods' statistics
        stay fp32 (autocast runs them in fp32, and cwgrpo casts the logits first)."""
        return torch.autocast(self.device.type, self.dtype, enabled=self.name != "fp32")

    def scaler(self) -> torch.amp.GradScaler:
        """fp16's dynamic loss scaler (torch's defaults: 2^16, halved after an overflow, doubled
        after 2,000 steps without one); in any other precision one that does nothing."""
        return torch.amp.GradScaler(self.device.type, enabled=self.name == "fp16")


class SkippedSteps:
    """The optimizer steps whose gradient norm was not finite (skipped: no weight, moment or
    learning rate changed): their total, and how many in a row; `limit` in a row stop the run."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.in_a_row = 0

    def count(self, finite: bool) -> None:
        self.total += not finite
        self.in_a_row = 0 if finite else self.in_a_row + 1

    def stop_if_too_many(self, run, record: dict) -> None:
        """One line and the run ends, when `limit` optimizer steps in a row were skipped: what
        happened, how many, and the newest checkpoint to resume from (none is written here)."""
        if self.in_a_row < self.limit:
            return
        newest = checkpoints.latest_checkpoint(run.path)
        resume = f"the newest checkpoint, {newest}, resumes with: {checkpoints.resume_command()}"
        if newest is None:
            resume = "no checkpoint was written yet"
        raise SystemExit(
            f"error: {self.in_a_row} optimizer steps in a row had a non-finite gradient (the last, "
            f"step {record['step']}: loss {record['loss']}, grad norm {record['grad_norm']}) and "
            f"changed nothing, so the run stops (--max-skipped-steps {self.limit}); {resume}; a "
            "resume replays the same steps: a new run with a lower --learning-rate or --precision "
            "fp32 changes them"
        )

    def state_dict(self) -> dict:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.total = state["total"]
        self.in_a_row = state["in_a_row"]
