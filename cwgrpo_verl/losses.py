"""cwgrpo.py's methods as verl policy losses, registered with verl's registry on import (the
package imports this module where verl is installed; cwgrpo_verl/__init__.py says what each is)."""

import dataclasses

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

import cwgrpo
from cwgrpo_utils.run.metrics import touched_tokens

VERL_METHODS = {  # verl name -> (cwgrpo method, Config overrides)
    "cw": ("cw", {}),
    "cw_valid": ("cw", {"cw_norm": "valid"}),
    "cw_detach": ("cw", {"cw_detach": True}),
    "cw_valid_detach": ("cw", {"cw_norm": "valid", "cw_detach": True}),
    "ar": ("ar", {}),
    "cwgrpo_clip_cov": ("clip_cov", {}),
    "cwgrpo_kl_cov": ("kl_cov", {}),
}


def cwgrpo_config(verl_config, overrides: dict) -> cwgrpo.Config:
    """cwgrpo's Config with verl's clip range and, for clip_cov/kl_cov, its policy_loss settings."""
    low = (
        verl_config.clip_ratio_low
        if verl_config.clip_ratio_low is not None
        else verl_config.clip_ratio
    )
    high = (
        verl_config.clip_ratio_high
        if verl_config.clip_ratio_high is not None
        else verl_config.clip_ratio
    )
    policy_loss = verl_config.policy_loss
    from_verl = {
        name: getattr(policy_loss, verl_name)
        for name, verl_name in (
            ("clip_cov_ratio", "clip_cov_ratio"),
            ("clip_cov_lb", "clip_cov_lb"),
            ("clip_cov_ub", "clip_cov_ub"),
            ("kl_cov_ratio", "kl_cov_ratio"),
            ("kl_cov_coef", "ppo_kl_coef"),
        )
        if getattr(policy_loss, verl_name, None) is not None
    }
    return dataclasses.replace(
        cwgrpo.Config(), eps_low=low, eps_high=high, beta=0.0, **from_verl, **overrides
    )


def verl_tokens(log_prob, old_log_prob, advantages, response_mask) -> cwgrpo.Group:
    """verl's micro-batch as the tokens cwgrpo's methods and loss read, one group (its rows'
    statistics together, as verl's own losses): each response's advantage (verl's are per token;
    GRPO's constant along a response), its mask and old log-probs."""
    mask = response_mask.to(log_prob.dtype)
    per_response = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
    return cwgrpo.Group(
        log_prob,
        old_logp=old_log_prob,
        advantages=per_response,
        mask=mask,
        entropy=torch.zeros_like(log_prob),
        batch_entropy=None,
        divergence=None,
        update_pass=0,
    )


def make_policy_loss(method_name: str, overrides: dict):
    cwgrpo_method = {"method": method_name, **overrides}

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ):
        # verl's micro-batch as one group (its rows' statistics together, as verl's own losses)
        cfg = cwgrpo_config(config, cwgrpo_method)
        cfg = dataclasses.replace(cfg, group_size=len(log_prob))
        tokens = verl_tokens(log_prob, old_log_prob, advantages, response_mask)
        # the sampler's log-probs are verl's: it weights its own rollout correction
        _, parts = cwgrpo.policy_loss(
            tokens,
            cwgrpo.method_terms(tokens, cfg),
            cfg,
            sampler_logp=old_log_prob,
            ref_logp=None,
            n_responses=len(log_prob),
            n_tokens=1,
        )  # only its per-token loss: verl averages it its own way
        loss, terms = parts.per_token, parts.terms
        if rollout_is_weights is not None:
            loss = loss * rollout_is_weights
        pg_loss = agg_loss(
            loss_mat=loss,
            loss_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            **getattr(config, "global_batch_info", {}),
        )
        # the sampler's log-probs are verl's business (it weights and logs its own rollout
        # correction, rollout_is_weights), and so is the KL: only the method's figures here
        valid = response_mask.bool()
        w = terms.pg_weight.detach()[valid]
        return pg_loss, {
            "actor/pg_clipfrac": parts.clipped[valid].float().mean().item(),
            "actor/ppo_kl": (old_log_prob - log_prob).detach()[valid].mean().item(),
            "actor/cwgrpo_w_mean": w.mean().item(),
            "actor/cwgrpo_w_min": w.min().item(),
            "actor/cwgrpo_w_max": w.max().item(),
            "actor/cwgrpo_touched_frac": touched_tokens(terms)[valid].float().mean().item(),
        }

    policy_loss.__name__ = f"cwgrpo_{method_name}_policy_loss"
    return policy_loss


for _verl_name, (_method, _overrides) in VERL_METHODS.items():
    register_policy_loss(_verl_name)(make_policy_loss(_method, _overrides))
