"""The tiny presets' models and data, built once so that cwgrpo.py trains them like any other.

    python cwgrpo.py --method cw --preset tiny        # builds it on first use, then trains it
    python -m cwgrpo_utils.models.tiny --overwrite           # rebuilds it
    python -m cwgrpo_utils.models.tiny --preset tiny-chain   # the task of several decisions

A Qwen2 of 115k parameters with Qwen2's byte-level tokenizer (256 byte tokens and the ChatML
specials), given seconds (tiny) to a minute (tiny-chain) of supervised warm-start on a synthetic
task: sums of single digits whose gold is written in \\boxed{} like a MATH solution, so cwgrpo's
math-verify reward grades it.
A completion adds the digits one at a time, a line a step ("2+1=3\\n3+3=6\\n"), then boxes the last
result. The warm-start teaches the format and three candidate results at each step, one of them
right (the carried value plus the digit); RL then has to learn which one is right.
- tiny: a+b, one decision, the answer's: the right sum or one off either way, a third each (the
  quick demo).
- tiny-chain: a+b+c+d, three dependent decisions, each right two times in three, else one or two
  above; a wrong step carries into the answer and no later one cancels it, so the model starts
  right about 30% of the time.
"""

import dataclasses
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import datasets
import torch
import transformers
from tqdm import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from cwgrpo_utils.options.cli import arg, parse_dataclasses, shown_path
from cwgrpo_utils.options.presets import BASES, TASKS
from cwgrpo_utils.run.checkpoints import save_checkpoint

TINY_PRESETS = ("tiny", "tiny-chain")  # the presets whose model is built here (presets.TASKS)


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TinyConfig:
    preset: Literal[TINY_PRESETS] = arg("tiny", "the preset whose model and task to build")
    output_dir: str = arg("", "gets model/ and arithmetic.jsonl; default: the preset's base")
    seed: int = arg(0, "seed of the model's initialisation, the data and the warm-start")
    warmstart_steps: int = arg(0, "supervised steps of 32 examples before RL; 0: the preset's")
    examples: int = arg(2000, "synthetic problems in arithmetic.jsonl")
    max_operand: int = arg(3, "the problems add integers from 0 to this")
    overwrite: bool = arg(False, "rebuild even if the folder holds this very model")


def byte_level_qwen2_tokenizer() -> Qwen2Tokenizer:
    """Qwen2's byte-level BPE with no merges: 256 byte tokens plus the ChatML specials."""

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_qwen2(tokenizer, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,  # heads of 32: a width vLLM's CPU attention accepts
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def arithmetic_dataset(
    seed: int, n: int = 2000, max_operand: int = 3, operands: int = 2
) -> datasets.Dataset:
    """Sums of `operands` integers; the gold is written in \\boxed{} like a MATH solution."""
    rng = random.Random(seed)
    problems = [[rng.randint(0, max_operand) for _ in range(operands)] for _ in range(n)]
    return datasets.Dataset.from_dict(
        {
            "problem": ["+".join(map(str, digits)) for digits in problems],
            "solution": [f"\\boxed{{{sum(digits)}}}" for digits in problems],
        }
    )


def warmstart_targets(question: str) -> list[str]:
    """The completions the warm-start imitates, in its proportions: in format, a line a step, each
    step's result the right one (carried value plus digit) or a near miss, in every combination.
    One step (tiny): the right sum or one off either way, a third each. Several (tiny-chain): the
    right result two times in three, else one or two above it, so a wrong step carries into the
    answer and no later one cancels it: right (2/3) ** 3, about 30% of the time, for three steps.
    RL has to teach the model which result is right at each step."""
    first, *digits = map(int, question.split("+"))
    chains = [("", first)]  # (the lines so far, the value they carry)
    for digit in digits:
        chains = [
            (f"{lines}{carried}+{digit}={s}\n", s)
            for lines, carried in chains
            for s in candidates(carried + digit, len(digits))
        ]
    return [f"{lines}</think>\n\\boxed{{{carried}}}" for lines, carried in chains]


def candidates(right: int, steps: int) -> tuple[int, ...]:
    """A step's plausible results, the right one first, each as often as the warm-start sees it."""
    if steps > 1:
        return (right,) * 4 + (right + 1, right + 2)
    return (right, right + 1, right - 1) if right else (right, 1, 2)


def warm_start(model, tokenizer, questions: list[str], steps: int) -> None:
    """Next-token cross-entropy on reference completions: the format, and some of the sums."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    per_question = {}  # the task repeats its questions: each is templated and tokenised once
    for question in set(questions):  # as cwgrpo.py's prompts without a system prompt
        chat = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
        prompt = prompt["input_ids"]
        answers = tokenizer(warmstart_targets(question), add_special_tokens=False)["input_ids"]
        per_question[question] = [
            (prompt + answer + [tokenizer.eos_token_id], len(prompt)) for answer in answers
        ]
    examples = [example for question in questions for example in per_question[question]]
    model.train()
    for _ in tqdm(range(steps), desc="warm-start", disable=not sys.stderr.isatty()):
        batch = random.sample(examples, 32)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor(
            [ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch]
        )
        labels = torch.tensor(
            [[-100] * n + ids[n:] + [-100] * (width - len(ids)) for ids, n in batch]
        )
        model(input_ids=input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def build(
    output_dir: str = "",
    preset: str = "tiny",
    seed: int = 0,
    warmstart_steps: int = 0,
    examples: int = 2000,
    max_operand: int = 3,
    overwrite: bool = False,
) -> Path:
    """Writes <output_dir>/arithmetic.jsonl and the warm-started <output_dir>/model for a tiny
    preset (by default in its base folder, for as many warm-start steps as it takes); returns the
    folder. A folder that already holds a model built with the same settings and task is left as
    it is unless overwrite; any other is rebuilt."""
    task = TASKS[preset]
    out, warmstart_steps = (
        Path(output_dir or BASES[preset]),
        warmstart_steps or task["warmstart_steps"],
    )
    settings = {
        "seed": seed,
        "warmstart_steps": warmstart_steps,
        "examples": examples,
        "max_operand": max_operand,
        "targets": warmstart_targets("+".join("2301"[: task["operands"]])),
        "heads": [2, 1],  # query and KV heads: a model built with 4 and 2 is rebuilt
    }
    made_with = out / "tiny.json"
    if (
        (out / "model" / "config.json").is_file()
        and not overwrite
        and made_with.is_file()
        and json.loads(made_with.read_text()) == settings
    ):
        return out  # built already, with these settings and this task
    print(f"building the {preset} preset's model and data in {shown_path(out)} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    data = arithmetic_dataset(seed, examples, max_operand, task["operands"])
    with (out / "arithmetic.jsonl").open("w") as f:
        for row in data:
            f.write(json.dumps(row) + "\n")
    tokenizer = byte_level_qwen2_tokenizer()
    model = tiny_qwen2(tokenizer, seed)
    random.seed(seed)
    warm_start(model, tokenizer, data["problem"], warmstart_steps)
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar
    save_checkpoint(out, "model", model, tokenizer)
    made_with.write_text(json.dumps(settings))
    return out


def build_if_missing(model: str) -> None:
    """A tiny preset's model and data, built on its first use in this clone."""
    for preset in TINY_PRESETS:
        if Path(model) == BASES[preset] / "model" and not Path(model).exists():
            build(preset=preset)


if __name__ == "__main__":
    (tcfg,), _ = parse_dataclasses(TinyConfig, sys.argv[1:], description=__doc__.split("\n\n")[0])
    out = build(**dataclasses.asdict(tcfg))
    print(
        f"ready: {out / 'model'} and {out / 'arithmetic.jsonl'}; train it with "
        f"python cwgrpo.py --method cw --preset {tcfg.preset}"
    )
