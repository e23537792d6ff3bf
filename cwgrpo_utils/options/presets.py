"""cwgrpo.py's --preset recipes, in one place: the paper's for one GPU, and the CPU ones, each
with the folder its model and task are built in, its task, and the held-out problems it is
evaluated on (evaluation_sets/). Light on purpose: cwgrpo.py reads it before it imports torch.

- tiny, tiny-chain: a Qwen2 of 115k parameters warm-started on sums of digits (tiny.py builds it
  on first use), one decision a completion or three;
- smollm2-sums, smollm2-3shot: SmolLM2-135M-Instruct, a real LM that writes no think tags, so
  only accuracy counts (smollm2.py writes their tasks and, where the hub is off, builds it from a
  GGUF file); smollm2-3shot's task was chosen for the power of an ablation (docs/smollm2.md).
"""

from cwgrpo_utils import REPOSITORY
from cwgrpo_utils.options.cli import shown_path

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the smollm2 presets' model, on the hub
# Each CPU preset's folder, one per clone: its task, and its model where one is built here
BASES = {
    name: REPOSITORY / "runs" / f"{name}-base"
    for name in ("tiny", "tiny-chain", "smollm2-sums", "smollm2-3shot")
}
EVALUATION_SETS = REPOSITORY / "evaluation_sets"

# LoRA on every linear layer at 10x full fine-tuning's learning rate ("LoRA Without Regret")
LORA = dict(lora_rank=32, learning_rate=1e-5)
# The GPU recipes' values; Config's defaults (config.py) are the paper's 1.5B one (docs/math.md,
# "Recipe")
GPU_PRESETS = {
    "paper-1.5b": {},
    # Qwen2.5-Math-7B has 4,096 positions: prompt + completion fit in them with --length-limit total
    "paper-7b": dict(model="Qwen/Qwen2.5-Math-7B-Instruct", format_weight=0.0, steps=150),
    # The 1.5B recipe on one 24 GB card: TRL's quick-start model, 3,072 positions, 4 prompts at once
    "qwen0.5b-24gb": dict(
        model="Qwen/Qwen2.5-0.5B-Instruct", max_completion_length=3072, rollout_chunk=4
    ),
    # The paper's model and recipe on one 24 GB card under LoRA: 3,072 positions, 4 prompts at once
    "paper-1.5b-lora-24gb": {**LORA, "max_completion_length": 3072, "rollout_chunk": 4},
    # ... on a free 16 GB T4 (fp16 by --precision auto): 1,536 positions, peak 13.1 of 14.7 GB
    "paper-1.5b-lora-16gb": {**LORA, "max_completion_length": 1536, "rollout_chunk": 4},
    # Qwen2.5-Math-7B with the paper's 7B recipe on one 80 GB card, under the same LoRA
    "paper-7b-lora-80gb": {
        **LORA,
        "model": "Qwen/Qwen2.5-Math-7B-Instruct",
        "format_weight": 0.0,
        "steps": 150,
    },
}

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
    # Sums of a 2-digit and a 1-digit number after three worked examples, which the base model gets
    # right 28% of the time: 4 prompts a step so that most groups carry a signal; 15 steps, so that
    # 5 seeds of 3 methods and their held-out evaluations fit 90 minutes on 2 CPU cores
    "smollm2-3shot": {
        **CPU_RECIPE,
        "model": SMOLLM2,
        "dataset": f"{BASES['smollm2-3shot']}/task.jsonl",
        "format_weight": 0.0,
        "prompts_per_step": 4,
        "max_prompt_length": 192,
        "max_completion_length": 32,
        "steps": 15,
        "temperature": 0.7,
        "learning_rate": 2e-5,
        "save_every": 5,
    },
}
PRESETS = {**GPU_PRESETS, **CPU_PRESETS}  # --preset's choices, the paper's 1.5B recipe first

# Each CPU preset's task: a tiny one adds `operands` digits, a decision a step, after a warm-start
# of `warmstart_steps`; a SmolLM2 one asks problems of a `form` of smollm2.TASK_FORMS; each is
# evaluated on every problem of its held-out set, with its limit
TASKS = {
    "tiny": dict(operands=2, warmstart_steps=250, evaluation_set="tiny-arithmetic.jsonl")
    | dict(max_new_tokens=40),
    "tiny-chain": dict(operands=4, warmstart_steps=1000, evaluation_set="tiny-chain.jsonl")
    | dict(max_new_tokens=64),
    # held out: 2-digit sums, asked with the same example
    "smollm2-sums": dict(form="sum-1d-fixed", evaluation_set="smollm2-sums.jsonl")
    | dict(max_new_tokens=48),
    # held out: problems of the same form, none of whose sums is asked in training
    "smollm2-3shot": dict(form="sum-2d1d-3shot", evaluation_set="smollm2-3shot.jsonl")
    | dict(max_new_tokens=32),
}

# evaluate.py's options for a CPU task's file: the question as training asks it, the gold an
# expression
QUESTION_AS_ASKED = ("--gold-format", "expr", "--prompt-template", "{question}")


def evaluate_options(preset: str) -> tuple[str, ...]:
    """evaluate.py's options for a CPU preset's model: its held-out set, the questions as they are
    (as in training), plain sampling; none for the other presets."""
    if preset not in TASKS:
        return ()
    problems = shown_path(EVALUATION_SETS / TASKS[preset]["evaluation_set"])
    sampling = ("--top-p", "1.0", "--max-new-tokens", str(TASKS[preset]["max_new_tokens"]))
    return ("--benchmarks", problems, *QUESTION_AS_ASKED, *sampling)


def final_model_evaluation(output_dir, preset: str) -> list[str]:
    """evaluate.py's arguments for a run's final model: the command a run prints, and the one
    tools.ablate --evaluate runs."""
    return ["--model", str(output_dir / "final-model"), *evaluate_options(preset)]
