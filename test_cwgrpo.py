"""Focused tests of cwgrpo.py: the math by hand, each method, the reward, the sampling
distribution, the loss, and one short end-to-end run of the tiny preset.

Run: python -m pytest -q test_cwgrpo.py   (CPU, no network; the whole-run and system tests are
in tests/, which CI runs too)
"""

import dataclasses
import doctest
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

import cwgrpo
from cwgrpo import TIMED_OUT, cw_weights, format_reward, grade_accuracy, group_advantages
from cwgrpo_utils.fast.lm_head import chunked_logprobs
from cwgrpo_utils.machine.grading_pool import Grader, LogCounter
from cwgrpo_utils.machine.precision import Precision, SkippedSteps
from cwgrpo_utils.models import loading, tiny
from cwgrpo_utils.models.prompts import PromptStream, chat_prompt_ids
from cwgrpo_utils.options import presets
from cwgrpo_utils.options.config import Method
from cwgrpo_utils.run import checkpoints
from cwgrpo_utils.run.metrics import token_values, update_metrics
from tests.support import ROOT, SMALL_SHAPE
from tools.diagnose import step_gradient

CPU = torch.device("cpu")
FP32 = Precision.choose("auto", CPU)  # what a run on the CPU computes in
# One thread: the tests' tensors are small, and beside another busy process a second thread
# makes them several times slower (docs/performance.md, "Threads on a shared CPU")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """The tiny preset's model and data, warm-started once for every test that samples."""
    return tiny.build(str(tmp_path_factory.mktemp("tiny-base")), warmstart_steps=150)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_base) -> Path:
    """Four steps of the tiny preset with cw, a checkpoint every two."""
    out = tmp_path_factory.mktemp("run") / "cw"
    data = ["--model", str(tiny_base / "model"), "--dataset", str(tiny_base / "arithmetic.jsonl")]
    steps = ["--steps", "4", "--save-every", "2", "--output-dir", str(out)]
    cwgrpo.main(*cwgrpo.parse_config(["--preset", "tiny", *data, *steps]))
    return out


def read_metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl records, their timings left out."""
    timings = ("rollout_s", "update_s", "tokens_per_s", "time")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in record.items() if k not in timings} for record in records]


def tiny_model_and_tokenizer(tiny_base: Path):
    model = loading.load_model(str(tiny_base / "model"), torch.float32, torch.device("cpu"))
    return model.eval(), loading.load_tokenizer(str(tiny_base / "model"))


# ---
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


def test_the_worked_example_in_cw_weights_docstring_is_what_it_computes():
    runner = doctest.DocTestRunner()
    for example in doctest.DocTestFinder().find(cw_weights, globs=vars(cwgrpo).copy()):
        runner.run(example)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted == 6 and failed == 0


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


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    bessel_std = math.sqrt(4 * 0.25 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / torch.tensor(
        [bessel_std + 1e-4] * 4 + [1e-4] * 4
    )
    torch.testing.assert_close(group_advantages(rewards, 4), expected)


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
    grader = Grader(grade_accuracy, TIMED_OUT, timeout_s=10)
    grade = grader.grade("\\boxed{5}", "no mathematics here")
    assert grade.accuracy == 0.0 and grade.gold_parsed is False


def test_hanging_input_returns_zero_within_limit():
    grader = Grader(grade_accuracy, TIMED_OUT, timeout_s=1.0)
    grade = grader.grade("\\boxed{9^{9^{9^{9}}}}", "5")  # sympy evaluates the tower for minutes
    assert grade.accuracy == 0.0 and grade.timed_out  # cut off: the worker was killed
    assert grader.grade("\\boxed{5}", "5").accuracy == 1.0  # a fresh worker took over


def test_format_reward():
    assert format_reward("<think>\nwork\n</think>\n\\boxed{1}") == 1.0
    assert format_reward("no tags \\boxed{1}") == 0.0
    assert format_reward("a\n</think>\nb\n</think>\n") == 0.0


class FixedSamples:
    """A sampler that 'draws' the (N, T) tokens it is given, log-prob -1 each: what
    generate_completions makes of a sampler's rows, whichever sampler it was."""

    def __init__(self, ids: torch.Tensor, eos: list[int]):
        self.ids, self.generation_config = ids, transformers.GenerationConfig(eos_token_id=eos)

    def generate(self, model, prompts, how, limits, eos, pad):
        return self.ids, -torch.ones(self.ids.shape)


def test_completion_mask_ends_at_the_first_eos_within_each_rows_limit():
    tokenizer, eos, pad = tiny.byte_level_qwen2_tokenizer(), 9, 0
    ids = torch.tensor([[5, 6, eos, pad, pad], [eos, eos, pad, pad, pad], [1, 2, 3, 4, 5]])
    how = cwgrpo.Sampling(1, 1.0, 1.0, 0, max_new_tokens=5)
    fixed = FixedSamples(ids, [eos, 8])
    out = cwgrpo.generate_completions(None, tokenizer, [[7]] * 3, how, engine=fixed)
    assert out.completion_mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out.truncated.tolist() == [False, False, True]
    assert out.sampler_logp.tolist() == (-out.completion_mask).tolist()  # 0 after a row's end
    assert out.texts == tokenizer.batch_decode([[5, 6, eos], [eos], [1, 2, 3, 4, 5]])  # to the EOS
    # each row's own limit (prompt + completion capped at 8): an EOS beyond it does not count
    prompts = [[7] * 6, [7] * 3, [7] * 5]  # room for 2, 5 and 3 new tokens
    how = cwgrpo.Sampling(1, 1.0, 1.0, 0, max_new_tokens=5, max_total=8)
    out = cwgrpo.generate_completions(None, tokenizer, prompts, how, engine=FixedSamples(ids, [9]))
    assert out.completion_mask.tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert out.truncated.tolist() == [True, False, True]
    assert out.prompt_mask.tolist() == [[1] * 6, [0] * 3 + [1] * 3, [0] + [1] * 5]  # left-padded


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_logprobs_equal_direct(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 8, generator=g, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (11,), generator=g)
    logp, entropy = chunked_logprobs(
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


def test_byte_level_tokenizer_round_trips_and_reloads(tiny_model, tmp_path):
    _, tokenizer = tiny_model
    text = "Héllo 12+3=\\boxed{15}\n</think>\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    tokenizer.save_pretrained(tmp_path)
    reloaded = loading.load_tokenizer(str(tmp_path))
    assert type(reloaded).__name__ == "Qwen2Tokenizer"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


@pytest.mark.parametrize("path", ["plain", "fast"])
def test_rollout_logprobs_match_unpadded_forward(tiny_model, path):
    """Section 3's plain log-probs, and the run's default fast drop-in (each group's prompt once,
    the LM head in chunks), each equal to a forward over each row alone, without padding."""
    model, tokenizer = tiny_model
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "tiny", "--max-completion-length", "12"])
    batch = [(chat_prompt_ids(tokenizer, q, ""), "\\boxed{1}") for q in ["1+2", "12+30"]]
    torch.manual_seed(0)
    prompts = [ids for ids, _ in batch]
    rollout = cwgrpo.sample(model, tokenizer, prompts, cfg, cwgrpo.Passes.of(cfg, run_cfg))
    assert rollout.prompt_ids.shape[0] == 2 * cfg.group_size
    passes = cwgrpo.Passes.of(cfg, run_cfg)  # the default: shared prompts, a chunked LM head
    if path == "plain":
        passes = passes._replace(share_prompts=False, logit_chunk_elements=0)
    logp, entropy, _ = cwgrpo.completion_logprobs(model, rollout, cfg, passes)
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


@pytest.mark.parametrize("method", ["cw", "grpo"])
def test_gradient_does_not_depend_on_micro_batching(tiny_model, method):
    """Per-group statistics and step-wide normalisers: a micro-batch of 2 groups == 2 of 1 group."""
    model, tokenizer = tiny_model
    batch = [(chat_prompt_ids(tokenizer, q, ""), "\\boxed{3}") for q in ["1+2", "2+1"]]
    grads = []
    for groups_per_micro_batch in (2, 1):
        cfg, run_cfg = cwgrpo.parse_config(
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
                "--beta",
                "0",  # no reference: the policy's own terms
            ]
        )
        torch.manual_seed(0)
        prompts = [ids for ids, _ in batch]
        samples = cwgrpo.sample(model, tokenizer, prompts, cfg, cwgrpo.Passes.of(cfg, run_cfg))
        advantages = torch.randn(len(samples.texts), generator=torch.Generator().manual_seed(1))
        model.zero_grad()  # the step's gradient, micro-batch by micro-batch as the run takes it
        passes = cwgrpo.Passes.of(cfg, run_cfg)
        step_gradient(model, batch_of(samples, advantages), cfg, passes, autocast=FP32.autocast)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_presets_and_overrides():
    cfg, _ = cwgrpo.parse_config([])
    assert (cfg.preset, cfg.method, cfg.group_size, cfg.learning_rate, cfg.beta) == (
        "paper-1.5b",
        "cw",
        12,
        1e-6,
        0.04,
    )
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "tiny", "--group-size", "4", "--cw-detach"])
    assert cfg.model == str(Path(cwgrpo.__file__).parent / "runs/tiny-base/model")  # the clone's
    assert cfg.group_size == 4 and cfg.cw_detach
    assert run_cfg.output_dir == "runs/cw-tiny-seed0"


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


def test_the_warm_start_imitates_every_chain_of_right_and_near_miss_steps():
    # one step (the tiny preset): the right sum, then one above and one below
    assert tiny.warmstart_targets("2+3") == [
        f"2+3={s}\n</think>\n\\boxed{{{s}}}" for s in (5, 6, 4)
    ]
    assert [t.split("=")[1][0] for t in tiny.warmstart_targets("0+0")] == ["0", "1", "2"]
    # three steps (tiny-chain): each step adds the next digit to the value written before it,
    # right 4 times in 6, else 1 or 2 above
    chains = tiny.warmstart_targets("2+3+1+0")
    assert len(chains) == 6**3
    right = "2+3=5\n5+1=6\n6+0=6\n</think>\n\\boxed{6}"
    assert chains[0] == right and chains.count(right) == 4**3
    assert chains.count("2+3=6\n6+1=7\n7+0=7\n</think>\n\\boxed{7}") == 4**2  # an error carried
    # a wrong step is never undone: the right answer comes only with every step right
    assert [c for c in chains if c.endswith("\\boxed{6}")] == [right] * 4**3
    assert not [c for c in chains if "=4\n" in c]  # no result below the right one


def test_the_chain_preset_builds_its_own_task_and_evaluates_on_every_problem(tmp_path):
    out = tiny.build(str(tmp_path / "chain"), "tiny-chain", warmstart_steps=1, examples=30)
    rows = [json.loads(line) for line in (out / "arithmetic.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    for row in rows:
        digits = [int(d) for d in row["problem"].split("+")]
        assert len(digits) == 4 and all(0 <= d <= 3 for d in digits)
        assert row["solution"] == f"\\boxed{{{sum(digits)}}}"
    made = (out / "model" / "model.safetensors").stat().st_mtime_ns
    tiny.build(str(tmp_path / "chain"), "tiny-chain", warmstart_steps=1, examples=30)
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == made  # built once
    options = presets.evaluate_options("tiny-chain")
    bench = Path(options[options.index("--benchmarks") + 1])
    problems = [json.loads(line) for line in (ROOT / bench).read_text().splitlines()]
    assert len({p["problem"] for p in problems}) == 4**4
    assert all(sum(map(int, p["problem"].split("+"))) == int(p["answer"]) for p in problems)
    assert options[options.index("--max-new-tokens") + 1] == "64"
    assert presets.evaluate_options("paper-1.5b") == ()
    data = ["--model", str(out / "model"), "--dataset", str(out / "arithmetic.jsonl")]
    run = ["--steps", "2", "--output-dir", str(tmp_path / "r")]
    cwgrpo.main(*cwgrpo.parse_config(["--preset", "tiny-chain", *data, *run]))
    records = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert cwgrpo.parse_config(["--preset", "tiny-chain"])[0].model == str(
        ROOT / "runs/tiny-chain-base/model"
    )


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
    return cwgrpo.parse_config(["--preset", "tiny", *args])[0]


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
    assert terms.pg_weight.tolist() == [[0, 1, 0], [1, 1, 1]] and terms.extra is None
    assert cwgrpo.METHODS["clip_cov"].clip
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
    assert not cwgrpo.METHODS["kl_cov"].clip and torch.equal(terms.pg_weight, COV_MASK)
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


@pytest.fixture
def given_weights(monkeypatch):
    """A method for the test only, "given", whose token weights are the ones the test gives: the
    loss is under test, not a method."""

    def method(weight, clip=True) -> str:
        given = Method(lambda group, cfg: cwgrpo.TokenTerms(weight), "given", clip=clip)
        monkeypatch.setitem(cwgrpo.METHODS, "given", given)
        return "given"

    return method


def loss_of(logp, old, ref, adv, weight, method, cfg_args=(), clip=True, mask=None, totals=(1, 1)):
    """policy_loss with the token weights `weight` (given_weights): its per-token loss and the
    loss, over n_responses and n_tokens of `totals`."""
    cfg = dataclasses.replace(method_cfg(*cfg_args), method=method(weight, clip))
    cfg = cfg if ref is not None else dataclasses.replace(cfg, beta=0.0)  # no reference, no KL
    mask = torch.ones_like(logp) if mask is None else mask
    tokens = group_of(logp, old, adv, mask)
    loss, parts = cwgrpo.policy_loss(
        tokens,
        cwgrpo.method_terms(tokens, cfg),
        cfg,
        sampler_logp=old * mask,
        ref_logp=ref,
        n_responses=totals[0],
        n_tokens=totals[1],
    )
    return parts.per_token, loss


def group_of(logp, old, adv, mask, **more) -> cwgrpo.Group:
    """Scored tokens as the methods and the loss read them, with no entropies or divergence
    unless `more` gives them."""
    fields = dict(entropy=torch.zeros_like(logp), batch_entropy=None, divergence=None)
    return cwgrpo.Group(
        logp, old_logp=old, advantages=adv, mask=mask, update_pass=0, **fields | more
    )


def batch_of(samples: cwgrpo.Samples, advantages, ref_logp=None) -> cwgrpo.Batch:
    """Samples scored with these advantages (rewards 0), as the update reads them; none of the
    rollout policy's own log-probs (one update a batch)."""
    zeros = torch.zeros(len(samples.texts))
    rewards = cwgrpo.Rewards(zeros, accuracy=zeros, format=zeros)
    return cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=ref_logp)


def test_pg_term_without_clipping_is_minus_ratio_times_advantage(given_weights):
    logp, old = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.4)]])  # ratio 1.25
    for adv, expected in ((2.0, -2.5), (-2.0, 2.5)):
        loss, _ = loss_of(
            logp, old, None, torch.tensor([adv]), torch.ones(1, 1), given_weights, clip=False
        )
        assert loss.item() == pytest.approx(expected)


def test_ppo_clipping_holds_the_ratio_within_the_range_on_the_side_of_the_advantage(
    given_weights,
):
    logp, old = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.4)]])  # ratio 1.25
    # A > 0: min(1.25 A, 1.2 A) = 1.2 A, and no gradient flows through the clipped ratio
    logp_grad = logp.clone().requires_grad_(True)
    loss, _ = loss_of(logp_grad, old, None, torch.tensor([2.0]), torch.ones(1, 1), given_weights)
    assert loss.item() == pytest.approx(-2.4)
    loss.sum().backward()
    assert logp_grad.grad.item() == 0
    # A < 0: min(-1.25 |A|, -1.2 |A|) = -1.25 |A|, unclipped
    loss, _ = loss_of(logp, old, None, torch.tensor([-2.0]), torch.ones(1, 1), given_weights)
    assert loss.item() == pytest.approx(2.5)


def test_k3_kl_and_weights_on_the_pg_term_only(given_weights):
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # exp(r - l) - (r - l) - 1
    # on-policy: ratio 1, pg = -A; w = (3, 0) scales pg only, beta 0.04 scales the KL
    weight = torch.tensor([[3.0, 0.0]])
    loss, _ = loss_of(logp, logp.clone(), ref, torch.tensor([1.5]), weight, given_weights)
    expected = [3 * -1.5 + 0.04 * k3[0], 0 * -1.5 + 0.04 * k3[1]]
    torch.testing.assert_close(loss, torch.tensor([expected]))


def test_both_aggregations_by_hand(given_weights):
    # on-policy with A = -1 and no KL: each token's loss is its weight
    per_token = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    logp, adv = torch.full((2, 3), -1.0), torch.tensor([-1.0, -1.0])

    def aggregate(mode, n_responses, n_tokens):
        args = ("--beta", "0", "--loss-aggregation", mode)
        loss_args = dict(cfg_args=args, mask=mask, totals=(n_responses, n_tokens))
        per_token_loss, loss = loss_of(logp, logp, None, adv, per_token, given_weights, **loss_args)
        assert torch.equal(per_token_loss, per_token)
        return loss

    # seq-mean-token-mean: mean of (1 + 3) / 2 and 2 / 1 = 2; token-mean: (1 + 3 + 2) / 3 = 2
    # with the step's totals larger than the micro-batch's: 4 responses, 6 tokens
    assert aggregate("seq-mean-token-mean", 4, 6).item() == 1.0
    assert aggregate("token-mean", 4, 6).item() == 1.0
    assert aggregate("token-mean", 2, 3).item() == 2.0


@pytest.mark.parametrize("method", sorted(cwgrpo.METHODS))
def test_every_method_gives_a_finite_loss_and_gradient_with_a_group_of_no_valid_tokens(method):
    """--mask-truncated-completions can leave a whole group without a token."""
    G, T = 4, 6
    logp = (-torch.rand(2 * G, T, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
    mask = torch.ones(2 * G, T)
    mask[G:] = 0  # the second group has no valid token
    cfg = method_cfg("--method", method, "--group-size", str(G))
    tokens = group_of(
        logp,
        logp.detach() * mask,
        torch.tensor([1.0, -1.0, 0.5, -0.5] * 2),
        mask,
        entropy=torch.rand(2 * G, T),
        divergence=torch.rand(2 * G, T) * mask,
        batch_entropy=torch.rand(G * T).sort().values,
    )
    loss, parts = cwgrpo.policy_loss(
        tokens,
        cwgrpo.method_terms(tokens, cfg),
        cfg,
        sampler_logp=logp.detach() * mask,
        ref_logp=logp.detach() - 0.1,
        n_responses=2 * G,
        n_tokens=int(mask.sum()),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[G:] == 0).all()  # the empty group contributes nothing
    assert torch.isfinite(parts.terms.pg_weight).all()


def test_sampling_ignores_the_generation_config_the_model_ships(tiny_base):
    """A model's generation_config.json (Qwen2.5 Instruct ships repetition_penalty, top_k, top_p)
    must not change what is sampled: the loss assumes plain temperature sampling."""
    model, tokenizer = tiny_model_and_tokenizer(tiny_base)
    prompts = [chat_prompt_ids(tokenizer, q, "") for q in ("1+2", "7+8")]

    def completions():
        torch.manual_seed(0)
        how = cwgrpo.Sampling(4, 1.0, 1.0, 0, 12)
        return cwgrpo.generate_completions(model, tokenizer, prompts, how).completion_ids

    plain = completions()
    shipped = model.generation_config
    shipped.repetition_penalty, shipped.top_k, shipped.top_p = 5.0, 1, 0.5
    shipped.no_repeat_ngram_size = 1
    shipped.suppress_tokens = list(range(48, 58))  # the digits
    assert torch.equal(completions(), plain)
    assert model.generation_config.suppress_tokens == list(range(48, 58))  # left as shipped


def test_total_length_limit_caps_prompt_plus_completion(tiny_base):
    model, tokenizer = tiny_model_and_tokenizer(tiny_base)
    prompts = [chat_prompt_ids(tokenizer, q, "") for q in ("1+2", "1+2" * 4)]
    torch.manual_seed(0)
    how = cwgrpo.Sampling(3, 1.0, 1.0, 0, 40, max_total=len(prompts[1]) + 6)
    out = cwgrpo.generate_completions(model, tokenizer, prompts, how)
    prompt_mask, mask, truncated = out.prompt_mask, out.completion_mask, out.truncated
    totals = prompt_mask.sum(1) + mask.sum(1)
    assert (totals <= len(prompts[1]) + 6).all()
    assert truncated[3:].all() and (mask[3:].sum(1) == 6).all()  # the long prompt: 6 tokens left
    assert (mask[:3].sum(1) > 6).any()  # the short one had room for more


def test_math_verify_cutoffs_are_counted():
    counter = LogCounter.installed("math_verify", "Timeout during")
    before = counter.count
    logging.getLogger("math_verify.parser").warning("Timeout during parsing: 9^9^9")
    logging.getLogger("math_verify.grader").warning("Timeout during comparison")
    logging.getLogger("math_verify.grader").warning("something else")
    assert counter.count == before + 2


@pytest.mark.parametrize("top_p,top_k", [(1.0, 1), (1e-6, 0)])
def test_sampling_loop_with_a_kv_cache_matches_greedy_generate(tiny_base, top_p, top_k):
    """With the nucleus or the top-k cut to one token, sampling is greedy decoding: the loop must
    then give exactly what transformers' generate gives, left padding included."""
    model, tokenizer = tiny_model_and_tokenizer(tiny_base)
    prompts = [chat_prompt_ids(tokenizer, q, "") for q in ("1+2", "12+30", "5+5")]
    how = cwgrpo.Sampling(2, 0.7, top_p, top_k, 16)
    out = cwgrpo.generate_completions(model, tokenizer, prompts, how)
    prompt_ids, prompt_mask = out.prompt_ids, out.prompt_mask
    ids, mask = out.completion_ids, out.completion_mask
    reference = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=False,
        max_new_tokens=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )[:, prompt_ids.shape[1] :]
    is_eos = reference == tokenizer.eos_token_id
    last = torch.where(is_eos.any(1), is_eos.int().argmax(1), reference.shape[1] - 1)
    reference_mask = (torch.arange(reference.shape[1])[None] <= last[:, None]).float()
    assert torch.equal(mask, reference_mask[:, : mask.shape[1]])
    assert torch.equal(ids * mask.long(), (reference * reference_mask.long())[:, : ids.shape[1]])


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 1.0, 3), (1.3, 0.9, 0)])
def test_sampled_tokens_follow_the_configured_distribution(tiny_base, temperature, top_p, top_k):
    """8,000 draws of one next token against softmax(logits / T), cut to top-k or top-p."""
    model, tokenizer = tiny_model_and_tokenizer(tiny_base)
    prompt = torch.tensor([chat_prompt_ids(tokenizer, "4+", "")])
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
    how, eos = cwgrpo.Sampling(8000, temperature, top_p, top_k, 1), [tokenizer.eos_token_id]
    prompts, mask = prompt.repeat(8000, 1), torch.ones(8000, prompt.shape[1])
    drawn, sampler_logp = cwgrpo.sample_tokens(model, prompts, mask, how, 1, eos, 0)
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
        cfg = method_cfg(*args, "--group-size", "6", "--beta", "0")
        leaf = logp.clone().requires_grad_(True)
        tokens = group_of(leaf, leaf.detach() - 0.1, adv, mask)
        losses[name], _ = cwgrpo.policy_loss(
            tokens,
            cwgrpo.method_terms(tokens, cfg),
            cfg,
            sampler_logp=torch.zeros_like(leaf),
            ref_logp=None,
            n_responses=6,
            n_tokens=int(mask.sum()),
        )
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


def test_gold_is_parsed_with_first_match_as_the_released_reward():
    """The released reward parsed the gold with math-verify's first_match: the gold's first
    (boxed) answer is the gold even when it does not parse to an expression, where any_match
    would fall back to a later one."""
    gold = "$\\boxed{\\frac{1}{}}$ so the answer is $5$"
    assert grade_accuracy("\\boxed{5}", gold).accuracy == 0.0
    assert grade_accuracy("\\boxed{5}", "so the answer is $5$").accuracy == 1.0


def test_kl_cov_on_a_group_with_no_valid_token_penalises_nothing():
    group = make_group(torch.zeros(4, 0), torch.tensor([1.0, -1.0, 0.5, 0.0]), torch.zeros(4, 0))
    terms = cwgrpo.kl_cov(group, method_cfg())
    assert terms.extra.shape == (4, 0)  # topk(1) of nothing raised "selected index k out of range"


def test_a_chunked_rollout_equals_the_unchunked_one_greedy(tiny_base):
    model, tokenizer = tiny_model_and_tokenizer(tiny_base)
    prompts = [chat_prompt_ids(tokenizer, q, "") for q in ["1+2", "3+3", "0+1", "12+3", "2"]]
    torch.manual_seed(0)
    how = cwgrpo.Sampling(2, 1.0, 1.0, 1, 12)
    whole = cwgrpo.generate_completions(model, tokenizer, prompts, how)
    chunked = cwgrpo.generate_completions(model, tokenizer, prompts, how, chunk=2)
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(whole, name), getattr(chunked, name)), name
    assert whole.texts == chunked.texts


def test_the_kv_cache_holds_bf16_keys_under_autocast_where_the_plain_one_holds_fp32():
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_SHAPE))
    assert loading.KVCache.for_model(model).store_dtype == torch.float32  # the model's own
    ids = torch.randint(0, 300, (2, 5))
    dtypes = {}
    caches = {"plain": transformers.DynamicCache(), "ours": loading.KVCache(torch.bfloat16)}
    for name, cache in caches.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as CUDA's bf16 autocast does it
            how = cwgrpo.Sampling(2, 1.0, 1.0, 0, 3)
            cwgrpo.sample_tokens(model, ids, torch.ones_like(ids), how, 3, [], 0, cache)
        dtypes[name] = {(layer.keys.dtype, layer.values.dtype) for layer in cache.layers}
    assert {keys for keys, _ in dtypes["plain"]} == {torch.float32}  # the rotary's fp32 cos, sin
    assert dtypes["ours"] == {(torch.bfloat16, torch.bfloat16)}


def test_no_query_row_is_fully_masked_and_real_rows_are_unchanged():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_SHAPE)).eval()
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    ids = torch.randint(0, 300, mask.shape)
    full = loading.attention_mask(model, mask)
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
    assert loading.attention_mask(model, torch.tensor([[1, 1, 0], [1, 1, 1]])) is None


@pytest.mark.parametrize("share", [False, True])
def test_log_probs_without_a_mask_equal_those_with_one_where_no_row_is_left_padded(share):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_SHAPE))
    cfg, run_cfg = cwgrpo.parse_config(["--group-size", "3", "--share-prompts", str(share)])
    prompts = torch.randint(0, 300, (1 if share else 3, 6))  # shared: a group of 3 rows
    rollout = cwgrpo.Samples(
        prompts.expand(3, 6),
        torch.ones(3, 6).long(),
        torch.randint(0, 300, (3, 7)),
        torch.tensor([[1.0] * 7, [1.0] * 4 + [0.0] * 3, [1.0] * 2 + [0.0] * 5]),
        torch.zeros(3, dtype=torch.bool),
        [""] * 3,
        torch.zeros(3, 7),
    )
    with torch.no_grad():
        passes = cwgrpo.Passes.of(cfg, run_cfg)
        logp, entropy, _ = cwgrpo.completion_logprobs(model.eval(), rollout, cfg, passes)
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 5:-1] / cfg.temperature
    reference = logits.log_softmax(-1).gather(-1, rollout.completion_ids[..., None])[..., 0]
    valid = rollout.completion_mask.bool()
    torch.testing.assert_close(logp[valid], reference[valid], rtol=1e-5, atol=1e-5)


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
        assert rho is None  # the PG term as it is
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
    rho = torch.tensor([[0.5, 2.0]])  # exp(l - s), within the cap of 3
    losses = {}
    for correction in ("none", "token_truncate"):
        cfg = method_cfg("--method", "grpo", "--beta", "0.1", "--sampler-correction", correction)
        tokens = group_of(logp, old, adv, torch.ones(1, 2))
        _, parts = cwgrpo.policy_loss(
            tokens,
            cwgrpo.method_terms(tokens, cfg),
            cfg,
            sampler_logp=old - rho.log(),
            ref_logp=ref,
            n_responses=1,
            n_tokens=2,
        )
        losses[correction] = parts.per_token
    plain, weighted = losses["none"], losses["token_truncate"]
    kl = 0.1 * cwgrpo.k3(logp, ref)
    torch.testing.assert_close(weighted - kl, (plain - kl) * rho)  # pg = -1 x adv x ratio 1


def test_the_logged_mismatch_is_the_sampler_against_the_trainer(tiny_base):
    """The logged figures are the valid tokens' |l - s| and exp(l - s), l the trainer's log-prob
    in the update and s the sampler's: with the sampler's shifted by 0.1 on every token, exactly
    0.1 and exp(0.1); with the real sampler (section 1's loop, fp32 on the CPU), below 1e-5."""
    cfg, run_cfg = cwgrpo.parse_config(
        ["--preset", "tiny", "--prompts-per-step", "2", "--beta", "0"]
    )
    model = loading.load_model(str(tiny_base / "model"), torch.float32, "cpu")
    tokenizer = loading.load_tokenizer(str(tiny_base / "model"))
    prompts = PromptStream(tiny.arithmetic_dataset(0), tokenizer, cfg)
    torch.manual_seed(0)
    questions = [ids for ids, _ in prompts.next_batch(2)]
    samples = cwgrpo.sample(model, tokenizer, questions, cfg, cwgrpo.Passes.of(cfg, run_cfg))
    grades = [cwgrpo.Grade(float(i % 2), True, False) for i in range(len(samples.texts))]
    rewards = cwgrpo.rewards_of(samples.texts, grades, cfg)
    advantages = cwgrpo.group_advantages(rewards.total, cfg.group_size)
    rollout = cwgrpo.Batch.of(samples, rewards, advantages, old=None, ref_logp=None)
    autocast, passes = FP32.autocast, cwgrpo.Passes.of(cfg, run_cfg)

    def update() -> dict:  # the update's metrics, what a step logs
        parts = step_gradient(model, rollout, cfg, passes, autocast=autocast)
        model.zero_grad()
        values = [token_values(loss_parts, rows.sampler_logp) for rows, _, loss_parts in parts]
        return update_metrics(
            values, sum(loss.item() for _, loss, _ in parts), grad_norm=0.0, lr=0.0
        )

    real = update()
    assert real["sampler_logp_diff_max"] < 1e-5 and real["sampler_logp_diff_mean"] < 1e-6
    assert abs(real["sampler_ratio_min"] - 1) < 1e-5 and abs(real["sampler_ratio_max"] - 1) < 1e-5
    rollout.sampler_logp = (rollout.sampler_logp - 0.1) * rollout.completion_mask
    shifted = update()
    assert shifted["sampler_logp_diff_mean"] == pytest.approx(0.1, abs=1e-5)
    assert shifted["sampler_logp_diff_max"] == pytest.approx(0.1, abs=1e-5)
    for stat in ("min", "mean", "max"):
        assert shifted[f"sampler_ratio_{stat}"] == pytest.approx(math.exp(0.1), abs=1e-5)


# ------------------------------------------------------------ precision, and the step's guard
CUDA_13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


@pytest.mark.parametrize(
    "capability,chosen",
    [((7, 5), "fp16"), ((8, 0), "bf16"), ((8, 6), "bf16"), ((9, 0), "bf16")],
)
def test_auto_precision_follows_the_compute_capability_not_is_bf16_supported(capability, chosen):
    cuda = torch.device("cuda")  # no GPU needed: the card's name and capability are given
    card = dict(capability=capability, card="Tesla T4", arch_list=CUDA_13_ARCHS)
    precision = Precision.choose("auto", cuda, **card)
    assert precision.name == chosen
    assert precision.reason == (
        f"{chosen}: Tesla T4 has {'no bf16' if chosen == 'fp16' else 'bf16'} "
        f"(compute capability {capability[0]}.{capability[1]})"
    )
    assert precision.vllm_dtype == {"fp16": "half", "bf16": "bfloat16"}[chosen]
    if capability < (
        8,
        0,
    ):  # no bf16 on the card: asked for, it is one line (tests/test_gpu_path.py)
        with pytest.raises(SystemExit, match="has no bf16; use --precision auto"):
            Precision.choose("bf16", cuda, **card)
    else:
        assert Precision.choose("bf16", cuda, **card).reason == "bf16: as asked"


@pytest.mark.parametrize("card,capability", [("Tesla P100", (6, 0)), ("Tesla V100", (7, 0))])
def test_a_card_the_installed_pytorch_has_no_kernels_for_is_one_line_naming_it(card, capability):
    with pytest.raises(SystemExit) as stop:
        Precision.choose(
            "auto", torch.device("cuda"), capability=capability, card=card, arch_list=CUDA_13_ARCHS
        )
    major, minor = capability
    assert str(stop.value).startswith(
        f"error: {card} (compute capability {major}.{minor}, sm_{major}{minor}) has no kernels "
        "in this PyTorch build"
    )
    assert "\n" not in str(stop.value)


def test_on_the_cpu_auto_is_fp32_and_an_explicit_half_precision_autocasts():
    assert Precision.choose("auto", CPU).name == "fp32" and not FP32.scaler().is_enabled()
    fp16 = Precision.choose("fp16", CPU)
    assert fp16.scaler().is_enabled() and fp16.dtype == torch.float16  # the loss scaler: fp16's
    with fp16.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    with FP32.autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_the_lm_head_stays_finite_in_fp16_at_qwens_vocabulary():
    """fp16 hidden states through a 151,936-token head: the log-softmax and entropy computed in
    fp32 (no sum over the vocabulary in fp16), forward and backward finite and close to fp32's."""
    g = torch.Generator().manual_seed(0)
    hidden = (3 * torch.randn(6, 64, generator=g)).half().requires_grad_(True)
    weight = (0.05 * torch.randn(151_936, 64, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 151_936, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        logp, entropy = chunked_logprobs(hidden, weight, targets, 0.7, 2**20)
    assert logp.dtype == entropy.dtype == torch.float32
    (logp.sum() * 1024).backward()  # a loss scale's worth of gradient
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    direct = (hidden.float() @ weight.detach().T / 0.7).log_softmax(-1)
    expected = direct.gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.detach(), expected.detach(), rtol=0, atol=0.05)


def test_under_fp16_the_log_probs_ratios_k3_and_weights_are_fp32(tiny_model):
    model, tokenizer = tiny_model
    cfg, run_cfg = cwgrpo.parse_config(["--preset", "tiny", "--max-completion-length", "6"])
    batch = [(chat_prompt_ids(tokenizer, "1+2", ""), "\\boxed{3}")]
    with Precision.choose("fp16", CPU).autocast():
        prompts = [ids for ids, _ in batch]
        samples = cwgrpo.sample(model, tokenizer, prompts, cfg, cwgrpo.Passes.of(cfg, run_cfg))
        rollout = batch_of(samples, torch.randn(8), ref_logp=torch.zeros_like(samples.sampler_logp))
        default = cwgrpo.Passes.of(cfg, run_cfg)
        plain = default._replace(share_prompts=False, logit_chunk_elements=0)
        for passes in (default, plain):  # the chunked LM head (default), and the plain one
            logp, entropy, hidden = cwgrpo.completion_logprobs(model, rollout, cfg, passes)
            tokens = cwgrpo.Group.of(rollout, logp, entropy, update_pass=0)
            loss, parts = cwgrpo.policy_loss(
                tokens,
                cwgrpo.method_terms(tokens, cfg),
                cfg,
                sampler_logp=rollout.sampler_logp,
                ref_logp=rollout.ref_logp,
                n_responses=8,
                n_tokens=8,
            )
            weights = parts.terms.pg_weight
            assert {logp.dtype, weights.dtype, loss.dtype, parts.per_token.dtype} == {torch.float32}
            assert torch.isfinite(parts.per_token).all()


def test_skipped_steps_are_counted_in_a_row_and_too_many_stop_the_run(tmp_path):
    skipped = SkippedSteps(limit=2)
    run = type("Run", (), {"path": tmp_path})()
    record = {"step": 7, "loss": math.nan, "grad_norm": math.inf}
    for finite in (False, True, False):
        skipped.count(finite)
        skipped.stop_if_too_many(run, record)  # never two in a row
    assert (skipped.total, skipped.in_a_row) == (2, 1)
    skipped.count(False)
    with pytest.raises(SystemExit) as stop:
        skipped.stop_if_too_many(run, record)
    assert str(stop.value).startswith(
        "error: 2 optimizer steps in a row had a non-finite gradient (the last, step 7: loss nan, "
        "grad norm inf) and changed nothing, so the run stops (--max-skipped-steps 2); no "
        "checkpoint was written yet"
    )
    again = SkippedSteps(limit=2)
    again.load_state_dict(skipped.state_dict())
    assert (again.total, again.in_a_row) == (3, 2)


class Poison:
    """A pickle whose loading runs a command (here: touching a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["trainer_state.pt", "optimizer.pt"])
def test_a_pickled_object_in_a_checkpoint_is_refused_in_one_line_and_never_runs(name, tmp_path):
    checkpoint, marker = tmp_path / "checkpoint-2", tmp_path / "ran"
    checkpoint.mkdir()
    torch.save({"step": 2, "scheduler": {}, "rng": {}}, checkpoint / "trainer_state.pt")
    torch.save({"state": {}, "param_groups": []}, checkpoint / "optimizer.pt")
    torch.save({"step": Poison(marker)}, checkpoint / name)
    with pytest.raises(SystemExit) as refused:
        checkpoints.load_trainer_state(checkpoint)
    assert not marker.exists()  # nothing in the file ran
    message = str(refused.value)
    assert message.startswith(f"error: {checkpoint / name} holds a pickled posix.system")
    assert "\n" not in message
    assert "it was not loaded; resume only from checkpoints you wrote" in message
    torch.load(checkpoint / name, weights_only=False)  # what an unsafe load would have done
    assert marker.exists()
