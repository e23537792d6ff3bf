"""cwgrpo.py's token-weighting methods as verl policy losses, for training beyond one GPU with verl
(cwgrpo_verl/README.md).

verl loads this package when it starts with

    VERL_USE_EXTERNAL_MODULES=cwgrpo_verl PYTHONPATH=$PWD python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.actor.policy_loss.loss_mode=cw

from the repository's root (cwgrpo.py and this package on PYTHONPATH). Each loss calls the same
tensor functions as cwgrpo.py: the method's token terms, then cwgrpo's PPO-clip term; verl adds its
own KL loss (use_kl_loss) and aggregates with its agg_loss. Registered names:

- cw: CW-GRPO (cwgrpo's cw_weights; released code's padded normalisation, weights not detached).
- cw_valid, cw_detach, cw_valid_detach: the other readings of docs/math.md's cw steps 6 and 7.
- ar: advantage reweighting (Yang et al. 2025), alpha 0.2.
- cwgrpo_clip_cov, cwgrpo_kl_cov: cwgrpo's clip_cov and kl_cov, beside verl's own clip_cov and
  kl_cov.

Methods that need what a verl policy loss is not given are not registered: lopti (two update
passes), ict (full next-token distributions), entropy20 and stapo (the whole batch's entropies).

Statistics scope: verl passes the loss one micro-batch, and cw, clip_cov and kl_cov compute their
statistics over the rows they are given. With ppo_micro_batch_size_per_gpu equal to rollout.n (and
use_dynamic_bsz off) a micro-batch is exactly one prompt's group, as in the paper's runs; otherwise
the statistics mix groups (or split one), which the released CW-GRPO code also does.
"""

import dataclasses
from pathlib import Path

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

import cwgrpo
from cwgrpo_utils import OPEN_RS_SYSTEM_PROMPT, loading
from cwgrpo_utils.metrics import touched_tokens

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


def make_policy_loss(method_name: str, overrides: dict):
    method = cwgrpo.METHODS[method_name]

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ):
        cfg = cwgrpo_config(config, overrides)
        mask = response_mask.to(log_prob.dtype)
        # verl's advantages are per token; GRPO's are constant along a response
        per_response = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
        group = cwgrpo.Group(
            logp=log_prob,
            old_logp=old_log_prob,
            advantages=per_response,
            mask=mask,
            entropy=torch.zeros_like(log_prob),
            batch_entropy=None,
            divergence=None,
            update_pass=0,
        )
        terms = method.token_terms(group, cfg)
        loss = cwgrpo.token_loss(
            log_prob,
            old_log_prob,
            None,
            advantages=per_response,
            terms=terms,
            cfg=cfg,
            clip=method.clip,
        )
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
        ratio = torch.exp(log_prob.detach() - old_log_prob)
        clipped = cwgrpo.ppo_clipped(ratio, per_response, cfg) & method.clip
        w = terms.pg_weight.detach()[valid]
        return pg_loss, {
            "actor/pg_clipfrac": clipped[valid].float().mean().item(),
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


# --------------------------------------------------------------------------------------------------
# The reward and the data, in verl's formats
# --------------------------------------------------------------------------------------------------

_grader = None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's custom_reward_function: cwgrpo's accuracy (math-verify, gold first) + format reward,
    1:1 as in the 1.5B recipe (format_weight 0 in extra_info: the 7B recipe's accuracy only)."""
    global _grader
    if _grader is None:
        _grader = cwgrpo.Grader()
    format_weight = (extra_info or {}).get("format_weight", 1.0)
    return _grader.grade(
        solution_str, ground_truth
    ).accuracy + format_weight * cwgrpo.format_reward(solution_str)


def convert(
    dataset: str,
    output_dir: str,
    question_column: str = "problem",
    gold_column: str = "solution",
    system_prompt: str = OPEN_RS_SYSTEM_PROMPT,
    format_weight: float = 1.0,
) -> Path:
    """Open-RS (or any problem/solution data) as verl's RL parquet: prompt, reward rule, gold."""
    rows = loading.load_dataset(dataset, "train", question_column, gold_column)

    def to_verl(row, index):
        prompt = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": str(row[question_column])}
        ]
        return {
            "data_source": dataset,
            "prompt": prompt,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(row[gold_column])},
            "extra_info": {"index": index, "format_weight": format_weight},
        }

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows.map(to_verl, with_indices=True, remove_columns=rows.column_names).to_parquet(
        str(out / "train.parquet")
    )
    return out / "train.parquet"
