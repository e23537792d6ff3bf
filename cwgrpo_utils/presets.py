"""The CPU presets' models and tasks (cwgrpo.py's PRESETS), ready on first use in the clone: tiny's
and tiny-chain's built here (tiny.py); smollm2-sums's task written and, where the hub cannot be
reached, its model built from a GGUF file (smollm2.py)."""

from cwgrpo_utils import REPOSITORY, smollm2, tiny
from cwgrpo_utils.cli import shown_path

# Each CPU preset's benchmark and completion limit: every problem of a tiny task; for smollm2-sums,
# 64 sums of two-digit numbers, which it never trains on
BENCHMARKS = dict(tiny.TASKS)
BENCHMARKS["smollm2-sums"] = smollm2.BENCHMARK


def ready(model: str, dataset: str = "") -> str:
    """The folder or hub id to load `model` from, once what it and `dataset` need is built."""
    tiny.build_if_missing(model)
    return smollm2.ready(model, dataset)


def evaluate_options(preset: str) -> tuple[str, ...]:
    """evaluate.py's options for a CPU preset's model: its benchmark, the questions as they are
    (as in training), plain sampling; none for the other presets."""
    if preset not in BENCHMARKS:
        return ()
    bench = shown_path(REPOSITORY / "benchmarks" / BENCHMARKS[preset]["benchmark"])
    prompts = ("--gold-format", "expr", "--prompt-template", "{question}")
    sampling = ("--top-p", "1.0", "--max-new-tokens", str(BENCHMARKS[preset]["max_new_tokens"]))
    return ("--benchmarks", bench, *prompts, *sampling)


def final_model_evaluation(output_dir, preset: str) -> list[str]:
    """evaluate.py's arguments for a run's final model: the command a run prints, and the one
    tools.ablate --evaluate runs."""
    return ["--model", str(output_dir / "final-model"), *evaluate_options(preset)]
