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

The reward and the data converter are cwgrpo_verl/data.py's and need no verl (python -m
cwgrpo_verl converts a dataset); the losses (losses.py) are registered when verl is installed.

Methods that need what a verl policy loss is not given are not registered: lopti (two update
passes), ict (full next-token distributions), entropy20 and stapo (the whole batch's entropies).

Statistics scope: verl passes the loss one micro-batch, and cw, clip_cov and kl_cov compute their
statistics over the rows they are given. With ppo_micro_batch_size_per_gpu equal to rollout.n (and
use_dynamic_bsz off) a micro-batch is exactly one prompt's group, as in the paper's runs; otherwise
the statistics mix groups (or split one), which the released CW-GRPO code also does.
"""

import importlib.util

if importlib.util.find_spec("verl") is not None:  # verl's external-module hook imports this
    from cwgrpo_verl import losses  # noqa: F401  (registers them)
