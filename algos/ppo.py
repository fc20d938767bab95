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
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from algos.common import Algorithm, clipped_policy_loss, masked_mean, masked_whiten, token_rewards
from config import opt, section
from registry import register


@section("algo.ppo", "PPO (algo.name=ppo): critic and GAE")
@dataclass
class PPOConfig:
    gamma: float = opt(1.0, "discount of the per-token return")
    gae_lambda: float = opt(0.95, "GAE lambda: 1 = Monte-Carlo return minus value, 0 = one-step TD")
    vf_coef: float = opt(0.5, "weight of the value loss")
    value_clip: float = opt(0.2, "clip of the new value around the rollout value (0 = off)")
    whiten: bool = opt(True, "normalise advantages to mean 0, std 1 over each mini-batch's tokens (needs the "
                             "mini-batch in one pass: false for micro_batch_size > 0 or torchrun)")
    critic_lr: float = opt(1e-4, "AdamW learning rate of the critic (its own optimizer)")

    def check(self, cfg) -> list:
        return [("gamma", 0 <= self.gamma <= 1, "in [0, 1]"), ("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
                ("vf_coef", self.vf_coef >= 0, ">= 0"), ("value_clip", self.value_clip >= 0, ">= 0 (0 = off)"),
                ("critic_lr", math.isfinite(self.critic_lr) and self.critic_lr > 0, "a finite number > 0")]


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
