"""cwgrpo_verl.py against verl: the registry, the same losses as cwgrpo.py, and verl's own clip_cov/kl_cov.

Skipped where verl is not installed; CI runs it in its own venv with verl pinned (see .ci/run).
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
import cwgrpo  # noqa: E402
import cwgrpo_verl  # noqa: E402

HERE = Path(__file__).parent


def verl_config(**policy_loss) -> SimpleNamespace:
    """The attributes of verl's ActorConfig that policy losses read."""
    settings = {"clip_cov_ratio": None, "clip_cov_lb": None, "clip_cov_ub": None, "kl_cov_ratio": None,
                "ppo_kl_coef": None, **policy_loss}
    return SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                           policy_loss=SimpleNamespace(**settings), global_batch_info={})


def tensors(seed: int, rows: int = 6, length: int = 40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    old = -torch.rand(rows, length, generator=g) * 4 * mask
    logp = (old + 0.3 * torch.randn(rows, length, generator=g)) * mask
    advantages = torch.randn(rows, 1, generator=g).expand(rows, length) * mask
    return old, logp, advantages, mask


def loss_and_grad(fn, logp, *args, **kwargs):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = fn(kwargs.pop("old"), logp, *args, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def test_every_name_resolves_through_verls_registry():
    for name in cwgrpo_verl.VERL_METHODS:
        assert callable(core_algos.get_policy_loss_fn(name))


def test_verl_loads_the_module_through_its_external_module_hook():
    code = ("import verl; from verl.trainer.ppo.core_algos import get_policy_loss_fn; "
            "print(get_policy_loss_fn('cw').__name__)")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "cwgrpo_verl",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cwgrpo_cw_policy_loss" in out.stdout


@pytest.mark.parametrize("name", list(cwgrpo_verl.VERL_METHODS))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_registered_loss_equals_cwgrpos_loss_path(name, mode):
    old, logp, advantages, mask = tensors(0)
    method, overrides = cwgrpo_verl.VERL_METHODS[name]
    torch.manual_seed(1)
    verl_loss, verl_grad, metrics = loss_and_grad(core_algos.get_policy_loss_fn(name), logp, advantages, mask, old=old,
                                                  loss_agg_mode=mode, config=verl_config())
    assert "actor/cwgrpo_w_mean" in metrics

    cfg = cwgrpo.dataclasses.replace(cwgrpo.Config(), beta=0.0, loss_aggregation=mode, **overrides)
    ours = logp.clone().requires_grad_(True)
    adv = advantages[:, 0]
    torch.manual_seed(1)
    group = cwgrpo.Group(logp=ours, old_logp=old, advantages=adv, mask=mask,
                         entropy=torch.zeros_like(ours), batch_entropy=None, divergence=None,
                         update_pass=0)
    terms = cwgrpo.METHODS[method].token_terms(group, cfg)
    per_token = cwgrpo.token_loss(ours, old, None, adv, terms, cfg)
    loss = cwgrpo.aggregate(per_token, mask, mode, len(mask), int(mask.sum()))
    loss.backward()
    torch.testing.assert_close(verl_loss, loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(verl_grad, ours.grad, rtol=1e-5, atol=1e-6)


def test_clip_cov_agrees_with_verls_clip_cov():
    old, logp, advantages, mask = tensors(2, rows=8, length=300)
    logp = logp * 3  # wider log-probs: more tokens with 1 < C < 5
    config = verl_config(clip_cov_ratio=0.01)
    results = []
    for name in ("clip_cov", "cwgrpo_clip_cov"):
        torch.manual_seed(3)  # both draw their random choice from torch's global generator
        results.append(loss_and_grad(core_algos.get_policy_loss_fn(name), logp, advantages, mask, old=old,
                                     loss_agg_mode="token-mean", config=config))
    (verl_loss, verl_grad, _), (our_loss, our_grad, metrics) = results
    assert metrics["actor/cwgrpo_touched_frac"] > 0
    torch.testing.assert_close(our_loss, verl_loss)
    torch.testing.assert_close(our_grad, verl_grad)


def test_kl_cov_agrees_with_verls_kl_cov_and_the_default_ratio_differs():
    old, logp, advantages, mask = tensors(4, rows=8, length=300)
    config = verl_config(kl_cov_ratio=0.002)
    (verl_loss, verl_grad, _), (our_loss, our_grad, _) = [
        loss_and_grad(core_algos.get_policy_loss_fn(name), logp, advantages, mask, old=old, loss_agg_mode="token-mean",
                      config=config) for name in ("kl_cov", "cwgrpo_kl_cov")]
    torch.testing.assert_close(our_loss, verl_loss)
    torch.testing.assert_close(our_grad, verl_grad)
    # a deliberate difference: verl's default kl_cov_ratio is 2e-4, Cui et al.'s 2e-3
    n_valid = int(mask.sum())
    _, _, ours = loss_and_grad(core_algos.get_policy_loss_fn("cwgrpo_kl_cov"), logp, advantages, mask, old=old,
                               loss_agg_mode="token-mean", config=verl_config())
    assert ours["actor/cwgrpo_touched_frac"] * n_valid == pytest.approx(max(1, int(2e-3 * n_valid)))
    verl_default = core_algos.get_policy_loss_fn("kl_cov")
    penalised = []
    for ratio in (None, 2e-4):
        loss, _, _ = loss_and_grad(verl_default, logp, advantages, mask, old=old, loss_agg_mode="token-mean",
                                   config=verl_config(kl_cov_ratio=ratio))
        penalised.append(loss)
    assert penalised[0] == penalised[1]  # None means 2e-4 in verl


def test_converter_and_reward_in_verls_formats(tmp_path):
    data = tmp_path / "open-rs-sample.jsonl"
    data.write_text('{"problem": "What is 1/2 + 1/4?", "solution": "It is $\\\\boxed{\\\\frac{3}{4}}$.", "level": 1}\n')
    path = cwgrpo_verl.convert(str(data), str(tmp_path / "verl"))
    import pandas
    row = pandas.read_parquet(path).iloc[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1]["content"] == "What is 1/2 + 1/4?"
    assert row["reward_model"]["style"] == "rule" and "frac{3}{4}" in row["reward_model"]["ground_truth"]
    good = "<think>\nadd\n</think>\n<answer>\\boxed{0.75}</answer>"
    assert cwgrpo_verl.compute_score("open-rs", good, row["reward_model"]["ground_truth"]) == 2.0
    assert cwgrpo_verl.compute_score("open-rs", good, row["reward_model"]["ground_truth"], {"format_weight": 0}) == 1.0
    assert cwgrpo_verl.compute_score("open-rs", "\\boxed{1}", row["reward_model"]["ground_truth"]) == 0.0
