"""The tiny preset's model and data, built once so that cwgrpo.py trains it like any other.

    python cwgrpo.py --method cw --preset tiny        # builds it on first use, then trains it
    python -m cwgrpo_utils.tiny --overwrite           # rebuilds it

A Qwen2 of 115k parameters with Qwen2's byte-level tokenizer (256 byte tokens and the ChatML
specials), given a few seconds of supervised warm-start on a synthetic task: single-digit sums
whose gold is written in \\boxed{} like a MATH solution, so cwgrpo's math-verify reward grades it.
The warm-start teaches the format and three candidate sums per question, one right; RL then has to
learn which one is right.
"""

import dataclasses
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
import transformers
from tqdm import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from cwgrpo_utils import REPOSITORY, TINY_BASE
from cwgrpo_utils.checkpoints import save_checkpoint
from cwgrpo_utils.cli import arg, parse_dataclasses, shown_path

BENCHMARK = REPOSITORY / "benchmarks" / "tiny-arithmetic.jsonl"


def evaluate_options() -> tuple[str, ...]:
    """evaluate.py's options for a tiny model: its benchmark, bare questions, plain sampling."""
    prompts = ("--gold-format", "expr", "--prompt-template", "{question}")
    sampling = ("--top-p", "1.0", "--max-new-tokens", "40")
    return ("--benchmarks", shown_path(BENCHMARK), *prompts, *sampling)


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TinyConfig:
    output_dir: str = arg(str(TINY_BASE), "gets model/ and arithmetic.jsonl")
    seed: int = arg(0, "seed of the model's initialisation, the data and the warm-start")
    warmstart_steps: int = arg(250, "supervised steps of 32 examples before RL")
    examples: int = arg(2000, "synthetic problems in arithmetic.jsonl")
    max_operand: int = arg(3, "the problems add two integers from 0 to this")
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


def arithmetic_dataset(seed: int, n: int = 2000, max_operand: int = 3) -> datasets.Dataset:
    """Two-number sums; the gold is written in \\boxed{} like a MATH solution."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    return datasets.Dataset.from_dict(
        {
            "problem": [f"{a}+{b}" for a, b in pairs],
            "solution": [f"\\boxed{{{a + b}}}" for a, b in pairs],
        }
    )


def warmstart_targets(question: str) -> list[str]:
    """The completions the warm-start imitates: in format, with the right sum in one of three and
    a near miss (off by one either way) in the others. The model starts knowing the format and
    the candidates, right about a third of the time; RL has to teach it which sum is right."""
    a, b = map(int, question.split("+"))
    near_misses = (a + b + 1, a + b - 1) if a + b else (1, 2)
    return [f"{a}+{b}={s}\n</think>\n\\boxed{{{s}}}" for s in (a + b, *near_misses)]


def warm_start(model, tokenizer, questions: list[str], steps: int) -> None:
    """Next-token cross-entropy on reference completions: the format, and some of the sums."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    examples = []
    for question in questions:  # as cwgrpo.py's prompts without a system prompt
        chat = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
        prompt = prompt["input_ids"]
        for target in warmstart_targets(question):
            answer = tokenizer(target, add_special_tokens=False)["input_ids"]
            examples.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
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
    output_dir: str = str(TINY_BASE),
    seed: int = 0,
    warmstart_steps: int = 250,
    examples: int = 2000,
    max_operand: int = 3,
    overwrite: bool = False,
) -> Path:
    """Writes <output_dir>/arithmetic.jsonl and the warm-started <output_dir>/model; returns the
    folder. A folder that already holds a model built with the same settings and task is left as
    it is unless overwrite; any other is rebuilt."""
    out, settings = (
        Path(output_dir),
        {
            "seed": seed,
            "warmstart_steps": warmstart_steps,
            "examples": examples,
            "max_operand": max_operand,
            "targets": warmstart_targets("2+3"),
            "heads": [2, 1],  # query and KV heads: a model built with 4 and 2 is rebuilt
        },
    )
    made_with = out / "tiny.json"
    if (
        (out / "model" / "config.json").is_file()
        and not overwrite
        and made_with.is_file()
        and json.loads(made_with.read_text()) == settings
    ):
        return out  # built already, with these settings and this task
    print(f"building the tiny preset's model and data in {shown_path(out)} ...", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    data = arithmetic_dataset(seed, examples, max_operand)
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
    """The tiny preset's model and data, built on its first use in this clone."""
    if Path(model) == TINY_BASE / "model" and not Path(model).exists():
        build()


if __name__ == "__main__":
    (tcfg,), _ = parse_dataclasses(TinyConfig, sys.argv[1:], description=__doc__.split("\n\n")[0])
    out = build(**dataclasses.asdict(tcfg))
    print(
        f"ready: {out / 'model'} and {out / 'arithmetic.jsonl'}; train it with "
        f"python cwgrpo.py --method cw --preset tiny"
    )
