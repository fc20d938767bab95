"""GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages + a PPO-style clipped loss.

    A_i   = (r_i - mean(r_group)) / (std(r_group) + eps)             same value on every token of sample i
    ratio = exp(logp_new - logp_old)
    loss  = agg( max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)) + beta * KL_k3(new || ref) )

Choices made here: no critic (the group mean is the baseline); the KL term sits in the loss, not the
reward; when each rollout batch gets a single optimizer step, logp_old is logp_new detached, so the
ratio is 1 and the gradient is exactly REINFORCE with the group-mean baseline (no recomputation).
`scale_rewards=false` drops the std division (Dr. GRPO's fix for its difficulty bias).
"""
import torch
from torch import Tensor

from algos import Algorithm
from algos.common import aggregate, kl_estimate, masked_mean
from registry import register


def group_advantages(rewards: Tensor, group_ids: Tensor, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """rewards (B,), group_ids (B,) -> advantages (B,): reward minus its group's mean (over its std)."""
    n_groups = int(group_ids.max()) + 1
    count = torch.zeros(n_groups).index_add_(0, group_ids, torch.ones_like(rewards))        # (G,)
    mean = torch.zeros(n_groups).index_add_(0, group_ids, rewards) / count                  # (G,)
    centred = rewards - mean[group_ids]                                                     # (B,)
    if not scale:
        return centred
    var = torch.zeros(n_groups).index_add_(0, group_ids, centred ** 2) / (count - 1).clamp(min=1)  # unbiased, like torch.std
    return centred / (var.sqrt()[group_ids] + eps)


def grpo_advantages(batch, cfg) -> Tensor:
    adv = group_advantages(batch.rewards.float(), batch.group_ids, scale=cfg.scale_rewards)  # (B,)
    return adv[:, None] * batch.completion_mask                                              # (B, C)


def clipped_policy_loss(new: dict, batch, cfg) -> tuple[Tensor, dict]:
    logp, mask, adv = new["logprobs"], batch.completion_mask, batch.advantages               # (B, C) each
    old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    ratio = torch.exp(logp - old)                                                           # (B, C)
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)                                 # (B, C)
    metrics = {"clip_frac": masked_mean(((ratio - clipped).abs() > 0).float(), mask).item(),
               "ratio": masked_mean(ratio.detach(), mask).item()}
    if cfg.kl_coef > 0:
        kl = kl_estimate(logp, batch.ref_logprobs, cfg.kl_estimator)                        # (B, C)
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl"] = masked_mean(kl.detach(), mask).item()
    loss = aggregate(per_token, mask, cfg.loss_agg)
    metrics["entropy"] = masked_mean(new["entropy"].detach(), mask).item()
    return loss, metrics


register("algo", "grpo")(Algorithm(advantages=grpo_advantages, loss=clipped_policy_loss))
