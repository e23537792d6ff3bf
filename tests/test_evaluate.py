"""System tests of evaluate.py: pass@k by hand, each benchmark's gold form, an evaluation that
resumes, refuses other settings' samples, and fails in one line leaving no folder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cwgrpo
from cwgrpo import Grader
from tests.support import ROOT, load_evaluate

evaluate = load_evaluate()


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 0, 1, 0.0),
        (5, 5, 1, 1.0),
        (5, 5, 5, 1.0),
        (5, 2, 1, 0.4),
        (4, 1, 2, 0.5),
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (10, 7, 4, 1.0),  # k > n - c: every draw of 4 holds a correct one
    ],
)
def test_pass_at_k_exact(n, c, k, expected):
    assert evaluate.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "completion,gold,gold_format,score",
    [
        (
            "... Therefore, the final answer is: $\\boxed{33}$. I hope it is correct",
            "33",
            "expr",
            1.0,
        ),  # AIME/AMC
        ("Therefore, the final answer is: $\\boxed{34}$.", "33", "expr", 0.0),
        (
            "so $\\boxed{\\dfrac{1}{2}}$",
            "We find $x = \\boxed{\\frac{1}{2}}$.",
            "latex",
            1.0,
        ),  # MATH-500 / Minerva solutions
        ("so $\\boxed{0.5}$", "The answer is $\\boxed{\\frac{1}{2}}$", "latex", 1.0),
        (
            "the final answer is: $\\boxed{\\frac{\\sqrt{3}}{2}}$",
            "$\\frac{\\sqrt{3}}{2}$",
            "latex",
            1.0,
        ),  # OlympiadBench
        ("the final answer is: $\\boxed{\\sqrt{3}}$", "$\\frac{\\sqrt{3}}{2}$", "latex", 0.0),
    ],
)
def test_grading_of_each_benchmarks_gold_form(completion, gold, gold_format, score):
    assert Grader().grade(completion, gold, gold_format).accuracy == score


# Hand-written answers of each kind the paper's grading and cwgrpo's reward may read apart, and
# each one's verdict: the paper protocol's is lighteval's metric's as the paper's evaluation set it
# up (the verdicts of lighteval 0.8.1, the pinned commit ed084813 with one guard on unparseable
# numbers, run beside: docs/evaluation.md, "Grading"); the robust protocol's is the training
# reward's with the benchmark's gold form, and the training reward's its own (gold "default")
GRADING_CASES = [  # completion, gold, gold form, paper, robust, training
    (
        "So the sum is 42. Therefore, the final answer is: $\\boxed{42}$. I hope it is correct",
        "42",
        "expr",
        1,
        1,
        1,
    ),
    ("Thus \\boxed{41}.", "42", "expr", 0, 0, 0),
    ("The answer is 42.", "42", "expr", 1, 0, 0),  # a right answer without a box
    ("**Answer:** 42", "42", "expr", 1, 0, 0),
    ("So $x = 42$.", "42", "expr", 1, 0, 0),
    ("<think>\nadd them\n</think>\n<answer>42</answer>", "42", "expr", 0, 0, 0),
    ("Therefore, the final answer is: 42. I hope it is correct", "42", "expr", 1, 0, 0),
    ("We have \\[ x = 42 \\]", "42", "expr", 1, 0, 0),
    ("The answer is 1,234.", "1234", "expr", 1, 0, 0),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", "latex", 1, 0, 0),  # LaTeX's shorthand
    ("\\boxed{0.33333}", "\\frac{1}{3}", "latex", 1, 0, 0),  # five decimals: the paper's precision
    ("\\boxed{0.333}", "\\frac{1}{3}", "latex", 0, 0, 0),
    ("First \\boxed{7}, then on reflection \\boxed{42}.", "42", "expr", 1, 0, 0),  # the last box
    ("So \\boxed{3}. Hmm, no: \\boxed{42}", "42", "expr", 1, 0, 0),
    ("\\boxed{1} or maybe \\boxed{2}", "2", "expr", 1, 0, 0),
    ("\\boxed{1} and \\boxed{2}", "1,2", "latex", 1, 0, 0),  # boxes the paper reads as one answer
    ("\\boxed{25\\%}", "25", "expr", 0, 1, 1),  # 25% is 1/4 to the paper, 25 to math-verify 0.9
    ("\\boxed{25}", "25\\%", "latex", 0, 0, 1),
    ("\\boxed{25\\%}", "25\\%", "latex", 1, 0, 1),
    (
        "\\boxed{25}",
        "The discount is $\\boxed{25\\%}$.",
        "latex",
        0,
        1,
        1,
    ),  # an Open-RS solution's gold
    ("The answer is 25%.", "25", "expr", 1, 0, 0),
    (
        "We have 3 + 4 = 7 and then 7 * 6 = 42, so we multiply by",
        "42",
        "expr",
        1,
        0,
        0,
    ),  # cut off: the paper reads its last number
    ("We have 3 + 4 = 7 and then 7 * 6 = 42, so we multiply by 2 to get", "84", "expr", 0, 0, 0),
    ("Let me think. The numbers are 10 and 32", "42", "expr", 0, 0, 0),
    ("\\boxed{42}", "The answer is 42.", "latex", 0, 0, 1),
    (
        "\\boxed{\\text{Friday}}",
        "\\text{Friday}",
        "latex",
        1,
        0,
        0,
    ),  # the paper compares an unparsed gold as text
    ("\\boxed{3.14159}", "\\pi", "latex", 0, 0, 0),
]


@pytest.mark.parametrize("completion,gold,gold_format,paper,robust,training", GRADING_CASES)
def test_each_protocol_grades_as_its_reference_does(
    completion, gold, gold_format, paper, robust, training
):
    assert evaluate.grade_paper(completion, gold, gold_format).accuracy == paper
    assert cwgrpo.grade_accuracy(completion, gold, gold_format).accuracy == robust
    assert cwgrpo.grade_accuracy(completion, gold).accuracy == training


def test_the_paper_reads_several_boxes_and_percents_as_its_pinned_versions_did():
    """latex2sympy2_extended 1.0.6 keeps the last box, or the last boxes joined by nothing but
    "and", "or" or a comma; X% is X/100 (math-verify 0.9 holds 25% = 25)."""
    assert (
        evaluate.last_boxes("First \\boxed{7}, then \\boxed{42}.") == "First {7}, then \\boxed{42}."
    )
    assert evaluate.last_boxes("\\boxed{1} and \\boxed{2}") == "\\boxed{1} and \\boxed{2}"
    assert (
        evaluate.last_boxes("\\fbox{1} so \\boxed{\\frac{1}{2}}") == "{1} so \\boxed{\\frac{1}{2}}"
    )
    assert (
        evaluate.last_boxes("no box, or an open one: \\boxed{4")
        == "no box, or an open one: \\boxed{4"
    )
    quarter = evaluate.percent_valued(evaluate.parse("\\boxed{25\\%}"))
    assert quarter[0] == evaluate.Rational(1, 4) and quarter[1] == "25\\%"


def test_an_unparseable_gold_scores_0_in_training_and_is_compared_as_text_by_the_paper():
    """The released reward returns None there (and its trainer stops on it); cwgrpo scores 0 and
    counts it (gold_unparseable). lighteval compares such a gold with the answer's text."""
    assert cwgrpo.grade_accuracy("\\boxed{7}", "").gold_parsed is False
    assert cwgrpo.grade_accuracy("\\boxed{7}", "no number here").accuracy == 0.0
    word = evaluate.grade_paper("\\boxed{Friday}", "Friday", "latex")
    assert (word.accuracy, word.gold_parsed) == (1.0, False)
    assert evaluate.grade_paper("\\boxed{Monday}", "Friday", "latex").accuracy == 0.0


def test_the_paper_protocol_grades_with_the_papers_metric(tiny_run, tmp_path, monkeypatch):
    """--protocol paper grades each sample with grade_paper, --protocol robust with the training
    reward: a right answer stated without a box counts for the first alone."""
    bench = tmp_path / "forty-two.jsonl"
    bench.write_text(json.dumps({"problem": "6*7", "answer": "42"}) + "\n")

    def unboxed(model, tokenizer, prompts, how, **_):  # the sampler stands in: grading is tested
        rollout = generate_completions(model, tokenizer, prompts, how)
        rollout.texts = ["The answer is 42."] * len(rollout.texts)
        return rollout

    generate_completions = evaluate.cwgrpo.generate_completions
    monkeypatch.setattr(evaluate.cwgrpo, "generate_completions", unboxed)
    args = ["--model", str(tiny_run / "final-model"), "--benchmarks", str(bench)]
    args += ["--gold-format", "expr", "--max-new-tokens", "4", "--n", "2"]
    scores = {}
    for protocol in ("paper", "robust"):
        out = tmp_path / protocol
        evaluate.main(
            evaluate.parse_config([*args, "--protocol", protocol, "--output-dir", str(out)])
        )
        scores[protocol] = json.loads((out / "results.json").read_text())["average_pass@1"]
    assert scores == {"paper": 100.0, "robust": 0.0}


def doubling_benchmark(tmp_path, problems: int, model, n: int) -> tuple[list[str], Path]:
    """evaluate.py's arguments for `problems` questions a+a of a local file, n samples each, and
    the output folder."""
    bench, out = tmp_path / "arith.jsonl", tmp_path / "eval"
    rows = ({"problem": f"{a}+{a}", "answer": str(2 * a)} for a in range(problems))
    bench.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--model", str(model), "--benchmarks", str(bench), "--gold-format", "expr"]
    return [*args, "--n", str(n), "--max-new-tokens", "8", "--output-dir", str(out)], out


def test_evaluate_tiny_model_on_a_local_file_and_resume(tiny_run, tmp_path, capsys):
    args, out = doubling_benchmark(tmp_path, 5, tiny_run / "final-model", 3)
    args += ["--batch-size", "2", "--device", "cpu"]
    evaluate.main(evaluate.parse_config(args))
    printed = capsys.readouterr().out
    assert f"written: {out / 'results.json'} and {out / 'results.md'}" in printed
    assert "at temperature 0.6" in printed  # its own temperature, beside the pass@1 it shaped
    results = json.loads((out / "results.json").read_text())["benchmarks"]["arith"]
    assert results["problems"] == 5 and results["samples_per_problem"] == 3
    assert set(results["pass@k"]) == {"1", "2"}
    assert all(
        len(p["completions"]) == 3 and len(p["correct"]) == 3 for p in results["per_problem"]
    )
    assert results["pass@1"] == pytest.approx(100 * results["correct_samples"] / 15)
    table = (out / "results.md").read_text()
    assert (
        "| model / method | arith | avg |" in table
        and "(measured)" in table
        and "(published)" not in table
    )

    progress = out / "arith.jsonl"
    lines = progress.read_text().splitlines()
    progress.write_text(
        "\n".join(lines[:-1]) + "\n"
    )  # as if killed before the last problem was written
    evaluate.main(evaluate.parse_config(args))
    relines = progress.read_text().splitlines()
    assert (
        len(relines) == len(lines) and relines[:-1] == lines[:-1]
    )  # only the missing problem was generated


def test_evaluate_rejects_unknown_benchmark(tiny_run):
    with pytest.raises(SystemExit, match="unknown benchmark 'aime25'; known: aime24, math500"):
        evaluate.main(
            evaluate.parse_config(
                ["--model", str(tiny_run / "final-model"), "--benchmarks", "aime25"]
            )
        )
    assert not evaluate.default_output_dir(
        str(tiny_run / "final-model")
    ).exists()  # no empty folder


def test_evaluate_checkpoints_writes_the_stability_table(tiny_run, tmp_path, capsys):
    bench = tmp_path / "arith.jsonl"
    bench.write_text(
        "".join(json.dumps({"problem": f"{a}+1", "answer": str(a + 1)}) + "\n" for a in range(3))
    )
    out = tmp_path / "ckpt"
    run = evaluate.main
    run(
        evaluate.parse_config(
            [
                "--checkpoints",
                str(tiny_run / "checkpoint-*"),
                "--benchmarks",
                str(bench),
                "--gold-format",
                "expr",
                "--protocol",
                "paper",
                "--max-new-tokens",
                "6",
                "--output-dir",
                str(out),
            ]
        )
    )
    table = (out / "checkpoints.md").read_text()
    assert "| benchmark | step 2 | step 4 |" in table and "| arith |" in table
    printed = capsys.readouterr().out  # the table, as one model's is printed
    assert printed.endswith(
        f"{table}\nwritten: {out / 'checkpoints.md'} and {out / 'checkpoints.png'}\n"
    )
    assert (out / "checkpoint-2" / "results.json").is_file() and (
        out / "checkpoint-4" / "results.md"
    ).is_file()


def test_evaluation_never_reuses_samples_made_with_other_settings(tiny_run, tmp_path):
    args, out = doubling_benchmark(tmp_path, 3, tiny_run / "final-model", 2)
    evaluate.main(evaluate.parse_config(args))
    with pytest.raises(
        SystemExit, match=r"made with other settings \(n differ\); pass --overwrite"
    ):
        evaluate.main(evaluate.parse_config([*args, "--n", "4"]))
    with pytest.raises(SystemExit, match=r"\(model, weights differ\)"):
        evaluate.main(evaluate.parse_config([*args[2:], "--model", str(tiny_run / "checkpoint-2")]))
    evaluate.main(evaluate.parse_config([*args, "--n", "4", "--overwrite"]))
    results = json.loads((out / "results.json").read_text())["benchmarks"]["arith"]
    assert results["samples_per_problem"] == 4
    assert all(len(p["completions"]) == 4 for p in results["per_problem"])


def test_default_evaluation_folders_differ_for_models_of_the_same_name():
    folders = [
        evaluate.default_output_dir(m)
        for m in (
            "runs/a/final-model",
            "runs/b/final-model",
            "./runs/a/final-model/",
            "/tmp/a/final-model",
            "Qwen/Qwen2.5-Math-7B-Instruct",
            "runs/x/checkpoint-*",
        )
    ]
    assert folders == [
        Path("eval/runs-a-final-model"),
        Path("eval/runs-b-final-model"),
        Path("eval/runs-a-final-model"),
        Path("eval/tmp-a-final-model"),
        Path("eval/Qwen-Qwen2.5-Math-7B-Instruct"),
        Path("eval/runs-x-checkpoint"),
    ]


def test_a_model_that_is_nowhere_is_one_line_and_leaves_no_folder(tmp_path):
    """As in a fresh clone: no runs/ folder, so runs/nope reads as a hub id, which is not cached
    and the hub cannot be reached: one line, no eval/ folder (it used to leave eval/runs-nope)."""
    bench = ROOT / "evaluation_sets" / "tiny-arithmetic.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "evaluate.py"),
            "--model",
            "runs/nope",
            "--benchmarks",
            str(bench),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard
        cwd=tmp_path,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "error: --model runs/nope: no such folder, and no hub model of that name is cached; "
        "the hub cannot be reached from here, so only what is cached loads"
    )
    assert list(tmp_path.iterdir()) == []
