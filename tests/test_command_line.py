"""System tests of the command lines: --help documents every option, and a misspelt option, a bad
value or a missing optional package is one line, before anything loads."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest

import cwgrpo
from cwgrpo_utils.machine import threads
from cwgrpo_utils.options import cli
from cwgrpo_utils.options.cli import OPTIONAL
from cwgrpo_utils.options.run_config import RunConfig
from tests.support import ROOT, load_evaluate, run_cli

evaluate = load_evaluate()
COMMANDS = {  # each tool as the README runs it, from the repository's root
    "cwgrpo.py": [sys.executable, str(ROOT / "cwgrpo.py")],
    "evaluate.py": [sys.executable, str(ROOT / "evaluate.py")],
    "tools.ablate": [sys.executable, "-m", "tools.ablate"],
    "tools.diagnose": [sys.executable, "-m", "tools.diagnose"],
}


def run(tool: str, *argv: str) -> subprocess.CompletedProcess:
    command = [*COMMANDS[tool], *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_help_documents_every_option_and_method():
    out = run("cwgrpo.py", "--help")
    assert out.returncode == 0
    for options in (cwgrpo.Config, RunConfig):
        for f in cwgrpo.dataclasses.fields(options):
            assert f"--{f.name}" in out.stdout and f.metadata.get("help")
    assert "{" + ",".join(cwgrpo.METHODS) + "}" in out.stdout  # every method, in the table's order
    # the algorithm's options, then the run's, each in a group of its own
    help_text = out.stdout.split("\noptions:\n")[1]  # below the usage lines
    algorithm = help_text.index(cwgrpo.Config._argument_group_name + ":")
    run_options = help_text.index(RunConfig._argument_group_name + ":")
    assert algorithm < help_text.index("--method") < run_options < help_text.index("--rollout ")


def test_every_method_in_the_one_table_has_its_token_terms_and_real_options():
    fields = {f.name for f in cwgrpo.dataclasses.fields(cwgrpo.Config)}
    for name, method in cwgrpo.METHODS.items():
        assert method.token_terms.__name__ == name  # registered under its own name
        assert set(method.options) <= fields, name


def test_flags_that_contradict_each_other_are_one_line_naming_both():
    with pytest.raises(SystemExit) as error:
        cwgrpo.parse_config(["--preset", "tiny", "--cw-reading", "paper", "--cw-norm", "padded"])
    assert str(error.value) == (
        "error: --cw-reading paper means --cw-norm valid; it contradicts --cw-norm padded"
    )
    agreed = ["--preset", "tiny", "--cw-reading", "paper", "--cw-norm", "valid"]
    assert cwgrpo.parse_config(agreed)[0].cw_detach  # what the reading means, and said alike


def test_a_methods_options_given_to_another_method_are_named(capsys):
    cli.WARNED.clear()
    cwgrpo.parse_config(["--preset", "tiny", "--method", "grpo", "--cw-norm", "valid"])
    cwgrpo.parse_config(["--method", "grpo", "--ar-alpha", "0.9", "--cw-norm", "valid"])
    assert capsys.readouterr().err.splitlines() == [
        "note: --cw-norm has no effect with --method grpo",
        "note: --ar-alpha has no effect with --method grpo",  # each once in a process
    ]
    plan = ["--preset", "tiny", "--method", "ar", "--lopti-eta", "0.3", "--plan"]
    done = run("tools.diagnose", "batch", *plan)
    assert (
        done.returncode == 0 and done.stderr == "note: --lopti-eta has no effect with --method ar\n"
    )


@pytest.mark.parametrize("script", ["cwgrpo.py", "evaluate.py"])
@pytest.mark.parametrize("argv", [["--help"], ["--stepz", "5"], ["--seed", "-1"]])
def test_the_command_line_is_answered_before_torch_is_imported(script, argv):
    code = (
        f"import runpy, sys\nsys.argv = [{script!r}, *{argv!r}]\n"
        f"try:\n    runpy.run_path({script!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'math_verify', 'datasets'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr


def test_gpu_recipe_without_cuda_fails_in_one_line(tmp_path):
    out = run_cli("--method", "cw", "--output-dir", str(tmp_path / "run"))
    assert out.returncode != 0
    assert (
        "no CUDA GPU" in out.stderr
        and "--preset tiny" in out.stderr
        and "Traceback" not in out.stderr
    )
    assert len(out.stderr.strip().splitlines()) == 1


def test_unknown_method_and_small_group_are_rejected():
    out = run_cli("--method", "nope")
    assert out.returncode == 1
    assert out.stderr.strip().startswith(
        "error: argument --method: invalid choice: 'nope' (choose from 'grpo', 'cw',"
    )
    assert len(out.stderr.strip().splitlines()) == 1
    with pytest.raises(SystemExit, match="group-size must be >= 2"):
        cwgrpo.parse_config(["--preset", "tiny", "--group-size", "1"])


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--learning-rate", "-1"], "error: --learning-rate must be > 0; got -1.0"),
        (["--steps", "x"], "error: argument --steps: invalid int value: 'x'"),
    ],
)
def test_a_bad_option_value_from_the_command_line_is_one_line(argv, expected):
    out = run_cli("--preset", "tiny", *argv)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == expected


@pytest.mark.parametrize(
    "tool,argv,expected",
    [
        ("cwgrpo.py", ["--metod", "cw"], "error: unknown option --metod; did you mean --method?"),
        (
            "cwgrpo.py",
            ["--lr", "1e-3"],
            "error: unknown option --lr; did you mean --learning_rate?",
        ),
        ("cwgrpo.py", ["--meth", "cw"], "error: unknown option --meth; did you mean --method?"),
        ("evaluate.py", ["--modle", "x"], "error: unknown option --modle; did you mean --model?"),
        (
            "tools.diagnose",
            ["batch", "--presett", "tiny"],
            "error: unknown option --presett; did you mean --preset?",
        ),
        (
            "tools.ablate",
            ["--method", "cw"],
            "error: unknown option --method; did you mean --methods?",
        ),
    ],
)
def test_a_misspelt_or_abbreviated_option_is_one_line_naming_the_closest(tool, argv, expected):
    done = run(tool, *argv)
    assert done.returncode == 1
    assert done.stderr.strip() == expected


def test_help_texts_say_what_each_option_does():
    flat = " ".join(run("cwgrpo.py", "--help").stdout.split())
    assert "turn off --gradient_checkpointing" in flat
    assert "stapo: silence tokens with p below this" in flat
    assert "G, completions sampled per prompt [>= 2]" in flat  # each range beside its option
    assert "Defaults shown: --preset paper-1.5b's." in flat
    tiny_help = run("cwgrpo.py", "--preset", "tiny", "--help").stdout
    assert "Defaults shown: --preset tiny's." in " ".join(tiny_help.split())
    batch = run("tools.diagnose", "batch", "--help").stdout
    assert "--reference_model" in batch
    assert all(f"--{o} " not in batch for o in ("resume", "steps", "save_every"))
    top = run("tools.diagnose", "--help")
    assert top.returncode == 0
    assert all(f"  {c} " in top.stdout for c in ("batch", "train", "plot"))
    assert "turn off --plot" in " ".join(run("tools.ablate", "--help").stdout.split())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_rollout_vllm_without_vllm_stops_at_parse_time_in_one_line(tmp_path):
    out = run_cli("--preset", "tiny", "--rollout", "vllm", "--output-dir", str(tmp_path / "r"))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    install = OPTIONAL["vllm"][1]
    assert (
        out.stderr.strip() == f"error: --rollout vllm needs vLLM, which is not installed: {install}"
    )
    assert not (tmp_path / "r").exists()
    with pytest.raises(SystemExit, match="--engine vllm needs vLLM"):
        evaluate.parse_config(["--model", str(tmp_path), "--engine", "vllm"])


REFUSED_AT_ONCE = {  # (command line, the start of its one line) for typos in both commands
    "a preset": (["cwgrpo.py", "--preset", "tnyi"], "error: argument --preset: invalid choice"),
    "a method": (["cwgrpo.py", "--method", "cww"], "error: argument --method: invalid choice"),
    "an option": (["cwgrpo.py", "--lerning-rate", "1"], "error: unknown option --lerning-rate"),
    "a range": (["cwgrpo.py", "--group-size", "1"], "error: --group-size must be >= 2; got 1"),
    "an occupied folder": (["cwgrpo.py", "--preset", "tiny", "--output-dir"], "error: "),
    "a protocol": (["evaluate.py", "--model", "m", "--protocol", "papr"], "error: argument --"),
    "an evaluate option": (["evaluate.py", "--modle", "m"], "error: unknown option --modle"),
    "an evaluate range": (["evaluate.py", "--model", "m", "--n", "0"], "error: --n must be > 0"),
}


@pytest.mark.parametrize("case", REFUSED_AT_ONCE)
def test_bad_input_to_either_command_is_one_line_and_exit_code_1_before_torch_loads(case, tmp_path):
    """Where torch cannot be imported (a stand-in that fails), every refusal still answers: it
    comes before torch and transformers' models load, in the same form and code for both."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')")
    occupied = tmp_path / "run"
    occupied.mkdir()
    (occupied / "metrics.jsonl").write_text("{}\n")
    argv, start = REFUSED_AT_ONCE[case]
    argv = [*argv, str(occupied)] if argv[-1] == "--output-dir" else argv
    done = subprocess.run(
        [sys.executable, str(ROOT / argv[0]), *argv[1:]],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(start) and done.stderr.count("\n") == 1, done.stderr
    if case == "an occupied folder":
        assert done.stderr == (
            f"error: {occupied} already holds a run; pass --resume to continue it, "
            "--overwrite-output-dir to start afresh, or choose another --output-dir\n"
        )


def test_threads_0_chooses_one_for_a_small_model_and_the_idle_cores_for_a_large_one(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    tiny, smollm2 = 115_000, 134_515_008
    assert threads.choose(0, tiny, on_gpu=False) == (
        1,
        "a 0.1 M-parameter model: a second thread does not pay; --threads N to choose",
    )
    monkeypatch.setattr(threads, "idle_cores", lambda: 1.9)  # a quiet machine
    assert threads.choose(0, smollm2, on_gpu=False)[0] == 2
    monkeypatch.setattr(threads, "idle_cores", lambda: 0.9)  # beside one busy process
    assert threads.choose(0, smollm2, on_gpu=False) == (
        1,
        "a 134.5 M-parameter model: 1 of its 2 cores were idle at the start; --threads N to choose",
    )
    assert threads.choose(3, tiny, on_gpu=False) == (3, "--threads 3")
    assert threads.choose(0, smollm2, on_gpu=True) == (None, "torch's default: the GPU computes")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads.choose(0, tiny, on_gpu=False) == (None, "OMP_NUM_THREADS=4")


def test_idle_cores_sees_busy_processes():
    """With a spinning process for every core and one more, no core is idle (whatever else runs
    beside the test)."""
    spinning = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(threads.usable_cores() + 1)
    ]
    try:
        time.sleep(0.5)
        assert threads.idle_cores(0.5) < 0.5
    finally:
        for process in spinning:
            process.kill()
            process.wait()
