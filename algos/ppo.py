"""PPO for language models (Schulman et al. 2017; Ouyang et al. 2022): actor + critic, GAE over tokens.

    r_t   = score * [t = last] - kl_coef * KL_t                   (KL in the reward when algo.kl_in_reward)
          per-step (process) rewards: each step's score at its last token instead (batch.turn_rewards)
    d_t   = r_t + gamma * V_{t+1} - V_t,   V after the last token = 0   (the episode ends there)
    A_t   = d_t + gamma * lambda * A_{t+1}                        GAE;  returns R_t = A_t + V_t
    loss  = agg( max(-A' * ratio, -A' * clip(ratio)) + kl_coef * KL )        A' = whitened A (optional)
          + vf_coef * token-mean( 0.5 * max((V - R)^2, (V_clip - R)^2) ),   V_clip = V_old + clip(V - V_old, +-c)

The critic is a separate model (critic.py: the policy's backbone with a 1-unit head, its own optimizer).
`batch.advantages` holds the raw GAE advantages; the loss rebuilds the returns as A + V_old and whitens A
over the mini-batch (cleanrl does too, but with the unbiased std + 1e-8; here the biased variance with eps
inside the root: see masked_whiten), so the advantage function stays pure and returns one tensor. Whitening
needs the whole mini-batch in one pass: with micro_batch_size > 0 or under torchrun, set algo.ppo.whiten=false
(the loop refuses the split otherwise: a micro-batch's own mean and std would change the gradient).
Simplified: no reward model (the verifier's score is the reward), no value-head warm-up phase.
"""
from dataclasses import replace

import torch
from torch import Tensor

from algos.common import Algorithm, clipped_policy_loss, masked_mean, masked_whiten, token_rewards
from registry import register


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """rewards, values, mask (B, C) -> GAE advantages (B, C); positions with mask 0 give 0 and are skipped: after
    the end the next real token sees V = 0, A = 0; between the turns of a multi-turn episode (observation
    tokens) a turn's last token sees the next turn's first, as if the observation were not there."""
    B, C = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value, next_adv = torch.zeros(B), torch.zeros(B)                                   # (B,) after the end
    for t in reversed(range(C)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]                           # (B,)
        adv[:, t] = (delta + gamma * lam * next_adv) * m
        real = m > 0
        next_value = torch.where(real, values[:, t], next_value)
        next_adv = torch.where(real, adv[:, t], next_adv)
    return adv


def ppo_advantages(batch, cfg, sum_over=None) -> Tensor:
    values = batch.values.float() * batch.completion_mask                                   # (B, C)
    return gae(token_rewards(batch, cfg), values, batch.completion_mask, cfg.ppo.gamma, cfg.ppo.gae_lambda)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> Tensor:
    """Clipped value loss (scalar): the new value may not buy a lower loss by moving more than clip."""
    loss = (values - returns) ** 2                                                          # (B, C)
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)


def ppo_loss(new: dict, batch, cfg):
    mask = batch.completion_mask
    returns = batch.advantages + batch.values                                               # (B, C)
    adv = masked_whiten(batch.advantages, mask) if cfg.ppo.whiten else batch.advantages
    pg, metrics = clipped_policy_loss(new, replace(batch, advantages=adv), cfg)
    vf = value_loss(new["values"], batch.values, returns, mask, cfg.ppo.value_clip)
    metrics.update(value_loss=vf.detach(), value=masked_mean(new["values"].detach(), mask),
                   policy_loss=pg.detach())
    return pg + cfg.ppo.vf_coef * vf, metrics


# the value loss is a token mean: the whole loss splits exactly only when the policy term is one too, and when
# no whitening runs, since whitening inside the loss would use each micro-batch's (each rank's) own mean and std
register("algo", "ppo")(Algorithm(advantages=ppo_advantages, loss=ppo_loss, needs_critic=True,
                                  splittable=lambda cfg: cfg.loss_agg == "token-mean" and not cfg.ppo.whiten))
