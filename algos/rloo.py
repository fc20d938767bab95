"""RLOO (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline.

    A_i  = r_i - mean_{j != i, j in group} r_j  =  k / (k - 1) * (r_i - mean(r_group))     (k samples per group)
    loss = agg( max(-A * ratio, -A * clip(ratio, ...)) + kl_coef * KL )                      (ratio = 1 on-policy)

The baseline excludes the sample itself, so it is independent of it and the estimator stays unbiased
(GRPO's mean includes r_i, which shrinks every advantage by (k - 1) / k). No std scaling. Simplified: the
paper's KL sits in the reward (set algo.kl_in_reward=true for that); the PPO clip only matters when
algo.epochs or algo.minibatch_size give several updates per batch.
"""
from torch import Tensor

from algos.common import Algorithm, clipped_policy_loss, sequence_rewards
from algos.grpo import group_stats
from registry import register


def leave_one_out_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """rewards (B,), group_ids (B,) -> (B,): r_i minus the mean of the other samples of its group."""
    count, centred, _ = group_stats(rewards, group_ids)                                     # float64
    return (centred * count / (count - 1).clamp(min=1)).to(rewards.dtype)


def rloo_advantages(batch, cfg, sum_over=None) -> Tensor:
    adv = leave_one_out_advantages(sequence_rewards(batch, cfg), batch.group_ids)           # (B,)
    return adv[:, None] * batch.completion_mask                                             # (B, C)


register("algo", "rloo")(Algorithm(advantages=rloo_advantages, loss=clipped_policy_loss, needs_groups=True))
