"""DAPO (Yu et al. 2025): GRPO with four changes, each a line here.

    r'_i  = r_i + overlong(|y_i|)        soft overlong penalty: 0 up to L - buffer, then falls linearly to
                                          -penalty at L = max_new_tokens (and stays there when truncated)
    A_i   = (r'_i - mean(r'_group)) / (std(r'_group) + eps)
    loss  = token-mean( max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)) ),  eps_high > eps_low
    keep  = groups whose rewards r_i are not all equal (dynamic sampling: equal ones carry no signal); a group
            keep drops gets A = 0 on every sample, also where the overlong penalty alone would make r' differ

Dynamic sampling as in the paper: the loop (train.draw) samples fresh prompts_per_step prompts again while
fewer than prompts_per_step groups have signal, at most algo.dapo.max_rounds rounds per step, and trains on the
first prompts_per_step groups with signal (logged: dynamic_sampling/rounds, .../groups_drawn). Simplified: a
step that runs out of rounds trains on the groups it found (fewer samples), as max_rounds=1 always does, and a
step that found none trains nothing (no optimizer step: update.py), as verl never trains a group without
signal (it samples on, or stops with an error after max_num_gen_batches); the paper's recipe has no KL;
algo.kl_coef still works if you set it. keep judges the raw rewards (verl's filter_groups.metric=acc), not
the overlong-shaped ones: a group whose answers are all right or all wrong is dropped whatever their lengths.
"""
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from algos.common import Algorithm, clipped_policy_loss, sequence_rewards
from algos.grpo import group_advantages, group_stats
from config import opt, section
from registry import register


@section("algo.dapo", "DAPO (algo.name=dapo)")
@dataclass
class DAPOConfig:
    clip_eps_high: float = opt(0.28, "clip-higher: the ratio may rise to 1 + this (the low side uses algo.clip_eps)")
    overlong_buffer: int = opt(2, "soft overlong penalty starts this many tokens before max_new_tokens (0 = off)")
    overlong_penalty: float = opt(1.0, "penalty at max_new_tokens; falls linearly to 0 over the buffer")
    dynamic_sampling: bool = opt(True, "train only on groups whose rewards differ (equal ones carry no signal), "
                                       "sampling more prompts until prompts_per_step such groups are found")
    max_rounds: int = opt(3, "dynamic sampling's rollout rounds per step at most (each of prompts_per_step prompts); "
                             "a step that runs out trains on the groups it found")

    def check(self, cfg) -> list:
        return [("clip_eps_high", self.clip_eps_high >= 0, ">= 0"),
                ("overlong_buffer", self.overlong_buffer >= 0, ">= 0 (0 = off)"),
                ("overlong_penalty", self.overlong_penalty >= 0, ">= 0"), ("max_rounds", self.max_rounds >= 1, ">= 1")]


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """lengths (B,) -> reward shaping (B,): 0 for |y| <= L - buffer, -penalty * (|y| - (L - buffer)) / buffer above."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0, max=buffer)                  # (B,)
    return -penalty * over / buffer


def dapo_advantages(batch, cfg, sum_over=None) -> Tensor:
    # L is the rollout's length limit, which only the config knows: the completion tensor is as wide as the
    # longest completion of the batch, which is shorter than L whenever no sample was truncated
    if cfg.max_new_tokens < 1:
        raise ValueError("dapo: algo.max_new_tokens is unset (config.fill_defaults copies max_new_tokens into it)")
    lengths = batch.completion_mask.sum(-1)                                                 # (B,)
    shaped = sequence_rewards(batch, cfg) + overlong_penalty(lengths, cfg.max_new_tokens, cfg.dapo.overlong_buffer,
                                                             cfg.dapo.overlong_penalty)
    adv = group_advantages(shaped, batch.group_ids, scale=True)                             # (B,)
    adv = adv * keep_groups_with_signal(batch, cfg)          # a dropped group's overlong spread is no signal either
    return adv[:, None] * batch.completion_mask                                             # (B, C)


def dapo_loss(new: dict, batch, cfg):
    return clipped_policy_loss(new, batch, cfg, loss_agg="token-mean", clip=(cfg.clip_eps, cfg.dapo.clip_eps_high))


def keep_groups_with_signal(batch, cfg) -> Tensor:
    """(B,) bool: True for samples whose group's rewards are not all equal (or every sample when off)."""
    if not cfg.dapo.dynamic_sampling:
        return torch.ones(len(batch), dtype=torch.bool)
    _, _, std = group_stats(batch.rewards.float(), batch.group_ids)    # exactly 0 when all are equal
    return std > 0


register("algo", "dapo")(Algorithm(advantages=dapo_advantages, loss=dapo_loss, keep=keep_groups_with_signal,
                                   loss_agg="token-mean", needs_groups=True,
                                   max_rounds=lambda cfg: cfg.dapo.max_rounds if cfg.dapo.dynamic_sampling else 1))
