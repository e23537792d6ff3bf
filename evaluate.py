"""evaluate.py: a checkpoint on the paper's five math benchmarks, its protocol and a robust one.

    python evaluate.py --model runs/cw-paper-1.5b-seed2025/checkpoint-100 --protocol paper
    python evaluate.py --model PATH --n 16                      # avg@16 and pass@k with error bars
    python evaluate.py --model PATH --benchmarks my.jsonl --question-column q --gold-column a
    python evaluate.py --checkpoints "runs/x/checkpoint-*"      # the checkpoint-stability table
    python evaluate.py --model PATH --n 16 --engine vllm        # the same, sampled by vLLM

Benchmarks, prompt and sampling follow docs/math.md, "Evaluation". --protocol paper grades as the
paper's table was graded (lighteval's extractive match, grade_paper below); --protocol robust with
cwgrpo.py's training reward, stricter (docs/evaluation.md, "Grading": each difference).
"""

import sys
from dataclasses import dataclass
from typing import Literal

from cwgrpo_utils import EVALUATION_TEMPERATURE, PRECISIONS
from cwgrpo_utils.options.cli import arg, check, check_ranges, parse_dataclasses, require

BENCHMARK_NAMES = ("aime24", "math500", "amc23", "minerva", "olympiadbench")
# docs/math.md, "Evaluation": user prompt, no system prompt
EVAL_PROMPT = (
    "Solve the following math problem efficiently and clearly.  The last line of your response "
    "should be of the following format: 'Therefore, the final answer is: $\\boxed{{ANSWER}}$. I "
    "hope it is correct' (without quotes) where ANSWER is just the final number or expression "
    "that solves the problem. Think "
    "step by step before answering.\n\n{question}"
)


@dataclass
class EvalConfig:
    model: str = arg("", "model to evaluate: hub id or local folder")
    checkpoints: str = arg("", "a glob of checkpoint folders ('runs/x/checkpoint-*'): their table")
    benchmarks: str = arg(",".join(BENCHMARK_NAMES), "comma-separated names or local data files")
    question_column: str = arg("problem", "question column of local files")
    gold_column: str = arg("answer", "gold column of local files")
    gold_format: Literal["expr", "latex", "default"] = arg(
        "latex", "how the gold of local files is parsed: expr (numbers), latex or default (both)"
    )
    prompt_template: str = arg(EVAL_PROMPT, "user message, {question} where the problem goes")
    system_prompt: str = arg("", "system message; empty: none of ours (as the paper's evaluation)")
    protocol: Literal["robust", "paper"] = arg(
        "robust",
        "paper: 1 sample per problem, graded as lighteval did; robust: --n samples, avg@n, graded "
        "by the training reward",
    )
    n: int = arg(8, "samples per problem under the robust protocol", "> 0")
    temperature: float = arg(EVALUATION_TEMPERATURE, "sampling temperature (the paper's)", "> 0")
    top_p: float = arg(0.95, "nucleus sampling (the paper: 0.95)", "in (0, 1]")
    max_new_tokens: int = arg(4096, "generation limit in tokens", "> 0")
    batch_size: int = arg(
        16, "problems sampled at once (each prompt encoded once for its n)", "> 0"
    )
    limit: int = arg(0, "evaluate only the first N problems of each benchmark; 0: all", ">= 0")
    seed: int = arg(2025, "sampling seed", ">= 0")
    reward_timeout_s: float = arg(10.0, "hard limit on grading one completion", "> 0")
    reward_workers: int = arg(0, "grading processes; 0: one per CPU core, at most 8", ">= 0")
    device: str = arg("auto", "auto (cuda if present), cuda or cpu")
    threads: int = arg(0, "CPU threads of torch; 0: chosen for the model and idle cores", ">= 0")
    precision: Literal[PRECISIONS] = arg(
        "auto", "the model's dtype: auto is bf16 on CUDA 8.0+, fp16 on 7.x, fp32 on a CPU"
    )
    engine: Literal["hf", "vllm"] = arg("hf", "sampler: hf (cwgrpo.py's loop) or vllm, alike")
    vllm_gpu_memory_utilization: float = arg(0.9, "--engine vllm on CUDA: its share", "in (0, 1]")
    overwrite: bool = arg(False, "recompute benchmarks whose kept samples were made otherwise")
    output_dir: str = arg("", "results.json, results.md and progress; default eval/<model path>")

    def __post_init__(self):
        check_ranges(self)


def parse_config(argv=None) -> EvalConfig:
    argv = sys.argv[1:] if argv is None else list(argv)
    (cfg,), _ = parse_dataclasses(EvalConfig, argv, description=__doc__.split("\n\n")[0])
    one = "pass exactly one of --model PATH_OR_HUB_ID and --checkpoints GLOB"
    check(bool(cfg.model) != bool(cfg.checkpoints), one)
    if cfg.engine == "vllm":
        require("vllm", "--engine vllm")
    return cfg


if __name__ == "__main__":  # --help and a bad option answer here, before the heavy imports below
    CONFIG = parse_config()

import functools
import glob
import hashlib
import json
import math
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from sympy import Basic, Rational, UnevaluatedExpr
from tqdm import tqdm

import cwgrpo
from cwgrpo_utils.machine import threads
from cwgrpo_utils.machine.grading_pool import Grader, LogCounter
from cwgrpo_utils.machine.precision import Precision
from cwgrpo_utils.machine.vllm_engine import Engine
from cwgrpo_utils.models import loading, preset_models
from cwgrpo_utils.models.prompts import chat_prompt_ids
from cwgrpo_utils.options.cli import command
from cwgrpo_utils.run import plots
from cwgrpo_utils.run.checkpoints import checkpoint_step
from cwgrpo_utils.run.folder import StopRequest


class Benchmark(NamedTuple):
    source: str  # hub id or local file
    split: str
    question_column: str
    gold_column: str
    gold_format: str  # how math-verify parses the gold: "expr" or "latex"


# docs/math.md, "Evaluation": hub id, split, question field, gold field, gold parsing
BENCHMARKS = {
    "aime24": Benchmark("HuggingFaceH4/aime_2024", "train", "problem", "answer", "expr"),
    "math500": Benchmark("HuggingFaceH4/MATH-500", "test", "problem", "solution", "latex"),
    "amc23": Benchmark("knoveleng/AMC-23", "train", "problem", "answer", "expr"),
    "minerva": Benchmark("knoveleng/Minerva-Math", "train", "problem", "solution", "latex"),
    "olympiadbench": Benchmark("knoveleng/OlympiadBench", "train", "question", "answer", "latex"),
}
TABLE_NAMES = {
    "aime24": "AIME24",
    "math500": "MATH-500",
    "amc23": "AMC23",
    "minerva": "Minerva",
    "olympiadbench": "OlympiadBench",
}

# the CW-GRPO paper's tables (pass@1, single sample)
PUBLISHED = [
    ("1.5B base (quoted from elsewhere, avg@16)", [28.8, 82.8, 62.9, 26.5, 43.3, 48.9]),
    ("1.5B GRPO", [33.3, 85.0, 67.5, 27.2, 49.9, 52.6]),
    ("1.5B Clip-Cov", [33.3, 85.5, 70.0, 29.0, 50.0, 53.6]),
    ("1.5B CW-GRPO", [30.0, 87.0, 77.5, 29.8, 52.0, 55.3]),
    ("7B base", [3.3, 82.6, 47.5, 33.1, 40.4, 41.4]),
    ("7B GRPO", [10.0, 82.2, 55.0, 33.1, 40.3, 44.1]),
    ("7B CW-GRPO", [13.3, 82.8, 62.5, 32.0, 42.7, 46.7]),
]


# The paper's grading: lighteval's extractive-match metric as Open-RS's evaluation configured it
# (lighteval at commit ed084813, Feb 2025: a benchmark's gold as an expression or as LaTeX, the
# prediction as either, boxed first, any match, five decimals), through math-verify's parser, which
# was split out of it, with what the versions it pinned read otherwise (last_boxes, percent_valued)
PAPER_GOLD = {
    "expr": [ExprExtractionConfig()],
    "latex": [LatexExtractionConfig()],
    "default": [LatexExtractionConfig(), ExprExtractionConfig()],
}
PAPER_PREDICTION = [ExprExtractionConfig(), LatexExtractionConfig(boxed_match_priority=0)]
BOX = re.compile(r"\\(?:boxed|fbox)\s*{")
# What joins two boxes into one answer for lighteval: "and", "or" or a comma alone between them, or
# between the math environments holding them ($\boxed{7}$ and $\boxed{42}$: the set {7, 42})
BOX_SEPARATOR = re.compile(
    r"^\s*(?:and|or|,)\s*$"
    r"|^[^$\n]*(?:\$\$|\$|\\\)|\\\])\s*(?:and|or|,)\s*(?:\$\$|\$|\\\(|\\\[)[^$\n]*$"
)
PERCENT = UnevaluatedExpr(Rational(1, 100))  # how latex2sympy2_extended writes X% (X * 1/100)


def grade_paper(completion: str, gold: str, gold_format: str) -> cwgrpo.Grade:
    """1.0 if lighteval's extractive match, as the paper's evaluation ran it, finds the completion's
    answer equal to the gold: any of its matches, an expression anywhere (the last number of an
    unfinished completion too) or LaTeX, boxed first; an unparseable gold compared as its text.
    The completion's matches are tried for as long as it takes, as lighteval did (its limit was
    each match's parse, not the search): math-verify 0.9's 5 s for the whole search gives up on
    a long completion of many unparseable matches, where lighteval went on to a number; the
    grading pool's hard limit (--reward-timeout-s) still bounds it."""
    cutoffs = LogCounter.installed("math_verify", "Timeout during")
    before = cutoffs.count
    modes = dict(fallback_mode="first_match", extraction_mode="any_match")
    try:
        gold_parsed = parse(gold, PAPER_GOLD[gold_format], **modes)
        prediction = parse(last_boxes(completion), PAPER_PREDICTION, **modes, parsing_timeout=None)
        golds = percent_valued(gold_parsed or [gold])
        accuracy = float(verify(golds, percent_valued(prediction), float_rounding=5))
    except Exception:  # noqa: BLE001 - a failure inside the grader is a wrong answer
        gold_parsed, accuracy = [gold], 0.0
    return cwgrpo.Grade(accuracy, bool(gold_parsed), cutoffs.count > before)


def last_boxes(text: str) -> str:
    """text with only its last box left boxed, or its last boxes where nothing but "and", "or" or
    a comma joins them (BOX_SEPARATOR): how lighteval at ed08481 with latex2sympy2_extended 1.0.6
    (the paper's) reads several boxes; 1.11 (math-verify 0.9's) makes a set of boxes 70
    characters apart, as \\boxed{7}, then \\boxed{42}. The earlier boxes keep their braces and
    content."""
    boxes = [(m.start(), m.end(), closing_brace(text, m.end() - 1)) for m in BOX.finditer(text)]
    kept = len(boxes) - 1
    while kept > 0 and BOX_SEPARATOR.match(text[boxes[kept - 1][2] + 1 : boxes[kept][0]]):
        kept -= 1
    for start, brace, _ in reversed(boxes[:kept]):  # unbox from the right: positions stay valid
        text = text[:start] + text[brace - 1 :]
    return text


def closing_brace(text: str, opening: int) -> int:
    """The position of the brace that closes the one at `opening` (the text's end if none)."""
    depth = 0
    for i in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def percent_valued(parsed: list) -> list:
    """Parsed answers with X% valued X/100, as lighteval and math-verify 0.5.2 compare them; math-
    verify 0.9 holds 25% equal to 25."""
    return [p.xreplace({PERCENT: Rational(1, 100)}) if isinstance(p, Basic) else p for p in parsed]


def pass_at_k(n: int, n_correct: int, k: int) -> float:
    """Unbiased pass@k of n samples with n_correct right (docs/math.md):
    1 - prod(1 - k / arange(n - n_correct + 1, n + 1))."""
    if n - n_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - n_correct + 1, n + 1))


def load_benchmark(name: str, cfg: EvalConfig) -> tuple[str, Benchmark, list[tuple[str, str]]]:
    if name in BENCHMARKS:
        bench = BENCHMARKS[name]
    elif Path(name).suffix in loading.LOCAL_DATA_FORMATS:
        bench = Benchmark(name, "train", cfg.question_column, cfg.gold_column, cfg.gold_format)
        name = Path(name).stem
    else:
        raise SystemExit(
            f"error: unknown benchmark '{name}'; known: {', '.join(BENCHMARKS)}, or a local "
            f".json/.jsonl/.parquet file"
        )
    rows = loading.load_dataset(bench.source, bench.split, bench.question_column, bench.gold_column)
    problems = [
        (str(q), str(g)) for q, g in zip(rows[bench.question_column], rows[bench.gold_column])
    ]
    return name, bench, problems[: cfg.limit or None]


def evaluate_model(model_path: str, cfg: EvalConfig, output_dir: Path, stop) -> dict:
    """Samples and grades every benchmark; finished problems are kept in <benchmark>.jsonl, so a
    rerun after a crash or a stop (`stop`: run_folder.StopRequest) only generates what is
    missing."""
    precision = Precision.choose(cfg.precision, loading.resolve_device(cfg.device))
    n = 1 if cfg.protocol == "paper" else cfg.n
    benchmarks = [
        load_benchmark(name.strip(), cfg) for name in cfg.benchmarks.split(",") if name.strip()
    ]
    tokenizer = loading.load_tokenizer(model_path)
    loading.note_template_system_prompt(tokenizer, cfg.system_prompt)
    prompts_of = [
        [
            chat_prompt_ids(
                tokenizer, cfg.prompt_template.replace("{question}", q), cfg.system_prompt
            )
            for q, _ in problems
        ]
        for _, _, problems in benchmarks
    ]
    longest = max((len(prompt) for prompts in prompts_of for prompt in prompts), default=0)
    generate = sampler(model_path, tokenizer, cfg, precision, n=n, longest_prompt=longest)
    output_dir.mkdir(parents=True, exist_ok=True)  # once the benchmarks and the model have loaded
    grade = grade_paper if cfg.protocol == "paper" else cwgrpo.grade_accuracy
    timed_out = cwgrpo.TIMED_OUT
    with Grader(grade, timed_out, cfg.reward_timeout_s, workers=cfg.reward_workers) as grader:
        return {
            name: evaluate_benchmark(
                name,
                bench,
                problems,
                prompts=prompts,
                generate=generate,
                grader=grader,
                settings=sample_settings(model_path, bench, cfg, n=n, precision=precision.name),
                progress_path=output_dir / f"{name}.jsonl",
                cfg=cfg,
                stop=stop,
            )
            for (name, bench, problems), prompts in zip(benchmarks, prompts_of)
        }


def sample_settings(model_path: str, bench: Benchmark, cfg: EvalConfig, n: int, precision: str):
    """What a benchmark's samples are made with: kept samples are reused only where these equal
    (--limit and --batch-size choose which problems are sampled at once, not how)."""
    return {
        "model": str(Path(model_path).resolve()) if Path(model_path).exists() else model_path,
        "weights": weights_fingerprint(model_path),
        "benchmark": bench._asdict(),
        "prompt_template": cfg.prompt_template,
        "system_prompt": cfg.system_prompt,
        "protocol": cfg.protocol,
        "n": n,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "engine": cfg.engine,
        "precision": precision,
    }


def evaluate_benchmark(
    name, bench, problems, prompts, generate, grader, settings, progress_path, cfg, stop
) -> dict:
    """One benchmark's problems sampled and graded, batch by batch, each written as it is done;
    after a stop request (Ctrl-C, SIGTERM), the batch under way is the last."""
    n = settings["n"]
    started = time.perf_counter()
    done = finished_problems(progress_path, settings, cfg.overwrite)  # kept, by index
    todo = sorted((i for i in range(len(problems)) if i not in done), key=lambda i: len(prompts[i]))
    with (
        progress_path.open("a") as log,
        tqdm(total=len(problems), initial=len(problems) - len(todo), desc=name) as bar,
    ):
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]  # similar lengths: little padding
            torch.manual_seed(cfg.seed + batch[0])  # a problem's samples: not what ran before
            how = cwgrpo.Sampling(
                n, cfg.temperature, top_p=cfg.top_p, top_k=0, max_new_tokens=cfg.max_new_tokens
            )
            texts = generate([prompts[i] for i in batch], how).texts
            all_grades = grader.map(
                [
                    (text, problems[batch[k // n]][1], bench.gold_format)
                    for k, text in enumerate(texts)
                ]
            )  # n samples per problem
            for j, i in enumerate(batch):
                question, gold = problems[i]
                completions = texts[j * n : (j + 1) * n]
                grades = all_grades[j * n : (j + 1) * n]
                done[i] = {
                    "index": i,
                    "prompt": question,
                    "gold": gold,
                    "completions": completions,
                    "answers": [last_boxed(c) for c in completions],
                    "correct": [g.accuracy == 1.0 for g in grades],
                    "gold_parsed": all(g.gold_parsed for g in grades),
                }
                log.write(json.dumps(done[i]) + "\n")
            log.flush()
            bar.update(len(batch))
            if stop.requested:
                break
    if stop.requested and any(i not in done for i in range(len(problems))):
        kept = sum(i in done for i in range(len(problems)))
        raise SystemExit(
            f"stopped after {kept} of {len(problems)} problems of {name} (their samples "
            f"kept in {progress_path}); continue with: {command(None, sys.argv[1:])}"
        )
    summary = summarise([done[i] for i in range(len(problems))], n)
    return summary | {"seconds": time.perf_counter() - started}  # this run's, kept samples aside


def sampler(model_path: str, tokenizer, cfg: EvalConfig, precision, n: int, longest_prompt: int):
    """generate(prompts, how) by the --engine: cwgrpo.py's loop over the model held in the
    precision's dtype, or a vLLM engine in it with the model's weights, which holds the longest
    prompt of the benchmarks plus --max-new-tokens."""
    if cfg.engine == "hf":  # each prompt prefilled once for its n samples, as in training
        model = loading.load_model(model_path, precision.dtype, precision.device).eval()
        return functools.partial(cwgrpo.generate_completions, model, tokenizer, share=True)
    engine = Engine(
        model_path,
        max_model_len=longest_prompt + cfg.max_new_tokens,
        n_rows=cfg.batch_size * n,
        device=precision.device,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        seed=cfg.seed,
        pushed_weights=False,
        dtype=precision.vllm_dtype,
    )
    return functools.partial(cwgrpo.generate_completions, None, tokenizer, engine=engine)


def finished_problems(progress_path: Path, settings: dict, overwrite: bool) -> dict:
    """The problems a previous run of the same settings finished, by index. The file's first line
    records the settings its samples were made with; samples made with any other are never
    reused, and refused unless --overwrite. A file with no sample yet starts again."""
    lines = progress_path.read_text().splitlines() if progress_path.exists() else []
    kept = {r["index"]: r for r in map(json.loads, lines[1:])}
    if kept and not overwrite:
        made_with = json.loads(lines[0]).get("settings") or {}
        differ = [k for k in settings if made_with.get(k, settings[k]) != settings[k]]
        if differ:
            raise SystemExit(
                f"error: {progress_path} holds {len(kept)} problems' samples made with other "
                f"settings ({', '.join(differ)} differ); pass --overwrite to recompute them, "
                "or choose another --output-dir"
            )
        return kept
    progress_path.write_text(json.dumps({"settings": settings}) + "\n")
    return {}


def weights_fingerprint(model_path: str) -> str:
    """An identity of the weights: a hash of each weight file's name, size and first and last
    MiB (local folders), or the hub id."""
    folder = Path(model_path)
    if not folder.is_dir():
        return model_path
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(2**20)
            f.seek(max(0, size - 2**20))
            digest.update(f"{path.name}:{size}:".encode() + head + f.read())
    return digest.hexdigest()


def last_boxed(text: str) -> str:
    """The last \\boxed{...} of a completion, for reading results.json (grading does not use it)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return ""
    depth, i = 0, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth < 0:
            return text[i:j]
    return text[i:]


def summarise(problems: list[dict], n: int) -> dict:
    """pass@1 (mean over samples and problems), pass@k for the k that n allows, the spread over
    sample indices (each a seed), counts; and the problems themselves."""
    correct = torch.tensor([p["correct"] for p in problems], dtype=torch.float64)  # (problems, n)
    per_sample = correct.mean(0) * 100
    counts = correct.sum(1).long().tolist()
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n]
    return {
        "pass@1": per_sample.mean().item(),
        "pass@1_std_over_samples": per_sample.std().item() if n > 1 else 0.0,
        "pass@k": {
            k: 100 * sum(pass_at_k(n, right, k) for right in counts) / len(counts) for k in ks
        },
        "problems": len(problems),
        "samples_per_problem": n,
        "correct_samples": int(correct.sum()),
        "gold_unparsed": sum(not p["gold_parsed"] for p in problems),
        "per_problem": problems,
    }


def markdown_table(results: dict, label: str) -> str:
    names = list(results)
    known = all(name in TABLE_NAMES for name in names)
    header = [TABLE_NAMES.get(name, name) for name in names] + ["avg"]
    lines = ["| model / method | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    if known and names == list(TABLE_NAMES):  # the published rows share the benchmark order
        lines += [
            f"| {row} (published) | " + " | ".join(f"{v:.1f}" for v in values) + " |"
            for row, values in PUBLISHED
        ]
    scores = [results[name]["pass@1"] for name in names]
    cells = [
        f"{s:.1f} ± {results[name]['pass@1_std_over_samples']:.1f}"
        if results[name]["samples_per_problem"] > 1
        else f"{s:.1f}"
        for s, name in zip(scores, names)
    ]
    lines.append(
        f"| {label} (measured) | " + " | ".join(cells) + f" | {sum(scores) / len(scores):.1f} |"
    )
    return "\n".join(lines)


def write_results(output_dir: Path, model_path: str, cfg: EvalConfig, results: dict) -> None:
    n = 1 if cfg.protocol == "paper" else cfg.n
    average = sum(r["pass@1"] for r in results.values()) / len(results)
    (output_dir / "results.json").write_text(
        json.dumps(
            {
                "model": model_path,
                "config": asdict(cfg),
                "average_pass@1": average,
                "benchmarks": results,
            },
            indent=1,
        )
    )
    note = (
        f"pass@1 in %, {n} sample{'s' if n > 1 else ''} per problem at temperature "
        f"{cfg.temperature}, "
        f"top-p {cfg.top_p}, up to {cfg.max_new_tokens} new tokens"
        + (
            ", ± the std over sample indices"
            if n > 1
            else " (the paper's protocol: one AIME problem is 3.3 points)"
        )
        + "."
    )
    pass_k = "\n".join(
        f"- {name}: "
        + ", ".join(f"pass@{k} {v:.1f}" for k, v in r["pass@k"].items())
        + f" ({r['correct_samples']} of {r['problems'] * r['samples_per_problem']} samples correct)"
        for name, r in results.items()
    )
    (output_dir / "results.md").write_text(
        f"# {model_path}\n\n{note}\n\n{markdown_table(results, model_path)}\n\n{pass_k}\n"
    )


def evaluate_checkpoints(cfg: EvalConfig, output_dir: Path, device: torch.device, stop) -> None:
    """The paper's checkpoint ablation: every benchmark at every checkpoint, a table and a plot."""
    paths = sorted(glob.glob(cfg.checkpoints), key=checkpoint_step)
    if not paths:
        raise SystemExit(f"error: no checkpoint matches '{cfg.checkpoints}'")
    threads.set_for(cfg.threads, paths[0], device)
    table = {}
    for path in paths:
        step_dir = output_dir / Path(path).name
        table[checkpoint_step(path)] = evaluate_model(path, cfg, step_dir, stop)
        write_results(step_dir, path, cfg, table[checkpoint_step(path)])
    names = list(next(iter(table.values())))
    lines = [
        "| benchmark | " + " | ".join(f"step {s}" for s in table) + " |",
        "|---|" + "---|" * len(table),
    ]
    for name in names:
        lines.append(
            f"| {TABLE_NAMES.get(name, name)} | "
            + " | ".join(f"{table[s][name]['pass@1']:.1f}" for s in table)
            + " |"
        )
    (output_dir / "checkpoints.md").write_text(
        "pass@1 in % per checkpoint\n\n" + "\n".join(lines) + "\n"
    )
    plots.plot_checkpoints(output_dir / "checkpoints.png", table, TABLE_NAMES)


def default_output_dir(source: str) -> Path:
    """eval/<the whole path or hub id>: not its last name, which every run's final-model shares."""
    return Path("eval") / (
        re.sub(r"[^\w.-]+", "-", source.rstrip("/*").lstrip("./")).strip("-") or "model"
    )


def main(cfg: EvalConfig) -> None:
    """The evaluation cfg asks for. The first Ctrl-C (or SIGTERM) stops it after the batch under
    way, its samples kept, with the command that continues; a second one at once."""
    device = loading.resolve_device(cfg.device)  # --device cuda without a GPU: one line, at once
    transformers.utils.logging.disable_progress_bar()
    source = cfg.model or cfg.checkpoints
    output_dir = Path(cfg.output_dir or default_output_dir(source))
    try:
        with StopRequest() as stop:
            evaluate(cfg, output_dir, device, stop)
    except KeyboardInterrupt:  # the second stop signal
        raise SystemExit(
            "interrupted: the batch under way is lost, those before it kept; continue with: "
            + command(None, sys.argv[1:])
        ) from None


def evaluate(cfg: EvalConfig, output_dir: Path, device: torch.device, stop) -> None:
    if cfg.checkpoints:
        evaluate_checkpoints(cfg, output_dir, device, stop)
        print((output_dir / "checkpoints.md").read_text())
        print(f"written: {output_dir / 'checkpoints.md'} and {output_dir / 'checkpoints.png'}")
        return
    model = preset_models.ready(cfg.model)  # a CPU preset's model, built here on first use
    loading.check_model_path(model)  # before the output folder exists
    threads.set_for(cfg.threads, model, device)
    results = evaluate_model(model, cfg, output_dir, stop)
    write_results(output_dir, cfg.model, cfg, results)
    print((output_dir / "results.md").read_text())
    print(f"written: {output_dir / 'results.json'} and {output_dir / 'results.md'}")


if __name__ == "__main__":
    main(CONFIG)
