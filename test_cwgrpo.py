"""Focused tests for cwgrpo.py: exact values on hand-computed cases, invariants, short tiny-model
runs.

Run: python -m pytest -q test_cwgrpo.py   (CPU, no network)
"""

import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import ablate  # noqa: E402
import cwgrpo  # noqa: E402
import diagnose  # noqa: E402
import evaluate  # noqa: E402
import loading  # noqa: E402
import memory_plan  # noqa: E402
import plots  # noqa: E402
import runtime  # noqa: E402
import sampling  # noqa: E402
import tiny  # noqa: E402
import vllm_engine  # noqa: E402
from cwgrpo import Grader, cw_weights, format_reward, grade_accuracy, group_advantages  # noqa: E402

HERE = Path(__file__).parent
# CWGRPO_TEST_ROLLOUT=vllm runs the whole-run tests (kill anywhere, degenerate batches, bad input)
# with --rollout vllm, in a venv with vLLM (.ci/run; README "Fast rollouts with vLLM")
ROLLOUT = os.environ.get("CWGRPO_TEST_ROLLOUT", "hf")


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# ---------------------------------------------------------------------------------------------- cw

# Hand-computed case: G = 2, T_pad = 3, the first response has 2 tokens and the second 3.
# mu = (-1.5, -1.0); centred advantages (1, -1); scores c = (0.5, -0.5 | -0.5, 0.5, 0) on the five
# real tokens: mean 0, variance 4 * 0.25 / 5 = 0.2; kernel exp(-0.25 / 0.4) = exp(-0.625) where
# |c| = 0.5, 1 at c = 0.
LOGP = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([1.0, -1.0])
KERNEL_SUM = 4 * math.exp(-0.625) + 1


@pytest.mark.parametrize("norm,total", [("padded", 2 * 3), ("valid", 5)])
@pytest.mark.parametrize("detach", [False, True])
def test_cw_weights_hand_computed(norm, total, detach):
    logp = LOGP.clone().requires_grad_(True)
    w = cw_weights(logp, ADV, MASK, norm=norm, detach=detach)
    edge, centre = math.exp(-0.625) * total / KERNEL_SUM, total / KERNEL_SUM
    expected = torch.tensor([[edge, edge, 0.0], [edge, edge, centre]])
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=1e-7)
    assert w.requires_grad is (not detach)


def test_cw_gradient_flows_through_weights_only_when_not_detached():
    logp = LOGP.clone().requires_grad_(True)
    (cw_weights(logp, ADV, MASK) * torch.arange(6.0).view(2, 3)).sum().backward()
    assert logp.grad.abs().sum() > 0
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 2] == 0  # padding gets no gradient
    assert not cw_weights(logp, ADV, MASK, detach=True).requires_grad


def random_group(seed, G=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (G,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    logp = -torch.rand(G, T, generator=g) * 5 * mask
    adv = torch.randn(G, generator=g)
    return logp, adv, mask


@pytest.mark.parametrize("seed", range(5))
def test_cw_weight_means(seed):
    logp, adv, mask = random_group(seed)
    padded = cw_weights(logp, adv, mask, norm="padded")
    valid = cw_weights(logp, adv, mask, norm="valid")
    t_pad = int(mask.sum(1).max())
    assert padded[:, :t_pad].mean().item() == pytest.approx(1.0, abs=1e-6)
    assert (valid.sum() / mask.sum()).item() == pytest.approx(1.0, abs=1e-6)
    assert ((padded * mask).sum() / mask.sum()).item() >= 1.0 - 1e-6
    assert (padded[mask == 0] == 0).all() and (valid[mask == 0] == 0).all()


def test_cw_zero_advantages_give_uniform_weights_and_finite_gradient():
    logp, _, mask = random_group(0)
    logp.requires_grad_(True)
    valid = cw_weights(logp, torch.zeros(6), mask, norm="valid")
    assert torch.equal(valid, mask)  # exactly 1 on real tokens
    padded = cw_weights(logp, torch.full((6,), 0.7), mask, norm="padded")
    constant = 6 * mask.sum(1).max() / mask.sum()
    torch.testing.assert_close(padded, constant * mask)
    padded.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_cw_one_token_responses_and_equal_scores_have_no_nan():
    mask = torch.tensor([[1.0], [1.0], [1.0]])
    logp = torch.tensor(
        [[-0.3], [-2.0], [-1.0]], requires_grad=True
    )  # one token: logp == own mean, c = 0
    w = cw_weights(logp, torch.tensor([1.0, -1.0, 0.0]), mask, norm="padded")
    torch.testing.assert_close(w, torch.ones(3, 1))
    w.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_cw_rejects_unknown_norm():
    with pytest.raises(ValueError, match="norm"):
        cw_weights(LOGP, ADV, MASK, norm="mean")


# -------------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    bessel_std = math.sqrt(4 * 0.25 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / torch.tensor(
        [bessel_std + 1e-4] * 4 + [1e-4] * 4
    )
    torch.testing.assert_close(group_advantages(rewards, 4), expected)


# ------------------------------------------------------------------------------------------ reward


@pytest.mark.parametrize(
    "completion,gold,score",
    [
        ("so the answer is \\boxed{0.5}", "\\boxed{\\frac{1}{2}}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "$\\frac{1}{2}$", 1.0),
        ("We get \\boxed{1/2}, which checks out.", "\\boxed{\\frac12}", 1.0),
        ("<think>\n3+4=7\n</think>\n\\boxed{7}", "7", 1.0),
        ("\\boxed{6}", "\\boxed{7}", 0.0),
        ("I do not know", "7", 0.0),
        ("\\boxed{\\frac{1}{", "\\boxed{7}", 0.0),
    ],
)
def test_math_reward(completion, gold, score):
    assert grade_accuracy(completion, gold).accuracy == score


def test_unparseable_gold_scores_zero_and_is_flagged():
    grade = Grader(timeout_s=10).grade("\\boxed{5}", "no mathematics here")
    assert grade.accuracy == 0.0 and grade.gold_parsed is False


def test_hanging_input_returns_zero_within_limit():
    grader = Grader(timeout_s=1.0)
    start = time.perf_counter()
    grade = grader.grade("\\boxed{9^{9^{9^{9}}}}", "5")  # sympy evaluates the tower for minutes
    assert grade.accuracy == 0.0 and grade.timed_out
    assert time.perf_counter() - start < 5
    assert grader.grade("\\boxed{5}", "5").accuracy == 1.0  # a fresh worker took over


def test_format_reward():
    assert format_reward("<think>\nwork\n</think>\n\\boxed{1}") == 1.0
    assert format_reward("no tags \\boxed{1}") == 0.0
    assert format_reward("a\n</think>\nb\n</think>\n") == 0.0


# ------------------------------------------------------------------------------- sampling, logprobs


def test_completion_mask_after_first_eos():
    eos, pad = 9, 0
    ids = torch.tensor([[5, 6, eos, pad, pad], [eos, eos, pad, pad, pad], [1, 2, 3, 4, 5]])
    mask, truncated = sampling.completion_mask_after_eos(ids, [eos, 8], torch.tensor([5, 5, 5]))
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]
    # each row's own limit (prompt + completion capped): an EOS beyond it does not count
    mask, truncated = sampling.completion_mask_after_eos(ids, [eos], torch.tensor([2, 5, 3]))
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert truncated.tolist() == [True, False, True]


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_logprobs_equal_direct(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=g)
    logp, entropy = cwgrpo.chunked_logprobs(
        hidden, weight, targets, 0.7, chunk * 50
    )  # chunk positions at once
    (logp * torch.arange(11.0)).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    direct_all = (hidden @ weight.T / 0.7).log_softmax(-1)
    direct = direct_all.gather(-1, targets[:, None]).squeeze(-1)
    (direct * torch.arange(11.0)).sum().backward()
    torch.testing.assert_close(logp, direct)
    torch.testing.assert_close(entropy, -(direct_all.exp() * direct_all).sum(-1).detach())
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)
    assert not entropy.requires_grad


@pytest.fixture(scope="module")
def tiny_model():
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    return tiny.tiny_qwen2(tokenizer, seed=0), tokenizer


@pytest.mark.slow
def test_byte_level_tokenizer_round_trips_and_reloads(tiny_model, tmp_path):
    _, tokenizer = tiny_model
    text = "Héllo 12+3=\\boxed{15}\n</think>\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    tokenizer.save_pretrained(tmp_path)
    reloaded = loading.load_tokenizer(str(tmp_path))
    assert type(reloaded).__name__ == "Qwen2Tokenizer"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


@pytest.mark.slow
def test_rollout_logprobs_match_unpadded_forward(tiny_model):
    model, tokenizer = tiny_model
    cfg = cwgrpo.parse_config(["--preset", "tiny", "--max-completion-length", "12"])
    batch = [(loading.chat_prompt_ids(tokenizer, q, ""), "\\boxed{1}") for q in ["1+2", "12+30"]]
    torch.manual_seed(0)
    rollout = cwgrpo.sample(model, tokenizer, batch, cfg)
    assert rollout.prompt_ids.shape[0] == 2 * cfg.group_size
    logp, entropy, _ = cwgrpo.completion_logprobs(model, rollout, cfg)
    assert (logp[rollout.completion_mask == 0] == 0).all() and (entropy >= 0).all()
    for row in (
        0,
        cfg.group_size,
        2 * cfg.group_size - 1,
    ):  # a shorter (left-padded) prompt and a longer
        n_prompt, n_completion = (
            int(rollout.prompt_mask[row].sum()),
            int(rollout.completion_mask[row].sum()),
        )
        ids = torch.cat(
            [rollout.prompt_ids[row, -n_prompt:], rollout.completion_ids[row, :n_completion]]
        )
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, n_prompt - 1 : -1] / cfg.temperature
        direct = logits.log_softmax(-1).gather(-1, ids[n_prompt:, None]).squeeze(-1)
        torch.testing.assert_close(logp[row, :n_completion].detach(), direct, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cw", "grpo"])
def test_gradient_does_not_depend_on_micro_batching(tiny_model, method):
    """Per-group statistics and step-wide normalisers: a micro-batch of 2 groups == 2 of 1 group."""
    model, tokenizer = tiny_model
    batch = [(loading.chat_prompt_ids(tokenizer, q, ""), "\\boxed{3}") for q in ["1+2", "2+1"]]
    grads = []
    for groups_per_micro_batch in (2, 1):
        cfg = cwgrpo.parse_config(
            [
                "--preset",
                "tiny",
                "--method",
                method,
                "--max-completion-length",
                "10",
                "--prompts-per-step",
                "2",
                "--groups-per-micro-batch",
                str(groups_per_micro_batch),
            ]
        )
        torch.manual_seed(0)
        rollout = cwgrpo.sample(model, tokenizer, batch, cfg)
        rollout.advantages = torch.randn(
            len(rollout.texts), generator=torch.Generator().manual_seed(1)
        )
        rows, n_tokens = (
            cfg.groups_per_micro_batch * cfg.group_size,
            int(rollout.completion_mask.sum()),
        )
        model.zero_grad()
        for start in range(0, len(rollout.texts), rows):
            loss, _ = cwgrpo.micro_batch_loss(
                model, rollout.select(start, start + rows), cfg, len(rollout.texts), n_tokens
            )
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------- config, errors


@pytest.mark.slow
def test_help_documents_every_option():
    out = subprocess.run(
        [sys.executable, str(HERE / "cwgrpo.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    for f in cwgrpo.dataclasses.fields(cwgrpo.Config):
        assert f"--{f.name}" in out.stdout and f.metadata.get("help")
    for name in cwgrpo.METHODS:
        assert f"{name}:" in out.stdout


def test_presets_and_overrides():
    cfg = cwgrpo.parse_config([])
    assert (cfg.preset, cfg.method, cfg.group_size, cfg.learning_rate, cfg.beta) == (
        "paper-1.5b",
        "cw",
        12,
        1e-6,
        0.04,
    )
    cfg = cwgrpo.parse_config(["--preset", "tiny", "--group-size", "4", "--cw-detach"])
    assert cfg.model == "runs/tiny-base/model" and cfg.group_size == 4 and cfg.cw_detach
    assert cfg.output_dir == "runs/cw-tiny-seed0"


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(HERE / "cwgrpo.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.mark.slow
def test_gpu_recipe_without_cuda_fails_in_one_line(tmp_path):
    out = run_cli("--method", "cw", "--output-dir", str(tmp_path / "run"))
    assert out.returncode != 0
    assert (
        "no CUDA GPU" in out.stderr
        and "--preset tiny" in out.stderr
        and "Traceback" not in out.stderr
    )
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_unknown_method_and_small_group_are_rejected():
    out = run_cli("--method", "nope")
    assert out.returncode == 1 and "unknown --method 'nope'; choose from grpo, cw" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    with pytest.raises(SystemExit, match="group-size must be >= 2"):
        cwgrpo.parse_config(["--preset", "tiny", "--group-size", "1"])


def test_missing_column_lists_the_columns(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(SystemExit, match=r"no column 'problem'.*columns found: question, answer"):
        loading.load_dataset(str(data), "train", "problem", "solution")
    assert loading.load_dataset(str(data), "train", "question", "answer")["answer"] == ["2"]


def test_model_not_found_offline_fails_clearly(tmp_path):
    with pytest.raises(SystemExit, match="cannot load model 'no-such-org/no-such-model'"):
        loading.load_model("no-such-org/no-such-model", torch.float32, torch.device("cpu"))
    with pytest.raises(SystemExit, match="cannot load dataset 'no-such-org/no-such-data'"):
        loading.load_dataset("no-such-org/no-such-data", "train", "problem", "solution")


# ----------------------------------------------------------------- bad input: one line, before work


@pytest.mark.parametrize(
    "option,value,rule",
    [
        ("--learning-rate", "-1e-6", "> 0"),
        ("--learning-rate", "0", "> 0"),
        ("--steps", "0", "> 0"),
        ("--temperature", "0", "> 0"),
        ("--top-p", "1.5", "in (0, 1]"),
        ("--beta", "-0.1", ">= 0"),
        ("--warmup-ratio", "2", "in [0, 1]"),
        ("--save-every", "0", "> 0"),
        ("--reward-timeout-s", "0", "> 0"),
        ("--lopti-eta", "0", "in (0, 1]"),
    ],
)
def test_numeric_options_out_of_range_are_refused_at_parse_time(option, value, rule):
    with pytest.raises(SystemExit) as refused:
        cwgrpo.parse_config(["--preset", "tiny", f"{option}={value}"])
    prefix = f"error: {option} must be {rule}; got "
    assert str(refused.value).startswith(prefix)
    assert float(str(refused.value)[len(prefix) :]) == float(value)


@pytest.mark.slow
def test_bad_option_value_from_the_command_line_is_one_line():
    out = run_cli("--preset", "tiny", "--learning-rate", "-1")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "error: --learning-rate must be > 0; got -1.0"


@pytest.mark.slow
def test_bad_paths_and_data_stop_before_any_model_is_loaded(tmp_path, tiny_args, monkeypatch):
    def no_loading(*_, **__):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", no_loading)
    monkeypatch.setattr(loading, "load_tokenizer", no_loading)

    def refused(*args):
        with pytest.raises(SystemExit) as error:
            cwgrpo.train(
                cwgrpo.parse_config([*tiny_args, "--output-dir", str(tmp_path / "r"), *args])
            )
        assert "\n" not in str(error.value)
        return str(error.value)

    (tmp_path / "file").write_text("")
    assert (
        refused("--output-dir", str(tmp_path / "file"))
        == f"error: --output-dir {tmp_path / 'file'} is a file; choose a folder"
    )
    assert "holds no complete checkpoint; drop --resume" in refused("--resume")
    assert (
        refused("--model", str(tmp_path / "no" / "model"))
        == f"error: --model {tmp_path / 'no' / 'model'}: no such folder"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert (
        refused("--dataset", str(empty))
        == f"error: dataset file {empty} is empty; give a file with some rows"
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "1+1", "solution": "2"}\n\n{"problem": "2+2", "solution"\n')
    message = refused("--dataset", str(broken))
    assert (
        message.startswith(f"error: {broken} line 3 is not valid JSON") and "online" not in message
    )


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """The tiny preset's model and data, warm-started once for every test that trains."""
    return tiny.build(str(tmp_path_factory.mktemp("tiny-base")), warmstart_steps=150)


@pytest.fixture(scope="session")
def tiny_args(tiny_base):
    return [
        "--preset",
        "tiny",
        "--model",
        str(tiny_base / "model"),
        "--dataset",
        str(tiny_base / "arithmetic.jsonl"),
        "--rollout",
        ROLLOUT,
    ]


@pytest.fixture(scope="session")
def TINY_RUN(tiny_args):
    return [*tiny_args, "--steps", "4", "--save-every", "2"]


TIMING_KEYS = {"rollout_s", "update_s", "tokens_per_s", "time"}


def read_metrics(path):
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
        for line in path.read_text().splitlines()
    ]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, TINY_RUN):
    out = tmp_path_factory.mktemp("run") / "cw"
    cwgrpo.train(cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(out)]))
    return out


@pytest.mark.slow
def test_tiny_run_writes_metrics_checkpoints_and_model(tiny_run):
    records = read_metrics(tiny_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    required = {
        "step",
        "reward_mean",
        "reward_std",
        "accuracy_mean",
        "entropy_mean",
        "completion_len_mean",
        "frac_zero_std_groups",
        "loss",
        "grad_norm",
        "lr",
        "kl_mean",
        "clip_frac",
        "w_mean",
        "w_std",
        "w_min",
        "w_max",
    }
    assert required <= set(records[0])
    assert all(math.isfinite(r[k]) for r in records for k in required)
    assert all(
        r["clip_frac"] == 0 for r in records
    )  # one update per batch: ratio == 1, nothing clipped
    assert (
        records[0]["kl_mean"] == 0 and records[-1]["kl_mean"] > 0
    )  # the policy leaves the reference
    for name in ("checkpoint-2", "checkpoint-4", "final-model"):
        assert (tiny_run / name / "config.json").is_file() and (
            tiny_run / name / "tokenizer_config.json"
        ).is_file()
    assert (tiny_run / "checkpoint-2" / "trainer_state.pt").is_file()
    assert "rollout_s" in json.loads((tiny_run / "metrics.jsonl").read_text().splitlines()[0])


class Crash(Exception):
    """What stops a run in-process where a kill would stop it in a process of its own."""


def crash_at_save(monkeypatch, n: int) -> None:
    """The run stops at its nth checkpoint save, before anything of it is written."""
    real, calls = runtime.save_checkpoint, []

    def save(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == n:
            (args[0] / f".{args[1]}.partial").mkdir()  # as a kill mid-save leaves it
            raise Crash(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "save_checkpoint", save)


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(tiny_run, tmp_path, TINY_RUN, monkeypatch):
    crashed = tmp_path / "crashed"
    crash_at_save(monkeypatch, 2)  # during step 4's save: no checkpoint-4, no final model
    with pytest.raises(Crash):
        cwgrpo.train(cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(crashed)]))
    monkeypatch.undo()
    assert runtime.latest_checkpoint(crashed).name == "checkpoint-2"
    cwgrpo.train(cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(crashed), "--resume"]))
    assert read_metrics(crashed / "metrics.jsonl") == read_metrics(tiny_run / "metrics.jsonl")


@pytest.mark.slow
def test_existing_run_is_not_silently_overwritten(tiny_run, TINY_RUN):
    with pytest.raises(SystemExit, match="already holds a run"):
        cwgrpo.train(cwgrpo.parse_config([*TINY_RUN, "--output-dir", str(tiny_run)]))


@pytest.mark.slow
def test_grpo_and_token_mean_and_iterations_run(tmp_path, TINY_RUN):
    out = tmp_path / "grpo"
    cwgrpo.train(
        cwgrpo.parse_config(
            [
                *TINY_RUN,
                "--method",
                "grpo",
                "--output-dir",
                str(out),
                "--steps",
                "2",
                "--loss-aggregation",
                "token-mean",
                "--num-iterations",
                "2",
                "--groups-per-micro-batch",
                "2",
                "--beta",
                "0",
            ]
        )
    )
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4] and [
        r["rollout_step"] for r in records
    ] == [1, 1, 2, 2]
    # the second update of a batch keeps the rollout's old log-probs: its ratios have moved off 1,
    # so its token-mean loss differs from the first's (on-policy, both would be -mean(A) alike)
    assert records[1]["loss"] != records[0]["loss"] and records[3]["loss"] != records[2]["loss"]
    assert records[0]["lr"] > records[1]["lr"] > 0  # one scheduler step per update


# ---------------------------------------------------------------------------------------- methods


def make_group(
    logp, adv, mask, old_logp=None, entropy=None, batch_entropy=None, divergence=None, update_pass=0
):
    old_logp = logp.clone() if old_logp is None else old_logp
    entropy = torch.zeros_like(logp) if entropy is None else entropy
    return cwgrpo.Group(
        logp=logp,
        old_logp=old_logp,
        advantages=adv,
        mask=mask,
        entropy=entropy,
        batch_entropy=batch_entropy,
        divergence=divergence,
        update_pass=update_pass,
    )


def method_cfg(*args):
    return cwgrpo.parse_config(["--preset", "tiny", *args])


# Covariance case: valid log-probs -1, -3 | -2, -2, -2 (mean -2); advantages 2 | -2 (token mean
# -0.4);
# C = (1)(2.4) = 2.4, (-1)(2.4) = -2.4, then 0, 0, 0.
COV_LOGP = torch.tensor([[-1.0, -3.0, 0.0], [-2.0, -2.0, -2.0]])
COV_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
COV_ADV = torch.tensor([2.0, -2.0])


def test_token_covariance_hand_computed():
    cov = cwgrpo.token_covariance(COV_LOGP, COV_ADV, COV_MASK)
    torch.testing.assert_close(cov, torch.tensor([[2.4, -2.4, 0.0], [0.0, 0.0, 0.0]]))


def test_clip_cov_zeroes_the_one_candidate():
    terms = cwgrpo.clip_cov(
        make_group(COV_LOGP, COV_ADV, COV_MASK), method_cfg("--clip-cov-ratio", "0.25")
    )
    assert terms.pg_weight.tolist() == [[0, 1, 0], [1, 1, 1]] and terms.clip and terms.extra is None
    # the same token already clipped by PPO (ratio 1.5 > 1.2 with A > 0) is no candidate
    old = COV_LOGP.clone()
    old[0, 0] -= math.log(1.5)
    terms = cwgrpo.clip_cov(make_group(COV_LOGP, COV_ADV, COV_MASK, old_logp=old), method_cfg())
    assert torch.equal(terms.pg_weight, COV_MASK)


@pytest.mark.parametrize("seed", range(4))
def test_clip_cov_selects_max_floor_rn_1_candidates(seed):
    logp, adv, mask = random_group(seed, G=8, T=40)
    cfg = method_cfg("--clip-cov-ratio", "0.05", "--clip-cov-lb", "0.2", "--clip-cov-ub", "5")
    cov = cwgrpo.token_covariance(logp, adv, mask)
    candidates = (mask > 0) & (cov > 0.2) & (cov < 5)
    zeroed = (cwgrpo.clip_cov(make_group(logp, adv, mask), cfg).pg_weight == 0) & (mask > 0)
    assert (zeroed & ~candidates).sum() == 0
    assert zeroed.sum() == min(max(int(0.05 * mask.sum()), 1), int(candidates.sum()))


def test_kl_cov_penalises_exactly_the_top_k():
    old = COV_LOGP - 0.1
    logp = COV_LOGP.clone().requires_grad_(True)
    terms = cwgrpo.kl_cov(
        make_group(logp, COV_ADV, COV_MASK, old_logp=old), method_cfg("--kl-cov-ratio", "0.25")
    )
    assert not terms.clip and torch.equal(terms.pg_weight, COV_MASK)
    torch.testing.assert_close(terms.extra.detach(), torch.tensor([[0.1, 0, 0], [0, 0, 0]]))
    logp, adv, mask = random_group(1, G=8, T=40)
    terms = cwgrpo.kl_cov(
        make_group(logp, adv, mask, old_logp=logp - 0.3), method_cfg("--kl-cov-ratio", "0.05")
    )
    k = max(1, int(0.05 * mask.sum()))
    top = (
        cwgrpo.token_covariance(logp, adv, mask)
        .masked_fill(mask == 0, -1e9)
        .view(-1)
        .topk(k)
        .indices
    )
    expected = torch.zeros(mask.numel())
    expected[top] = 0.3
    torch.testing.assert_close(terms.extra.view(-1), expected)


def test_ar_weights_are_alpha_p_plus_one_minus_alpha():
    old = torch.log(torch.tensor([[0.1, 0.5, 0.9]]))
    mask = torch.ones(1, 3)
    group = make_group(old.clone(), torch.tensor([1.0]), mask, old_logp=old)
    torch.testing.assert_close(cwgrpo.ar(group, method_cfg()).pg_weight, 0.2 * old.exp() + 0.8)
    torch.testing.assert_close(
        cwgrpo.ar_lopti(group, method_cfg()).pg_weight, 0.3 * old.exp() + 0.7
    )
    torch.testing.assert_close(
        cwgrpo.ar(group, method_cfg("--ar-alpha", "0.5")).pg_weight,
        torch.tensor([[0.55, 0.75, 0.95]]),
    )


def test_lopti_passes_partition_the_valid_tokens():
    old = torch.log(torch.tensor([[0.1, 0.39, 0.41, 0.9], [0.45, 0.6, 0.2, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    cfg = method_cfg()
    low, high = (
        cwgrpo.lopti(make_group(old, torch.ones(2), mask, old_logp=old, update_pass=p), cfg).active
        for p in (0, 1)
    )
    assert low.tolist() == [[1, 1, 0, 0], [0, 0, 1, 0]]  # eta 0.4 alone
    assert torch.equal(low + high, mask)
    low_ar = cwgrpo.ar_lopti(make_group(old, torch.ones(2), mask, old_logp=old), cfg).active
    assert low_ar.tolist() == [[1, 1, 1, 0], [1, 0, 1, 0]]  # eta 0.5 with ar


@pytest.mark.parametrize("group_size", [4, 2])
def test_ict_streamed_divergence_equals_direct(group_size):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 7, 5, generator=g), torch.randn(11, 5, generator=g)
    mask = (torch.arange(7)[None] < torch.tensor([7, 5, 2, 6])[:, None]).float()
    streamed = cwgrpo.ict_divergence(
        hidden, weight, mask, 0.7, chunk_elements=4 * 11 * 2, group_size=group_size
    )  # 2 positions per chunk
    p = (hidden @ weight.T / 0.7).softmax(-1)
    for first in range(0, 4, group_size):  # pbar is the mean over one's own group only
        rows = range(first, first + group_size)
        for t in range(7):
            running = [i for i in rows if mask[i, t]]
            p_bar = p[running, t].mean(0)
            for i in rows:
                m = (p[i, t] + p_bar) / 2
                js = (
                    0.5 * (p[i, t] * (p[i, t] / m).log()).sum()
                    + 0.5 * (p_bar * (p_bar / m).log()).sum()
                )
                expected = js.item() if i in running else 0.0
                assert streamed[i, t].item() == pytest.approx(expected, abs=1e-6)


def test_ict_keeps_each_responses_top_tenth():
    mask = (torch.arange(25)[None] < torch.tensor([25, 10, 3])[:, None]).float()
    divergence = torch.rand(3, 25, generator=torch.Generator().manual_seed(0)) * mask
    terms = cwgrpo.ict(
        make_group(torch.zeros(3, 25), torch.ones(3), mask, divergence=divergence), method_cfg()
    )
    kept = terms.pg_weight > 0
    assert kept.sum(1).tolist() == [3, 1, 1]  # ceil(10% of 25, 10, 3)
    for i, k in enumerate([3, 1, 1]):
        assert set(kept[i].nonzero().flatten().tolist()) == set(
            divergence[i].topk(k).indices.tolist()
        )
    torch.testing.assert_close(terms.pg_weight.sum(1), mask.sum(1))  # mean over kept tokens only


def test_sorted_quantile_matches_torch_quantile():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0)).sort().values
    for q in (0.0, 0.05, 0.2, 0.5, 0.8, 0.999, 1.0):
        torch.testing.assert_close(cwgrpo.sorted_quantile(values, q), torch.quantile(values, q))


def test_entropy20_keeps_the_top_fifth_by_entropy():
    entropy = torch.arange(10.0).view(2, 5)
    mask = torch.ones(2, 5)
    terms = cwgrpo.entropy20(
        make_group(
            torch.zeros(2, 5), torch.ones(2), mask, entropy=entropy, batch_entropy=entropy.flatten()
        ),
        method_cfg(),
    )
    assert terms.pg_weight.tolist() == [
        [0, 0, 0, 0, 0],
        [0, 0, 0, 1, 1],
    ]  # H >= 80th percentile (7.2)


def test_stapo_silences_only_tokens_meeting_all_three_conditions():
    old = torch.log(torch.tensor([[0.005, 0.005, 0.5, 0.005], [0.005, 0.5, 0.5, 0.5]]))
    entropy = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    mask = torch.ones(2, 4)
    group = make_group(
        old.clone(),
        torch.tensor([1.0, -1.0]),
        mask,
        old_logp=old,
        entropy=entropy,
        batch_entropy=torch.full((100,), -1.0),
    )
    assert torch.equal(
        cwgrpo.stapo(group, method_cfg()).pg_weight, mask
    )  # no entropy below the 5th pct (-1)
    # 5th percentile of 5 zeros and 95 threes: 0.95 * 3 = 2.85
    group = group._replace(batch_entropy=torch.cat([torch.zeros(5), torch.full((95,), 3.0)]))
    terms = cwgrpo.stapo(group, method_cfg())
    # silenced: A > 0 (row 0) and p < 0.01 (columns 0, 1, 3) and entropy < 2.85 (columns 0, 2, 3)
    assert (terms.pg_weight == 0).tolist() == [[True, False, False, True], [False] * 4]
    torch.testing.assert_close(
        terms.pg_weight[0], torch.tensor([0.0, 2.0, 2.0, 0.0])
    )  # renormalised
    torch.testing.assert_close(terms.pg_weight[1], torch.ones(4))


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(cwgrpo.METHODS))
def test_every_method_trains_on_the_tiny_preset(method, tmp_path, tiny_args):
    out = tmp_path / method
    cwgrpo.train(
        cwgrpo.parse_config(
            [
                *tiny_args,
                "--method",
                method,
                "--steps",
                "2",
                "--save-every",
                "2",
                "--output-dir",
                str(out),
            ]
        )
    )
    records = read_metrics(out / "metrics.jsonl")
    passes = cwgrpo.METHODS[method].update_passes
    assert [r["update_pass"] for r in records] == list(range(passes)) * 2  # lopti: low pass first
    assert all(
        math.isfinite(r[k])
        for r in records
        for k in ("loss", "grad_norm", "w_mean", "touched_frac")
    )
    if passes == 2:  # the two passes' active tokens partition the valid tokens
        assert records[0]["pg_active_frac"] + records[1]["pg_active_frac"] == pytest.approx(1.0)
    assert all(METHOD_FOOTPRINT[method](r) for r in records), records


METHOD_FOOTPRINT = {  # what each method must have done to a batch's tokens, from its metrics
    "grpo": lambda r: r["touched_frac"] == 0 and r["w_min"] == r["w_max"] == 1,
    "cw": lambda r: r["touched_frac"] > 0.5 and r["w_min"] < 1 < r["w_max"],
    "clip_cov": lambda r: r["touched_frac"] < 0.05 and r["w_min"] in (0, 1) and r["w_max"] == 1,
    "kl_cov": lambda r: r["touched_frac"] == 0,  # on-policy: |logp - old_logp| is 0
    "ar": lambda r: r["touched_frac"] > 0.5 and 0.8 <= r["w_min"] and r["w_max"] <= 1,
    "lopti": lambda r: 0 < r["pg_active_frac"] < 1 and r["w_min"] == r["w_max"] == 1,
    "ar_lopti": lambda r: 0 < r["pg_active_frac"] < 1 and 0.7 <= r["w_min"] and r["w_max"] <= 1,
    "ict": lambda r: 0.1 <= r["pg_active_frac"] <= 0.4,  # each response's top 10%, rounded up
    "entropy20": lambda r: 0.15 <= r["pg_active_frac"] <= 0.5,  # ties at the 80th percentile
    "stapo": lambda r: r["pg_active_frac"] > 0.9 and r["w_min"] >= 0,
}


# -------------------------------------------------------------------------------------- evaluate.py


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


@pytest.mark.slow
def test_evaluate_tiny_model_on_a_local_file_and_resume(tiny_run, tmp_path, capsys):
    bench = tmp_path / "arith.jsonl"
    bench.write_text(
        "".join(json.dumps({"problem": f"{a}+{a}", "answer": str(2 * a)}) + "\n" for a in range(5))
    )
    out = tmp_path / "eval"
    args = [
        "--model",
        str(tiny_run / "final-model"),
        "--benchmarks",
        str(bench),
        "--gold-format",
        "expr",
        "--n",
        "3",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--output-dir",
        str(out),
        "--device",
        "cpu",
    ]
    evaluate.main(args)
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
    evaluate.main(args)
    relines = progress.read_text().splitlines()
    assert (
        len(relines) == len(lines) and relines[:-1] == lines[:-1]
    )  # only the missing problem was generated


@pytest.mark.slow
def test_evaluate_rejects_unknown_benchmark(tiny_run):
    with pytest.raises(SystemExit, match="unknown benchmark 'aime25'; known: aime24, math500"):
        evaluate.main(["--model", str(tiny_run / "final-model"), "--benchmarks", "aime25"])
    assert not evaluate.default_output_dir(
        str(tiny_run / "final-model")
    ).exists()  # no empty folder


@pytest.mark.slow
def test_evaluate_checkpoints_writes_the_stability_table(tiny_run, tmp_path):
    bench = tmp_path / "arith.jsonl"
    bench.write_text(
        "".join(json.dumps({"problem": f"{a}+1", "answer": str(a + 1)}) + "\n" for a in range(3))
    )
    out = tmp_path / "ckpt"
    evaluate.main(
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
    table = (out / "checkpoints.md").read_text()
    assert "| benchmark | step 2 | step 4 |" in table and "| arith |" in table
    assert (out / "checkpoint-2" / "results.json").is_file() and (
        out / "checkpoint-4" / "results.md"
    ).is_file()


def test_interval_by_hand():
    assert plots.interval([1.0, 2.0, 3.0]) == pytest.approx((2.0, 4.303 / math.sqrt(3)))
    mean, half = plots.interval([5.0])  # one seed: no interval
    assert mean == 5.0 and math.isnan(half)
    assert ablate.cell([5.0]) == "5.000 ± n/a"
    assert ablate.difference([5.0], [4.0]) == "+1.000 ± n/a"  # and never bold


@pytest.mark.slow
def test_ablate_table_holds_the_runs_figures_and_a_run_equals_its_standalone_twin(
    tmp_path, tiny_args
):
    out = tmp_path / "ablation"
    args = [
        "--methods",
        "grpo,cw-detached=cw --cw-detach",
        "--seeds",
        "2",
        "--no-plot",
        "--output-dir",
        str(out),
        "--",
        *tiny_args[2:],
        "--steps",
        "3",
        "--save-every",
        "3",
    ]
    ablate.ablate(args)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "cw-detached-seed0",
        "cw-detached-seed1",
        "grpo-seed0",
        "grpo-seed1",
    ]
    runs = {
        label: [ablate.run_summary(out / f"{label}-seed{seed}", 0.7) for seed in (0, 1)]
        for label in ("grpo", "cw-detached")
    }
    final = {label: [r["final_accuracy_mean"] for r in rs] for label, rs in runs.items()}
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ")
        for line in (out / "ablation.md").read_text().splitlines()
        if line.startswith("| ")
    }
    assert rows["cw-detached"][1] == "`--method cw --cw-detach`"
    assert rows["grpo"][2].endswith(ablate.cell(final["grpo"])) and rows["grpo"][3] == "-"
    assert rows["cw-detached"][3].strip("*") == ablate.difference(
        final["cw-detached"], final["grpo"]
    ).strip("*")
    stamp = (out / "grpo-seed0" / "wall_time.json").stat().st_mtime_ns
    ablate.ablate(args)  # finished runs are not run again
    assert (out / "grpo-seed0" / "wall_time.json").stat().st_mtime_ns == stamp
    # the standalone twin: the same options, one thread and one grading process
    twin = run_cli(
        *tiny_args,
        "--method",
        "cw",
        "--cw-detach",
        "--seed",
        "1",
        "--steps",
        "3",
        "--save-every",
        "3",
        "--threads",
        "1",
        "--reward-workers",
        "1",
        "--output-dir",
        str(tmp_path / "twin"),
    )
    assert twin.returncode == 0, twin.stderr
    assert read_metrics(tmp_path / "twin" / "metrics.jsonl") == read_metrics(
        out / "cw-detached-seed1" / "metrics.jsonl"
    )
    recorded = json.loads((out / "cw-detached-seed1" / "run_config.json").read_text())
    assert (recorded["torch_threads"], recorded["reward_workers_used"]) == (1, 1)
    with pytest.raises(SystemExit, match="unknown method nope"):
        ablate.ablate(["--methods", "grpo,nope", "--no-plot", "--output-dir", str(out)])


# ------------------------------------------------------------------------------------- diagnostics


def test_concentration_hand_computed():
    # 4 positive scores (10, 3, 2, 1) and 2 negative (-6, -2); zeros belong to neither side
    scores = torch.tensor([1.0, -2.0, 10.0, 0.0, 3.0, -6.0, 2.0])
    result = diagnose.concentration(scores)
    # top 0.01%, 0.1%, 1% of 4 tokens: 1 token; 10%: ceil(0.4) = 1; 100%: all four
    assert result["positive"] == {0.0001: 10.0, 0.001: 10.0, 0.01: 10.0, 0.1: 10.0, 1.0: 4.0}
    assert result["negative"] == {0.0001: -6.0, 0.001: -6.0, 0.01: -6.0, 0.1: -6.0, 1.0: -4.0}
    many = torch.arange(
        1.0, 1001.0
    )  # top 1% of 1000 = the 10 largest: mean 995.5; top 10%: mean 950.5
    assert diagnose.concentration(many)["positive"][0.01] == 995.5
    assert diagnose.concentration(many)["positive"][0.1] == 950.5
    assert diagnose.concentration(many)["negative"][1.0] == 0.0


def test_quantile_masks_partition():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0))
    masks = diagnose.quantile_masks(values, 4)
    assert torch.equal(sum(m.long() for m in masks), torch.ones(1001, dtype=torch.long))
    assert [int(m.sum()) for m in masks] == [251, 250, 250, 250]
    assert all(values[a].max() <= values[b].min() for a, b in zip(masks, masks[1:]))


@pytest.fixture(scope="module")
def scored_rollout(tiny_run, tiny_base):
    cfg = cwgrpo.parse_config(
        ["--preset", "tiny", "--prompts-per-step", "4", "--groups-per-micro-batch", "2"]
    )
    tokenizer = loading.load_tokenizer(str(tiny_run / "final-model"))
    model = loading.load_model(str(tiny_run / "final-model"), torch.float32, torch.device("cpu"))
    reference = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    prompts = loading.PromptStream(tiny.arithmetic_dataset(0), tokenizer, cfg)
    rollout = cwgrpo.sample(model, tokenizer, prompts.next_batch(4), cfg)
    grades = Grader().map([(t, g, "default") for t, g in zip(rollout.texts, rollout.golds)])
    cwgrpo.rollout_rewards(rollout, grades, cfg)
    rollout.ref_logp = cwgrpo.policy_token_stats(reference, rollout, cfg)["logp"]
    return model, rollout, cfg


@pytest.mark.slow
def test_quartile_gradients_sum_to_the_full_gradient(scored_rollout):
    model, rollout, cfg = scored_rollout
    valid = rollout.completion_mask.bool()
    prob = cwgrpo.policy_token_stats(model, rollout, cfg)["logp"].exp()[valid]
    quartiles = [diagnose.scatter_valid(q, valid) for q in diagnose.quantile_masks(prob, 4)]
    assert torch.equal(sum(quartiles), rollout.completion_mask)

    def gradient(active):
        model.zero_grad(set_to_none=True)
        cwgrpo.accumulate_gradients(
            model, dataclasses.replace(rollout, active=active), cfg, contextlib.nullcontext
        )
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = gradient(rollout.completion_mask)
    parts = [gradient(q) for q in quartiles]
    model.zero_grad(set_to_none=True)
    assert full.norm() > 0 and all(p.norm() > 0 for p in parts)
    torch.testing.assert_close(sum(parts), full, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_diagnose_rollout_report(scored_rollout):
    model, rollout, cfg = scored_rollout
    rng = torch.get_rng_state()
    report = diagnose.diagnose_rollout(model, rollout, cfg, contextlib.nullcontext)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert set(report["full_gradient_norm"]) == {"beta=0", "beta=0.04"}
    assert (
        sum(q["tokens"] for q in report["quartiles"])
        == report["tokens"]
        == int(rollout.completion_mask.sum())
    )
    # with beta = 0 the token weight is the advantage alone: the KL part is zero
    valid = rollout.completion_mask.bool()
    prob = cwgrpo.policy_token_stats(model, rollout, cfg)["logp"].exp()[valid]
    adv = rollout.advantages[:, None].expand_as(rollout.completion_mask)[valid]
    for q, mask in zip(report["quartiles"], diagnose.quantile_masks(prob, 4)):
        assert q["beta=0"]["abs_weight_mean"] == pytest.approx(
            adv[mask].abs().mean().item(), rel=1e-5
        )
    assert any(
        q["beta=0.04"]["abs_weight_mean"] != q["beta=0"]["abs_weight_mean"]
        for q in report["quartiles"]
    )
    assert len(report["cw_weight_by_covariance_decile"]) == 10


@pytest.mark.slow
def test_diagnose_command_and_training_diagnostics(tiny_run, tiny_base, tmp_path, TINY_RUN):
    out = tmp_path / "diag"
    diagnose.batch(
        [
            "--preset",
            "tiny",
            "--model",
            str(tiny_run / "final-model"),
            "--reference-model",
            str(tiny_base / "model"),
            "--diagnostics-dir",
            str(out),
            "--prompts-per-step",
            "2",
            "--dataset",
            str(tiny_base / "arithmetic.jsonl"),
        ]
    )
    assert "## Covariance concentration" in (out / "diagnostics.md").read_text()
    assert json.loads((out / "diagnostics.json").read_text())["tokens"] > 0
    # --diagnose-every appends figures without changing the training itself
    run = tmp_path / "run"
    diagnose.train([*TINY_RUN, "--output-dir", str(run), "--every", "2"])
    assert [
        json.loads(line)["rollout_step"]
        for line in (run / "diagnostics.jsonl").read_text().splitlines()
    ] == [2, 4]
    assert read_metrics(run / "metrics.jsonl") == read_metrics(tiny_run / "metrics.jsonl")


# ------------------------------------------------------------------------------ the loss, by hand


def loss_of(logp, old, ref, adv, weight, cfg_args=(), **terms):
    cfg = method_cfg(*cfg_args)
    return cwgrpo.token_loss(logp, old, ref, adv, cwgrpo.TokenTerms(weight, **terms), cfg)


def test_pg_term_without_clipping_is_minus_ratio_times_advantage():
    logp, old = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.4)]])  # ratio 1.25
    for adv, expected in ((2.0, -2.5), (-2.0, 2.5)):
        loss = loss_of(logp, old, None, torch.tensor([adv]), torch.ones(1, 1), clip=False)
        assert loss.item() == pytest.approx(expected)


def test_ppo_clipping_holds_the_ratio_within_the_range_on_the_side_of_the_advantage():
    logp, old = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.4)]])  # ratio 1.25
    # A > 0: min(1.25 A, 1.2 A) = 1.2 A, and no gradient flows through the clipped ratio
    logp_grad = logp.clone().requires_grad_(True)
    loss = loss_of(logp_grad, old, None, torch.tensor([2.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-2.4)
    loss.sum().backward()
    assert logp_grad.grad.item() == 0
    # A < 0: min(-1.25 |A|, -1.2 |A|) = -1.25 |A|, unclipped
    assert loss_of(logp, old, None, torch.tensor([-2.0]), torch.ones(1, 1)).item() == pytest.approx(
        2.5
    )


def test_k3_kl_and_weights_on_the_pg_term_only():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # exp(r - l) - (r - l) - 1
    # on-policy: ratio 1, pg = -A; w = (3, 0) scales pg only, beta 0.04 scales the KL
    loss = loss_of(logp, logp.clone(), ref, torch.tensor([1.5]), torch.tensor([[3.0, 0.0]]))
    expected = [3 * -1.5 + 0.04 * k3[0], 0 * -1.5 + 0.04 * k3[1]]
    torch.testing.assert_close(loss, torch.tensor([expected]))


def test_both_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # seq-mean-token-mean: mean of (1 + 3) / 2 and 2 / 1 = 2; token-mean: (1 + 3 + 2) / 3 = 2
    # with the step's totals larger than the micro-batch's: 4 responses, 6 tokens
    assert cwgrpo.aggregate(per_token, mask, "seq-mean-token-mean", 4, 6).item() == 1.0
    assert cwgrpo.aggregate(per_token, mask, "token-mean", 4, 6).item() == 1.0
    assert cwgrpo.aggregate(per_token, mask, "token-mean", 2, 3).item() == 2.0


@pytest.mark.parametrize("method", sorted(cwgrpo.METHODS))
def test_every_method_gives_a_finite_loss_and_gradient_with_a_group_of_no_valid_tokens(method):
    """--mask-truncated-completions can leave a whole group without a token."""
    G, T = 4, 6
    logp = (-torch.rand(2 * G, T, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
    mask = torch.ones(2 * G, T)
    mask[G:] = 0  # the second group has no valid token
    rollout = cwgrpo.Rollout(
        prompt_ids=torch.zeros(2 * G, 1, dtype=torch.long),
        prompt_mask=torch.ones(2 * G, 1),
        completion_ids=torch.zeros(2 * G, T, dtype=torch.long),
        completion_mask=mask,
        truncated=torch.zeros(2 * G, dtype=torch.bool),
        texts=[""] * 2 * G,
        sampler_logp=logp.detach() * mask,
        golds=[""] * 2 * G,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * 2),
        divergence=torch.rand(2 * G, T) * mask,
        batch_entropy=torch.rand(G * T).sort().values,
        ref_logp=logp.detach() - 0.1,
    )
    cfg = method_cfg("--method", method, "--group-size", str(G))
    old = logp.detach() * mask
    terms = cwgrpo.micro_batch_terms(logp, old, torch.rand(2 * G, T), rollout, cfg, 0)
    per_token = cwgrpo.token_loss(logp, old, rollout.ref_logp, rollout.advantages, terms, cfg)
    loss = cwgrpo.aggregate(per_token, mask, cfg.loss_aggregation, 2 * G, int(mask.sum()))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[G:] == 0).all()  # the empty group contributes nothing
    assert torch.isfinite(terms.pg_weight).all()


# ----------------------------------------------------------------------- sampling as configured


@pytest.mark.slow
def test_sampling_ignores_the_generation_config_the_model_ships(tiny_base):
    """A model's generation_config.json (Qwen2.5 Instruct ships repetition_penalty, top_k, top_p)
    must not change what is sampled: the loss assumes plain temperature sampling."""
    model = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    prompts = [loading.chat_prompt_ids(tokenizer, q, "") for q in ("1+2", "7+8")]

    def completions():
        torch.manual_seed(0)
        out = sampling.generate_completions(model, tokenizer, prompts, 4, 1.0, 1.0, 0, 12, None)
        return out.completion_ids

    plain = completions()
    shipped = model.generation_config
    shipped.repetition_penalty, shipped.top_k, shipped.top_p = 5.0, 1, 0.5
    shipped.no_repeat_ngram_size = 1
    shipped.suppress_tokens = list(range(48, 58))  # the digits
    assert torch.equal(completions(), plain)
    assert model.generation_config.suppress_tokens == list(range(48, 58))  # left as shipped


@pytest.mark.slow
def test_total_length_limit_caps_prompt_plus_completion(tiny_base):
    model = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    prompts = [loading.chat_prompt_ids(tokenizer, q, "") for q in ("1+2", "1+2" * 4)]
    torch.manual_seed(0)
    out = sampling.generate_completions(
        model, tokenizer, prompts, 3, 1.0, 1.0, 0, 40, len(prompts[1]) + 6
    )
    prompt_mask, mask, truncated = out.prompt_mask, out.completion_mask, out.truncated
    totals = prompt_mask.sum(1) + mask.sum(1)
    assert (totals <= len(prompts[1]) + 6).all()
    assert truncated[3:].all() and (mask[3:].sum(1) == 6).all()  # the long prompt: 6 tokens left
    assert (mask[:3].sum(1) > 6).any()  # the short one had room for more


def test_math_verify_cutoffs_are_counted():
    counter = runtime.LogCounter.installed("math_verify", "Timeout during")
    before = counter.count
    import logging

    logging.getLogger("math_verify.parser").warning("Timeout during parsing: 9^9^9")
    logging.getLogger("math_verify.grader").warning("Timeout during comparison")
    logging.getLogger("math_verify.grader").warning("something else")
    assert counter.count == before + 2


# ------------------------------------------------------------------------- runs and processes


def children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_live_run_locks_its_folder_and_kill_9_frees_it_and_its_workers(tmp_path, tiny_args):
    out = tmp_path / "run"
    first = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "cwgrpo.py"),
            *tiny_args,
            "--steps",
            "500",
            "--reward-workers",
            "2",
            "--output-dir",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.5)
        workers = children_of(first.pid)
        assert len(workers) >= 2
        second = run_cli(*tiny_args, "--output-dir", str(out), "--resume")
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines() == [
            f"error: {out} is in use by a live run (pid {first.pid}); wait for it or stop it, or "
            f"choose another --output-dir"
        ]
    finally:
        first.kill()
        first.wait()
    deadline = time.time() + 5
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(w) for w in workers)  # the grading workers died with their parent
    shutil.rmtree(out / "checkpoint-50", ignore_errors=True)
    (out / "metrics.jsonl").write_text("")
    resumed = run_cli(
        *tiny_args, "--output-dir", str(out), "--overwrite-output-dir", "--steps", "1"
    )
    assert resumed.returncode == 0, resumed.stderr  # the dead run's lock does not block


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_step_and_prints_the_resume_command(tmp_path, tiny_args):
    out = tmp_path / "run"
    run = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "cwgrpo.py"),
            *tiny_args,
            "--steps",
            "500",
            "--output-dir",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").exists() and time.time() < deadline:
            time.sleep(0.2)
        run.send_signal(2)  # SIGINT, as Ctrl-C
        _, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode != 0 and "Traceback" not in stderr
    steps = len((out / "metrics.jsonl").read_text().splitlines())
    assert (out / f"checkpoint-{steps}" / "trainer_state.pt").is_file()
    assert (
        f"stopped after step {steps} (saved checkpoint-{steps}); resume with: python cwgrpo.py"
        in stderr
        and stderr.rstrip().endswith("--resume")
    )


# ------------------------------------------------------------------------ evaluation resumption


@pytest.mark.slow
def test_evaluation_never_reuses_samples_made_with_other_settings(tiny_run, tmp_path):
    bench = tmp_path / "arith.jsonl"
    bench.write_text(
        "".join(json.dumps({"problem": f"{a}+{a}", "answer": str(2 * a)}) + "\n" for a in range(3))
    )
    out = tmp_path / "eval"
    args = [
        "--model",
        str(tiny_run / "final-model"),
        "--benchmarks",
        str(bench),
        "--gold-format",
        "expr",
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--output-dir",
        str(out),
    ]
    evaluate.main(args)
    with pytest.raises(
        SystemExit, match=r"made with other settings \(n differ\); pass --overwrite"
    ):
        evaluate.main([*args, "--n", "4"])
    with pytest.raises(SystemExit, match=r"\(model, weights differ\)"):
        evaluate.main([*args[2:], "--model", str(tiny_run / "checkpoint-2")])
    evaluate.main([*args, "--n", "4", "--overwrite"])
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


# --------------------------------------------------------------------------- what a run leaves


class PageParser(HTMLParser):
    """Checks that every tag is closed in order, and collects each view's token spans."""

    VOID = {"meta", "br", "img", "input", "link"}

    def __init__(self):
        super().__init__()
        self.stack, self.views, self.view, self.in_token = [], {}, None, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in self.VOID:
            self.stack.append(tag)
        if "data-view" in attrs:
            self.view = int(attrs["data-view"])
            self.views[self.view] = []
        if tag == "span" and attrs.get("class") == "t":
            self.in_token = True
            self.views[self.view].append("")

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing open"
        self.in_token = False

    def handle_data(self, data):
        if self.in_token:
            self.views[self.view][-1] += data


@pytest.mark.slow
def test_a_run_leaves_its_curves_and_a_valid_small_token_page(tiny_run):
    assert (tiny_run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tiny_run / "tokens.html").read_text()
    assert "cw as released normalises its weights over padded positions" in page  # the legend
    views = torch.load(tiny_run / "checkpoint-4" / "trainer_state.pt", weights_only=False)[
        "token_views"
    ]
    assert [v["label"] for v in views] == ["step 1", "step 4"]
    assert len(page.encode()) < 300_000
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert parser.stack == []
    for index, view in enumerate(views):  # every token's text, once per view, in order
        assert parser.views[index] == [token for tokens in view["tokens"] for token in tokens]
        assert list(view["weights"]) == [name for name, *_ in cwgrpo.method_passes()]
    embedded = page.split('<script type="application/json" id="data">')[1].split("</script>")[0]
    assert json.loads(embedded)["views"][0]["weights"] == views[0]["weights"]


def test_token_page_escapes_model_output(tmp_path):
    hostile = ["</script><script>alert(1)</script>", "<b>", "&amp;", '"q"']
    view = {
        "label": "step 1",
        "tokens": [hostile],
        "prob": [[0.5] * 4],
        "cov": [[0.0] * 4],
        "adv": [1.0],
        "weights": {"grpo": [[1.0] * 4]},
        "touched": {"grpo": [[0] * 4]},
    }
    plots.token_page(tmp_path / "t.html", "t", "grpo", {"grpo": "GRPO"}, [view])
    page = (tmp_path / "t.html").read_text()
    assert "<b>" not in page and "alert(1)</script>" not in page
    parser = PageParser()
    parser.feed(page)
    assert parser.views[0] == hostile and parser.stack == []


@pytest.mark.slow
def test_token_view_weights_are_the_methods_weights(tiny_base):
    cfg = cwgrpo.parse_config(["--preset", "tiny", "--max-completion-length", "12"])
    model = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    torch.manual_seed(0)
    rollout = cwgrpo.sample(
        model, tokenizer, [(loading.chat_prompt_ids(tokenizer, "3+4", ""), "\\boxed{7}")], cfg
    )
    rollout.advantages = torch.randn(cfg.group_size, generator=torch.Generator().manual_seed(1))
    rng = torch.get_rng_state()
    view = cwgrpo.token_view(model, tokenizer, rollout, cfg, "step 1")
    assert torch.equal(torch.get_rng_state(), rng)
    with torch.no_grad():
        logp, _, _ = cwgrpo.completion_logprobs(model, rollout, cfg)
    mask = rollout.completion_mask
    cw = cwgrpo.cw_weights(logp, rollout.advantages, mask)
    for i, tokens in enumerate(view["tokens"]):
        n = int(mask[i].sum())
        assert tokens == plots.token_texts(tokenizer, rollout.completion_ids[i, :n].tolist())
        assert view["weights"]["cw"][i] == pytest.approx(cw[i, :n].tolist(), rel=1e-3)
        assert view["weights"]["grpo"][i] == [1.0] * n
        assert view["prob"][i] == pytest.approx(logp[i, :n].exp().tolist(), rel=1e-3)


@pytest.mark.slow
def test_a_run_says_what_it_does_and_what_it_did(tiny_args, tmp_path):
    out = run_cli(*tiny_args, "--steps", "2", "--output-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"cwgrpo: --method cw on {tiny_args[3]}, data {tiny_args[5]}"
    assert lines[1].startswith("  8 prompts x G = 8 per step, 2 steps, beta 0.04")
    summary = lines[lines.index(next(x for x in lines if x.startswith("done in "))) :]
    assert [x.split()[0] for x in summary[1:6]] == ["reward", "accuracy", "format", "entropy", "kl"]
    assert summary[-1].startswith(f"evaluate it: python evaluate.py --model {tmp_path}")


@pytest.mark.slow
def test_import_cwgrpo_loads_no_plotting_library():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, cwgrpo; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))",
        ],
        capture_output=True,
        text=True,
        cwd=HERE,
        timeout=120,
    )
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("top_p,top_k", [(1.0, 1), (1e-6, 0)])
def test_sampling_loop_with_a_kv_cache_matches_greedy_generate(tiny_base, top_p, top_k):
    """With the nucleus or the top-k cut to one token, sampling is greedy decoding: the loop must
    then give exactly what transformers' generate gives, left padding included."""
    model = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu")).eval()
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    prompts = [loading.chat_prompt_ids(tokenizer, q, "") for q in ("1+2", "12+30", "5+5")]
    out = sampling.generate_completions(model, tokenizer, prompts, 2, 0.7, top_p, top_k, 16, None)
    prompt_ids, prompt_mask, ids, mask = out[:4]
    reference = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=False,
        max_new_tokens=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )[:, prompt_ids.shape[1] :]
    reference_mask, _ = sampling.completion_mask_after_eos(
        reference, [tokenizer.eos_token_id], torch.full((len(reference),), reference.shape[1])
    )
    assert torch.equal(mask, reference_mask[:, : mask.shape[1]])
    assert torch.equal(ids * mask.long(), (reference * reference_mask.long())[:, : ids.shape[1]])


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 3), (1.3, 0.9, 0)])
def test_sampled_tokens_follow_the_configured_distribution(tiny_base, temperature, top_p, top_k):
    """8,000 draws of one next token against softmax(logits / T), cut to top-k or top-p."""
    model = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu")).eval()
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    prompt = torch.tensor([loading.chat_prompt_ids(tokenizer, "4+", "")])
    with torch.no_grad():
        probs = (model(input_ids=prompt).logits[0, -1] / temperature).softmax(-1)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    order = probs.argsort(descending=True)
    if top_k:
        kept[order[:top_k]] = True
    else:  # the nucleus: the most probable tokens until their mass reaches top_p
        before = probs[order].cumsum(0) - probs[order]
        kept[order[before < top_p]] = True
    expected = probs * kept / (probs * kept).sum()
    torch.manual_seed(0)
    drawn, sampler_logp = sampling.sample_tokens(
        model,
        prompt.repeat(8000, 1),
        torch.ones(8000, prompt.shape[1]),
        1,
        temperature,
        top_p,
        top_k,
        [tokenizer.eos_token_id],
        tokenizer.pad_token_id,
    )
    drawn, sampler_logp = drawn[:, 0], sampler_logp[:, 0]
    # each draw's log-prob is that of the distribution it came from, after the cut
    torch.testing.assert_close(sampler_logp, expected[drawn].log(), rtol=1e-5, atol=1e-5)
    frequency = torch.bincount(drawn, minlength=len(probs)).float() / 8000
    assert (frequency[~kept] == 0).all()
    assert (frequency - expected).abs().max() < 0.02


def test_cw_gradient_only_control_is_grpo_plus_the_gradient_through_the_weights():
    """Loss w * pg has gradient w dpg + pg dw: the control (value 1, w's gradient) must give
    GRPO's loss, and a gradient that exceeds GRPO's by exactly what released exceeds detached by."""
    logp, adv, mask = random_group(3, G=6, T=12)
    grads, losses = {}, {}
    for name, args in {
        "grpo": ("--method", "grpo"),
        "released": (),
        "detached": ("--cw-detach",),
        "control": ("--cw-reading", "gradient-only"),
    }.items():
        cfg = method_cfg(*args)
        leaf = logp.clone().requires_grad_(True)
        terms = cwgrpo.METHODS[cfg.method].token_terms(make_group(leaf, adv, mask), cfg)
        per_token = cwgrpo.token_loss(leaf, leaf.detach() - 0.1, None, adv, terms, cfg)
        losses[name] = cwgrpo.aggregate(per_token, mask, cfg.loss_aggregation, 6, int(mask.sum()))
        losses[name].backward()
        grads[name] = leaf.grad
    assert losses["control"].item() == losses["grpo"].item()
    assert not torch.allclose(grads["control"], grads["grpo"])
    torch.testing.assert_close(
        grads["control"] - grads["grpo"],
        grads["released"] - grads["detached"],
        rtol=1e-4,
        atol=1e-7,
    )


@pytest.mark.slow
def test_the_paper_recipe_code_path_runs_and_resumes_on_cpu(tmp_path, tiny_base, monkeypatch):
    """The paper-1.5b preset's code path, which no tiny run takes: an untied LM head, gradient
    checkpointing, the Open-RS system prompt through the chat template, beta 0.04 with a
    reference model, then a checkpoint and --resume. Qwen2.5-1.5B's hidden size (1,536), heads
    (12) and KV heads (2) and its untied head, in 2 layers. Reduced where CPU time forces it:
    the MLP width (8,960 -> 1,536), the vocabulary (151,936 -> the byte-level tokenizer's),
    prompt lengths (byte tokens are about four times Qwen's: --max-prompt-length 1024), and 16
    new tokens (--length-limit new)."""
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    config = tiny.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=1536,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = tiny.Qwen2ForCausalLM(config)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    runtime.save_checkpoint(tmp_path, "qwen-1.5b-shaped", model, tokenizer)
    args = [
        "--preset",
        "paper-1.5b",
        "--device",
        "cpu",
        "--model",
        str(tmp_path / "qwen-1.5b-shaped"),
        "--dataset",
        str(tiny_base / "arithmetic.jsonl"),
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-prompt-length",
        "1024",
        "--length-limit",
        "new",
        "--max-completion-length",
        "16",
        "--steps",
        "2",
        "--save-every",
        "1",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    cfg = cwgrpo.parse_config(args)
    full = tmp_path / "full"
    cwgrpo.train(cwgrpo.parse_config([*args, "--output-dir", str(full)]))
    crash_at_save(monkeypatch, 2)  # a crash during checkpoint-2's save, then --resume
    assert (cfg.gradient_checkpointing, cfg.beta, cfg.method, cfg.system_prompt) == (
        True,
        0.04,
        "cw",
        cwgrpo.OPEN_RS_SYSTEM_PROMPT,
    )
    with pytest.raises(Crash):
        cwgrpo.train(cfg)
    monkeypatch.undo()
    records = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    # a random model earns no reward, so its advantages and update are 0; what is checked is that
    # the whole path runs: the reference pass, backward through checkpointed layers, the untied head
    assert all(math.isfinite(r[k]) for r in records for k in ("loss", "grad_norm", "kl_mean"))
    cwgrpo.train(cwgrpo.parse_config([*args, "--resume"]))
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == records


def test_gold_is_parsed_with_first_match_as_the_released_reward():
    """The released reward parsed the gold with math-verify's first_match: the gold's first
    (boxed) answer is the gold even when it does not parse to an expression, where any_match
    would fall back to a later one."""
    gold = "$\\boxed{\\frac{1}{}}$ so the answer is $5$"
    assert grade_accuracy("\\boxed{5}", gold).accuracy == 0.0
    assert grade_accuracy("\\boxed{5}", "so the answer is $5$").accuracy == 1.0


# ------------------------------------------------------------- whole runs: kill anywhere, faults
# A tiny run is killed (SIGKILL) at the Nth call of a named function (faults.py), then resumed;
# the resumed run must finish with one record per step, equal bit for bit to an uninterrupted run
# (all keys but timings), and no grading worker may outlive the kill.
FAULT_STEPS = ["--steps", "6", "--save-every", "2", "--threads", "1", "--reward-workers", "1"]
SAMPLER = "sampling:sample_tokens" if ROLLOUT == "hf" else "vllm_engine:Engine.generate"
KILL_POINTS = {  # CWGRPO_FAULT -> where the run dies
    f"{SAMPLER}:3": "sampling step 3",
    "cwgrpo:Grader.submit:3:after": "grading step 3, workers busy",
    "cwgrpo:policy_token_stats:4": "step 3's reference pass (calls: ref 1, page 1, ref 2, ref 3)",
    "cwgrpo:accumulate_gradients:3:after": "step 3's update, after backward, before the step",
    "torch.optim:AdamW.step:5:after": "step 5's update, after the optimizer step",
    "runtime:append_record:3:torn": "writing step 3's record to metrics.jsonl (half a line)",
    "transformers:PreTrainedModel.save_pretrained:2:after": "checkpoint-4: weights written",
    "transformers:PreTrainedTokenizerBase.save_pretrained:2:after": "checkpoint-4: tokenizer",
    "torch:save:3:after": "checkpoint-4: optimizer.pt written, trainer_state.pt not",
    "torch:save:4:after": "checkpoint-4: trainer state written, not yet renamed",
    "runtime:prune_checkpoints:2": "checkpoint-4 renamed, checkpoint-2 still holds optimizer.pt",
    "plots:plot_run:1": "just after checkpoint-2 is complete, before its pictures",
    "plots:token_page:2": "drawing checkpoint-4's token page",
    "runtime:save_checkpoint:4": "after every step, before final-model is written",
}
# With --rollout vllm (CI's vLLM venv, whose share of CI's 25 minutes is bounded): the kill points
# where the engine's state matters (inside its sampling call; with grading in flight; after a step
# whose weights the engine does not have yet; just after a checkpoint); those inside a checkpoint's
# writing are the sampler's business no more than the HF loop's, and run there
VLLM_KILL_POINTS = ("vllm_engine:", "cwgrpo:Grader", "torch.optim:", "plots:plot_run")
if ROLLOUT == "vllm":
    KILL_POINTS = {f: where for f, where in KILL_POINTS.items() if f.startswith(VLLM_KILL_POINTS)}


def fault_run(args, fault=None, marker="", timeout=300):
    """python faults.py cwgrpo ARGS, with CWGRPO_FAULT if given; marker tags its processes."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CWGRPO_TEST_MARKER": marker}
    env.pop("CWGRPO_FAULT", None)
    if fault:
        env["CWGRPO_FAULT"] = fault
    return subprocess.run(
        [sys.executable, str(HERE / "faults.py"), "cwgrpo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=HERE,
    )


def processes_tagged(marker: str) -> list[int]:
    """Live processes whose environment holds CWGRPO_TEST_MARKER=marker."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"CWGRPO_TEST_MARKER={marker}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def kill_and_resume(fault: str, out: Path, tiny_args) -> dict:
    args = [*tiny_args, *FAULT_STEPS, "--output-dir", str(out)]
    marker = f"{out}-{time.time()}"
    killed = fault_run(args, fault, marker)
    deadline = time.time() + 5  # workers die within a second of their parent (runtime.py)
    while processes_tagged(marker) and time.time() < deadline:
        time.sleep(0.1)
    survivors = processes_tagged(marker)
    resumed = fault_run([*args, "--resume"] if (out / "metrics.jsonl").exists() else args)
    return {"killed": killed, "survivors": survivors, "resumed": resumed}


@pytest.fixture(scope="module")
def uninterrupted_fault_run(tiny_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = fault_run([*tiny_args, *FAULT_STEPS, "--output-dir", str(out)])
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def killed_runs(tiny_args, tmp_path_factory, uninterrupted_fault_run):
    """Every kill point, two at a time (one per core)."""
    root = tmp_path_factory.mktemp("killed")
    with ThreadPoolExecutor(2) as pool:
        jobs = {
            fault: pool.submit(kill_and_resume, fault, root / f"run{i}", tiny_args)
            for i, fault in enumerate(KILL_POINTS)
        }
        return {
            fault: (job.result(), root / f"run{i}") for i, (fault, job) in enumerate(jobs.items())
        }


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(KILL_POINTS))
def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_run(
    fault, killed_runs, uninterrupted_fault_run
):
    result, out = killed_runs[fault]
    assert result["killed"].returncode == -signal.SIGKILL, result["killed"].stderr[-2000:]
    assert result["survivors"] == [], "grading workers outlived the kill"
    assert result["resumed"].returncode == 0, result["resumed"].stderr[-2000:]
    resumed, expected = (
        read_metrics(out / "metrics.jsonl"),
        read_metrics(uninterrupted_fault_run / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # exactly one record per step
    assert resumed == expected  # bit for bit, all keys but timings
    assert (out / "final-model" / "config.json").is_file()
    assert (out / "tokens.html").is_file() and (out / "curves.png").is_file()
    assert not list(out.glob(".*.partial"))


@pytest.mark.slow
def test_a_failed_save_keeps_the_previous_checkpoint_stops_in_one_line_and_resumes(
    tiny_args, tmp_path, uninterrupted_fault_run
):
    out = tmp_path / "run"
    args = [*tiny_args, *FAULT_STEPS, "--output-dir", str(out)]
    full = fault_run(args, "torch:save:3:enospc")  # checkpoint-4's optimizer.pt: disk full
    assert full.returncode == 1
    assert full.stderr.strip().splitlines()[-1] == (
        f"error: could not write {out / 'checkpoint-4'} (No space left on device); "
        f"{out / 'checkpoint-2'} is intact; free space and resume with: python cwgrpo.py "
        f"{shlex.join(args)} --resume"
    )
    assert "Traceback" not in full.stderr
    assert not (out / ".checkpoint-4.partial").exists() and not (out / "checkpoint-4").exists()
    assert (out / "checkpoint-2" / "trainer_state.pt").is_file()
    resumed = fault_run([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert read_metrics(out / "metrics.jsonl") == read_metrics(
        uninterrupted_fault_run / "metrics.jsonl"
    )


@pytest.mark.slow
def test_a_save_the_disk_cannot_hold_stops_before_writing(tiny_args, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(
        runtime.shutil,
        "disk_usage",
        lambda p: real(p)._replace(free=100_000),  # < the model
    )
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as error:
        cwgrpo.main([*tiny_args, "--steps", "2", "--save-every", "2", "--output-dir", str(out)])
    message = str(error.value)
    assert (
        message.startswith(f"error: {out / 'checkpoint-2'} needs about 0.00")
        and "\n" not in message
    )
    assert "0.00 GB are free; no checkpoint was written yet; free space and resume" in message
    assert not (out / ".checkpoint-2.partial").exists()


@pytest.mark.slow
def test_drawing_that_fails_warns_once_and_the_run_trains_on(tiny_args, tmp_path):
    out = tmp_path / "run"
    (out / "curves.png").mkdir(parents=True)  # savefig cannot write a folder
    done = run_cli(*tiny_args, "--steps", "4", "--save-every", "1", "--output-dir", str(out))
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: could not draw curves.png (")
    assert [int(p.name.split("-")[1]) for p in sorted(out.glob("checkpoint-*"))] == [1, 2, 3, 4]
    assert (out / "tokens.html").is_file()  # the other picture is still drawn
    assert len(read_metrics(out / "metrics.jsonl")) == 4


# -------------------------------------------------- degenerate batches, every method, the CLI
@pytest.fixture(scope="session")
def eos_first_model(tiny_base, tmp_path_factory):
    """The tiny model with every token listed as EOS: every completion ends at its first token."""
    out = tmp_path_factory.mktemp("eos-first") / "model"
    shutil.copytree(tiny_base / "model", out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = list(
        range(json.loads((out / "config.json").read_text())["vocab_size"])
    )
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def single_valid_token(sample):
    """The real sampler, with every token of the first group but its first one masked out."""

    def wrapped(*args, **kwargs):
        rollout = sample(*args, **kwargs)
        group = args[3].group_size
        rollout.completion_mask[:group] = 0
        rollout.completion_mask[0, 0] = 1
        return rollout

    return wrapped


def prompt_length(tiny_base) -> int:
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    return len(loading.chat_prompt_ids(tokenizer, "1+2", ""))  # every tiny question is a+b


DEGENERATE = ["all-masked", "equal-rewards", "eos-at-once", "one-valid-token", "prompt-at-limit"]


@pytest.mark.slow
@pytest.mark.parametrize("case", DEGENERATE)
def test_every_method_trains_on_a_degenerate_batch_with_the_pictures_on(
    case, tiny_args, tiny_base, eos_first_model, tmp_path, monkeypatch
):
    small = [
        "--steps",
        "2",
        "--save-every",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--groups-per-micro-batch",
        "2",
        "--reward-workers",
        "1",
    ]
    extra = {
        "all-masked": ["--mask-truncated-completions", "--max-completion-length", "2"],
        "equal-rewards": ["--accuracy-weight", "0", "--format-weight", "0"],
        "eos-at-once": ["--model", str(eos_first_model)],
        "one-valid-token": [],
        "prompt-at-limit": [
            "--max-prompt-length",
            str(prompt_length(tiny_base)),
            "--length-limit",
            "total",
            "--max-completion-length",
            str(prompt_length(tiny_base) + 1),
        ],
    }[case]
    if case == "one-valid-token":
        monkeypatch.setattr(cwgrpo, "sample", single_valid_token(cwgrpo.sample))
    # with --rollout vllm one method of one pass and one of two (lopti): the methods' math is the
    # sampler's business no more than the HF loop's, and runs there
    methods = cwgrpo.METHODS if ROLLOUT == "hf" else ("grpo", "lopti")
    for method in methods:
        out = tmp_path / method
        cwgrpo.main([*tiny_args, *small, *extra, "--method", method, "--output-dir", str(out)])
        records = read_metrics(out / "metrics.jsonl")
        assert len(records) == 2 * cwgrpo.METHODS[method].update_passes, method
        for record in records:
            numbers = {k: v for k, v in record.items() if isinstance(v, float)}
            assert all(math.isfinite(v) for v in numbers.values()), (method, record)
        assert (out / "final-model" / "config.json").is_file() and (out / "tokens.html").is_file()
        if case == "all-masked":
            assert all(r["truncated_frac"] == 1 and r["grad_norm"] == 0 for r in records), method
        if case == "equal-rewards":
            assert all(r["reward_std"] == 0 and r["grad_norm"] == 0 for r in records), method
        if case == "eos-at-once":
            assert all(r["completion_len_mean"] == 1 for r in records), method
        if case == "prompt-at-limit":
            assert all(r["prompts_skipped"] == 0 and r["completion_len_mean"] == 1 for r in records)


# ----------------------------------------------------- silent or misleading, as a user meets it
@pytest.mark.slow
def test_a_resume_with_other_options_is_refused_and_the_record_kept(tiny_args, tmp_path):
    out = tmp_path / "run"
    first = fault_run(
        [
            *tiny_args,
            "--method",
            "cw",
            "--steps",
            "4",
            "--save-every",
            "2",
            "--output-dir",
            str(out),
        ],
        "runtime:save_checkpoint:2",
    )  # before ckpt-4
    assert first.returncode == -signal.SIGKILL, first.stderr
    record = (out / "run_config.json").read_text()

    def resume(method: str, steps: int):
        options = ["--method", method, "--steps", str(steps), "--save-every", "2"]
        return run_cli(*tiny_args, *options, "--output-dir", str(out), "--resume")

    refused = resume("grpo", 4)
    assert refused.returncode == 1
    line = refused.stderr.strip()
    assert line.startswith(
        f"error: --resume with options other than {out / 'checkpoint-2'}'s: "
        "--method 'cw' -> 'grpo'; resume with the run's own options"
    )
    assert "--steps, --save_every, --log_every, --reward_workers, --output_dir" in line
    assert "\n" not in line and (out / "run_config.json").read_text() == record
    extended = resume("cw", 5)
    assert extended.returncode == 0, extended.stderr
    assert (
        "note: --steps 5 (was 4): the cosine learning-rate schedule is recomputed"
        in extended.stdout
    )
    recorded = json.loads((out / "run_config.json").read_text())
    assert recorded["method"] == "cw" and recorded["steps"] == 4  # the run as it was started
    assert recorded["resumes"] == [{"from": "checkpoint-2", "changed": {"steps": [4, 5]}}]
    again = resume("cw", 5)
    assert again.returncode == 0
    assert f"nothing to do: {out} has finished its 5 steps" in again.stdout
    assert "done in" not in again.stdout  # no retraining, no summary


@pytest.mark.slow
def test_ablate_never_reuses_a_run_made_with_other_options(tmp_path, tiny_base):
    base = ["--methods", "grpo", "--seeds", "1", "--no-plot", "--output-dir", str(tmp_path)]
    run_args = [
        "--",
        "--model",
        str(tiny_base / "model"),
        "--dataset",
        str(tiny_base / "arithmetic.jsonl"),
    ]
    ablate.ablate([*base, *run_args, "--steps", "2"])
    with pytest.raises(SystemExit) as error:
        ablate.ablate([*base, *run_args, "--steps", "3"])
    assert str(error.value) == (
        f"error: 1 runs in {tmp_path} were made with other options: grpo-seed0 (--steps 2 -> 3); "
        f"pass --rerun-changed to redo them, or choose another --output-dir"
    )
    ablate.ablate([*base, "--rerun-changed", *run_args, "--steps", "3"])
    assert len(read_metrics(tmp_path / "grpo-seed0" / "metrics.jsonl")) == 3
    table = (tmp_path / "ablation.md").read_text()
    assert "± n/a" in table and "± 0.000" not in table  # one seed: no interval


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
            "diagnose.py",
            ["batch", "--presett", "tiny"],
            "error: unknown option --presett; did you mean --preset?",
        ),
        (
            "ablate.py",
            ["--method", "cw"],
            "error: unknown option --method; did you mean --methods?",
        ),
    ],
)
def test_a_misspelt_or_abbreviated_option_is_one_line_naming_the_closest(tool, argv, expected):
    done = subprocess.run(
        [sys.executable, str(HERE / tool), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["evaluate.py", "--model", "runs/nope"],
        ["diagnose.py", "batch", "--preset", "tiny", "--model", "runs/nope"],
    ],
)
def test_a_missing_local_model_is_one_line_at_once_and_leaves_no_folder(argv, tmp_path):
    (tmp_path / "runs").mkdir()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(HERE / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert time.perf_counter() - start < 30
    assert done.stderr.strip() == "error: --model runs/nope: no such folder"
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_an_unreachable_hub_fails_fast_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / "cwgrpo.py"),
            "--method",
            "cw",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert time.perf_counter() - start < 20  # the libraries' retries took 27 s
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "the hub cannot be reached from here, so only what is cached loads" in done.stderr
    assert not (tmp_path / "run").exists()  # a run that failed early leaves no folder


@pytest.mark.slow
def test_a_first_run_builds_the_tiny_model_says_so_and_is_quiet(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / "cwgrpo.py"),
            "--preset",
            "tiny",
            "--steps",
            "12",
            "--save-every",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("building the tiny preset's model and data in runs/tiny-base") == 1
    assert (tmp_path / "runs" / "tiny-base" / "model" / "config.json").is_file()
    output = done.stdout + done.stderr
    for noise in ("past_key_values", "Generating train split", "Writing model shards", "it/s]"):
        assert noise not in output
    progress = [line for line in done.stdout.splitlines() if line.startswith("cw: step")]
    assert progress == ["cw: step 10/12, " + progress[0].split(", ", 1)[1], progress[1]]
    assert progress[1].startswith("cw: step 12/12, reward ")
    rebuilt = subprocess.run(
        [sys.executable, str(HERE / "tiny.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert "building" not in rebuilt.stdout and rebuilt.stdout.startswith("ready: runs/tiny-base")


def test_help_texts_say_what_each_option_does():
    parser_help = subprocess.run(
        [sys.executable, str(HERE / "cwgrpo.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    flat = " ".join(parser_help.split())
    assert "turn off --gradient_checkpointing" in flat
    assert "stapo: silence tokens with p below this" in flat
    assert "Defaults shown: --preset paper-1.5b's." in flat
    tiny_help = subprocess.run(
        [sys.executable, str(HERE / "cwgrpo.py"), "--preset", "tiny", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "Defaults shown: --preset tiny's." in " ".join(tiny_help.split())
    batch = subprocess.run(
        [sys.executable, str(HERE / "diagnose.py"), "batch", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "--reference_model" in batch
    assert all(f"--{o} " not in batch for o in ("resume", "steps", "save_every"))
    top = subprocess.run(
        [sys.executable, str(HERE / "diagnose.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert top.returncode == 0
    assert all(f"  {c} " in top.stdout for c in ("batch", "train", "plot"))
    ablate_help = subprocess.run(
        [sys.executable, str(HERE / "ablate.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "turn off --plot" in " ".join(ablate_help.split())


def test_kl_cov_on_a_group_with_no_valid_token_penalises_nothing():
    group = make_group(torch.zeros(4, 0), torch.tensor([1.0, -1.0, 0.5, 0.0]), torch.zeros(4, 0))
    terms = cwgrpo.kl_cov(group, method_cfg())
    assert terms.extra.shape == (4, 0)  # topk(1) of nothing raised "selected index k out of range"


def test_lopti_shows_both_passes_on_the_token_page():
    names = [name for name, *_ in cwgrpo.method_passes()]
    assert names.count("lopti") == 1 and "lopti, pass 2" in names and "ar_lopti, pass 2" in names
    about = {name: text for name, _, _, text in cwgrpo.method_passes()}
    assert about["lopti, pass 2"] == "lopti's pass 2, on the tokens pass 1 left out"


def test_split_byte_tokens_show_their_character_once_complete():
    tokenizer = tiny.byte_level_qwen2_tokenizer()
    ids = tokenizer("é=1", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4  # é is two bytes, so two byte tokens
    assert plots.token_texts(tokenizer, ids + [tokenizer.eos_token_id]) == [
        "\u00b7",
        "é",
        "=",
        "1",
        "<|im_end|>",
    ]


def test_ties_fill_every_decile():
    values = torch.cat([torch.zeros(60), torch.linspace(-1, 1, 40)])  # 60% of the scores are 0
    sizes = [int(m.sum()) for m in diagnose.quantile_masks(values, 10)]
    assert sizes == [10] * 10


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"rollout_step": 1}\n{"rollout_step": 2}\n{"rollout_st')
    runtime.keep_records_until(path, 5)
    assert path.read_text() == '{"rollout_step": 1}\n{"rollout_step": 2}\n'


# ------------------------------------------------------------------- the memory and disk plan
PLAN_SHAPE = dict(
    vocab_size=300,
    hidden_size=96,
    intermediate_size=320,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)  # a shape the plan's count was not fit on


@pytest.fixture(scope="module")
def plan_model(tmp_path_factory):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**PLAN_SHAPE))
    folder = tmp_path_factory.mktemp("plan-model")
    model.save_pretrained(folder)
    return model, folder


def plan_options(**overrides):
    args = [
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--groups-per-micro-batch",
        "1",
        "--max-prompt-length",
        "24",
        "--max-completion-length",
        "40",
        "--length-limit",
        "new",
        "--beta",
        "0.04",
        "--steps",
        "6",
        "--save-every",
        "2",
    ]
    for name, value in overrides.items():
        args += [f"--{name}", str(value)]
    return dataclasses.asdict(cwgrpo.parse_config(args))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    "name,count",
    [
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1_777_088_000),
        ("Qwen/Qwen2.5-Math-7B-Instruct", 7_615_616_512),
        ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768),
    ],
)
def test_parameter_counts_from_config_equal_the_published_ones(name, count):
    arch = memory_plan.Architecture.from_config(memory_plan.read_config(name))  # shipped: offline
    assert arch.parameters() == count


def test_parameter_count_equals_the_built_model(plan_model):
    model, folder = plan_model
    arch = memory_plan.Architecture.from_config(memory_plan.read_config(str(folder)))
    assert arch.parameters() == sum(p.numel() for p in model.parameters())


def test_weights_gradients_and_adamw_state_equal_the_plan_after_a_real_step(plan_model):
    model, folder = plan_model
    items = memory_plan.plan(str(folder), plan_options(), cuda=False)["items"]
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    model(
        input_ids=torch.randint(0, 300, (2, 8)), labels=torch.randint(0, 300, (2, 8))
    ).loss.backward()
    assert tensor_bytes(model.parameters()) == items["weights (fp32)"]
    assert tensor_bytes(p.grad for p in model.parameters()) == items["gradients (fp32)"]
    optimizer.step()
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert tensor_bytes(moments) == items["AdamW moments (fp32)"]
    assert items["reference"] == items["weights (fp32)"]  # fp32 on the CPU, with beta > 0


def test_the_kv_cache_after_sampling_is_the_plans(plan_model):
    model, folder = plan_model
    options = plan_options()
    planned = memory_plan.plan(str(folder), options, cuda=False)["items"]["KV cache"]
    rows, prompt, new = 8, options["max_prompt_length"], options["max_completion_length"]
    cache = sampling.KVCache(torch.float32)
    ids = torch.randint(0, 300, (rows, prompt))
    sampling.sample_tokens(model, ids, torch.ones_like(ids), new, 1.0, 1.0, 0, [], 0, cache)
    measured = tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
    assert measured == pytest.approx(planned, rel=0.03)  # the last token is never fed back


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_saved_for_backward_are_the_plans(plan_model, checkpointing):
    model, folder = plan_model
    model = copy.deepcopy(model).train()
    if checkpointing:
        loading.enable_checkpointing(model)
    options = plan_options(gradient_checkpointing=checkpointing)
    cfg = cwgrpo.parse_config(["--max-prompt-length", "24", "--max-completion-length", "40"])
    planned = memory_plan.plan(str(folder), options, cuda=False)["items"]
    rows, prompt, new = 4, options["max_prompt_length"], options["max_completion_length"]
    rollout = cwgrpo.Rollout(
        torch.randint(0, 300, (rows, prompt)),
        torch.ones(rows, prompt).long(),
        torch.randint(0, 300, (rows, new)),
        torch.ones(rows, new),
        torch.zeros(rows, dtype=torch.bool),
        [""] * rows,
        torch.zeros(rows, new),
        [""] * rows,
    )
    storages, parameters = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(tensor):
        if tensor.numel():
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda tensor: tensor):
        cwgrpo.completion_logprobs(model, rollout, cfg)
    measured = sum(size for pointer, size in storages.items() if pointer not in parameters)
    assert measured == pytest.approx(planned["activations saved for backward"], rel=0.03)
    if checkpointing:  # the layer recomputed in backward holds what one layer saves without it
        per_layer = memory_plan.layer_activation_bytes(
            memory_plan.Architecture.from_config(PLAN_SHAPE), cuda=False
        )
        assert planned["one layer recomputed in backward"] == rows * (prompt + new) * per_layer


def test_a_checkpoint_on_disk_is_the_plans_and_only_the_newest_keeps_the_optimizer(
    tiny_args, tmp_path
):
    out = tmp_path / "run"
    cwgrpo.main(
        [
            *tiny_args,
            "--steps",
            "4",
            "--save-every",
            "1",
            "--save-total-limit",
            "2",
            "--output-dir",
            str(out),
        ]
    )
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert not (out / "checkpoint-3" / "optimizer.pt").exists()
    newest = out / "checkpoint-4"
    files = newest / "model.safetensors", newest / "optimizer.pt"
    plan = memory_plan.plan(
        str(newest),
        plan_options_of(tiny_args, steps=4, save_every=1, save_total_limit=2),
        cuda=False,
    )
    assert sum(f.stat().st_size for f in files) == pytest.approx(
        plan["disk"]["checkpoint"], rel=0.02
    )
    assert runtime.latest_checkpoint(out) == newest  # and a resume from it works:
    cwgrpo.main(
        [
            *tiny_args,
            "--steps",
            "5",
            "--save-every",
            "1",
            "--save-total-limit",
            "2",
            "--output-dir",
            str(out),
            "--resume",
        ]
    )
    assert len(read_metrics(out / "metrics.jsonl")) == 5


def plan_options_of(argv, **overrides):
    return dataclasses.asdict(cwgrpo.parse_config(argv)) | overrides


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["paper-1.5b", "paper-7b", "qwen0.5b-24gb", "tiny"])
def test_plan_prints_every_presets_numbers_offline(preset, tmp_path):
    done = subprocess.run(
        [sys.executable, str(HERE / "cwgrpo.py"), "--preset", preset, "--plan"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.strip().splitlines() if not line.startswith("building")]
    count = {
        "paper-1.5b": "1,777,088,000",
        "paper-7b": "7,615,616,512",
        "qwen0.5b-24gb": "494,032,768",
    }.get(preset, "115,456")
    assert f"{count} parameters" in lines[0]
    assert (
        lines[-1]
        == {
            "paper-1.5b": "fits: 80, 141 GB; does not fit: 24, 40, 48 GB",
            "paper-7b": "fits: none of them; does not fit: 24, 40, 48, 80, 141 GB",
            "qwen0.5b-24gb": "fits: 24, 40, 48, 80, 141 GB; does not fit: none of them",
            "tiny": "fits: 24, 40, 48, 80, 141 GB; does not fit: none of them",
        }[preset]
    )
    assert any(line.startswith("disk: ") for line in lines)


def test_paper_presets_plan_with_margin():
    def peak(preset):
        cfg = cwgrpo.parse_config(["--preset", preset])
        return memory_plan.plan(cfg.model, dataclasses.asdict(cfg))["peak"]

    assert peak("paper-1.5b") < 0.75 * 80e9
    assert peak("qwen0.5b-24gb") < 0.85 * 24e9


def test_a_run_that_cannot_fit_stops_in_one_line_naming_the_largest_items():
    cfg = cwgrpo.parse_config(["--preset", "paper-1.5b"])
    with pytest.raises(SystemExit) as error:
        memory_plan.check_fit(cfg.model, dataclasses.asdict(cfg), 40 * 10**9, 40 * 10**9)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("error: this run needs about 58.1 GB and the GPU has 40.0 GB free ")
    assert "(largest: KV cache 16.9 GB, AdamW moments (fp32) 14.2 GB, activations" in message
    memory_plan.check_fit(cfg.model, dataclasses.asdict(cfg), 80 * 10**9, 80 * 10**9)  # silent


@pytest.mark.slow
def test_a_chunked_rollout_equals_the_unchunked_one_greedy(tiny_base):
    model, tokenizer = (
        loading.load_model(str(tiny_base / "model"), torch.float32, "cpu"),
        loading.load_tokenizer(str(tiny_base / "model")),
    )
    prompts = [
        loading.chat_prompt_ids(tokenizer, q, "") for q in ["1+2", "3+3", "0+1", "12+3", "2"]
    ]
    torch.manual_seed(0)
    whole = sampling.generate_completions(model, tokenizer, prompts, 2, 1.0, 1.0, 1, 12, None)
    chunked = sampling.generate_completions(model, tokenizer, prompts, 2, 1.0, 1.0, 1, 12, None, 2)
    for a, b in zip(whole[:5], chunked[:5]):
        assert torch.equal(a, b)
    assert whole[5] == chunked[5]


def test_the_kv_cache_holds_bf16_keys_under_autocast_where_the_plain_one_holds_fp32():
    model = Qwen2ForCausalLM(Qwen2Config(**PLAN_SHAPE))
    assert sampling.cache_dtype(model) == torch.float32  # no CUDA autocast: the model's own
    ids = torch.randint(0, 300, (2, 5))
    dtypes = {}
    caches = {"plain": transformers.DynamicCache(), "ours": sampling.KVCache(torch.bfloat16)}
    for name, cache in caches.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as CUDA's bf16 autocast does it
            sampling.sample_tokens(model, ids, torch.ones_like(ids), 3, 1.0, 1.0, 0, [], 0, cache)
        dtypes[name] = {(layer.keys.dtype, layer.values.dtype) for layer in cache.layers}
    assert {keys for keys, _ in dtypes["plain"]} == {torch.float32}  # the rotary's fp32 cos, sin
    assert dtypes["ours"] == {(torch.bfloat16, torch.bfloat16)}


def test_no_query_row_is_fully_masked_and_real_rows_are_unchanged():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**PLAN_SHAPE)).eval()
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    ids = torch.randint(0, 300, mask.shape)
    full = sampling.attention_mask(model, mask)
    assert full.shape == (3, 1, 5, 5) and bool(full.any(-1).all())  # every query sees something
    plain = torch.ones(5, 5, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    real = mask.bool()
    assert torch.equal(
        full[real[:, None, :, None].expand_as(full)], plain[real[:, None, :, None].expand_as(plain)]
    )
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=full, position_ids=positions).logits
        theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)
    # no left padding: no mask at all, and the same log-probs as with the padding mask
    assert sampling.attention_mask(model, torch.tensor([[1, 1, 0], [1, 1, 1]])) is None


def test_log_probs_without_a_mask_equal_those_with_one_where_no_row_is_left_padded(plan_model):
    model, _ = plan_model
    cfg = cwgrpo.parse_config([])
    rollout = cwgrpo.Rollout(
        torch.randint(0, 300, (3, 6)),
        torch.ones(3, 6).long(),
        torch.randint(0, 300, (3, 7)),
        torch.tensor([[1.0] * 7, [1.0] * 4 + [0.0] * 3, [1.0] * 2 + [0.0] * 5]),
        torch.zeros(3, dtype=torch.bool),
        [""] * 3,
        torch.zeros(3, 7),
        [""] * 3,
    )
    with torch.no_grad():
        logp, entropy, _ = cwgrpo.completion_logprobs(model.eval(), rollout, cfg)
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 5:-1] / cfg.temperature
    reference = logits.log_softmax(-1).gather(-1, rollout.completion_ids[..., None])[..., 0]
    valid = rollout.completion_mask.bool()
    torch.testing.assert_close(logp[valid], reference[valid], rtol=1e-5, atol=1e-5)


def test_rng_states_hold_only_the_runs_own_gpu(monkeypatch):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: restored.append(state))
    states = runtime.rng_states()
    assert torch.equal(states["cuda"], torch.tensor([7]))
    runtime.set_rng_states(states)
    runtime.set_rng_states(states | {"cuda": [torch.tensor([5]), torch.tensor([6])]})  # older
    assert [int(s) for s in restored] == [7, 5]


@pytest.mark.slow
def test_gpu_check_runs_at_tiny_shapes():
    done = subprocess.run(
        [sys.executable, str(HERE / "benchmarks" / "gpu_check.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("device: cpu; 137,280 parameters; 12 prompts x G = 12")
    assert lines[1].startswith("step 1: decode ") and lines[2].startswith("step 2: decode ")
    assert "KV cache dtype: torch.float32" in lines
    assert (
        "every logit finite after a left-padded prefill: cwgrpo's mask True, plain mask True"
        in lines
    )


def test_a_cuda_run_that_cannot_fit_stops_before_loading(monkeypatch, tmp_path):
    """The wiring of the fit check into a run: CUDA's API answers as a 40 GB card would; the plan,
    the check and the run are the real ones, and nothing is loaded (the model is a hub id)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (40 * 10**9, 48 * 10**9))
    monkeypatch.setattr(loading, "load_dataset", lambda *_: pytest.fail("loaded before the check"))
    with pytest.raises(SystemExit) as error:
        cwgrpo.main(["--preset", "paper-1.5b", "--output-dir", str(tmp_path / "run")])
    assert str(error.value).startswith("error: this run needs about 58.1 GB and the GPU has 40.0")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ the sampler-trainer mismatch
def correction_cfg(mode, cap=3.0, low=0.0):
    return method_cfg(
        "--sampler-correction", mode, "--sampler-correction-cap", str(cap),
        "--sampler-correction-min", str(low),
    )  # fmt: skip


# l - s per token on two rows; the second row's last token is padding (its difference ignored)
L_MINUS_S = torch.tensor([[math.log(4.0), math.log(0.5), 0.0], [math.log(2.0), 0.0, 9.0]])
CORRECTION_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("none", 1.0),
        ("token_truncate", [[3.0, 0.5, 1.0], [2.0, 1.0, 1.0]]),  # min(rho, 3); padding: exp(0)
        ("token_mask", [[0.0, 0.5, 1.0], [2.0, 1.0, 1.0]]),  # rho, 0 above 3
        ("sequence_truncate", [[2.0], [2.0]]),  # rho of a row: 4 x 0.5 x 1 = 2 and 2 x 1 = 2
        ("sequence_mask", [[2.0], [2.0]]),
    ],
)
def test_sampler_correction_hand_computed(mode, expected):
    old, sampler = L_MINUS_S - 1.0, torch.full_like(L_MINUS_S, -1.0)
    rho = cwgrpo.sampler_correction(old, sampler, CORRECTION_MASK, correction_cfg(mode))
    if mode == "none":
        assert rho == 1.0
    else:
        torch.testing.assert_close(rho, torch.tensor(expected))


def test_sequence_correction_masks_in_log_space_and_token_mask_has_a_floor():
    """A 4,096-token completion whose per-token difference is 0.05 has a sequence ratio of
    exp(204.8): inf in fp32, and inf x 0 is NaN. The mask modes must give 0, not NaN."""
    old, sampler = torch.full((2, 4096), -1.0), torch.full((2, 4096), -1.05)
    mask = torch.ones(2, 4096)
    for mode in ("sequence_mask", "sequence_truncate"):
        rho = cwgrpo.sampler_correction(old, sampler, mask, correction_cfg(mode))
        assert torch.isfinite(rho).all()
        assert (rho == (0.0 if mode == "sequence_mask" else 3.0)).all()
    floor = cwgrpo.sampler_correction(
        L_MINUS_S - 1, torch.full_like(L_MINUS_S, -1.0), CORRECTION_MASK,
        correction_cfg("token_mask", low=0.75),
    )  # fmt: skip
    torch.testing.assert_close(floor, torch.tensor([[0.0, 0.0, 1.0], [2.0, 1.0, 1.0]]))


def test_the_correction_weights_only_the_policy_gradient_term():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, ref, adv = logp.detach(), logp.detach() - 0.5, torch.tensor([1.0])
    terms = cwgrpo.TokenTerms(torch.ones(1, 2))
    cfg = method_cfg("--beta", "0.1")
    rho = torch.tensor([[0.5, 2.0]])
    plain = cwgrpo.token_loss(logp, old, ref, adv, terms, cfg)
    weighted = cwgrpo.token_loss(logp, old, ref, adv, terms, cfg, rho)
    kl = 0.1 * cwgrpo.k3(logp, ref)
    torch.testing.assert_close(weighted - kl, (plain - kl) * rho)  # pg = -1 x adv x ratio 1


@pytest.mark.slow
def test_the_logged_mismatch_is_the_sampler_against_the_trainer(tiny_base):
    """The logged figures are the valid tokens' |l - s| and exp(l - s), l the trainer's log-prob
    in the update and s the sampler's: with the sampler's shifted by 0.1 on every token, exactly
    0.1 and exp(0.1); with the real sampler (sampling.py, fp32 on the CPU), below 1e-5."""
    cfg = cwgrpo.parse_config(["--preset", "tiny", "--prompts-per-step", "2", "--beta", "0"])
    model = loading.load_model(str(tiny_base / "model"), torch.float32, "cpu")
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    prompts = loading.PromptStream(tiny.arithmetic_dataset(0), tokenizer, cfg)
    torch.manual_seed(0)
    rollout = cwgrpo.sample(model, tokenizer, prompts.next_batch(2), cfg)
    grades = [cwgrpo.Grade(float(i % 2), True, False) for i in range(len(rollout.texts))]
    cwgrpo.rollout_rewards(rollout, grades, cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    autocast = runtime.bf16_autocast(torch.device("cpu"))
    real = cwgrpo.update(model, optimizer, scheduler, rollout, cfg, autocast)
    assert real["sampler_logp_diff_max"] < 1e-5 and real["sampler_logp_diff_mean"] < 1e-6
    assert abs(real["sampler_ratio_min"] - 1) < 1e-5 and abs(real["sampler_ratio_max"] - 1) < 1e-5
    rollout.sampler_logp = (rollout.sampler_logp - 0.1) * rollout.completion_mask
    shifted = cwgrpo.update(model, optimizer, scheduler, rollout, cfg, autocast)
    assert shifted["sampler_logp_diff_mean"] == pytest.approx(0.1, abs=1e-5)
    assert shifted["sampler_logp_diff_max"] == pytest.approx(0.1, abs=1e-5)
    for stat in ("min", "mean", "max"):
        assert shifted[f"sampler_ratio_{stat}"] == pytest.approx(math.exp(0.1), abs=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_rollout_vllm_without_vllm_stops_at_parse_time_in_one_line(tmp_path):
    started = time.time()
    out = run_cli("--preset", "tiny", "--rollout", "vllm", "--output-dir", str(tmp_path / "r"))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert (
        out.stderr.strip()
        == f"error: --rollout vllm needs vLLM, which is not installed: {vllm_engine.INSTALL}"
    )
    assert time.time() - started < 30 and not (tmp_path / "r").exists()
    with pytest.raises(SystemExit, match="--engine vllm needs vLLM"):
        evaluate.main(["--model", str(tmp_path), "--engine", "vllm"])


def test_the_plan_with_vllm_counts_the_engine_share_per_card():
    cfg = cwgrpo.parse_config(["--preset", "paper-1.5b", "--rollout", "vllm", "--plan"])
    p = memory_plan.plan(cfg.model, dataclasses.asdict(cfg))
    hf = memory_plan.plan(cfg.model, dataclasses.asdict(cwgrpo.parse_config([])))
    assert p["items"]["KV cache"] == 0 and hf["items"]["KV cache"] > 0  # the engine's own
    items = p["items"]
    resident = items["weights (fp32)"] + items["AdamW moments (fp32)"] + items["reference"]
    assert p["phases"]["rollout"] == resident  # no HF forward while the engine samples
    assert p["phases"]["update"] == hf["phases"]["update"]  # the engine sleeps, holding nothing
    assert memory_plan.fits(p) == ([80, 141], [24, 40, 48])
    assert memory_plan.holds(p, 80e9)
    assert not memory_plan.holds({**p, "engine_share": 0.01}, 80e9)  # 0.8 GB: not its weights
    assert not memory_plan.holds({**p, "engine_share": 0.9}, 80e9)  # 72 GB beside the trainer's
    report = memory_plan.report(cfg.model, dataclasses.asdict(cfg))
    assert "vLLM engine while sampling: 30% of the card, its bf16 weights 3.55 GB" in report
