"""DPO (Rafailov et al. 2023), IPO (Azar et al. 2023) and SimPO (Meng et al. 2024): preference losses on
(chosen y_w, rejected y_l) pairs, offline from a file (train_dpo.py) or online from rollouts (online_dpo).

    h(y)   = sum_t [log pi(y_t) - log pi_ref(y_t)]            the policy's log-ratio to the reference
    sigmoid (DPO): loss = -log sigmoid( beta * (h(y_w) - h(y_l)) )              = log 2 when h(y_w) = h(y_l)
    ipo:           loss = ( h(y_w) - h(y_l) - 1 / (2 beta) )^2
    simpo:         loss = -log sigmoid( beta * (avg_t log pi(y_w) - avg_t log pi(y_l)) - gamma )   no reference
    online_dpo:    per group (one prompt's samples), y_w = the highest-reward sample, y_l = the lowest; groups
                   whose rewards are all equal give no pair and no gradient.

The pairing travels in `batch.advantages` (+1 on y_w, -1 on y_l, 0 elsewhere, on every token), so online
DPO fits the same contract as the policy-gradient algorithms; a mini-batch keeps whole groups together, so
both halves of a pair are always in it. Simplified: IPO uses summed (not length-averaged) log-ratios;
online pairs use one pair per group (best vs worst), not all pairs.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from algos.common import Algorithm, masked_mean
from algos.grpo import group_stats
from config import UserError, opt, section
from registry import register

LOSSES = ("sigmoid", "ipo", "simpo")


@section("algo.dpo", "DPO family (algo.name=online_dpo, and train_dpo.py)")
@dataclass
class DPOConfig:
    loss: str = opt("sigmoid", "preference loss: sigmoid (DPO), ipo, or simpo (reference-free, length-normalised)",
                    choices=LOSSES)
    beta: float = opt(0.1, "DPO/IPO inverse temperature; SimPO's reward scale")
    simpo_gamma: float = opt(0.5, "SimPO's target margin")
    data: str = opt("assets/arithmetic_prefs.jsonl", "preference file for offline DPO (train_dpo.py): jsonl of "
                                                   "{prompt, chosen, rejected}")

    def check(self, cfg) -> list:
        if cfg.algo.name == "online_dpo" and cfg.algo.kl_coef != 0:   # the loss below has no KL term to weigh
            raise UserError(f"algo 'online_dpo' takes no KL term in its loss: algo.kl_coef={cfg.algo.kl_coef} would do "
                            "nothing; use algo.kl_coef=0 (algo.dpo.beta sets how far it may move from the reference)")
        return [("beta", self.beta > 0, "> 0")]


def sequence_scores(logp: Tensor, ref_logp: Tensor | None, mask: Tensor, kind: str) -> Tensor:
    """(B, C) token log-probs -> (B,): summed log-ratio to the reference, or SimPO's mean log-prob."""
    if kind == "simpo":
        return masked_mean(logp, mask, dim=-1)
    return ((logp - ref_logp) * mask).sum(-1)


def preference_loss(chosen: Tensor, rejected: Tensor, kind: str, beta: float, simpo_gamma: float = 0.0) -> Tensor:
    """Scores of the chosen and rejected halves (N,) each -> per-pair loss (N,)."""
    margin = chosen - rejected                                                              # (N,)
    if kind == "sigmoid":
        return -F.logsigmoid(beta * margin)
    if kind == "ipo":
        return (margin - 1 / (2 * beta)) ** 2
    if kind == "simpo":
        return -F.logsigmoid(beta * margin - simpo_gamma)
    raise ValueError(f"unknown algo.dpo.loss {kind!r}; known: {', '.join(LOSSES)}")


def pair_labels(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """rewards, group_ids (B,) -> (B,): +1 on each group's first best sample, -1 on its first worst, else 0.
    Groups whose rewards are all equal get no pair."""
    B = len(rewards)
    _, _, std = group_stats(rewards, group_ids)
    n_groups = int(group_ids.max()) + 1
    rows = torch.arange(B)
    labels = torch.zeros(B)
    for sign, best in ((1.0, rewards), (-1.0, -rewards)):
        top = torch.full((n_groups,), float("-inf")).scatter_reduce(0, group_ids, best, "amax")   # (G,)
        is_top = best == top[group_ids]                                                    # (B,)
        first = torch.full((n_groups,), B).scatter_reduce(0, group_ids, torch.where(is_top, rows, B), "amin")
        labels[first[group_ids] == rows] = sign
    return labels * (std > 0)


def online_dpo_advantages(batch, cfg, sum_over=None) -> Tensor:
    return pair_labels(batch.rewards.float(), batch.group_ids)[:, None] * batch.completion_mask   # (B, C)


def pair_loss(logp: Tensor, ref_logp: Tensor | None, mask: Tensor, chosen: Tensor, rejected: Tensor, cfg):
    """Mean preference loss over pairs given as row indices (N,) each; returns (loss, metrics)."""
    s = sequence_scores(logp, ref_logp, mask, cfg.dpo.loss)                                 # (B,)
    losses = preference_loss(s[chosen], s[rejected], cfg.dpo.loss, cfg.dpo.beta, cfg.dpo.simpo_gamma)  # (N,)
    margin = (s[chosen] - s[rejected]).detach()
    return losses.mean(), {"pairs": float(len(chosen)), "margin": margin.mean().detach(),
                           "pref_acc": (margin > 0).float().mean().detach()}


def online_dpo_loss(new: dict, batch, cfg):
    label, mask = batch.advantages[:, 0], batch.completion_mask                            # (B,), (B, C)
    # rows are grouped and in group order, so the i-th chosen and the i-th rejected row share a group
    chosen, rejected = (label > 0).nonzero().squeeze(-1), (label < 0).nonzero().squeeze(-1)  # (N,) each
    metrics = {"entropy": masked_mean(new["entropy"].detach(), mask)}
    if len(chosen) == 0:   # no group with signal: a zero loss that still touches the graph
        return (new["logprobs"] * 0).sum(), {**metrics, "pairs": 0.0}
    loss, m = pair_loss(new["logprobs"], batch.ref_logprobs, mask, chosen, rejected, cfg)
    return loss, {**metrics, **m}


register("algo", "online_dpo")(Algorithm(advantages=online_dpo_advantages, loss=online_dpo_loss,
                                         needs_ref=lambda cfg: cfg.dpo.loss != "simpo",
                                         splittable=lambda cfg: False,    # a pair must stay in one piece
                                         needs_groups=True, exact_kl=lambda cfg: False,   # its loss has no KL term
                                         behaviour_weight=False))         # a pair's loss has no per-token ratio
