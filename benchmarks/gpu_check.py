"""The first thing to run on a GPU: cwgrpo's rollout and update at the paper's shapes, with no
download, in a few minutes, printing what the CPU tests cannot show.

    python -m benchmarks.gpu_check          # R1-Distill-Qwen-1.5B's architecture, 2 steps
    python -m benchmarks.gpu_check --tiny   # the same path at tiny shapes (the tests run it)
    python -m benchmarks.gpu_check --lora-rank 32   # the -lora presets' frozen bf16 base + adapter

A randomly initialised model of R1-Distill-Qwen-1.5B's exact architecture (its config.json from
cwgrpo_utils/model_configs/: the full vocabulary, 28 layers), the paper's batch (12 prompts x G =
12) with prompts of up to 128 random tokens and --new-tokens new ones (512), beta 0.04 with a bf16
reference, two steps through cwgrpo's own sample() and update(). Random weights never emit EOS, so
every row runs to the limit: the KV cache at its largest. It prints decode and update tokens/s, the
peak memory (torch.cuda.max_memory_allocated) beside the plan's (cwgrpo_utils/memory_plan.py), the
KV cache's dtype, the KL at step 0, and whether every logit after a left-padded prefill is finite,
with cwgrpo's attention mask and with the plain one. Where vLLM is installed, the same batch by
--rollout vllm (cwgrpo_utils/vllm_engine.py): the engine's start, its decode tokens/s beside the
loop's, the weight push, the GPU memory it frees asleep, the share of greedy tokens equal to the
loop's, and the sampler-trainer mismatch (mean and max |l - s|), which the CPU tests check only in
fp32.
"""

import argparse
import dataclasses
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils import loading, lora, memory_plan, tiny
from cwgrpo_utils.cli import OPTIONAL
from cwgrpo_utils.run_folder import update_metrics
from cwgrpo_utils.vllm_engine import Engine

PAPER_CONFIG = memory_plan.SHIPPED_CONFIGS / "deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B.json"
TINY_CONFIG = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,  # heads of 32, which vLLM's CPU attention takes
    num_key_value_heads=1,
    tie_word_embeddings=False,
)


def random_model(config: dict, device: torch.device) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    model.generation_config.eos_token_id = None  # the tokenizer's EOS, never drawn in practice
    return model


def prompts(n: int, longest: int, vocab: int, seed: int) -> list[tuple[list[int], str]]:
    """n prompts of random byte-level tokens, of different lengths (so the batch is left-padded)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(longest // 2, longest + 1, (n,), generator=g).tolist()
    return [(torch.randint(0, vocab, (k,), generator=g).tolist(), "\\boxed{0}") for k in lengths]


def finite_after_left_padded_prefill(model, tokenizer, autocast) -> dict:
    """Every logit of a left-padded prefill finite, with cwgrpo's mask and with the plain one."""
    device = next(model.parameters()).device
    batch = prompts(4, 64, 256, seed=1)
    width = max(len(p) for p, _ in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out = {}
    with torch.no_grad(), autocast():
        for name, attention in (("cwgrpo", loading.attention_mask(model, mask)), ("plain", mask)):
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
            out[name] = bool(torch.isfinite(logits).all())
    return out


def vllm_check(model, tokenizer, cfg, batch, autocast, hf_decode: float) -> None:
    """--rollout vllm on the same model and batch (see the module's docstring)."""
    device = next(model.parameters()).device
    with tempfile.TemporaryDirectory() as folder:  # the architecture; the weights are pushed
        model.config.save_pretrained(folder)
        gen = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        (Path(folder) / "generation_config.json").write_text(json.dumps(gen))
        tokenizer.save_pretrained(folder)
        start = time.perf_counter()
        engine = Engine.for_run(dataclasses.replace(cfg, model=folder), device)
        started = time.perf_counter() - start
    start = time.perf_counter()
    engine.push_weights(model)
    pushed = time.perf_counter() - start
    if engine.sleeps:
        engine.llm.sleep(level=2)
    with autocast():
        cwgrpo.sample(model, tokenizer, batch[:1], cfg=cfg, engine=engine)  # warm-up: it compiles
        start = time.perf_counter()
        rollout = cwgrpo.sample(model, tokenizer, batch, cfg=cfg, engine=engine)
        decode_s = time.perf_counter() - start
        logp = cwgrpo.policy_token_stats(model, rollout, cfg)["logp"]
    valid = rollout.completion_mask.bool()
    diff = (logp - rollout.sampler_logp)[valid].abs()
    generated = int(valid.sum())
    print(
        f"vllm: started in {started:.1f} s; decode {generated / decode_s:,.0f} tokens/s "
        f"({decode_s:.1f} s, the loop's {hf_decode:,.0f} tokens/s), weight push {pushed:.2f} s; "
        f"|trainer - sampler log-prob| mean {diff.mean():.2e}, max {diff.max():.2e}"
    )
    prompts = [ids for ids, _ in batch[:4]]
    with autocast():
        torch.manual_seed(0)
        greedy = cwgrpo.Sampling(1, 1.0, top_p=1.0, top_k=1, max_new_tokens=32)
        hf = cwgrpo.generate_completions(model, tokenizer, prompts, how=greedy)
        ours = cwgrpo.generate_completions(model, tokenizer, prompts, how=greedy, engine=engine)
    width = min(hf.completion_ids.shape[1], ours.completion_ids.shape[1])
    same = (hf.completion_ids[:, :width] == ours.completion_ids[:, :width]).float().mean()
    print(
        f"vllm: greedy tokens equal to the loop's: {same:.1%} of {4 * width} (a random model's "
        f"near-ties and, on CUDA, bf16 kernels tell them apart)"
    )
    if engine.sleeps:
        asleep = torch.cuda.mem_get_info()[0]
        engine.llm.wake_up()
        awake = torch.cuda.mem_get_info()[0]
        engine.llm.sleep(level=2)
        share = cfg.vllm_gpu_memory_utilization
        print(f"vllm: asleep it frees {(asleep - awake) / 1e9:.1f} GB (its share: {share:.0%})")
    else:
        print("vllm: no sleep mode off CUDA")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU or GPU)")
    parser.add_argument("--new-tokens", type=int, default=0, help="default 512 (tiny: 16)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="with a LoRA adapter (presets: 32)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = TINY_CONFIG if args.tiny else json.loads(PAPER_CONFIG.read_text())
    new_tokens = args.new_tokens or (16 if args.tiny else 512)
    longest = 16 if args.tiny else 128
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        cfg = cwgrpo.parse_config(
            [
                "--model",
                folder,
                "--max-completion-length",
                str(new_tokens),
                "--length-limit",
                "new",
                "--max-prompt-length",
                str(longest),
                "--device",
                device.type,
                "--lora-rank",
                str(args.lora_rank),
            ]
        )
        options = memory_plan.PlanOptions.of(cfg)
        planned = memory_plan.plan(folder, options, cuda=device.type == "cuda")
        report = memory_plan.report(folder, options).split("\n", 1)[1]
    print(
        f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"{planned['parameters']:,} parameters; {cfg.prompts_per_step} prompts x G = "
        f"{cfg.group_size}, prompts up to {longest} tokens, {new_tokens} new tokens"
    )
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    model = random_model(config, device)
    if cfg.lora_rank:  # as loading.load_policy: a frozen base, bf16 on CUDA, and an fp32 adapter
        base = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        adapter = (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
        model, reference = lora.adapted(base.requires_grad_(False), *adapter), None
    else:
        reference = random_model(config, device)
        reference.load_state_dict(model.state_dict())
        if device.type == "cuda":
            reference.to(torch.bfloat16)  # as loading.load_reference holds it
        reference.eval().requires_grad_(False)
    if cfg.gradient_checkpointing:
        loading.enable_checkpointing(model)
    autocast = loading.autocast(device)
    fused = device.type == "cuda"
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=cfg.learning_rate, fused=fused)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    decode_speeds = []
    for step in range(args.steps):
        start = time.perf_counter()
        with autocast():
            rollout = cwgrpo.sample(
                model, tokenizer, prompts(cfg.prompts_per_step, longest, 256, step), cfg
            )
            generated = int(rollout.completion_mask.sum())
            decode_s = time.perf_counter() - start
            decode_speeds.append(generated / decode_s)
            with lora.reference_of(model, reference) as frozen:  # LoRA: the adapter off
                rollout.ref_logp = cwgrpo.policy_token_stats(frozen, rollout, cfg)["logp"]
        rewards = torch.rand(len(rollout.texts), generator=torch.Generator().manual_seed(step))
        rollout.advantages = cwgrpo.group_advantages(rewards, cfg.group_size).to(device)
        start = time.perf_counter()
        loss, token_values = cwgrpo.accumulate_gradients(model, rollout, cfg, autocast=autocast)
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = update_metrics(
            token_values, loss, grad_norm=grad_norm.item(), lr=cfg.learning_rate
        )
        update_s = time.perf_counter() - start
        tokens = int(rollout.prompt_mask.sum()) + generated
        print(
            f"step {step + 1}: decode {generated / decode_s:,.0f} tokens/s ({generated:,} tokens, "
            f"{decode_s:.1f} s); update {tokens / update_s:,.0f} tokens/s ({tokens:,} tokens, "
            f"{update_s:.1f} s); kl {metrics['kl_mean']:.3g}; grad norm "
            f"{metrics['grad_norm']:.3g}"
        )
    with autocast():
        print(f"KV cache dtype: {loading.KVCache.for_model(model).store_dtype}")
    finite = finite_after_left_padded_prefill(model, tokenizer, autocast)
    print(
        f"every logit finite after a left-padded prefill: cwgrpo's mask {finite['cwgrpo']}, "
        f"plain mask {finite['plain']}"
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        print(
            f"peak memory: {peak / 1e9:.2f} GB measured, {planned['peak'] / 1e9:.2f} GB planned "
            f"(measured / planned {peak / planned['peak']:.2f})"
        )
        print(report)
    else:
        print(f"peak memory: not measured on the CPU; planned {planned['peak'] / 1e9:.3f} GB")
    if importlib.util.find_spec("vllm") is None:
        print(f"vllm: not installed ({OPTIONAL['vllm'][1]})")
    else:
        batch = prompts(cfg.prompts_per_step, longest, 256, 0)
        vllm_check(model, tokenizer, cfg, batch, autocast, decode_speeds[-1])


if __name__ == "__main__":
    main()
