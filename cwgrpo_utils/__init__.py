"""cwgrpo_utils: what cwgrpo.py and evaluate.py call for everything that is not a training step's
algorithm. Each module knows nothing of cwgrpo and never imports it (as cleanRL keeps
cleanrl_utils/), in a room named for what it holds:

- options/: the command lines, read before torch: the algorithm's Config (config.py), the run's
  RunConfig (run_config.py), the presets, and dataclasses as command lines (cli.py)
- run/: a training run's machinery around the loop: Run (run.py), its folder, records and resume
  (folder.py), checkpoints, metrics, trackers, pictures (plots.py, token_page.py)
- machine/: what a run computes on: precision, CPU threads, the GPU memory plan, the vLLM
  sampler, the grading processes
- fast/: section 3's fast paths: each group's prompt once, the LM head in chunks
- models/: models and what they read: loading, LoRA, the CPU presets' models and tasks, the
  prompts a run trains on, a batch's rows

This file holds the constants read before torch is imported: the clone's root, the precisions,
the evaluation's temperature, Open-RS's system prompt.
"""

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent  # the clone's root, whatever the working folder
PRECISIONS = ("auto", "bf16", "fp16", "fp32")  # --precision's choices (precision.py)
EVALUATION_TEMPERATURE = 0.6  # the paper's evaluation samples at it (docs/math.md, "Evaluation")
# The system prompt Open-RS trains with (the paper's training data)
OPEN_RS_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer, and put your final answer within \\boxed{} . The reasoning process and "
    "answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>. Note that respond by "
    "English, NOT use other languages."
)
