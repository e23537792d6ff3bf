"""A cwgrpo.py run's machinery, everything around the algorithm: what it prints, its folder (lock,
stop signals, resume, metrics.jsonl, trackers), the device, precision and threads, what it loads,
the memory phases, the records and progress, the skipped steps, the checkpoints, curves and token
page. cwgrpo.py's main and training loop hand it each step in a few calls:

    with Run(cfg, run_cfg) as run:              # checked, locked, its header printed
        run.start(grader)                           # the data; run_config.json; records kept
        loaded = run.load()                         # policy, reference, tokenizer, prompts, engine
        start = run.begin(optimizer, scheduler, scaler=..., prompts=...)
        with run.phase("sampling", rollout_step): ...   # out of memory: one line and the lever
        run.rollout_scored(rollout_step, model=..., batch=...)  # the token page, a tool's hook
        run.log_update(step, rollout_step, update_pass, figures, finite)  # a metrics.jsonl line
        run.end_step(rollout_step, model, tokenizer)    # progress; a checkpoint when due
        run.finish(model, tokenizer)                # the final model
    print(run.summary())
"""

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from cwgrpo_utils import EVALUATION_TEMPERATURE, REPOSITORY
from cwgrpo_utils.machine import memory_plan, threads
from cwgrpo_utils.machine.grading_pool import Grader
from cwgrpo_utils.machine.memory_plan import OutOfMemory, PlanOptions
from cwgrpo_utils.machine.precision import Precision, SkippedSteps
from cwgrpo_utils.machine.vllm_engine import Engine
from cwgrpo_utils.models import lora, preset_models, tiny
from cwgrpo_utils.models.loading import (
    check_model_path,
    load_dataset,
    load_policy,
    load_reference,
    load_tokenizer,
    resolve_device,
)
from cwgrpo_utils.models.prompts import PromptStream
from cwgrpo_utils.options.cli import command, shown_path
from cwgrpo_utils.options.config import Config, Passes
from cwgrpo_utils.options.presets import CPU_PRESETS, GPU_PRESETS, final_model_evaluation
from cwgrpo_utils.options.run_config import RunConfig
from cwgrpo_utils.run import checkpoints, plots
from cwgrpo_utils.run.folder import Progress, RunFolder, read_records
from cwgrpo_utils.run.metrics import GRADING_PROBLEMS
from cwgrpo_utils.run.token_page import TokenPage


class Loaded(NamedTuple):
    """What a run trains and samples with."""

    model: torch.nn.Module  # the policy, a checkpoint's on resume
    reference: (
        torch.nn.Module | None
    )  # the KL's: a frozen copy; None under LoRA (the base) or beta 0
    tokenizer: Any
    prompts: PromptStream  # the data's prompts in their seeded order
    engine: Engine | None  # --rollout vllm's sampler; else None


class Run:
    """One training run of cfg (the algorithm's Config) and run_cfg (RunConfig). Made,
    it has chosen the device, precision and thread count and printed the run's header; entered, it
    holds the folder's lock and has checked the model (a CPU preset's built on first use, its fit
    on the GPU against the plan)."""

    def __init__(self, cfg: Config, run_cfg: RunConfig):
        self.cfg, self.run_cfg = cfg, run_cfg
        self.started = time.perf_counter()
        gpu_recipe = "" if cfg.preset in CPU_PRESETS else cfg.preset
        self.device = resolve_device(run_cfg.device, gpu_recipe)
        self.precision = Precision.choose(run_cfg.precision, self.device)  # by the card
        print(run_header(cfg, run_cfg, self.precision.reason), flush=True)
        plots.pyplot()  # fail now, not at the first checkpoint, if matplotlib is missing
        self.folder = RunFolder.for_run(cfg, run_cfg)
        self.hooks = []

    @staticmethod
    def plan(cfg, run_cfg: RunConfig) -> str:
        """--plan's text: the memory and disk the run needs, before anything loads."""
        tiny.build_if_missing(cfg.model)
        return memory_plan.report(cfg.model, PlanOptions.of(cfg, run_cfg))

    def __enter__(self) -> "Run":
        self.folder.__enter__()  # locked against a second run; a resume's checkpoint checked
        try:
            model = preset_models.ready(self.cfg.model, self.cfg.dataset)
            self.cfg = dataclasses.replace(self.cfg, model=model)
            if self.device.type == "cuda":  # before anything loads: a run that cannot fit stops
                memory_plan.check_fit_on_gpu(
                    self.cfg.model, PlanOptions.of(self.cfg, self.run_cfg), self.gpu_recipes()
                )
            check_model_path(self.cfg.model)
            self.threads = threads.set_for(self.run_cfg.threads, self.cfg.model, self.device)
        except BaseException as error:
            self.folder.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def __exit__(self, *exc_info):
        self.folder.__exit__(*exc_info)

    def gpu_recipes(self) -> dict:
        """Each GPU preset as the (Config, RunConfig) pair it makes: the advice a run that does
        not fit its card gets names those that would."""
        run_fields = {f.name for f in dataclasses.fields(RunConfig)}
        pairs = {}
        for name, values in GPU_PRESETS.items():
            algorithm = {k: v for k, v in values.items() if k not in run_fields}
            run = {k: v for k, v in values.items() if k in run_fields}
            pairs[name] = (type(self.cfg)(preset=name, **algorithm), RunConfig(**run))
        return pairs

    @property
    def path(self) -> Path:
        return self.folder.path

    @property
    def resume_from(self) -> Path | None:
        return self.folder.resume_from

    @property
    def weights(self) -> str:
        """Where the policy's weights load from: the checkpoint resumed from, or the model."""
        return str(self.resume_from or self.cfg.model)

    def finished(self) -> bool:
        """A resumed run that has done its steps says so (and the loop has nothing to do)."""
        return self.folder.finished(self.cfg.steps)

    def grader(self, grade, on_timeout) -> Grader:
        """The processes that grade completions with grade(completion, gold, gold_format) while
        the step goes on: --reward-workers of them, each grading cut off after --reward-timeout-s
        and scored on_timeout."""
        return Grader(
            grade,
            on_timeout=on_timeout,
            timeout_s=self.cfg.reward_timeout_s,
            workers=self.run_cfg.reward_workers,
        )

    def start(self, grader: Grader) -> None:
        """The data loaded; run_config.json with what the run used, and on resume the records
        after its checkpoint dropped; then it says what it loads."""
        cfg = self.cfg
        self.dataset = load_dataset(
            cfg.dataset, cfg.dataset_split, cfg.question_column, gold_column=cfg.gold_column
        )
        self.folder.start(
            torch_threads=torch.get_num_threads(),
            threads_because=self.threads,
            reward_workers_used=grader.size,
            precision_used=self.precision.reason,
        )
        print(f"loading {shown_path(self.weights)} ...", flush=True)

    def load(self) -> "Loaded":
        """What the run trains and samples with (Loaded)."""
        cfg, run_cfg = self.cfg, self.run_cfg
        tokenizer = load_tokenizer(self.weights)
        prompts = PromptStream(self.dataset, tokenizer, cfg)
        model = load_policy(cfg, run_cfg, self.resume_from, self.precision)
        frozen_copy = cfg.beta > 0 and not run_cfg.lora_rank
        reference = load_reference(cfg.model, self.precision) if frozen_copy else None
        engine = None
        if run_cfg.rollout == "vllm":
            engine = Engine.for_run(cfg, run_cfg, self.precision)
        return Loaded(model, reference, tokenizer, prompts, engine)

    def show_tokens(self, tokenizer, methods: dict, weigh, hook=None) -> None:
        """tokens.html at the first and last steps (token_page.py; weigh: every method's weights
        of a batch's rows), and a tool's hook, each called with every scored batch."""
        passes = Passes.of(self.cfg, self.run_cfg)
        page = TokenPage(self.folder, self.cfg, tokenizer, methods, weigh, passes)
        self.hooks = [page] if hook is None else [page, hook]

    def begin(self, optimizer, scheduler, scaler, prompts) -> int:
        """The rollout steps done before this start: a resumed run's checkpoint step, with the
        optimizer, schedule, loss scaler, skipped steps, RNG states and the prompts' position as it
        saved them; 0 for a new run."""
        self.skipped = SkippedSteps(self.run_cfg.max_skipped_steps)  # non-finite gradients
        self.stateful = dict(optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        self.stateful["skipped"] = self.skipped
        self.scaler, self.prompts = scaler, prompts
        start = 0
        if self.resume_from is not None:
            state = checkpoints.restore(self.resume_from, self.stateful)
            start = state["step"]
            prompts.position = state["data_position"]
        self.memory = OutOfMemory(
            self.cfg.model, PlanOptions.of(self.cfg, self.run_cfg), self.folder.path
        )
        self.progress = Progress(
            start, self.cfg.steps, label=self.cfg.method, every=self.run_cfg.log_every
        )
        self.clock = time.perf_counter()  # what a step's phases took, for metrics.jsonl
        return start

    def phase(self, name: str, rollout_step: int):
        """A context in which running out of GPU memory stops the run in one line: the phase and
        rollout step, the plan's peak there, the option that lowers it, the command that
        resumes."""
        return self.memory.phase(name, rollout_step)

    def rollout_scored(self, rollout_step: int, model, batch) -> None:
        """A scored batch, before its update: its time, then the hooks."""
        self.batch, self.rollout_s = batch, time.perf_counter() - self.clock
        for hook in self.hooks:
            hook(rollout_step, model=model, batch=batch, autocast=self.precision.autocast)
        self.clock = time.perf_counter()

    def log_update(self, step: int, rollout_step: int, update_pass: int, figures, finite) -> None:
        """An optimizer step's line of metrics.jsonl (and the trackers'), from the rollout's and
        the update's figures; after --max-skipped-steps non-finite ones in a row, the run stops."""
        update_s = time.perf_counter() - self.clock
        self.skipped.count(finite)
        tokens = self.batch.completion_mask.sum().item()
        self.record = {
            "step": step,
            "rollout_step": rollout_step,
            "update_pass": update_pass,
            **figures,
            "skipped_steps": self.skipped.total,
            "prompts_skipped": self.prompts.skipped,
            "rollout_s": self.rollout_s,
            "update_s": update_s,
            "time": time.time(),
            "tokens_per_s": tokens / (self.rollout_s + update_s),
        }
        if self.scaler.is_enabled():
            self.record["loss_scale"] = self.scaler.get_scale()
        self.folder.log(self.record)
        self.skipped.stop_if_too_many(self.folder, self.record)
        self.clock = time.perf_counter()

    def end_step(self, rollout_step: int, model, tokenizer) -> None:
        """The progress bar (the step's last record); a checkpoint and the curves every
        --save-every steps, after the last, and after Ctrl-C or SIGTERM, when the run then stops."""
        self.progress.step(self.record)
        if (
            rollout_step % self.run_cfg.save_every == 0
            or rollout_step == self.cfg.steps
            or self.folder.stop.requested
        ):
            position = self.prompts.position
            state = checkpoints.trainer_state(self.stateful, rollout_step, data_position=position)
            self.folder.save(rollout_step, model, tokenizer, state)
            title = f"{self.cfg.method} on {self.cfg.model}, seed {self.cfg.seed}"
            plots.draw_curves(self.folder.path, title)
        self.folder.stop_if_requested(
            rollout_step
        )  # after a Ctrl-C or SIGTERM: with that checkpoint
        self.clock = time.perf_counter()

    def finish(self, model, tokenizer) -> None:
        """The final model: the trained one, or under LoRA the base with the adapter merged."""
        self.progress.close()
        final = lora.merged_model(model)
        checkpoints.save_checkpoint(self.path, "final-model", model=final, tokenizer=tokenizer)

    def summary(self) -> str:
        wall_s = time.perf_counter() - self.started
        return run_summary(self.path, wall_s, self.cfg.preset, resumed_from=self.resume_from)


def run_header(cfg, run_cfg: RunConfig, precision: str) -> str:
    """What a run is about to do, in two lines, from its options and its precision (and why)."""
    model, data = shown_path(cfg.model), shown_path(cfg.dataset)
    header = f"cwgrpo: --method {cfg.method} on {model}, data {data}\n  "
    header += f"{cfg.prompts_per_step} prompts x G = {cfg.group_size} per step, {cfg.steps} steps, "
    header += f"beta {cfg.beta:g}, lr {cfg.learning_rate:g}, temperature {cfg.temperature:g}; "
    return header + f"{precision}; output {run_cfg.output_dir}"


SUMMARY_KEYS = ("reward_mean", "accuracy_mean", "format_mean", "entropy_mean", "kl_mean")


def run_summary(output_dir: Path, wall_s: float, preset: str, resumed_from=None) -> str:
    """What a run did, in a few lines: first -> last 10% of each curve (the format's only where the
    reward counts it), its wall time (a resumed run's: this part's, and the steps' of the whole
    run), where its checkpoints, final model and pictures are, and the commands that evaluate its
    final model (on a CPU preset's own held-out set)."""
    records = read_records(output_dir / "metrics.jsonl")
    options = json.loads((output_dir / "run_config.json").read_text())
    evaluation = [str(REPOSITORY / "evaluate.py"), final_model_evaluation(output_dir, preset)]
    trained_at = f"{options['temperature']:g}"
    took = f"done in {wall_s:.0f} s"
    if resumed_from is not None:  # the steps' own times, each rollout counted once
        batches = {r["rollout_step"]: r["rollout_s"] for r in records}
        steps_s = sum(batches.values()) + sum(r["update_s"] for r in records)
        took += (
            f" (this part, resumed from {resumed_from.name}; the whole run's steps {steps_s:.0f} s)"
        )
    out = [
        f"{took}; first -> last 10% of {len(records)} steps "
        f"(completions sampled at temperature {options['temperature']:g}):"
    ]
    for key in SUMMARY_KEYS:
        first, last = plots.first_to_last(records, key)
        if key == "format_mean" and not options["format_weight"]:
            out.append("  format    not rewarded (--format-weight 0)")
            continue
        out.append(f"  {key.removesuffix('_mean'):9s} {first:8.3f} -> {last:.3f}")
    batches = {r["rollout_step"]: r for r in records}.values()  # a batch's grades, counted once
    problems = {what: sum(r.get(key, 0) for r in batches) for key, what in GRADING_PROBLEMS.items()}
    if any(problems.values()):
        counts = ", ".join(f"{n} {what}" for what, n in problems.items() if n)
        out.append(f"  grading: {counts} (scored 0)")
    skipped = records[-1].get("skipped_steps", 0)  # records before the count was kept have none
    if skipped:
        scale = (
            f"; loss scale now {records[-1]['loss_scale']:g}" if "loss_scale" in records[-1] else ""
        )
        out.append(
            f"  skipped: {skipped} of {len(records)} optimizer steps, their gradient not finite "
            f"(no weight changed){scale}"
        )
    kept = sorted(checkpoints.checkpoints(output_dir), key=checkpoints.checkpoint_step)
    return "\n".join(
        out
        + [
            f"checkpoints: {', '.join(map(str, kept))}",
            f"final model: {output_dir / 'final-model'}",
            f"pictures:    {output_dir / 'curves.png'} and {output_dir / 'tokens.html'}",
            f"evaluate it: {command(*evaluation)} (samples at the paper's evaluation "
            f"temperature, {EVALUATION_TEMPERATURE:g})",
            f"  or at its training temperature, {trained_at}: "
            f"{command(evaluation[0], [*evaluation[1], '--temperature', trained_at])}",
        ]
    )
