"""The CPU presets' models and tasks, ready on first use in the clone: tiny's and tiny-chain's
built here (tiny.py); smollm2-sums's task written and, where the hub cannot be reached, its model
built from a GGUF file (smollm2.py). cwgrpo.py, evaluate.py and tools.ablate call ready()."""

from cwgrpo_utils.models import smollm2, tiny


def ready(model: str, dataset: str = "") -> str:
    """The folder or hub id to load `model` from, once what it and `dataset` need is built."""
    tiny.build_if_missing(model)
    return smollm2.ready(model, dataset)
