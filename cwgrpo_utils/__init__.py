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

This file holds the constants cwgrpo.py reads before it imports torch: the clone's folders, the
CPU presets' option values and Open-RS's system prompt.
"""

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent  # the clone's root, whatever the working folder
# Each CPU preset's folder, one per clone: its task, and its model where one is built here
BASES = {
    name: REPOSITORY / "runs" / f"{name}-base" for name in ("tiny", "tiny-chain", "smollm2-sums")
}
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # smollm2-sums's model, on the hub
PRECISIONS = ("auto", "bf16", "fp16", "fp32")  # --precision's choices (precision.py)
# The system prompt Open-RS trains with (the paper's training data)
OPEN_RS_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer, and put your final answer within \\boxed{} . The reasoning process and "
    "answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>. Note that respond by "
    "English, NOT use other languages."
)

# What the CPU presets share: no system prompt (the toys' template has none), 8 prompts x G = 8 in
# one micro-batch, new tokens counted alone, a short warmup, no activation checkpointing, seed 0
CPU_RECIPE = dict(
    system_prompt="",
    group_size=8,
    prompts_per_step=8,
    groups_per_micro_batch=0,
    seed=0,
    max_prompt_length=64,
    length_limit="new",
    temperature=1.0,
    learning_rate=7e-4,
    warmup_ratio=0.05,
    steps=200,
    save_every=50,
    gradient_checkpointing=False,
)
# cwgrpo.py's CPU presets: tiny and tiny-chain, a model and task that tiny.py builds in the clone on
# first use (one decision a completion, or three); smollm2-sums, a real LM that writes no think
# tags, so only accuracy counts (smollm2.py)
CPU_PRESETS = {
    "tiny": {
        **CPU_RECIPE,
        "model": f"{BASES['tiny']}/model",
        "dataset": f"{BASES['tiny']}/arithmetic.jsonl",
        "max_completion_length": 40,
    },
    "tiny-chain": {
        **CPU_RECIPE,
        "model": f"{BASES['tiny-chain']}/model",
        "dataset": f"{BASES['tiny-chain']}/arithmetic.jsonl",
        "max_completion_length": 64,
    },
    "smollm2-sums": {
        **CPU_RECIPE,
        "model": SMOLLM2,
        "dataset": f"{BASES['smollm2-sums']}/sums.jsonl",
        "format_weight": 0.0,
        "prompts_per_step": 2,
        "max_prompt_length": 128,
        "max_completion_length": 48,
        "steps": 12,
        "temperature": 0.7,
        "learning_rate": 2e-5,
        "save_every": 10,
    },
}
