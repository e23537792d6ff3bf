"""The base model on each candidate form of a task, before one is chosen to train on: how often
it is right (with a 95% interval over problems), how many groups of G samples would carry a
signal (not all equal: an all-equal group has advantage 0 and teaches nothing), and how many
tokens a completion takes (what a step costs; its text tokenized again).

    python -m tools.probe                                   # SmolLM2 on every form, at 0.7
    python -m tools.probe --forms sum-2d-3shot,diff-2d1d-3shot --temperatures 0.7,1.0

Each form's problems (smollm2.TASK_FORMS) are written to <output-dir>/<form>.jsonl and sampled
by one evaluate.py command per temperature (printed, and resumable as evaluate.py is), with the
training reward's grading, n samples a problem; n is G, so the share of problems whose samples
are not all equal is the share of groups that carry a signal.
"""

import json
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cwgrpo_utils.models import loading, preset_models, smollm2
from cwgrpo_utils.options.cli import arg, parse_dataclasses
from cwgrpo_utils.options.presets import QUESTION_AS_ASKED, SMOLLM2
from cwgrpo_utils.run import plots

EVALUATE = Path(__file__).resolve().parent.parent / "evaluate.py"


@dataclass
class ProbeConfig:
    forms: str = arg("all", f"comma-separated forms of {', '.join(smollm2.TASK_FORMS)}; or all")
    model: str = arg(SMOLLM2, "the base model: hub id or local folder")
    problems: int = arg(64, "problems a form", "> 0")
    n: int = arg(8, "samples a problem: the group size G of the run it stands for", ">= 2")
    temperatures: str = arg("0.7", "comma-separated sampling temperatures, each probed")
    max_new_tokens: int = arg(32, "generation limit in tokens", "> 0")
    seed: int = arg(2, "the problems' seed (training files use 0, held-out sets 1)", ">= 0")
    engine: Literal["hf", "vllm"] = arg("hf", "evaluate.py's sampler")
    output_dir: str = arg("runs/probe", "gets <form>.jsonl, eval-t<temperature>/ and probe.md")


def probe(argv: list) -> str:
    (pcfg,), _ = parse_dataclasses(ProbeConfig, argv, prog="python -m tools.probe")
    forms = list(smollm2.TASK_FORMS) if pcfg.forms == "all" else pcfg.forms.split(",")
    unknown = [f for f in forms if f not in smollm2.TASK_FORMS]
    if unknown:
        raise SystemExit(
            f"error: unknown form {unknown[0]}; choose from {', '.join(smollm2.TASK_FORMS)}"
        )
    output_dir = Path(pcfg.output_dir)
    files = [write_problems(output_dir / f"{form}.jsonl", form, pcfg) for form in forms]
    tokenizer = loading.load_tokenizer(preset_models.ready(pcfg.model))
    rows = []
    for temperature in pcfg.temperatures.split(","):
        eval_dir = output_dir / f"eval-t{temperature}"
        command = [
            *("--model", pcfg.model, "--benchmarks", ",".join(map(str, files))),
            *QUESTION_AS_ASKED,
            *("--n", str(pcfg.n), "--temperature", temperature, "--top-p", "1.0"),
            *("--max-new-tokens", str(pcfg.max_new_tokens), "--engine", pcfg.engine),
            *("--reward-workers", "1", "--output-dir", str(eval_dir)),
        ]
        print(f"python evaluate.py {shlex.join(command)}", flush=True)
        subprocess.run([sys.executable, str(EVALUATE), *command], check=True)
        for form in forms:
            problems = [json.loads(line) for line in (eval_dir / f"{form}.jsonl").open()][1:]
            rows.append(form_row(form, temperature, problems, tokenizer))
    table = probe_table(rows, pcfg, argv)
    (output_dir / "probe.md").write_text(table)
    print(table)
    return table


def write_problems(path: Path, form: str, pcfg: ProbeConfig) -> Path:
    """The form's problems as evaluate.py reads a local file: the question and its answer."""
    problems = smollm2.task_problems(form, pcfg.problems, pcfg.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dict(problem=q, answer=a)) + "\n" for q, a in problems))
    return path


def form_row(form: str, temperature: str, problems: list[dict], tokenizer) -> dict:
    """One form at one temperature: accuracy over problems, groups with a signal, tokens."""
    per_problem = [statistics.fmean(p["correct"]) for p in problems]
    completions = [c for p in problems for c in p["completions"]]
    accuracy, half = plots.interval(per_problem)
    return {
        "form": form,
        "temperature": temperature,
        "accuracy": accuracy,
        "half": half,
        "signal": statistics.fmean(0 < a < 1 for a in per_problem),
        "boxed": statistics.fmean("\\boxed{" in c for c in completions),
        "tokens": statistics.fmean(len(tokenizer(c)["input_ids"]) for c in completions),
    }


def probe_table(rows: list[dict], pcfg: ProbeConfig, argv: list) -> str:
    lines = [
        f"`python -m tools.probe {shlex.join(argv)}`: {pcfg.model}, {pcfg.problems} "
        f"problems a form (seed {pcfg.seed}), {pcfg.n} samples each, top-p 1.0, up to "
        f"{pcfg.max_new_tokens} new tokens, graded by the training reward. Accuracy: mean over "
        f"problems ± the half-width of its 95% interval over them; groups with a signal: the "
        f"share of problems whose {pcfg.n} samples are not all equal.",
        "",
        "| form | temperature | accuracy | groups with a signal | boxed | tokens a completion |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['form']} | {r['temperature']} | {r['accuracy']:.3f} ± {r['half']:.3f} | "
        f"{r['signal']:.2f} | {r['boxed']:.2f} | {r['tokens']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    probe(sys.argv[1:])
