"""cwgrpo_utils: what cwgrpo.py and evaluate.py call for everything that is not the algorithm.

Each module knows nothing of cwgrpo and never imports it (as cleanRL keeps cleanrl_utils/):

- cli: command lines as dataclasses, each option's range beside its field
- run_config: the run's options (RunConfig), beside the algorithm's Config in cwgrpo.py
- run: a run's machinery around the training loop: header, resume, records, checkpoints, summary
- run_folder: a run's output folder (lock, stop signals, resume policy, metrics.jsonl, progress)
- checkpoints: checkpoints written atomically, the RNG states they hold, the resume command
- trackers: TensorBoard, W&B and trackio, each optional
- loading: models, tokenizers, data and the device, every failure one line
- lora: LoRA through PEFT, its reference and its merged weights
- precision: bf16, fp16 or fp32 by the card, the loss scaler, the skipped steps
- memory_plan: the GPU memory and disk a run needs, before anything loads
- batch: a rollout batch's rows, selected, joined and cut in micro-batches
- prompts: the prompts a run trains on, in a seeded order
- grading_pool: processes that grade under a hard time limit
- fast_logprobs: the fast drop-in for cwgrpo.py's log-probs, built on
  - shared_prompt: each group's prompt encoded once
  - lm_head: log-probs and entropies through the LM head, chunked over positions
- metrics: what metrics.jsonl records of a step
- plots, token_page: what a run draws: its curves, the ablation's, tokens.html
- vllm_engine: the optional vLLM sampler
- presets: the CPU presets' options, tasks and held-out sets, in one place
- preset_models: the CPU presets' models made ready on first use, by
  - tiny: the tiny presets' models and tasks, built here
  - smollm2: the real-model presets' tasks, and their model built from a GGUF where the hub is off

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
