"""The measurements the three papers argue from, on any model, through the training code's
sampling and loss (docs/math.md, "Diagnostics").

    python -m tools.diagnose batch --preset tiny --model runs/cw-tiny-seed0/final-model \\
        --reference-model runs/tiny-base/model      # one rollout batch: diagnostics.{md,json}
    python -m tools.diagnose train --every 15 --method cw --preset tiny  # measuring as it trains
    python -m tools.diagnose plot --runs runs/diagnose-cw-tiny-seed0 runs/diagnose-grpo-tiny-seed0
    python -m tools.diagnose summary --runs runs/diagnose/*   # per method, intervals over seeds

- Covariance concentration (CW-GRPO): the mean covariance score of the top 0.01% ... 100% of the
  positive scores, and of the negative ones; the share of all |score| mass the top 0.01% ... 100%
  of tokens by |score| hold.
- Probability-quartile accounting (Yang et al.'s claim, as their reviewers asked): per quartile of
  token probability, |w| of the token weight, the analytic logit-gradient norm, and the norm of
  the parameter gradient of the step's loss with only that quartile's tokens active, and its share
  of the full gradient (its projection on it: the four shares sum to 1).
- summary: per method, over seeds, these through training beside the run's entropy and the tokens
  its method turned down (w < 0.5) or silenced (out of the policy-gradient term).
"""

import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import cwgrpo
from cwgrpo_utils.fast.lm_head import squared_probability_mass
from cwgrpo_utils.machine.grading_pool import Grader
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.machine.vllm_engine import Engine
from cwgrpo_utils.models import loading
from cwgrpo_utils.models.prompts import PromptStream
from cwgrpo_utils.options.cli import arg, parse_dataclasses
from cwgrpo_utils.options.presets import CPU_PRESETS
from cwgrpo_utils.run import checkpoints, plots
from cwgrpo_utils.run.folder import append_record, keep_records_until, read_records

CONCENTRATION_CUTOFFS = (0.0001, 0.001, 0.01, 0.1, 1.0)  # top 0.01% ... 100% of one side
PAPER_CONCENTRATION = {0.0001: (11.5, -13.6), 1.0: (0.06, -0.04)}  # CW-GRPO, R1-Distill-1.5B


@dataclass
class BatchConfig:
    reference_model: str = arg(
        "",
        "the KL reference (e.g. runs/tiny-base/model); default "
        "the model itself, which makes the KL part 0",
    )
    diagnostics_dir: str = arg(
        "", "where diagnostics.md and .json go (default <model>/diagnostics)"
    )


@dataclass
class TrainConfig:
    every: int = arg(
        15, "append the diagnostics to diagnostics.jsonl every this many rollout steps"
    )


@dataclass
class SummaryConfig:
    runs: list[str] = dataclasses.field(
        metadata={"help": "folders of diagnose train runs, named <label>-seed<seed>"}
    )
    output: str = arg("", "also write the table to this markdown file")


@dataclass
class PlotConfig:
    runs: list[str] = dataclasses.field(metadata={"help": "run folders with diagnostics.jsonl"})
    output: str = arg("runs/diagnostics.png", "the figure to write")


def concentration(scores: torch.Tensor) -> dict:
    """Mean covariance score of the top X% of the positive (negative) scores for each cutoff X:
    how much of the covariance a few tokens carry (the layout of the CW-GRPO paper's table)."""
    out = {}
    for side, sign in (("positive", 1.0), ("negative", -1.0)):
        magnitudes = (scores[scores * sign > 0] * sign).sort(descending=True).values
        out[side] = {
            cut: (sign * magnitudes[: max(1, math.ceil(cut * len(magnitudes)))].mean()).item()
            if len(magnitudes)
            else 0.0
            for cut in CONCENTRATION_CUTOFFS
        }
    magnitudes = scores.abs().sort(descending=True).values
    total = magnitudes.sum().clamp(min=1e-30)
    out["mass_share"] = {
        cut: (magnitudes[: max(1, math.ceil(cut * len(magnitudes)))].sum() / total).item()
        for cut in CONCENTRATION_CUTOFFS
    }
    return out


def quantile_masks(values: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """`parts` boolean masks of equal size (to one) that split `values` by rank; together they
    partition it. Ties are split by position, so a value shared by many tokens (the score 0 of
    every token in a group whose rewards are all equal) fills several parts instead of leaving
    some empty."""
    order = values.float().argsort(stable=True)
    bucket = torch.empty_like(order)
    bucket[order] = torch.arange(len(values), device=values.device) * parts // max(len(values), 1)
    return [bucket == q for q in range(parts)]


@torch.no_grad()
def logp_and_squared_mass(model, batch: cwgrpo.Batch, cfg, passes: cwgrpo.Passes):
    """(N, T) log-probs and sum_v p_v^2 at each position (for ||onehot - p||^2 = 1 - 2 p_y +
    sum_v p_v^2), micro-batch by micro-batch."""
    logp, squared_mass = (torch.zeros_like(batch.completion_mask) for _ in range(2))
    head = model.get_output_embeddings().weight
    for block, rows in batch.micro_batches(passes.micro_batch_rows):
        logp[block], _, hidden = cwgrpo.completion_logprobs(model, rows, cfg, passes)
        valid = rows.completion_mask.bool()
        squared_mass[block][valid] = squared_probability_mass(
            hidden[valid], head, cfg.temperature, passes.logit_chunk_elements
        )
    return logp, squared_mass


def step_gradient(model, batch, cfg, passes, autocast, only=None, scale=None) -> list:
    """The gradient of the step's loss (its first update pass), summed into .grad micro-batch by
    micro-batch through cwgrpo.py's sections 3, 5 and 6 as its loop sums it (scale: fp16's loss
    scaler's, where given), not applied: it is measured. With `only` (N, T), only those tokens'
    PG and KL terms count. Returns each micro-batch's (rows, loss, LossParts)."""
    model.train()
    n_tokens = int(batch.completion_mask.sum().clamp(min=1))
    out = []
    for block, rows in batch.micro_batches(passes.micro_batch_rows):
        with autocast():
            logp, entropy, _ = cwgrpo.completion_logprobs(model, rows, cfg, passes)
            tokens = cwgrpo.Group.of(rows, logp, entropy, update_pass=0)
            terms = cwgrpo.method_terms(tokens, cfg)
            if only is not None:
                active = only[block] if terms.active is None else only[block] * terms.active
                terms = terms._replace(active=active)
            loss, parts = cwgrpo.policy_loss(
                tokens,
                terms,
                cfg,
                sampler_logp=rows.sampler_logp,
                ref_logp=rows.ref_logp,
                n_responses=len(batch.texts),
                n_tokens=n_tokens,
            )
        (loss if scale is None else scale(loss)).backward()
        out.append((rows, loss, parts))
    return out


def quartile_gradients(model, batch, cfg, passes, autocast, quartiles: list) -> dict:
    """L2 norm of the parameter gradient of the step's loss with only one quartile's tokens
    active (their PG and KL terms; the rest masked), and its cosine with the full gradient."""

    def gradient(tokens: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        step_gradient(model, batch, cfg, passes, autocast, only=tokens)
        return torch.cat(
            [
                torch.zeros(p.numel(), device=p.device) if p.grad is None else p.grad.flatten()
                for p in model.parameters()
            ]
        )

    full = gradient(batch.completion_mask)
    per_quartile = [gradient(q.float()) for q in quartiles]
    model.zero_grad(set_to_none=True)
    return {
        "full_norm": full.norm().item(),
        "norm": [g.norm().item() for g in per_quartile],
        "cosine_with_full": [F.cosine_similarity(g, full, dim=0).item() for g in per_quartile],
    }


def scatter_valid(flat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A (N, T) tensor holding `flat` at the valid positions, 0 elsewhere."""
    out = torch.zeros(valid.shape, device=valid.device)
    out[valid] = flat.float()
    return out


def diagnose_batch(model, batch: cwgrpo.Batch, cfg, passes, autocast) -> dict:
    """The papers' measurements on one scored batch (ref_logp set when beta > 0), through the
    training loss. Restores the RNG and leaves no gradient: training goes on unchanged."""
    with checkpoints.rng_kept():
        return measure_batch(model, batch, cfg, passes, autocast)


def measure_batch(model, batch: cwgrpo.Batch, cfg, passes, autocast) -> dict:
    logp, squared_mass = logp_and_squared_mass(model, batch, cfg, passes)
    mask, valid = batch.completion_mask, batch.completion_mask.bool()
    spans = [slice(i, i + cfg.group_size) for i in range(0, len(batch.texts), cfg.group_size)]
    score = torch.cat(
        [cwgrpo.covariance_score(logp[g], batch.advantages[g], mask[g]) for g in spans]
    )[valid]
    cw = torch.cat(
        [cwgrpo.cw_weights(logp[g], batch.advantages[g], mask[g], norm=cfg.cw_norm) for g in spans]
    )[valid]
    prob = logp.exp()[valid]
    quartiles = quantile_masks(prob, 4)
    logit_grad_unit = (1 - 2 * prob + squared_mass[valid]).clamp(min=0).sqrt()  # ||onehot - p||
    report = {
        "tokens": int(valid.sum()),
        "concentration": concentration(score),
        "quartiles": [
            {
                "prob_min": prob[q].min().item(),
                "prob_max": prob[q].max().item(),
                "tokens": int(q.sum()),
                "cw_weight_mean": cw[q].mean().item(),
            }
            for q in quartiles
        ],
        "cw_weight_by_covariance_decile": [cw[d].mean().item() for d in quantile_masks(score, 10)],
    }
    adv = batch.advantages[:, None].expand_as(logp)[valid]
    for beta in sorted({0.0, cfg.beta}):
        # Yang et al.'s token weight (their Eq. 8), on-policy: A + beta (pi_ref / pi - 1)
        weight = adv.clone()
        if beta > 0:
            weight += beta * ((batch.ref_logp - logp)[valid].exp() - 1)
        key = f"beta={beta:g}"
        gradients = quartile_gradients(
            model,
            batch,
            dataclasses.replace(cfg, beta=beta),
            passes,
            autocast,
            [scatter_valid(q, valid) for q in quartiles],
        )
        report.setdefault("full_gradient_norm", {})[key] = gradients["full_norm"]
        for i, q in enumerate(quartiles):
            report["quartiles"][i][key] = {
                "abs_weight_mean": weight[q].abs().mean().item(),
                "abs_weight_median": weight[q].abs().median().item(),
                "logit_grad_norm_mean": (weight[q].abs() * logit_grad_unit[q]).mean().item(),
                "param_grad_norm": gradients["norm"][i],
                "cosine_with_full": gradients["cosine_with_full"][i],
                # its projection on the full gradient: the quartiles' shares sum to 1
                "grad_share": gradients["norm"][i]
                * gradients["cosine_with_full"][i]
                / max(gradients["full_norm"], 1e-30),
            }
    return report


def diagnostics_markdown(report: dict, cfg: cwgrpo.Config, rollout: str, source: str) -> str:
    cut_names = [f"{100 * c:g}%" for c in CONCENTRATION_CUTOFFS]
    lines = [
        f"# Diagnostics of {source}",
        "",
        f"One rollout batch of `--preset {cfg.preset}`: {cfg.prompts_per_step} prompts x G = "
        f"{cfg.group_size} sampled by `--rollout {rollout}`, {report['tokens']} valid tokens, "
        f"method `{cfg.method}` for the gradients.",
        "",
        "## Covariance concentration",
        "",
        "Mean CW covariance score (docs/math.md, cw step 3) of the top X% of the positive "
        "(negative) scores.",
        "",
        "| side | " + " | ".join(cut_names) + " |",
        "|---|" + "---|" * len(cut_names),
    ]
    for side in ("positive", "negative"):
        lines.append(
            f"| {side} (measured) | "
            + " | ".join(f"{report['concentration'][side][c]:.4g}" for c in CONCENTRATION_CUTOFFS)
            + " |"
        )
    for i, side in enumerate(("positive", "negative")):
        lines.append(
            f"| {side} (paper, 1.5B) | "
            + " | ".join(
                f"{PAPER_CONCENTRATION[c][i]:g}" if c in PAPER_CONCENTRATION else "-"
                for c in CONCENTRATION_CUTOFFS
            )
            + " |"
        )
    betas = list(report["full_gradient_norm"])
    full_norms = ", ".join(f"{b}: {report['full_gradient_norm'][b]:.4g}" for b in betas)
    lines += [
        "",
        "## Probability-quartile accounting",
        "",
        "Valid tokens split at the quartiles of their probability. |w| is the token weight "
        "A x ratio + beta (pi_ref / pi - 1); the logit-gradient norm is |w| ||onehot - p||; "
        "the parameter-gradient norm is that of the step's loss with only the quartile's "
        f"tokens active; cos is its cosine with the full gradient (full norms: "
        f"{full_norms}).",
        "",
        "| quartile | p range | tokens | "
        + " | ".join(
            f"mean \\|w\\| {b} | median \\|w\\| {b} | logit grad {b} | param grad {b} | cos {b}"
            for b in betas
        )
        + " | CW weight |",
        "|---|---|---|" + "---|" * (5 * len(betas) + 1),
    ]
    for i, q in enumerate(report["quartiles"]):
        cells = [
            f"{q[b]['abs_weight_mean']:.4g} | {q[b]['abs_weight_median']:.4g} | "
            f"{q[b]['logit_grad_norm_mean']:.4g} | {q[b]['param_grad_norm']:.4g} | "
            f"{q[b]['cosine_with_full']:.3f}"
            for b in betas
        ]
        lines.append(
            f"| Q{i + 1} | {q['prob_min']:.3g} - {q['prob_max']:.3g} | {q['tokens']} | "
            + " | ".join(cells)
            + f" | {q['cw_weight_mean']:.3f} |"
        )
    deciles = report["cw_weight_by_covariance_decile"]
    lines += [
        "",
        "## CW weights by covariance decile",
        "",
        "Deciles by rank of the covariance score; tied scores (the many 0s of groups whose rewards "
        "are all equal) are split by position, so every decile holds a tenth of the tokens.",
        "",
        "| decile | " + " | ".join(f"D{i + 1}" for i in range(10)) + " |",
        "|---|" + "---|" * 10,
        "| mean CW weight | " + " | ".join(f"{w:.3f}" for w in deciles) + " |",
    ]
    return "\n".join(lines) + "\n"


# Options of a training run that one diagnosed batch has no use for: out of its --help, refused
TRAINING_ONLY = (
    "resume",
    "overwrite_output_dir",
    "steps",
    "save_every",
    "save_total_limit",
    "log_every",
    "output_dir",
    "learning_rate",
    "min_lr_ratio",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "max_skipped_steps",
    "num_iterations",
    "report_to",
    "lora_rank",  # it measures --model as it is
    "lora_alpha",
    "lora_target_modules",
)


def batch(argv: list) -> Path | None:
    """The diagnostics of one rollout batch sampled from --model with the run's settings."""
    prog = "python -m tools.diagnose batch"
    cfg, run_cfg, bcfg = cwgrpo.parse_config(argv, BatchConfig, hidden=TRAINING_ONLY, prog=prog)
    if run_cfg.plan:  # the memory a run's step needs: the batch's sampling and gradients, as here
        return cwgrpo.main(cfg, run_cfg)
    if run_cfg.threads:
        torch.set_num_threads(run_cfg.threads)
    device = loading.resolve_device(run_cfg.device, "" if cfg.preset in CPU_PRESETS else cfg.preset)
    precision = Precision.choose(run_cfg.precision, device)
    for path in filter(None, (cfg.model, bcfg.reference_model)):
        loading.check_model_path(path)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = loading.load_tokenizer(cfg.model)
    model = loading.load_model(cfg.model, torch.float32, device)
    if run_cfg.gradient_checkpointing:
        loading.enable_checkpointing(model)
    reference = None
    if cfg.beta > 0:
        reference = loading.load_reference(bcfg.reference_model or cfg.model, precision)
    autocast = precision.autocast
    torch.manual_seed(cfg.seed)
    dataset = loading.load_dataset(
        cfg.dataset, cfg.dataset_split, cfg.question_column, gold_column=cfg.gold_column
    )
    prompts = PromptStream(dataset, tokenizer, cfg)
    engine = Engine.for_run(cfg, run_cfg, precision) if run_cfg.rollout == "vllm" else None
    passes = cwgrpo.Passes.of(cfg, run_cfg)
    questions = prompts.next_batch(cfg.prompts_per_step)
    golds = [gold for _, gold in questions for _ in range(cfg.group_size)]
    grading = Grader(
        cwgrpo.grade_accuracy,
        on_timeout=cwgrpo.TIMED_OUT,
        timeout_s=cfg.reward_timeout_s,
        workers=run_cfg.reward_workers,
    )
    with grading as grader, autocast():
        prompt_ids = [ids for ids, _ in questions]
        samples = cwgrpo.sample(model, tokenizer, prompt_ids, cfg, passes, engine=engine)
        grades = grader.map([(t, gold, "default") for t, gold in zip(samples.texts, golds)])
        rewards = cwgrpo.rewards_of(samples.texts, grades, cfg)
        advantages = cwgrpo.group_advantages(rewards.total, cfg.group_size)
        ref_logp = None
        if reference is not None:
            ref_logp = cwgrpo.token_stats(reference, samples, cfg, passes).logp
    batch = cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=ref_logp)
    report = diagnose_batch(model, batch, cfg, passes, autocast)
    out = Path(bcfg.diagnostics_dir or Path(cfg.model) / "diagnostics")
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostics.json").write_text(json.dumps(report, indent=1))
    table = diagnostics_markdown(report, cfg, run_cfg.rollout, source=cfg.model)
    (out / "diagnostics.md").write_text(table)
    print(f"{table}\nwritten: {out / 'diagnostics.md'} and {out / 'diagnostics.json'}")
    return out


def train(argv: list) -> None:
    """cwgrpo's training run, appending the diagnostics to diagnostics.jsonl every --every steps.
    The hook restores the RNG and the gradients, so the run's metrics are those of a plain run."""
    prog = "python -m tools.diagnose train"
    cfg, run_cfg, tcfg = cwgrpo.parse_config(argv, TrainConfig, prog=prog)
    if not {"--output-dir", "--output_dir"} & {a.split("=")[0] for a in argv}:
        run_cfg.output_dir = (
            f"runs/diagnose-{cfg.method}-{cfg.preset}-seed{cfg.seed}"  # not a plain run's
        )
    path = Path(run_cfg.output_dir) / "diagnostics.jsonl"

    passes = cwgrpo.Passes.of(cfg, run_cfg)

    def on_rollout(rollout_step, model, batch, autocast):
        if rollout_step == 1 or rollout_step % tcfg.every == 0:  # the first too: first -> last
            report = diagnose_batch(model, batch, cfg, passes, autocast)
            append_record(path, {"rollout_step": rollout_step, **report})

    if run_cfg.resume:
        keep_records_until(path, resumed_step(Path(run_cfg.output_dir)))
    return cwgrpo.main(cfg, run_cfg, on_rollout)


def resumed_step(output_dir: Path) -> int:
    checkpoint = checkpoints.latest_checkpoint(output_dir)
    return 0 if checkpoint is None else checkpoints.checkpoint_step(checkpoint)


def plot(argv: list) -> Path:
    """Entropy and the top-0.01% covariance over training steps, several runs on one figure."""
    (pcfg,), _ = parse_dataclasses(PlotConfig, argv, prog="python -m tools.diagnose plot")
    runs, top = {}, str(CONCENTRATION_CUTOFFS[0])
    for run in map(Path, pcfg.runs):
        if not (run / "diagnostics.jsonl").is_file():
            raise SystemExit(
                f"error: {run} has no diagnostics.jsonl; train it with "
                f"python -m tools.diagnose train --every N ..."
            )
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        found = [json.loads(line) for line in (run / "diagnostics.jsonl").read_text().splitlines()]
        runs[run.name] = (
            [r["step"] for r in metrics],
            [r["entropy_mean"] for r in metrics],
            [d["rollout_step"] for d in found],
            [d["concentration"]["positive"][top] for d in found],
            [d["concentration"]["negative"][top] for d in found],
        )
    Path(pcfg.output).parent.mkdir(parents=True, exist_ok=True)
    plots.plot_diagnostics(Path(pcfg.output), runs)
    print(f"written: {pcfg.output}")
    return Path(pcfg.output)


def summary(argv: list) -> str:
    """Per method, over seeds: |cov| mass, quartile gradient shares, entropy, tokens touched."""
    (scfg,), _ = parse_dataclasses(SummaryConfig, argv, prog="python -m tools.diagnose summary")
    labels = {}
    for run in map(Path, scfg.runs):
        if not (run / "diagnostics.jsonl").is_file():
            raise SystemExit(f"error: {run} has no diagnostics.jsonl; train it with diagnose train")
        labels.setdefault(run.name.rsplit("-seed", 1)[0], []).append(run_summary(run))
    table = summary_table(labels, f"python -m tools.diagnose summary --runs {' '.join(scfg.runs)}")
    if scfg.output:
        Path(scfg.output).write_text(table)
    print(table)
    return table


def run_summary(run: Path) -> dict:
    """One run's figures: each diagnosed batch's, first and last; metrics.jsonl's, first and last
    10% of rollout steps (entropy, accuracy), or means over the run (tokens touched)."""
    found = read_records(run / "diagnostics.jsonl")
    records = [r for r in read_records(run / "metrics.jsonl") if r["update_pass"] == 0]
    beta = f"beta={json.loads((run / 'run_config.json').read_text())['beta']:g}"
    out = {}
    for when, report in (("first", found[0]), ("last", found[-1])):
        for cut in MASS_CUTOFFS:
            out[f"{when} mass {cut}"] = report["concentration"]["mass_share"][str(cut)]
        for i, quartile in enumerate(report["quartiles"]):
            out[f"{when} Q{i + 1}"] = quartile[beta]["grad_share"]
    for key in ("accuracy_mean", "entropy_mean"):
        out[f"first {key}"], out[f"last {key}"] = plots.first_to_last(records, key)
    out["turned down"] = statistics.fmean(r["w_frac_below_half"] for r in records)
    out["silenced"] = statistics.fmean(1 - r["pg_active_frac"] for r in records)
    out["steps"] = [found[0]["rollout_step"], found[-1]["rollout_step"]]
    return out


MASS_CUTOFFS = (0.0001, 0.001, 0.01)  # the top 0.01%, 0.1% and 1% of tokens by |covariance|


def summary_table(labels: dict, command: str) -> str:
    """labels: method label -> its runs' run_summary; command: the one that made the table."""

    def cells(runs: list, key: str, digits: int = 2) -> str:
        if key.startswith("first"):  # first -> last
            last = key.replace("first", "last", 1)
            first = statistics.fmean(r[key] for r in runs)
            return f"{first:.{digits}f} → {plots.cell([r[last] for r in runs], digits)}"
        return plots.cell([r[key] for r in runs], digits)

    steps = {tuple(r["steps"]) for rs in labels.values() for r in rs}
    lines = [
        f"`{command}`",
        "",
        "Mean ± half-width of the 95% Student-t interval over each method's seeds; a → b: the "
        f"first diagnosed batch (rollout step {'/'.join(str(s[0]) for s in steps)}) against the "
        f"last ({'/'.join(str(s[1]) for s in steps)}), for entropy and accuracy the first and "
        "last 10% of rollout steps. |cov| mass: the share of the batch's summed |covariance "
        "score| (cw step 3) held by its top X% of tokens. Qk gradient share: the projection on "
        "the full gradient of the gradient with only the k-th probability quartile active (Q1: "
        "least probable; the four sum to 1), at the run's beta. Turned down: tokens whose "
        "weight w < 0.5; silenced: tokens out of the policy-gradient term; both per step, "
        "averaged over the run.",
        "",
        "| method | seeds | accuracy | entropy | top 0.01% mass | top 0.1% | top 1% | "
        "Q1 grad share | Q2 | Q3 | Q4 | turned down | silenced |",
        "|---" * 13 + "|",
    ]
    for label, rs in labels.items():
        quartiles = [cells(rs, f"first Q{i}") for i in range(1, 5)]
        masses = [cells(rs, f"first mass {cut}") for cut in MASS_CUTOFFS]
        lines.append(
            f"| {label} | {len(rs)} | {cells(rs, 'first accuracy_mean')} | "
            f"{cells(rs, 'first entropy_mean')} | {' | '.join(masses)} | {' | '.join(quartiles)} | "
            f"{cells(rs, 'turned down', 3)} | {cells(rs, 'silenced', 3)} |"
        )
    return "\n".join(lines) + "\n"


COMMANDS = {"batch": batch, "train": train, "plot": plot, "summary": summary}

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in COMMANDS:
        COMMANDS[sys.argv[1]](sys.argv[2:])
    else:
        commands = "\n".join(
            f"  {name:6s} {fn.__doc__.splitlines()[0]}" for name, fn in COMMANDS.items()
        )
        print(
            f"usage: python -m tools.diagnose {{{','.join(COMMANDS)}}} ... (each with --help)\n\n"
            f"{__doc__.split(chr(10) * 2)[0]}\n\n{commands}"
        )
        raise SystemExit(0 if {"-h", "--help"} & set(sys.argv[1:2]) else 2)
