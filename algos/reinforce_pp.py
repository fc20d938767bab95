"""REINFORCE++ (Hu et al. 2025): REINFORCE with per-token returns normalised over the whole batch.

    r_t   = score * [t = last] - kl_coef * KL_t             (KL in the reward when algo.kl_in_reward)
          per-step (process) rewards: each step's score at its last token instead (batch.turn_rewards)
    G_t   = sum_{s >= t} r_s                                 reward-to-go, gamma = 1
    A_t   = (G_t - mean(G)) / std(G)                         mean/std over every token of the batch (all ranks;
                                                             biased variance, eps inside the root: masked_whiten)
    loss  = agg( max(-A * ratio, -A * clip(ratio, ...)) )
  REINFORCE++-baseline (reinforce_pp_baseline), as verl computes it: no reward-to-go, one value per sample
    R_i   = score_i - kl_coef * sum_t KL_t                   the whole return (KL summed when in the reward)
    A_t   = whiten(R_i - mean(R_group))                      the same value on every token of sample i

No critic and no per-prompt std: the global normalisation is the only scaling, which the paper argues is
more stable than GRPO's per-group std. Simplified: gamma is fixed at 1 (the score comes at the end anyway).
The whitening's variance is the biased one (verl's is unbiased: over n tokens its advantages are this file's
times sqrt((n - 1) / n); docs/conventions.md).
"""
from functools import partial

from torch import Tensor

from algos.common import Algorithm, clipped_policy_loss, masked_whiten, sequence_rewards, token_rewards
from algos.grpo import group_advantages
from registry import register


def reward_to_go(token_rewards: Tensor) -> Tensor:
    """(B, C) -> (B, C): G_t = sum_{s >= t} r_s."""
    return token_rewards.flip(-1).cumsum(-1).flip(-1)


def reinforce_pp_advantages(batch, cfg, sum_over=None, baseline: bool = False) -> Tensor:
    mask = batch.completion_mask                                                            # (B, C)
    if baseline:   # the group mean of the whole return (score and summed KL alike) subtracted, on every token
        returns = group_advantages(sequence_rewards(batch, cfg), batch.group_ids, scale=False)[:, None] * mask
    else:
        returns = reward_to_go(token_rewards(batch, cfg))                                   # (B, C)
    # under torchrun each rank holds part of the batch: the loop's sum_over sums over all ranks, so the mean and
    # std are the whole batch's
    return masked_whiten(returns, mask, sum_over=sum_over)                                  # (B, C)


register("algo", "reinforce_pp")(Algorithm(advantages=reinforce_pp_advantages, loss=clipped_policy_loss))
register("algo", "reinforce_pp_baseline")(Algorithm(advantages=partial(reinforce_pp_advantages, baseline=True),
                                                    loss=clipped_policy_loss, needs_groups=True))
