"""System tests of evaluate.py: pass@k by hand, each benchmark's gold form, an evaluation that
resumes, refuses other settings' samples, and fails in one line leaving no folder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
