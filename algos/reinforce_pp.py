"""REINFORCE++ (Hu et al. 2025): REINFORCE with per-token returns normalised over the whole batch.

    r_t   = score * [t = last] - kl_coef * KL_t             (KL in the reward when algo.kl_in_reward)
    G_t   = sum_{s >= t} r_s                                 reward-to-go, gamma = 1
    A_t   = (G_t - mean(G)) / std(G)                         mean/std over every token of the batch (all ranks;
                                                             biased variance, eps inside the root: masked_whiten)
    baseline variant: score_i - mean(score_group) replaces score before the above (REINFORCE++-baseline)
    loss  = agg( max(-A * ratio, -A * clip(ratio, ...)) )

No critic and no per-prompt std: the global normalisation is the only scaling, which the paper argues is
more stable than GRPO's per-group std. Simplified: gamma is fixed at 1 (the score comes at the end anyway).
"""
from functools import partial

from torch import Tensor

from algos.common import Algorithm, clipped_policy_loss, masked_whiten, token_rewards
from algos.grpo import group_advantages
from registry import register


def reward_to_go(token_rewards: Tensor) -> Tensor:
    """(B, C) -> (B, C): G_t = sum_{s >= t} r_s."""
    return token_rewards.flip(-1).cumsum(-1).flip(-1)


def reinforce_pp_advantages(batch, cfg, sum_over=None, baseline: bool = False) -> Tensor:
    mask = batch.completion_mask                                                            # (B, C)
    score = batch.rewards.float()
    if baseline:
        score = group_advantages(score, batch.group_ids, scale=False)                       # (B,) r - group mean
    # under torchrun each rank holds part of the batch: the loop's sum_over sums over all ranks, so the mean and
    # std are the whole batch's
    return masked_whiten(reward_to_go(token_rewards(batch, cfg, score)), mask, sum_over=sum_over)  # (B, C)


register("algo", "reinforce_pp")(Algorithm(advantages=reinforce_pp_advantages, loss=clipped_policy_loss))
register("algo", "reinforce_pp_baseline")(Algorithm(advantages=partial(reinforce_pp_advantages, baseline=True),
                                                    loss=clipped_policy_loss, needs_groups=True))
