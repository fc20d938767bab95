"""GSPO (Zheng et al. 2025, Qwen3): GRPO's advantages with a sequence-level, length-normalised ratio.

    A_i   = (r_i - mean(r_group)) / std(r_group)
    s_i   = exp( mean_t (logp_new - logp_old) )          one ratio per sequence, not per token
    loss  = mean_i max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_low, 1 + eps_high))
            + kl_coef * token-mean KL (when the KL is in the loss)

The clip range is tiny (3e-4 / 4e-4 in the paper) because s_i is a geometric mean over tokens.
clip_frac and clip_frac_cut count sequences here, not tokens (algos/common.py has the two definitions).
On-policy (s_i = 1, one update per batch) the gradient is mean_i A_i * mean_t grad logp_t: REINFORCE
with seq-mean-token-mean aggregation. Simplified: no GSPO-token variant (per-token advantages); the KL term is a
token mean whatever the policy term's aggregation (verl aggregates it as the policy term: docs/conventions.md);
algo.dual_clip does not apply here (nor in verl's GSPO).
"""
from dataclasses import dataclass

import torch

from algos.common import Algorithm, clip_cuts, kl_in_loss, masked_mean, tis_weights
from algos.grpo import grpo_advantages
from config import opt, section
from registry import register


@section("algo.gspo", "GSPO (algo.name=gspo)")
@dataclass
class GSPOConfig:
    clip_eps: float = opt(3e-4, "lower clip of the sequence-level (length-normalised) ratio")
    clip_eps_high: float = opt(4e-4, "upper clip of the sequence-level ratio")

    def check(self, cfg) -> list:
        return [("clip_eps", self.clip_eps > 0, "> 0"), ("clip_eps_high", self.clip_eps_high > 0, "> 0")]


def gspo_loss(new: dict, batch, cfg):
    logp, mask = new["logprobs"], batch.completion_mask                                     # (B, C)
    old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    adv = batch.advantages[:, 0]                                                            # (B,) sequence-level
    log_s = masked_mean(logp - old, mask, dim=-1)                                           # (B,)
    s = log_s.exp()
    clipped = s.clamp(1 - cfg.gspo.clip_eps, 1 + cfg.gspo.clip_eps_high)
    per_seq = torch.maximum(-adv * s, -adv * clipped)                                       # (B,)
    metrics = {"clip_frac": ((s - clipped).abs() > 0).float().mean().detach(),      # sequences, not tokens
               "clip_frac_cut": clip_cuts(s, clipped, adv).mean(), "ratio": s.detach().mean()}
    if cfg.tis != "off":   # the sequence weight is the natural one here: token mode is reduced to its mean
        w = masked_mean(tis_weights(old, batch.sample_logprobs, mask, cfg.tis, cfg.tis_cap), mask, dim=-1)
        per_seq = per_seq * w
        metrics["tis_weight"] = w.mean().detach()
    loss = per_seq.mean() + masked_mean(kl_in_loss(logp, batch, cfg, metrics, new.get("ref_kl")), mask)
    metrics["entropy"] = masked_mean(new["entropy"].detach(), mask)
    return loss, metrics


# a sequence-mean policy term; with KL on, a token-mean KL term beside it: no single split weight fits both
register("algo", "gspo")(Algorithm(advantages=grpo_advantages, loss=gspo_loss, loss_agg="seq-mean-token-mean",
                                   splittable=lambda cfg: cfg.kl_coef == 0, needs_groups=True))
