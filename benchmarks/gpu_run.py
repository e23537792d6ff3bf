"""The next GPU run, prepared: one command that checks on CUDA what the CPU tests cannot and
measures the card's speed against its limit, sized for about 8 minutes on one H100, printing each
figure and writing them to <output-dir>/gpu_run.json. It runs on the GPU machine's bare image
(torch 2.11 for CUDA 13, transformers 5.17, peft; no index, no vLLM) once the wheels the image
lacks are installed (benchmarks/gpu_wheels.py; docs/gpu.md, "The next GPU run", has the call).

    python3 -m benchmarks.gpu_wheels --install && python3 -m benchmarks.gpu_run   # on the card
    python -m benchmarks.gpu_run --tiny     # the CPU twin at tiny shapes (CI runs it)
    python -m benchmarks.gpu_run --only update_peak,speed   # some of them (a rerun)

Checks, each on the path a run takes, each able to fail (tests/test_gpu_path.py shows each one
failing on the defect it guards against):
1. lora_push: LoRA's weights pushed to the sampler one merged layer at a time (R1-Distill-Qwen-
   1.5B's shapes, random weights, its fp16 base under an r 32 adapter on every linear layer): the
   memory the push adds is at most what the loop must hold (one layer's merge, the layer before
   it until released), and every tensor is in the base's dtype.
2. fp16_skip: cwgrpo's own optimizer step (unscale, clip, the norm's check, the skip) under fp16's
   loss scaler, an inf injected into one gradient: no weight, AdamW moment or learning rate
   changed, the scale halved.
3. finite_left_padded_prefill: every logit finite after a left-padded prefill with cwgrpo's
   attention mask, under the memory-efficient SDPA kernel (the one a T4 gets).
4. update_peak: the trainer's update at the paper's batch (12 prompts of 128 tokens x G = 12
   completions of 512) in the card's precision: the memory its passes add, measured, against the
   plan's figure for them (cwgrpo_utils/machine/memory_plan.py), within TOLERANCE.
5. grading_after_cuda: the grading pool forked after CUDA holds 20 GB, graded under a time limit.
6. run_resumed_<precision>: `--preset tiny-chain` for 100 steps in each precision the card has
   (bf16 and fp16 on an H100), killed (SIGKILL) after step 50 and resumed, its records equal to an
   uninterrupted run's; evaluate.py on the first one's final model.
Measured, not checked (so the next change to the sampler is chosen from data):
7. speed: section 1's token loop at the paper's shapes (random weights, 144 rows, 512 new tokens),
   ms a token step and tokens/s; the update's tokens/s (from 4); the card's bandwidth by a
   device-to-device copy; the token step against the bytes it must read (weights and KV cache) at
   that bandwidth; and a profile of token steps: its top kernels.
"""

import argparse
import concurrent.futures
import contextlib
import copy
import functools
import importlib.metadata
import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cwgrpo
from benchmarks.gpu_check import PAPER_CONFIG, TINY_CONFIG, card_precisions, prompts, random_model
from cwgrpo_utils import REPOSITORY
from cwgrpo_utils.machine import memory_plan
from cwgrpo_utils.machine.grading_pool import Grader
from cwgrpo_utils.machine.memory_plan import Architecture
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.models import loading, lora, tiny
from cwgrpo_utils.options import presets
from cwgrpo_utils.run.folder import read_records
from tools import diagnose

GB = 1e9
TIMINGS = {"rollout_s", "update_s", "time", "tokens_per_s"}
# How far the update's measured memory may be from the plan's. On CUDA the plan is the GPU's:
# on an H200 the whole peak was within 0.1% of it (docs/gpu-check-h200.md), so 10% of the passes'
# part is a real bound. On a CPU (fp32) the plan is high by a fifth to a quarter (it counts a
# recomputed layer's backward twice and every chunk of the LM head at once: 0.70-0.79 measured at
# three shapes), so the twin allows 35%
TOLERANCE = {"cuda": 0.10, "cpu": 0.35}


def allocation_sizes(profiler) -> list[int]:
    """The bytes of each allocation (+) and free (-) a CPU profile recorded, in time order."""

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    tree = profiler.profiler.kineto_results.experimental_event_tree()
    allocations = [e for e in walk(tree) if e.tag == torch._C._profiler._EventType.Allocation]
    return [e.extra_fields.alloc_size for e in sorted(allocations, key=lambda e: e.start_time_ns)]


@contextlib.contextmanager
def peak_added(device: torch.device):
    """A context yielding a dict that gets, on exit, the most bytes allocated at once inside it
    beyond what was allocated before (GB): CUDA's allocator statistics, or on a CPU the
    allocations and frees torch's profiler records; and on CUDA the peak reserved."""
    out = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        yield out
        torch.cuda.synchronize()
        out["allocated_gb"] = (torch.cuda.max_memory_allocated() - before) / GB
        out["reserved_gb"] = torch.cuda.max_memory_reserved() / GB
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profiler:
        yield out
    out["allocated_gb"] = max(itertools.accumulate(allocation_sizes(profiler), initial=0)) / GB


def merged_at_once(model):
    """Every adapted layer merged before the first is pushed: the push before 2026-12-05 (c42c093),
    which held the whole model's merge. For the tests, which show lora_push failing on it."""
    yield from list(lora.merged_weights(model))


def lora_push(config: dict, device: torch.device, merge=lora.merged_weights) -> dict:
    half = torch.float16  # the T4's, where the push's memory matters most
    base = random_model(config, device).to(half).requires_grad_(False)
    adapted = lora.adapted(base, rank=32, alpha=32, target_modules="all-linear")
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:  # B starts at 0; a trained adapter's is not
            parameter.data.normal_(0, 0.01)
    largest = max(
        n_in * n_out for n_in, n_out in Architecture.from_config(config).adapted("all-linear")
    )
    # what the loop holds at once: a layer's fp32 delta and sum and its fp16 cast (the plan's
    # item), and the fp16 cast of the layer before it, which the caller holds until the next is
    # handed over; a CPU's add of an fp16 weight to an fp32 delta casts the weight first
    bound = largest * (4 + 4 + 2) + largest * 2 + largest * 4 * (device.type == "cpu")
    torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)  # cuBLAS's workspace, first
    dtypes, count = set(), 0
    with peak_added(device) as memory:
        for _, tensor in merge(adapted):  # each copied into the engine, then dropped
            dtypes.add(str(tensor.dtype))
            count += 1
    return {
        "passed": dtypes == {str(half)} and memory["allocated_gb"] <= bound / GB,
        "tensors": count,
        "dtypes": sorted(dtypes),
        "peak_added_gb": memory["allocated_gb"],
        "bound_gb": bound / GB,
    }


def fp16_skip(device: torch.device, step=cwgrpo.optimizer_step) -> dict:
    """An inf injected into one gradient of a real fp16 backward, then `step` (cwgrpo's)."""
    precision = Precision.choose("fp16", device)
    cfg, _ = cwgrpo.parse_config(["--preset", "tiny", "--steps", "10", "--warmup-ratio", "0"])
    model = random_model(TINY_CONFIG, device)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = cwgrpo.optimizer_and_schedule(trained, cfg, updates=1)
    scaler = precision.scaler()
    ids = torch.randint(0, TINY_CONFIG["vocab_size"], (4, 16), device=device)

    def backward():
        with precision.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()

    backward()  # a finite step first, so AdamW has moments to keep
    step(trained, optimizer, scheduler, scaler=scaler, max_grad_norm=cfg.max_grad_norm)
    weights = [p.detach().clone() for p in trained]
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    scale, lr = scaler.get_scale(), scheduler.get_last_lr()
    backward()
    trained[0].grad.view(-1)[0] = float("inf")  # an overflow, injected
    _, _, ran = step(trained, optimizer, scheduler, scaler=scaler, max_grad_norm=cfg.max_grad_norm)
    unchanged = all(torch.equal(w, p) for w, p in zip(weights, trained))
    state = optimizer.state_dict()["state"]
    kept = all(torch.equal(moments[i][k], state[i][k]) for i in moments for k in moments[i])
    same_lr = scheduler.get_last_lr() == lr
    return {
        "passed": not ran and unchanged and kept and same_lr and scaler.get_scale() == scale / 2,
        "skipped": not ran,
        "weights_unchanged": unchanged,
        "moments_unchanged": kept,
        "learning_rate_unchanged": same_lr,
        "scale": [scale, scaler.get_scale()],
    }


def finite_left_padded_prefill(config: dict, device: torch.device) -> dict:
    model = random_model(config, device).eval()
    batch = prompts(4, 64, 256, seed=1)
    width = max(len(p) for p, _ in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
    kernel = SDPBackend.EFFICIENT_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    with torch.no_grad(), sdpa_kernel(kernel), torch.autocast(device.type, dtype=torch.float16):
        logits = model(
            input_ids=ids,
            attention_mask=loading.attention_mask(model, mask),
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
        ).logits
    finite = bool(torch.isfinite(logits).all())
    return {"passed": finite, "kernel": kernel.name, "every_logit_finite": finite}


def paper_batch(config: dict, cfg, device: torch.device, prompt: int, new: int) -> cwgrpo.Batch:
    """The paper's batch of random tokens: cfg.prompts_per_step prompts of `prompt` tokens, G
    completions of `new` tokens each, every one to the limit, random rewards."""
    rows, vocab = cfg.prompts_per_step * cfg.group_size, config["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, vocab, (cfg.prompts_per_step, prompt), generator=g)
    samples = cwgrpo.Samples(
        prompt_ids=prompt_ids.repeat_interleave(cfg.group_size, 0).to(device),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.long, device=device),
        completion_ids=torch.randint(0, vocab, (rows, new), generator=g).to(device),
        completion_mask=torch.ones(rows, new, device=device),
        truncated=torch.ones(rows, dtype=torch.bool, device=device),
        texts=[""] * rows,
        sampler_logp=torch.zeros(rows, new, device=device),
    )
    random_rewards = torch.rand(rows, generator=g)
    rewards = cwgrpo.Rewards(random_rewards, accuracy=random_rewards, format=random_rewards)
    advantages = cwgrpo.group_advantages(rewards.total, cfg.group_size)
    return cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=None)


def update_peak(
    config: dict,
    device: torch.device,
    prompt: int,
    new: int,
    folder: Path,
    logit_chunk_elements: int = 2**26,
    tolerance: float | None = None,
    plan=memory_plan.plan,
) -> dict:
    """The memory the update's passes add (forward and backward of every micro-batch, as the
    training loop runs them), measured at its second update, against the plan's update phase less
    what every phase holds (`plan`: memory_plan.plan, or a test's plan that is off)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    precision = Precision.choose("auto", device)
    cfg, run_cfg = cwgrpo.parse_config(
        ["--model", str(folder), "--max-completion-length", str(new), "--length-limit", "new"]
        + ["--max-prompt-length", str(prompt), "--beta", "0", "--precision", precision.name]
        + ["--logit-chunk-elements", str(logit_chunk_elements)]
    )
    model = random_model(config, device)
    loading.enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    batch = paper_batch(config, cfg, device, prompt=prompt, new=new)
    passes = cwgrpo.Passes.of(cfg, run_cfg)

    def update():
        diagnose.step_gradient(model, batch, cfg, passes, precision.autocast)

    tolerance = TOLERANCE[device.type] if tolerance is None else tolerance
    update()  # a first update and step: AdamW's moments, the lazy allocations of the kernels
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with peak_added(device) as memory:
        start = time.perf_counter()
        update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    planned = plan(
        str(folder), memory_plan.PlanOptions.of(cfg, run_cfg), cuda=device.type == "cuda"
    )
    planned_gb = (planned["phases"]["update"] - planned["resident"]) / GB
    measured = memory["allocated_gb"]
    tokens = batch.prompt_mask.numel() + batch.completion_mask.numel()
    return {
        "passed": abs(measured - planned_gb) <= tolerance * planned_gb,
        "precision": precision.name,
        "measured_added_gb": measured,
        "planned_added_gb": planned_gb,
        "measured_over_planned": measured / planned_gb,
        "tolerance": tolerance,
        "peak_reserved_gb": memory.get("reserved_gb"),
        "update_s": seconds,
        "update_tokens_per_s": tokens / seconds,
    }


def grading_after_cuda(device: torch.device, gigabytes: float) -> dict:
    held = torch.empty(int(gigabytes * GB), dtype=torch.uint8, device=device)  # CUDA holding it
    cases = [("so \\boxed{42}", "\\boxed{42}"), ("\\boxed{41}", "\\boxed{42}")] * 8
    start = time.perf_counter()
    with (
        Grader(cwgrpo.grade_accuracy, cwgrpo.TIMED_OUT, timeout_s=10, workers=2) as grader,
        concurrent.futures.ThreadPoolExecutor() as pool,
    ):
        grades = pool.submit(grader.map, [(c, g, "default") for c, g in cases])
        try:
            accuracy = [grade.accuracy for grade in grades.result(timeout=120)]
        except concurrent.futures.TimeoutError:
            accuracy = None
    del held
    seconds = time.perf_counter() - start
    return {
        "passed": accuracy == [1.0, 0.0] * 8,
        "held_gb": gigabytes,
        "seconds": seconds,
        "graded": accuracy is not None,
    }


def run(args: list[str], out: Path) -> subprocess.Popen:
    command = [sys.executable, str(REPOSITORY / "cwgrpo.py"), *args, "--output-dir", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_resumed(
    preset: str,
    device: torch.device,
    precision: str,
    steps: int,
    kill_after: int,
    folder: Path,
    evaluate: bool = True,
    between=None,
) -> dict:
    """A real run killed after step kill_after and resumed, against its uninterrupted twin;
    between(folder), where given, is done to the killed run's folder before its resume (a test's
    defect)."""
    args = ["--preset", preset, "--method", "grpo", "--steps", str(steps), "--device", device.type]
    args += ["--precision", precision, "--save-every", str(max(1, kill_after // 2))]
    args += ["--threads", "1", "--reward-workers", "1"]
    start = time.perf_counter()
    _, error = run(args, folder / "uninterrupted").communicate()
    wall_s = time.perf_counter() - start
    killed = run(args, folder / "killed")
    metrics = folder / "killed" / "metrics.jsonl"
    while (
        killed.poll() is None
        and len(read_records(metrics) if metrics.exists() else []) < kill_after
    ):
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    mid_run = killed.wait() == -signal.SIGKILL  # not finished before the kill
    if between is not None:
        between(folder / "killed")
    _, resume_error = run([*args, "--resume"], folder / "killed").communicate()
    records = [
        [
            {k: v for k, v in r.items() if k not in TIMINGS}
            for r in read_records(f / "metrics.jsonl")
        ]
        for f in (folder / "uninterrupted", folder / "killed")
    ]
    differing = [r["step"] for r, s in zip(*records) if r != s]
    out = {
        "passed": mid_run and not differing and len(records[1]) == steps == len(records[0]),
        "precision": precision,
        "steps": steps,
        "killed_mid_run": mid_run,
        "killed_after_step": kill_after,
        "uninterrupted_wall_s": wall_s,
        "records_identical": not differing,
        "first_differing_step": differing[0] if differing else None,
        "final_accuracy": records[1][-1]["accuracy_mean"] if records[1] else None,
        "errors": [e[-500:] for e in (error, resume_error) if e and "Traceback" in e],
    }
    if evaluate:
        evaluated = subprocess.run(
            [sys.executable, str(REPOSITORY / "evaluate.py"), "--device", device.type]
            + presets.final_model_evaluation(folder / "killed", preset)
            + ["--output-dir", str(folder / "eval")],
            capture_output=True, text=True,
        )  # fmt: skip
        results = folder / "eval" / "results.json"
        pass_at_1 = json.loads(results.read_text())["average_pass@1"] if results.exists() else None
        out["passed"] &= pass_at_1 is not None
        out["held_out_pass@1"] = pass_at_1
        out["errors"] += [evaluated.stderr[-500:]] if "Traceback" in evaluated.stderr else []
    return out


def synchronized(device: torch.device) -> float:
    """time.perf_counter() once the device has finished what it was given."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def copy_bandwidth(device: torch.device, gigabytes: float) -> float:
    """Bytes a second a device-to-device copy moves, read and written counted (best of 5)."""
    source = torch.empty(int(gigabytes * GB / 2), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        start = synchronized(device)
        target.copy_(source)
        best = min(best, synchronized(device) - start)
    return 2 * source.numel() / best


def top_kernels(profiler, device: torch.device, wall_s: float, rows: int = 8) -> dict:
    """Where a profiled stretch's time went: its top operations or kernels by their own device
    time (CPU time on a CPU), each with its share, and the device's busy share of the wall time."""
    cuda = device.type == "cuda"
    events = [e for e in profiler.key_averages() if not cuda or e.device_type.name == "CUDA"]
    own = [(e.key, e.self_device_time_total if cuda else e.self_cpu_time_total) for e in events]
    own.sort(key=lambda pair: -pair[1])
    total_us = sum(us for _, us in own)
    return {
        "busy_share": total_us / 1e6 / wall_s,
        "top": [
            {"name": name[:80], "ms": us / 1e3, "share": us / total_us} for name, us in own[:rows]
        ],
    }


def speed(config: dict, device: torch.device, prompt: int, new: int, update: dict) -> dict:
    """Section 1's token loop on the paper's batch (random weights, so no row stops early) in the
    card's precision, against the bytes each token step must read at the card's bandwidth."""
    precision = Precision.choose("auto", device)
    cfg, _ = cwgrpo.parse_config(["--preset", "paper-1.5b"])
    model = random_model(config, device).eval()
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    batch = prompts(cfg.prompts_per_step, prompt, 256, seed=0)
    prompt_ids = [ids for ids, _ in batch]

    def sampled(tokens: int):
        how = cwgrpo.Sampling(cfg.group_size, cfg.temperature, 1.0, top_k=0, max_new_tokens=tokens)
        with precision.autocast():
            return cwgrpo.generate_completions(model, tokenizer, prompt_ids, how=how, share=True)

    sampled(2)  # the kernels' first calls
    start = synchronized(device)
    sampled(1)  # the prefill and one draw
    prefill_s = synchronized(device) - start
    start = synchronized(device)
    rollout = sampled(new)
    total_s = synchronized(device) - start
    rows = len(rollout.texts)
    step_s = (total_s - prefill_s) / (new - 1)
    arch = Architecture.from_config(config)
    element = precision.dtype.itemsize
    mean_positions = prompt + new / 2
    kv_bytes = rows * mean_positions * arch.layers * 2 * arch.kv_width * element
    weight_bytes = arch.parameters() * element  # autocast's cast of each weight, read each step
    bandwidth = copy_bandwidth(device, 4 if device.type == "cuda" else 0.25)
    limit_s = (weight_bytes + kv_bytes) / bandwidth
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
        + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ) as profiler:
        start = synchronized(device)
        sampled(16)
        profiled_s = synchronized(device) - start
    return {
        "precision": precision.name,
        "rows": rows,
        "new_tokens": new,
        "prefill_s": prefill_s,
        "ms_a_token_step": 1e3 * step_s,
        "decode_tokens_per_s": rows / step_s,
        "update_tokens_per_s": update.get("update_tokens_per_s"),
        "bandwidth_gb_per_s": bandwidth / GB,
        "bytes_a_token_step_gb": (weight_bytes + kv_bytes) / GB,
        "limit_ms_a_token_step": 1e3 * limit_s,
        "token_step_over_limit": step_s / limit_s,
        "profile_of_16_token_steps": top_kernels(profiler, device, profiled_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (CI's twin)")
    parser.add_argument("--only", default="", help="comma-separated names of the checks to run")
    parser.add_argument(
        "--output-dir", default="", help="default runs/gpu-run (tiny: gpu-run-tiny)"
    )
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit(
            "error: benchmarks.gpu_run checks a CUDA card and none was found; "
            "python -m benchmarks.gpu_run --tiny runs its CPU twin"
        )
    device = torch.device("cpu" if args.tiny else "cuda")
    config = TINY_CONFIG if args.tiny else json.loads(PAPER_CONFIG.read_text())
    prompt, new = (16, 8) if args.tiny else (128, 512)
    # the LM head's logits a chunk at once: the paper's default (441 positions of Qwen's 151,936
    # tokens); at the twin's 300 tokens, 16 positions, so that it is chunked as at the paper's
    chunk = 16 * config["vocab_size"] if args.tiny else 2**26
    out = Path(args.output_dir or ("runs/gpu-run-tiny" if args.tiny else "runs/gpu-run"))
    out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    versions = {
        name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")
    }
    if device.type == "cuda":
        versions["cuda"] = torch.version.cuda
        versions["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    print(f"benchmarks.gpu_run on {card}: {versions}", flush=True)
    # the precisions a run may get on this card (bf16 and fp16 from 8.0); the twin: both on a CPU
    precisions = ["bf16", "fp16"] if args.tiny else card_precisions(device)
    preset, steps, kill_after = ("tiny", 6, 3) if args.tiny else ("tiny-chain", 100, 50)
    checks = {
        "lora_push": lambda: lora_push(config, device),
        "fp16_skip": lambda: fp16_skip(device),
        "finite_left_padded_prefill": lambda: finite_left_padded_prefill(config, device),
        "update_peak": lambda: update_peak(
            config, device, prompt, new, folder=out / "model", logit_chunk_elements=chunk
        ),
        "grading_after_cuda": lambda: grading_after_cuda(device, 0.2 if args.tiny else 20),
        **{
            f"run_resumed_{name}": functools.partial(
                run_resumed,
                preset,
                device,
                name,
                steps=steps,
                kill_after=kill_after,
                folder=out / name,
                evaluate=i == 0,
            )
            for i, name in enumerate(precisions)
        },
        "speed": lambda: speed(
            config, device, prompt, new, update=report["checks"].get("update_peak", {})
        ),
    }
    chosen = args.only.split(",") if args.only else list(checks)
    unknown = sorted(set(chosen) - set(checks))
    if unknown:
        raise SystemExit(f"error: no check {', '.join(unknown)}; the checks: {', '.join(checks)}")
    report = {"card": card, "versions": versions, "checks": {}}
    for name in chosen:
        start = time.perf_counter()
        try:
            result = checks[name]()
        except Exception as error:  # noqa: BLE001 - a check that breaks is a finding, not a stop
            result = {"passed": False, "error": f"{type(error).__name__}: {error}"[:500]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        report["checks"][name] = result
        print(f"{name}: {json.dumps(result)}", flush=True)
        (out / "gpu_run.json").write_text(json.dumps(report, indent=1))
    failed = [name for name, result in report["checks"].items() if not result.get("passed", True)]
    print(
        f"written: {out / 'gpu_run.json'}; "
        + (f"failed: {', '.join(failed)}" if failed else "all passed")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
