"""System tests of evaluate.py: pass@k by hand, each benchmark's gold form, an evaluation that
resumes, stops on Ctrl-C with its samples kept, reuses the samples its settings match and refuses
those they conflict with, and fails in one line leaving no folder."""

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cwgrpo
from cwgrpo_utils.machine.grading_pool import Grader
from cwgrpo_utils.options.cli import shown_path
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
    "completion,gold,gold_format,accuracy",
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
def test_grading_of_each_benchmarks_gold_form(completion, gold, gold_format, accuracy):
    grader = Grader(cwgrpo.grade_accuracy, cwgrpo.TIMED_OUT)
    assert grader.grade(completion, gold, gold_format).accuracy == accuracy


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


# The paper protocol where evaluate.py once read otherwise than lighteval at the commit the
# released code pins (ed084813; latex2sympy2_extended 1.0.6, run beside on 2026-12-06): boxes
# in math environments joined by "and", "or" or a comma are one answer, a set; and a long
# completion of many unparseable matches is searched to its end (math-verify 0.9 gives up after
# 5 s of searching, lighteval did not), where it finds a number
UNPARSEABLE_TAIL = (
    "The number 7 is prime. "
    + "We keep going without any conclusion here. " * 1200
    + "$\\sqrt{a^{2} + b^{2}} =$ " * 700
)  # 69,123 characters, about 6 s to search
ED084813_CASES = [  # completion, gold, gold form, lighteval's verdict
    ("$\\boxed{7}$ and $\\boxed{42}$", "42", "expr", 0),  # the set {7, 42}: neither alone
    ("$\\boxed{7}$ and $\\boxed{42}$", "7", "expr", 0),
    ("$\\boxed{7}$, $\\boxed{42}$", "42", "expr", 0),
    ("\\(\\boxed{7}\\) and \\(\\boxed{42}\\)", "42", "expr", 0),
    ("\\[\\boxed{7}\\] or \\[\\boxed{42}\\]", "42", "expr", 0),
    ("$x = \\boxed{7}$ and $y = \\boxed{42}$", "42", "expr", 0),
    ("$\\boxed{7}$ and $\\boxed{42}$", "$7$ and $42$", "latex", 1),  # a gold that lists them
    ("\\(\\boxed{7}\\) and \\(\\boxed{42}\\)", "$7$ and $42$", "latex", 1),
    ("$\\boxed{7}$ then $\\boxed{42}$", "42", "expr", 1),  # "then" joins nothing: the last
    ("$\\boxed{7}$ then $\\boxed{42}$", "$7$ and $42$", "latex", 0),
    ("So $\\boxed{7}$. Then $\\boxed{42}$", "42", "expr", 1),
    (UNPARSEABLE_TAIL, "7", "expr", 1),  # no final answer: the number found in the text
    (UNPARSEABLE_TAIL, "3", "expr", 0),
]


@pytest.mark.parametrize("completion,gold,gold_format,verdict", ED084813_CASES)
def test_the_paper_protocol_grades_as_lighteval_at_the_pinned_commit(
    completion, gold, gold_format, verdict
):
    assert evaluate.grade_paper(completion, gold, gold_format).accuracy == verdict


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


def test_a_run_with_other_settings_reuses_what_matches_and_names_what_conflicts(tiny_run, tmp_path):
    args, out = doubling_benchmark(tmp_path, 6, tiny_run / "final-model", 2)
    progress = out / "arith.jsonl"
    evaluate.main(evaluate.parse_config([*args, "--limit", "4"]))
    four = progress.read_text().splitlines()
    assert len(four) == 1 + 4
    evaluate.main(evaluate.parse_config([*args, "--limit", "2"]))  # fewer: nothing sampled
    assert progress.read_text().splitlines() == four
    results = json.loads((out / "results.json").read_text())["benchmarks"]["arith"]
    assert results["problems"] == 2
    evaluate.main(evaluate.parse_config(args))  # all six: the two missing sampled
    six = progress.read_text().splitlines()
    assert len(six) == 1 + 6 and six[:5] == four
    with pytest.raises(SystemExit) as refused:
        evaluate.main(evaluate.parse_config([*args, "--temperature", "1.0"]))
    assert str(refused.value) == (
        f"error: {progress} holds 6 problems' samples made with other settings (temperature "
        "differ); pass --overwrite to recompute them, or choose another --output-dir"
    )


def test_a_file_holding_no_sample_yet_is_no_conflict(tiny_run, tmp_path):
    """A stop before the first batch was written leaves only the settings line: any run may
    start there again."""
    args, out = doubling_benchmark(tmp_path, 2, tiny_run / "final-model", 2)
    out.mkdir()
    (out / "arith.jsonl").write_text(json.dumps({"settings": {"n": 99, "temperature": 9}}) + "\n")
    evaluate.main(evaluate.parse_config(args))
    settings = json.loads((out / "arith.jsonl").read_text().splitlines()[0])["settings"]
    assert settings["n"] == 2 and settings["temperature"] == 0.6


def test_ctrl_c_stops_after_the_batch_keeps_its_samples_and_prints_the_command_that_continues(
    tiny_run, tmp_path
):
    args, out = doubling_benchmark(tmp_path, 40, tiny_run / "final-model", 2)
    command = [sys.executable, str(ROOT / "evaluate.py"), *args, "--batch-size", "1"]
    running = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = out / "arith.jsonl"
    deadline = time.time() + 600  # a hang guard
    while time.time() < deadline and (
        not progress.exists() or len(progress.read_text().splitlines()) < 3
    ):
        time.sleep(0.05)
    running.send_signal(signal.SIGINT)
    _, stderr = running.communicate(timeout=600)
    assert running.returncode == 1 and "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    kept = len(progress.read_text().splitlines()) - 1
    assert 2 <= kept < 40
    assert last.startswith(f"stopped after {kept} of 40 problems of arith (their samples kept")
    printed = last.split("continue with: ")[1]
    assert printed == shlex.join(["python", shown_path(str(ROOT / "evaluate.py")), *command[2:]])
    again = subprocess.run(
        [sys.executable, *shlex.split(printed)[1:]], capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr
    indices = [json.loads(line)["index"] for line in progress.read_text().splitlines()[1:]]
    assert sorted(indices) == list(range(40))  # each problem once: the kept ones not redone


def test_evaluate_sets_its_threads_as_the_trainer_does(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # CI's: it would choose for them
    args, _ = doubling_benchmark(tmp_path, 1, tiny_run / "final-model", 1)
    threads = torch.get_num_threads()
    try:
        evaluate.main(evaluate.parse_config([*args, "--threads", "2"]))
        assert torch.get_num_threads() == 2
        assert "threads: 2 (--threads 2)" in capsys.readouterr().out
        evaluate.main(evaluate.parse_config([*args, "--overwrite"]))
        assert torch.get_num_threads() == 1  # a tiny model: one thread
    finally:
        torch.set_num_threads(threads)
