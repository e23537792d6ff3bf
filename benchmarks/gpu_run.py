"""The next GPU run, prepared: one command that checks on CUDA what the CPU tests cannot, sized to
finish in about 10 minutes on one H100 (torch 2.11 with CUDA 13, transformers, peft; no vLLM, no
network), printing each check's figures and writing them to <output-dir>/gpu_run.json.

    python -m benchmarks.gpu_run                 # on a CUDA card: runs/gpu-run/gpu_run.json
    python -m benchmarks.gpu_run --tiny          # the CPU twin at tiny shapes (CI runs it)

1. lora_push: LoRA's weights pushed to the sampler one merged layer at a time (the shapes of
   R1-Distill-Qwen-1.5B, random weights, its fp16 base under an r 32 adapter on every linear
   layer): the memory the push adds beside the plan's one layer, every tensor in the base's dtype.
2. fused_adamw_skips_inf: fused AdamW under fp16's GradScaler, an inf injected into one gradient:
   no parameter and no AdamW moment changed, the loss scale halved.
3. finite_left_padded_prefill: every logit finite after a left-padded prefill with cwgrpo's
   attention mask, under the memory-efficient SDPA kernel (the one a T4 gets).
4. update_under_a_cap: the trainer's update (paper shapes, 512 new tokens) under the cap vLLM
   0.34's extensible KV cache would set (torch.cuda.set_per_process_memory_fraction, 0.7 of the
   card): whether it runs, its allocated and reserved peaks.
5. grading_after_cuda: the grading pool forked after CUDA holds 20 GB, graded under a time limit.
6. tiny_chain_run: `--preset tiny-chain`, 100 steps, `--device cuda`: killed (SIGKILL) after step
   50 and resumed, its records against an uninterrupted run's; evaluate.py on its final model.
"""

import argparse
import concurrent.futures
import contextlib
import copy
import importlib.metadata
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cwgrpo
from benchmarks.gpu_check import PAPER_CONFIG, TINY_CONFIG, prompts, random_model
from cwgrpo_utils import REPOSITORY, loading, lora, memory_plan, presets
from cwgrpo_utils.memory_plan import Architecture
from cwgrpo_utils.run_folder import read_records

GB = 1e9
TIMINGS = {"rollout_s", "update_s", "time", "tokens_per_s"}


def peak_added(device: torch.device):
    """A context yielding a dict that gets, on exit, the bytes allocated at the peak inside it
    beyond what was allocated before, and the peak reserved (None on a CPU: not measured)."""

    @contextlib.contextmanager
    def measured():
        out = {}
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        yield out
        if cuda:
            torch.cuda.synchronize()
            out["allocated_gb"] = (torch.cuda.max_memory_allocated() - before) / GB
            out["reserved_gb"] = torch.cuda.max_memory_reserved() / GB
        else:
            out["allocated_gb"] = out["reserved_gb"] = None

    return measured()


def lora_push(config: dict, device: torch.device) -> dict:
    half = torch.float16  # the T4's, where the push's memory matters most
    base = random_model(config, device).to(half).requires_grad_(False)
    adapted = lora.adapted(base, rank=32, alpha=32, target_modules="all-linear")
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:  # B starts at 0; a trained adapter's is not
            parameter.data.normal_(0, 0.01)
    one_layer = max(
        n_in * n_out * (4 + 4 + 2)
        for n_in, n_out in Architecture.from_config(config).adapted("all-linear")
    )
    dtypes, count = set(), 0
    with peak_added(device) as memory:
        for _, tensor in lora.merged_weights(adapted):  # each copied into the engine, then freed
            dtypes.add(str(tensor.dtype))
            count += 1
    allocated = memory["allocated_gb"]
    return {
        "passed": dtypes == {str(half)}
        and (allocated is None or allocated <= 1.1 * one_layer / GB),
        "tensors": count,
        "dtypes": sorted(dtypes),
        "peak_added_gb": allocated,
        "plan_one_layer_gb": one_layer / GB,
    }


def fused_adamw_skips_inf(device: torch.device) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(device.type)
    x = torch.randn(16, 64, device=device)

    def backward():
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()

    backward()  # a finite step first, so AdamW has moments to keep
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    scale = scaler.get_scale()
    backward()
    next(model.parameters()).grad[0, 0] = float("inf")  # an overflow, injected
    scaler.step(optimizer)  # fused AdamW gets the scaler's found_inf and skips
    scaler.update()
    unchanged = all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    state = optimizer.state_dict()["state"]
    kept = all(torch.equal(moments[i][k], state[i][k]) for i in moments for k in moments[i])
    return {
        "passed": unchanged and kept and scaler.get_scale() == scale / 2,
        "weights_unchanged": unchanged,
        "moments_unchanged": kept,
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


def update_under_a_cap(
    config: dict, device: torch.device, new_tokens: int, cap: float, folder: Path
) -> dict:
    """One update of the paper's batch on random tokens (12 prompts of 128 x G = 12 completions),
    the trainer's passes and AdamW under torch.cuda.set_per_process_memory_fraction(cap)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    cfg, run_cfg = cwgrpo.parse_config(
        ["--model", str(folder), "--max-completion-length", str(new_tokens)]
        + ["--length-limit", "new", "--max-prompt-length", "128", "--beta", "0"]
    )
    model = random_model(config, device)
    loading.enable_checkpointing(model)
    rows, vocab = cfg.prompts_per_step * cfg.group_size, config["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, vocab, (cfg.prompts_per_step, 128), generator=g)
    rollout = cwgrpo.Rollout(
        prompt_ids=prompt_ids.repeat_interleave(cfg.group_size, 0).to(device),
        prompt_mask=torch.ones(rows, 128, dtype=torch.long, device=device),
        completion_ids=torch.randint(0, vocab, (rows, new_tokens), generator=g).to(device),
        completion_mask=torch.ones(rows, new_tokens, device=device),
        truncated=torch.ones(rows, dtype=torch.bool, device=device),
        texts=[""] * rows,
        sampler_logp=torch.zeros(rows, new_tokens, device=device),
        advantages=torch.randn(rows, generator=g).to(device),
    )
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    logprobs = cwgrpo.logprobs_of_run(run_cfg, cfg.group_size)
    error = ""
    with peak_added(device) as memory:
        try:
            model.train()
            for _, part in rollout.micro_batches(cwgrpo.micro_batch_rows(cfg, run_cfg)):
                with torch.autocast(
                    device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
                ):
                    logp, entropy, _ = logprobs(model, part, cfg.temperature)
                    loss, _ = cwgrpo.policy_loss(
                        logp, entropy, part, cfg, 0, n_responses=rows, n_tokens=rows * new_tokens
                    )
                loss.backward()
            optimizer.step()
        except torch.OutOfMemoryError as oom:
            error = str(oom).splitlines()[0]
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    del model, optimizer
    planned = memory_plan.plan(str(folder), memory_plan.PlanOptions.of(cfg, run_cfg))["peak"]
    return {
        "passed": not error,
        "cap": cap,
        "out_of_memory": error,
        "peak_added_gb": memory["allocated_gb"],
        "peak_reserved_gb": memory["reserved_gb"],
        "plan_peak_gb": planned / GB,
    }


def grading_after_cuda(device: torch.device, gigabytes: float) -> dict:
    held = torch.empty(int(gigabytes * GB), dtype=torch.uint8, device=device)  # CUDA holding it
    cases = [("so \\boxed{42}", "\\boxed{42}"), ("\\boxed{41}", "\\boxed{42}")] * 8
    start = time.perf_counter()
    with (
        cwgrpo.Grader(timeout_s=10, workers=2) as grader,
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


def tiny_chain_run(
    preset: str, device: torch.device, steps: int, kill_after: int, folder: Path
) -> dict:
    args = ["--preset", preset, "--method", "grpo", "--steps", str(steps), "--device", device.type]
    args += [
        "--save-every",
        str(max(1, kill_after // 2)),
        "--threads",
        "1",
        "--reward-workers",
        "1",
    ]
    start = time.perf_counter()
    uninterrupted = run(args, folder / "uninterrupted")
    _, error = uninterrupted.communicate()
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
    _, resume_error = run([*args, "--resume"], folder / "killed").communicate()
    records = [
        [
            {k: v for k, v in r.items() if k not in TIMINGS}
            for r in read_records(f / "metrics.jsonl")
        ]
        for f in (folder / "uninterrupted", folder / "killed")
    ]
    differing = [r["step"] for r, s in zip(*records) if r != s]
    evaluated = subprocess.run(
        [sys.executable, str(REPOSITORY / "evaluate.py"), "--device", device.type]
        + presets.final_model_evaluation(folder / "killed", preset)
        + ["--output-dir", str(folder / "eval")],
        capture_output=True, text=True,
    )  # fmt: skip
    results = folder / "eval" / "results.json"
    pass_at_1 = json.loads(results.read_text())["average_pass@1"] if results.exists() else None
    return {
        "passed": mid_run and not differing and len(records[1]) == steps and pass_at_1 is not None,
        "steps": steps,
        "killed_mid_run": mid_run,
        "killed_after_step": kill_after,
        "uninterrupted_wall_s": wall_s,
        "records_identical": not differing,
        "first_differing_step": differing[0] if differing else None,
        "final_accuracy": records[1][-1]["accuracy_mean"] if records[1] else None,
        "held_out_pass@1": pass_at_1,
        "errors": [
            e[-500:] for e in (error, resume_error, evaluated.stderr) if e and "Traceback" in e
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (CI's twin)")
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
    out = Path(args.output_dir or ("runs/gpu-run-tiny" if args.tiny else "runs/gpu-run"))
    out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    versions = {
        name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")
    }
    print(f"benchmarks.gpu_run on {card}: {versions}", flush=True)
    checks = {
        "lora_push": lambda: lora_push(config, device),
        "fused_adamw_skips_inf": lambda: fused_adamw_skips_inf(device),
        "finite_left_padded_prefill": lambda: finite_left_padded_prefill(config, device),
        "update_under_a_cap": lambda: update_under_a_cap(
            config, device, 8 if args.tiny else 512, cap=0.7, folder=out / "model"
        ),
        "grading_after_cuda": lambda: grading_after_cuda(device, 0.2 if args.tiny else 20),
        "tiny_chain_run": lambda: tiny_chain_run(
            "tiny" if args.tiny else "tiny-chain",
            device,
            6 if args.tiny else 100,
            3 if args.tiny else 50,
            out,
        ),
    }
    report = {"card": card, "versions": versions, "checks": {}}
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            result = check()
        except Exception as error:  # noqa: BLE001 - a check that breaks is a finding, not a stop
            result = {"passed": False, "error": f"{type(error).__name__}: {error}"[:500]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        report["checks"][name] = result
        print(f"{name}: {json.dumps(result)}", flush=True)
        (out / "gpu_run.json").write_text(json.dumps(report, indent=1))
    failed = [name for name, result in report["checks"].items() if not result["passed"]]
    print(
        f"written: {out / 'gpu_run.json'}; "
        + (f"failed: {', '.join(failed)}" if failed else "all passed")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
