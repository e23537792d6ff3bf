"""LoRA through PEFT: a frozen base model with a small trained adapter (Hu et al. 2021), as TRL's
GRPOTrainer takes a peft_config. The policy is the base plus the adapter; the KL reference is the
same model with the adapter disabled, so no second copy of the weights is held.

    model = adapted(base, rank=16, alpha=32, target_modules="all-linear")
    with reference_of(model, None) as reference:   # the base: the adapter switched off
        ...
    merged_weights(model)                           # W + (alpha / r) B A, one layer at a time

A checkpoint holds the adapter only (adapter_config.json, adapter_model.safetensors); the final
model is merged, so it loads as any other.
"""

import contextlib
import warnings

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

ADAPTER = "default"  # PEFT's name for a model's one adapter


def adapted(base, rank: int, alpha: float, target_modules: str, seed: int = 0):
    """base with a fresh LoRA adapter on `target_modules` ("all-linear": every linear layer but
    the LM head; or comma-separated module names). B starts at 0, so the policy starts as the base
    exactly; A is drawn from `seed`, leaving the global RNG as it was. The adapter is fp32 whatever
    the base's dtype (PEFT's autocast_adapter_dtype)."""
    targets = target_modules if target_modules == "all-linear" else target_modules.split(",")
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    devices = [base.device] if base.device.type == "cuda" else []
    with quiet_peft(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return get_peft_model(base, config)


def load_adapter(base, checkpoint, trainable: bool = True):
    """base with the adapter a checkpoint holds."""
    with quiet_peft():
        return PeftModel.from_pretrained(base, str(checkpoint), is_trainable=trainable)


@contextlib.contextmanager
def quiet_peft():
    """PEFT 0.21 reads transformers' deprecated is_gradient_checkpointing, which warns each run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        yield


def is_adapted(model) -> bool:
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def reference_of(model, reference):
    """The KL reference: `reference` (a frozen copy) when there is one, else `model` with its
    LoRA adapter disabled, which is the frozen base itself."""
    if reference is not None:
        yield reference
    else:
        with model.disable_adapter():
            yield model


@torch.no_grad()
def merged_weights(model):
    """The weights of the model as one plain model of its architecture holds them, one at a time
    (name, tensor): for an adapted model, the base's with each adapted layer's W + (alpha / r) B A,
    under the base's own names (what vLLM loads); else its state_dict. A layer is merged when it is
    reached, in W's dtype (PEFT's delta is the fp32 adapter's), so a push holds one layer's merge
    at a time, not the model's in fp32. Nothing is merged in place: W + BA - BA is not W in
    floating point, so an in-place merge and unmerge would drift the base a little every push."""
    if not is_adapted(model):
        yield from model.state_dict().items()
        return
    base = model.get_base_model()
    adapted = {
        f"{name}.base_layer.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        if name in adapted:
            tensor = (tensor + adapted[name].get_delta_weight(ADAPTER)).to(tensor.dtype)
        yield name.replace(".base_layer.", "."), tensor


def merged_model(model):
    """The plain model the adapted one amounts to, merged in place (the end of training); a
    model without an adapter as it is."""
    return model.merge_and_unload() if is_adapted(model) else model
