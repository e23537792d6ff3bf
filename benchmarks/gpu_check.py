"""The first thing to run on a GPU: cwgrpo's rollout and update at the paper's shapes, with no
download, in a few minutes, in each precision the card has, printing what the CPU tests cannot
show.

    python -m benchmarks.gpu_check          # R1-Distill-Qwen-1.5B's shapes, 2 steps a precision
    python -m benchmarks.gpu_check --tiny   # the same path at tiny shapes (the tests, on a CPU)
    python -m benchmarks.gpu_check --lora-rank 32   # the -lora presets' frozen base + adapter
    python -m benchmarks.gpu_check --precisions fp16  # one precision only
    python -m benchmarks.gpu_check --lora-rank 32 --precisions fp16 --new-tokens 1536 \
        --rollout-chunk 4   # paper-1.5b-lora-16gb's shapes (the T4 preset), in fp16

A randomly initialised model of R1-Distill-Qwen-1.5B's exact architecture (its config.json from
cwgrpo_utils/models/model_configs/: the full vocabulary, 28 layers), the paper's batch (12 prompts
x G = 12) with prompts of up to 128 random tokens and --new-tokens new ones (512), beta 0.04 with a
half-precision reference, --steps steps through cwgrpo's own sampling, log-prob passes and update
(phases 1-7 of cwgrpo.training_loop, with random rewards). Random weights never emit EOS, so every
row runs to the limit: the KV cache at its largest. For each precision (bf16 and fp16 on a card of
compute capability 8.0 or more, fp16 on 7.x; --precisions to choose), it prints decode and update
tokens/s, the loss scale's path and the steps skipped as not finite (fp16's scaler), the
sampler-trainer mismatch of section 1's loop (mean and max |l - s|), the peak memory allocated (and
reserved) beside the plan's (cwgrpo_utils/machine/memory_plan.py), the KV cache's dtype, the KL at
step 0, and whether every logit after a left-padded prefill is finite, with cwgrpo's attention mask
and with the plain one. Where vLLM is installed, first the same batch by --rollout vllm in the
engine's dtype for that precision: its start, its decode tokens/s, the weight push, the GPU memory
it frees asleep, the share of greedy tokens equal to the loop's, and its mismatch; the engine then
sleeps beside the steps, as in a run, so an update that ran into a cap of the engine's would show.
"""

import argparse
import dataclasses
import gc
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo_utils.machine import memory_plan
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.machine.vllm_engine import Engine
from cwgrpo_utils.models import loading, lora, tiny
from cwgrpo_utils.options.cli import OPTIONAL
from cwgrpo_utils.run.metrics import token_values as token_values_of
from cwgrpo_utils.run.metrics import update_metrics
from tools import diagnose

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


def mismatch(model, samples, cfg, passes) -> torch.Tensor:
    """|trainer - sampler| log-prob of each valid sampled token."""
    logp = cwgrpo.token_stats(model, samples, cfg, passes).logp
    return (logp - samples.sampler_logp)[samples.completion_mask.bool()].abs()


def sampled(model, tokenizer, batch, cfg, run_cfg, engine=None) -> cwgrpo.Samples:
    """The batch's (prompt ids, gold) pairs sampled as the run's loop samples them."""
    passes = cwgrpo.Passes.of(cfg, run_cfg)
    return cwgrpo.sample(model, tokenizer, [ids for ids, _ in batch], cfg, passes, engine=engine)


def finite_after_left_padded_prefill(model, autocast) -> dict:
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


def vllm_check(model, tokenizer, cfg, run_cfg, batch, precision):
    """--rollout vllm on the same model and batch, in the engine's dtype for `precision`, before
    the training steps: the engine is then asleep beside them, as in a run, so an update that ran
    into a cap of the engine's would show. Returns the engine, to keep it alive through them."""
    with tempfile.TemporaryDirectory() as folder:  # the architecture; the weights are pushed
        model.config.save_pretrained(folder)
        gen = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        (Path(folder) / "generation_config.json").write_text(json.dumps(gen))
        tokenizer.save_pretrained(folder)
        start = time.perf_counter()
        engine = Engine.for_run(dataclasses.replace(cfg, model=folder), run_cfg, precision)
        started = time.perf_counter() - start
    start = time.perf_counter()
    engine.push_weights(model)
    pushed = time.perf_counter() - start
    if engine.sleeps:
        engine.llm.sleep(level=2)
    passes = cwgrpo.Passes.of(cfg, run_cfg)
    with precision.autocast():
        sampled(model, tokenizer, batch[:1], cfg, run_cfg, engine=engine)  # it compiles
        start = time.perf_counter()
        samples = sampled(model, tokenizer, batch, cfg, run_cfg, engine=engine)
        decode_s = time.perf_counter() - start
        diff = mismatch(model, samples, cfg, passes)
    generated = int(samples.completion_mask.sum())
    print(
        f"  vllm ({precision.vllm_dtype}): started in {started:.1f} s; decode "
        f"{generated / decode_s:,.0f} tokens/s ({decode_s:.1f} s; the loop's: its steps below), "
        f"weight push {pushed:.2f} s; |trainer - sampler log-prob| mean {diff.mean():.2e}, max "
        f"{diff.max():.2e}"
    )
    prompt_ids = [ids for ids, _ in batch[:4]]
    greedy = cwgrpo.Sampling(1, 1.0, top_p=1.0, top_k=1, max_new_tokens=32)
    with precision.autocast():
        torch.manual_seed(0)
        hf = cwgrpo.generate_completions(model, tokenizer, prompt_ids, how=greedy)
        ours = cwgrpo.generate_completions(model, tokenizer, prompt_ids, how=greedy, engine=engine)
    width = min(hf.completion_ids.shape[1], ours.completion_ids.shape[1])
    same = (hf.completion_ids[:, :width] == ours.completion_ids[:, :width]).float().mean()
    print(
        f"  vllm: greedy tokens equal to the loop's: {same:.1%} of {4 * width} (a random model's "
        f"near-ties and, on CUDA, half-precision kernels tell them apart)"
    )
    if engine.sleeps:
        asleep = torch.cuda.mem_get_info()[0]
        engine.llm.wake_up()
        awake = torch.cuda.mem_get_info()[0]
        engine.llm.sleep(level=2)
        share = run_cfg.vllm_gpu_memory_utilization
        print(f"  vllm: asleep it frees {(asleep - awake) / 1e9:.1f} GB (its share: {share:.0%})")
    else:
        print("  vllm: no sleep mode off CUDA")
    return engine


def policy_and_reference(config: dict, run_cfg, precision):
    """The policy as cwgrpo.loading.load_policy makes it (fp32 master weights, or a frozen base in
    the half precision under an fp32 LoRA adapter) and its reference (None with LoRA: the base)."""
    model = random_model(config, precision.device)
    if run_cfg.lora_rank:
        base = model.to(precision.dtype).requires_grad_(False)
        adapter = lora.adapted(
            base, run_cfg.lora_rank, run_cfg.lora_alpha, run_cfg.lora_target_modules
        )
        return adapter, None
    reference = random_model(config, precision.device).to(precision.dtype)
    return model, reference.eval().requires_grad_(False)


def check(config: dict, cfg, run_cfg, precision, steps: int, longest: int) -> None:
    """The steps in one precision, and what they measure."""
    print(f"precision {precision.reason}:")
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    model, reference = policy_and_reference(config, run_cfg, precision)
    if run_cfg.gradient_checkpointing:
        loading.enable_checkpointing(model)
    engine = None  # the engine first, asleep through the steps as in a run
    if importlib.util.find_spec("vllm") is None:
        print(f"  vllm: not installed ({OPTIONAL['vllm'][1]})")
    else:
        batch = prompts(cfg.prompts_per_step, longest, 256, 0)
        engine = vllm_check(model, tokenizer, cfg, run_cfg, batch, precision)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = cwgrpo.optimizer_and_schedule(trained, cfg, updates=1)
    scaler = precision.scaler()
    passes = cwgrpo.Passes.of(cfg, run_cfg)
    cuda = precision.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    decode_speeds, scales, skipped = [], [], 0
    for rollout_step in range(steps):
        start = time.perf_counter()
        with precision.autocast():
            batch = prompts(cfg.prompts_per_step, longest, 256, rollout_step)
            samples = sampled(model, tokenizer, batch, cfg, run_cfg)
            generated = int(samples.completion_mask.sum())
            decode_s = time.perf_counter() - start
            decode_speeds.append(generated / decode_s)
            ref_logp = cwgrpo.reference_logprobs(model, reference, samples, cfg, passes)
            diff = mismatch(model, samples, cfg, passes)
        random_rewards = torch.rand(
            len(samples.texts), generator=torch.Generator().manual_seed(rollout_step)
        )
        rewards = cwgrpo.Rewards(random_rewards, accuracy=random_rewards, format=random_rewards)
        advantages = cwgrpo.group_advantages(rewards.total, cfg.group_size)
        scored = cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=ref_logp)
        start = time.perf_counter()  # phases 3, 5-7 of cwgrpo.training_loop
        loss, token_values = 0.0, []
        for rows, micro_loss, parts in diagnose.step_gradient(
            model, scored, cfg, passes, precision.autocast, scale=scaler.scale
        ):
            loss += micro_loss.item()
            token_values.append(token_values_of(parts, rows.sampler_logp))
        scales.append(scaler.get_scale() if scaler.is_enabled() else None)
        grad_norm, _, finite = cwgrpo.optimizer_step(
            trained, optimizer, scheduler, scaler=scaler, max_grad_norm=cfg.max_grad_norm
        )
        skipped += not finite
        metrics = update_metrics(token_values, loss, grad_norm=grad_norm.item(), lr=0.0)
        update_s = time.perf_counter() - start
        tokens = int(samples.prompt_mask.sum()) + generated
        print(
            f"  step {rollout_step + 1}: decode {generated / decode_s:,.0f} tokens/s "
            f"({generated:,} tokens, {decode_s:.1f} s); update {tokens / update_s:,.0f} tokens/s "
            f"({tokens:,} tokens, {update_s:.1f} s); kl {metrics['kl_mean']:.3g}; grad norm "
            f"{metrics['grad_norm']:.3g}; |trainer - sampler log-prob| mean {diff.mean():.2e}, "
            f"max {diff.max():.2e}"
        )
    path = " -> ".join(f"{s:g}" for s in scales) if scaler.is_enabled() else "none (no scaler)"
    print(f"  loss scale: {path}; steps skipped as not finite: {skipped} of {steps}")
    with precision.autocast():
        print(f"  KV cache dtype: {loading.KVCache.for_model(model).store_dtype}")
    finite = finite_after_left_padded_prefill(model, precision.autocast)
    print(
        f"  every logit finite after a left-padded prefill: cwgrpo's mask {finite['cwgrpo']}, "
        f"plain mask {finite['plain']}"
    )
    options = memory_plan.PlanOptions.of(
        cfg, dataclasses.replace(run_cfg, precision=precision.name)
    )
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        planned = memory_plan.plan(folder, options, cuda=cuda)
        report = memory_plan.report(folder, options).split("\n", 1)[1]
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        print(
            f"  peak memory: {peak / 1e9:.2f} GB allocated ({reserved / 1e9:.2f} GB reserved) "
            f"measured, {planned['peak'] / 1e9:.2f} GB planned (allocated / planned "
            f"{peak / planned['peak']:.2f}); the plan:"
        )
        print("\n".join(f"    {line}" for line in report.splitlines()))
    else:
        print(f"  peak memory: not measured on the CPU; planned {planned['peak'] / 1e9:.3f} GB")
    del model, reference, optimizer, engine
    gc.collect()  # the engine gone before the next precision's: vLLM 0.32-0.33 allow one a process
    if cuda:
        torch.cuda.empty_cache()


def card_precisions(device: torch.device) -> list[str]:
    """The precisions a device has: bf16 and fp16 from compute capability 8.0, fp16 on 7.x."""
    if device.type != "cuda":
        return ["fp32"]
    first = Precision.choose("auto", device).name
    return ["bf16", "fp16"] if first == "bf16" else [first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU or GPU)")
    parser.add_argument("--new-tokens", type=int, default=0, help="default 512 (tiny: 16)")
    parser.add_argument("--steps", type=int, default=2, help="steps a precision")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="with a LoRA adapter (presets: 32)"
    )
    parser.add_argument(
        "--rollout-chunk", type=int, default=0, help="prompts sampled at once; 0: all (presets: 4)"
    )
    parser.add_argument(
        "--precisions", default="", help="comma-separated (bf16,fp16,fp32); default: the card's"
    )
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit(
            "error: benchmarks.gpu_check measures a CUDA GPU and none was found; "
            "python -m benchmarks.gpu_check --tiny runs the same path at tiny shapes on the CPU"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = TINY_CONFIG if args.tiny else json.loads(PAPER_CONFIG.read_text())
    new_tokens = args.new_tokens or (16 if args.tiny else 512)
    longest = 16 if args.tiny else 128
    names = args.precisions.split(",") if args.precisions else card_precisions(device)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        cfg, run_cfg = cwgrpo.parse_config(
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
                "--rollout-chunk",
                str(args.rollout_chunk),
            ]
        )
        options = memory_plan.PlanOptions.of(cfg, run_cfg)
        parameters = memory_plan.plan(folder, options)["parameters"]
    print(
        f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"{parameters:,} parameters; {cfg.prompts_per_step} prompts x G = "
        f"{cfg.group_size}, prompts up to {longest} tokens, {new_tokens} new tokens, "
        f"{run_cfg.rollout_chunk or cfg.prompts_per_step} prompts sampled at once; precisions "
        f"{', '.join(names)}"
    )
    for name in names:
        check(config, cfg, run_cfg, Precision.choose(name, device), args.steps, longest)


if __name__ == "__main__":
    main()
