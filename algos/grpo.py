"""GRPO (Shao et al. 2024, DeepSeekMath) and Dr. GRPO (Liu et al. 2025): group-relative advantages + a
PPO-style clipped loss.

    A_i   = (r_i - mean(r_group)) / (std(r_group) + eps)             same value on every token of sample i
    ratio = exp(logp_new - logp_old)
    loss  = agg( max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)) + beta * KL(new || ref) )
    Dr. GRPO: A_i = r_i - mean(r_group) (no std: it up-weights too-easy/too-hard prompts), and
              agg = seq-mean-token-sum-norm with a constant divisor (no length bias toward long wrong answers)

Choices made here: no critic (the group mean is the baseline); the KL term sits in the loss unless
algo.kl_in_reward; when each rollout batch gets a single optimizer step, logp_old is logp_new detached, so
the ratio is 1 and the gradient is exactly REINFORCE with the group-mean baseline (no recomputation).
`scale_rewards=false` drops the std division in plain GRPO too; dr_grpo ignores scale_rewards and loss_agg.
The std is the unbiased one (like torch.std, TRL and verl), and the group statistics are taken in float64
around the group's first reward: a group whose rewards are all equal gets exactly zero advantage.
Metrics: clip_frac (ratio outside the range) and clip_frac_cut (gradient removed): see algos/common.py.
Per-step (process) rewards (docs/rewards.md), algo.step_rewards:
    sum       r_i is the sample's summed steps: the formula above, as for any reward
    per_step  DeepSeekMath's process supervision: every step reward r_i,k of the group's samples is normalised
              over the group's step rewards, r~ = (r - mean(R_group)) / (std(R_group) + eps) (no std for dr_grpo),
              and A_t = sum of r~_i,k over the steps k ending at or after token t. A scalar reward is one step at
              the last token; kl_in_reward's summed KL joins the last step. One step per sample is plain GRPO.
"""
from functools import partial

import torch
from torch import Tensor

from algos.common import Algorithm, clipped_policy_loss, kl_in_reward, sequence_rewards  # noqa: F401
from registry import register


def group_stats(x: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (B,), group_ids (B,) -> per-sample group count, x minus its group's mean, unbiased group std
    (each (B,), float64).

    Computed in float64 and around each group's first value, so that a group whose values are all equal
    gets exactly 0 for both (in float32, eight rewards of 1.2 average to 1.2000000477, and the 5e-8 left
    over, divided by std + eps, was an advantage of +0.1 on every sample of a group with no signal).
    """
    B, n_groups = len(x), int(group_ids.max()) + 1
    x64 = x.double()
    first = torch.full((n_groups,), B, device=x.device).scatter_reduce_(
        0, group_ids, torch.arange(B, device=x.device), reduce="amin")                      # (G,) first index
    shifted = x64 - x64[first][group_ids]                                                   # (B,) exact zeros
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=x.device)
    count = zeros.index_add(0, group_ids, torch.ones_like(x64))                             # (G,)
    centred = shifted - (zeros.index_add(0, group_ids, shifted) / count)[group_ids]         # (B,)
    var = zeros.index_add(0, group_ids, centred ** 2) / (count - 1).clamp(min=1)           # (G,) like torch.std
    return count[group_ids], centred, var.sqrt()[group_ids]


def group_advantages(rewards: Tensor, group_ids: Tensor, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """rewards (B,), group_ids (B,) -> advantages (B,): reward minus its group's mean (over its std);
    exactly 0 for every sample of a group whose rewards are all equal."""
    _, centred, std = group_stats(rewards, group_ids)
    return (centred / (std + eps) if scale else centred).to(rewards.dtype)


def step_group_advantages(batch, scale: bool, kl: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """(B, C): each step reward normalised over its group's step rewards, summed from the token's step to the end.
    The steps are batch.turn_rewards at batch.step_mask, or one per sample (batch.rewards) at its last token;
    kl (B,) is added to the last step's reward."""
    mask = batch.completion_mask
    C = mask.shape[1]
    last = (torch.arange(C, device=mask.device) * (mask > 0)).argmax(-1)                   # (B,)
    if batch.step_mask is not None and batch.turn_rewards is not None:
        values, ends = batch.turn_rewards.double(), batch.step_mask > 0                     # (B, C) each
    else:
        values = torch.zeros_like(mask, dtype=torch.float64).scatter(1, last[:, None], batch.rewards.double()[:, None])
        ends = torch.zeros_like(mask, dtype=torch.bool).scatter(1, last[:, None], True)
    if kl is not None:
        values = values.scatter_add(1, last[:, None], kl.double()[:, None])
    rows, cols = ends.nonzero(as_tuple=True)                                                # (S,) each: every step
    _, centred, std = group_stats(values[rows, cols], batch.group_ids[rows])                 # (S,)
    normed = torch.zeros_like(values)
    normed[rows, cols] = centred / (std + eps) if scale else centred
    return (normed.flip(-1).cumsum(-1).flip(-1) * mask).to(mask.dtype)                      # (B, C) steps to go


def grpo_advantages(batch, cfg, sum_over=None, scale: bool | None = None) -> Tensor:
    scale = cfg.scale_rewards if scale is None else scale
    if cfg.step_rewards == "per_step":
        return step_group_advantages(batch, scale, kl_in_reward(batch, cfg).sum(-1))
    adv = group_advantages(sequence_rewards(batch, cfg), batch.group_ids, scale=scale)      # (B,)
    return adv[:, None] * batch.completion_mask                                             # (B, C)


register("algo", "grpo")(Algorithm(advantages=grpo_advantages, loss=clipped_policy_loss, needs_groups=True))
register("algo", "dr_grpo")(Algorithm(advantages=partial(grpo_advantages, scale=False),
                                      loss=partial(clipped_policy_loss, loss_agg="seq-mean-token-sum-norm"),
                                      loss_agg="seq-mean-token-sum-norm", needs_groups=True))
