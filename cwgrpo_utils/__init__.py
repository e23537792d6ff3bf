"""cwgrpo_utils: what cwgrpo.py and evaluate.py call for everything that is not the algorithm.

Each module knows nothing of cwgrpo and never imports it (as cleanRL keeps cleanrl_utils/):

- cli: command lines as dataclasses, each option's range beside its field
- grading_pool: processes that grade under a hard time limit
- lm_head: log-probs and entropies through the LM head, chunked over positions
- loading: models, tokenizers, data and the device, every failure one line
- run_folder: a run's output folder (lock, stop signals, resume policy, metrics.jsonl)
- checkpoints: checkpoints written atomically, the RNG states they hold
- memory_plan: the GPU memory and disk a run needs, before anything loads
- plots, token_page: what a run shows a person
- tiny: the tiny presets' models and tasks, built on first use
- smollm2: the real-model preset's task, and its model built from a GGUF where the hub is off
- presets: the CPU presets made ready on first use, and the benchmark each is evaluated on
- vllm_engine: the optional vLLM sampler
"""

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent  # the clone's root, whatever the working folder
# Each CPU preset's folder, one per clone: its task, and its model where one is built here
CPU_PRESETS = ("tiny", "tiny-chain", "smollm2-sums")
BASES = {name: REPOSITORY / "runs" / f"{name}-base" for name in CPU_PRESETS}
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # smollm2-sums's model, on the hub
