"""The precision a run computes in (--precision), and what guards its optimizer steps.

auto chooses by the card (docs/gpu.md): bf16 autocast over fp32 master weights on a CUDA card of
compute capability 8.0 or more; fp16 autocast with a dynamic loss scaler on 7.x (a T4, a V100: no
bf16 tensor cores; since PyTorch 2.4 is_bf16_supported() counts emulation, so the capability
decides); fp32 on a CPU. An explicit value runs where the card has it: bf16 on a 7.x card is
refused in one line (emulated, it is far slower, and vLLM stops on it), and so is a card the
installed PyTorch has no kernels for (CUDA 13 builds start at sm_75: no V100). fp16 and bf16
autocast run on a CPU too, the CPU twins of the GPU's paths.

One mechanism skips an optimizer step whose gradient is not finite, in every precision: fp16's
scaler finds an overflow and halves its scale, and a NaN from anywhere (a pathological batch, an
overflow in bf16) is caught by the same finiteness check of the gradient's norm. A skipped step
changes no weight, no AdamW moment and no learning rate; SkippedSteps counts them, and a run of
them in a row stops the run before it trains on nothing.
"""

import dataclasses
import re

import torch

from cwgrpo_utils.run import checkpoints

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "half", "fp32": "float32"}


def capability_choice(major: int, minor: int, card: str) -> tuple[str, str]:
    """auto's choice on a CUDA card, and why."""
    if major >= 8:
        return "bf16", f"bf16: {card} has bf16 (compute capability {major}.{minor})"
    return "fp16", f"fp16: {card} has no bf16 (compute capability {major}.{minor})"


def has_kernels(major: int, minor: int, arch_list: list[str]) -> bool:
    """Whether a PyTorch build for arch_list (torch.cuda.get_arch_list(): "sm_75", "sm_90a",
    "compute_120", ...) runs on a card of compute capability major.minor: a cubin of its major
    and a minor at most its own, or PTX for a capability at most its own (the driver compiles
    it). Stricter than torch's own warning, which accepts any cubin of the same major (sm_75's do
    not run on a V100, 7.0)."""
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        built = int(re.sub(r"\D", "", number) or 0)  # sm_90a: 90
        if kind == "sm" and built // 10 == major and built % 10 <= minor:
            return True
        if kind == "compute" and built <= 10 * major + minor:
            return True
    return False


def check_card(card: str, capability: tuple[int, int], requested: str, arch_list: list) -> None:
    """One line, before anything loads, for a card the installed PyTorch cannot run, and for
    --precision bf16 on a card without bf16."""
    major, minor = capability
    if not has_kernels(major, minor, arch_list):
        raise SystemExit(
            f"error: {card} (compute capability {major}.{minor}, sm_{major}{minor}) has no kernels "
            f"in this PyTorch build (torch {torch.__version__}: {' '.join(arch_list)}); install a "
            f"build with sm_{major}{minor} (an older CUDA's: pytorch.org lists them), use another "
            "GPU, or the CPU demo: --preset tiny --device cpu"
        )
    if requested == "bf16" and major < 8:
        raise SystemExit(
            f"error: --precision bf16, but {card} (compute capability {major}.{minor}) has no "
            "bf16; use --precision auto (fp16 on this card) or --precision fp16"
        )


@dataclasses.dataclass
class Precision:
    """What a run computes in on `device`: name (bf16, fp16 or fp32), and why (the run header)."""

    name: str
    reason: str
    device: torch.device

    @classmethod
    def choose(cls, requested: str, device: torch.device, capability=None, card="", arch_list=None):
        """--precision on `device`; capability, card and arch_list (the kernels PyTorch has)
        default to the CUDA card's and the installed build's own."""
        if device.type != "cuda":
            if requested == "auto":
                return cls("fp32", "fp32: no CUDA GPU", device)
            if requested == "fp32":
                return cls("fp32", "fp32: as asked", device)
            return cls(requested, f"{requested}: as asked, autocast on the {device.type}", device)
        card = card or torch.cuda.get_device_name(device)
        capability = capability or torch.cuda.get_device_capability(device)
        arch_list = torch.cuda.get_arch_list() if arch_list is None else arch_list
        check_card(card, capability, requested, arch_list)
        name, reason = capability_choice(*capability, card)
        if requested != "auto":
            name, reason = requested, f"{requested}: as asked"
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
