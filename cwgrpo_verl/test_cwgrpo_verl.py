"""cwgrpo_verl against verl: the registry, the same losses as cwgrpo.py, and verl's own
clip_cov/kl_cov.

Run: python -m pytest -q cwgrpo_verl   (in a venv with verl; cwgrpo_verl/README.md)
Skipped where verl is not installed; CI runs it in its own venv with verl pinned (see .ci/run).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from omegaconf import OmegaConf  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

import cwgrpo  # noqa: E402
from cwgrpo_verl import losses  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def verl_config(**policy_loss):
    """verl's own actor config, built as verl builds it from its YAML: through OmegaConf into
    FSDPActorConfig, so every setting a loss reads has verl's real default unless given here."""
    return omega_conf_to_dataclass(
        OmegaConf.create(
            {
                "_target_": "verl.workers.config.FSDPActorConfig",
                "strategy": "fsdp",
                "ppo_mini_batch_size": 12,
                "ppo_micro_batch_size_per_gpu": 12,
                "use_dynamic_bsz": False,
                "rollout_n": 12,
                "policy_loss": {"_target_": "verl.workers.config.PolicyLossConfig", **policy_loss},
            }
        )
    )


def tensors(seed: int, n_rows: int = 6, length: int = 40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n_rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    old = -torch.rand(n_rows, length, generator=g) * 4 * mask
    logp = (old + 0.3 * torch.randn(n_rows, length, generator=g)) * mask
    advantages = torch.randn(n_rows, 1, generator=g).expand(n_rows, length) * mask
    return old, logp, advantages, mask


def loss_and_grad(fn, logp, *args, **kwargs):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = fn(kwargs.pop("old"), logp, *args, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def test_every_name_resolves_through_verls_registry():
    for name in losses.VERL_METHODS:
        assert callable(core_algos.get_policy_loss_fn(name))


def test_verl_loads_the_module_through_its_external_module_hook():
    code = (
        "import verl; from verl.trainer.ppo.core_algos import get_policy_loss_fn; "
        "print(get_policy_loss_fn('cw').__name__)"
    )
    env = {
        **os.environ,
        "VERL_USE_EXTERNAL_MODULES": "cwgrpo_verl",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cwgrpo_cw_policy_loss" in out.stdout


@pytest.mark.parametrize("name", list(losses.VERL_METHODS))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_registered_loss_equals_cwgrpos_loss_path(name, mode):
    old, logp, advantages, mask = tensors(0)
    method, overrides = losses.VERL_METHODS[name]
    torch.manual_seed(1)
    verl_loss, verl_grad, metrics = loss_and_grad(
        core_algos.get_policy_loss_fn(name),
        logp,
        advantages,
        mask,
        old=old,
        loss_agg_mode=mode,
        config=verl_config(kl_cov_ratio=0.002, ppo_kl_coef=1.0),
    )
    assert "actor/cwgrpo_w_mean" in metrics
    # with Cui et al.'s kl_cov settings set in verl's config, as the README's command does, the
    # registered loss is cwgrpo's with its own defaults

    cfg = cwgrpo.dataclasses.replace(
        cwgrpo.Config(), method=method, beta=0.0, loss_aggregation=mode, group_size=len(mask)
    )
    cfg = cwgrpo.dataclasses.replace(cfg, **overrides)
    ours = logp.clone().requires_grad_(True)
    tokens = losses.verl_tokens(ours, old, advantages, mask)
    torch.manual_seed(1)
    loss, _ = cwgrpo.policy_loss(
        tokens,
        cwgrpo.method_terms(tokens, cfg),
        cfg,
        sampler_logp=old,
        ref_logp=None,
        n_responses=len(mask),
        n_tokens=int(mask.sum()),
    )
    loss.backward()
    torch.testing.assert_close(verl_loss, loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(verl_grad, ours.grad, rtol=1e-5, atol=1e-6)


def test_clip_cov_agrees_with_verls_clip_cov():
    old, logp, advantages, mask = tensors(2, n_rows=8, length=300)
    logp = logp * 3  # wider log-probs: more tokens with 1 < C < 5
    config = verl_config(clip_cov_ratio=0.01)
    results = []
    for name in ("clip_cov", "cwgrpo_clip_cov"):
        torch.manual_seed(3)  # both draw their random choice from torch's global generator
        results.append(
            loss_and_grad(
                core_algos.get_policy_loss_fn(name),
                logp,
                advantages,
                mask,
                old=old,
                loss_agg_mode="token-mean",
                config=config,
            )
        )
    (verl_loss, verl_grad, _), (our_loss, our_grad, metrics) = results
    assert metrics["actor/cwgrpo_touched_frac"] > 0
    torch.testing.assert_close(our_loss, verl_loss)
    torch.testing.assert_close(our_grad, verl_grad)


def test_kl_cov_agrees_with_verls_kl_cov_and_the_default_ratio_differs():
    old, logp, advantages, mask = tensors(4, n_rows=8, length=300)
    config = verl_config(kl_cov_ratio=0.002)
    (verl_loss, verl_grad, _), (our_loss, our_grad, _) = [
        loss_and_grad(
            core_algos.get_policy_loss_fn(name),
            logp,
            advantages,
            mask,
            old=old,
            loss_agg_mode="token-mean",
            config=config,
        )
        for name in ("kl_cov", "cwgrpo_kl_cov")
    ]
    torch.testing.assert_close(our_loss, verl_loss)
    torch.testing.assert_close(our_grad, verl_grad)
    # verl's config always fills kl_cov_ratio and ppo_kl_coef (2e-4 and 0.1), and cwgrpo_kl_cov
    # follows them, as the README says; Cui et al.'s 2e-3 and 1 must be set, as its command does
    n_valid = int(mask.sum())
    defaults = verl_config()
    assert (defaults.policy_loss.kl_cov_ratio, defaults.policy_loss.ppo_kl_coef) == (2e-4, 0.1)
    for settings, ratio in (({}, 2e-4), ({"kl_cov_ratio": 0.002, "ppo_kl_coef": 1.0}, 2e-3)):
        config = verl_config(**settings)
        results = [
            loss_and_grad(
                core_algos.get_policy_loss_fn(name),
                logp,
                advantages,
                mask,
                old=old,
                loss_agg_mode="token-mean",
                config=config,
            )
            for name in ("kl_cov", "cwgrpo_kl_cov")
        ]
        torch.testing.assert_close(results[1][0], results[0][0])
        penalised = results[1][2]["actor/cwgrpo_touched_frac"] * n_valid
        assert penalised == pytest.approx(max(1, int(ratio * n_valid)))
