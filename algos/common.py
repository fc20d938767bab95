"""Small shared pieces of the algorithms: masked means, loss aggregation, KL estimators (in the reward or in
the loss), truncated importance sampling, and the clipped policy-gradient loss most algorithms share.

    from algos.common import aggregate, kl_estimate, clipped_policy_loss
    loss, metrics = clipped_policy_loss(new, batch, cfg, loss_agg="token-mean", clip=(0.2, 0.28))

Every function here is pure: tensors in, tensors out; `cfg` is the `algo` section of the config.
Conventions to check before comparing numbers with another framework:
  * group statistics (algos/grpo.py group_stats) and whitening are taken in float64, so equal rewards give
    exactly zero advantage; whitening divides by sqrt(biased variance + eps) (cleanrl: unbiased std + eps);
  * clip_frac counts tokens whose ratio is outside the clip range whatever the advantage's sign;
    clip_frac_cut counts those whose gradient the clip removes (verl's pg_clipfrac);
  * k3 is bounded as verl's low_var_kl is: its log-ratio clamped to +-KL_LOG_RATIO_MAX, its value to K3_MAX;
    k1 and k2 are not clamped (nor in verl; TRL clamps none of the three);
  * the KL in the reward is taken on the trainer's log-probs of the samples (batch.old_logprobs), as in verl and
    TRL, never on the engine's sampling log-probs;
  * dual_clip (off by default) is verl's dual-clip PPO: a negative advantage's loss is capped at -A * dual_clip.
docs/conventions.md lists every convention that differs from verl or TRL, with the option that gives theirs.
"""
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from config import AGG_MODES


@dataclass(frozen=True)
class Algorithm:
    """What an algorithm file registers: its two pure functions and what the loop must build for them."""
    advantages: Callable        # (batch: Experience, cfg: AlgoConfig, sum_over=None) -> (B, C) per-token advantages
    loss: Callable              # (new: dict, batch: Experience, cfg: AlgoConfig) -> (loss, metrics: dict)
    needs_ref: Callable = lambda cfg: cfg.kl_coef > 0   # does the batch need reference log-probs?
    # does the loss take the exact KL to the reference over the whole vocabulary? Then the batch carries the
    # reference's hidden states (ref_hidden) and the loss gets new["ref_kl"] (B, C) with its gradient (full_kl.py)
    exact_kl: Callable = lambda cfg: exact_kl_penalty(cfg)
    needs_critic: bool = False  # the loop builds a critic, fills batch.values and passes new["values"]
    keep: Callable | None = None  # (batch, cfg) -> (B,) bool: rows to train on (e.g. DAPO's dynamic sampling)
    # How the loss reduces over tokens, so that micro-batches (microbatch.py) and ranks (distributed.py) can be
    # weighted to give exactly the whole mini-batch's gradient: a fixed mode, or None for cfg.loss_agg.
    loss_agg: str | None = None
    splittable: Callable = lambda cfg: True   # False: no exact split exists (pairs, mixed reductions)
    # True: the advantage compares samples of one prompt (a group baseline, a pair), so samples_per_prompt=1
    # gives every sample zero signal; config_checks.validate refuses it
    needs_groups: bool = False
    # (cfg) -> rollout rounds per step at most: with more than 1 the loop samples fresh prompts until `keep` has
    # left prompts_per_step groups (DAPO's dynamic sampling: train.draw), instead of training on fewer
    max_rounds: Callable = lambda cfg: 1
    # True: the loss weights each token by pi_prox / pi_behav (algo.tis on old_logprobs vs sample_logprobs), so it
    # can train on samples of an older policy (mode=async, docs/async.md); False: config_checks refuses staleness
    behaviour_weight: bool = True


def exact_kl_penalty(cfg) -> bool:
    """Is the KL penalty the whole vocabulary's (kl_estimator=exact) rather than a sampled estimate?"""
    return cfg.kl_coef > 0 and cfg.kl_estimator == "exact"


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, sum_over=None) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (the whole batch); masked-out entries come back as 0.

    Conventions (compare before comparing numbers with another framework): the variance is the biased one
    (divided by n, like numpy's default), and eps sits inside the square root. cleanrl's PPO divides by the
    unbiased std plus 1e-8 (torch.std); over n tokens the two differ by a factor sqrt(n / (n - 1)), which
    is negligible over a batch of tokens and matters only for tiny tests. Mean and variance are taken in
    float64, so a batch of equal values whitens to exactly 0.
    sum_over: a function that sums a list of numbers over the processes holding parts of one batch
    (distributed.all_sum), so that the mean and std are the whole batch's under torchrun, not this rank's."""
    x64, m64 = x.double(), mask.double()
    if sum_over is None:
        n = m64.sum().clamp(min=1)
        mean = (x64 * m64).sum() / n
        var = ((x64 - mean) ** 2 * m64).sum() / n
    else:   # the same two passes, each sum taken over every rank (float64 on the host)
        total, n = sum_over([(x64 * m64).sum().item(), m64.sum().item()])
        mean = total / max(n, 1.0)
        (squares,) = sum_over([((x64 - mean) ** 2 * m64).sum().item()])
        var = torch.tensor(squares / max(n, 1.0), dtype=torch.float64)
    return ((x64 - mean) * torch.rsqrt(var + eps) * m64).to(x.dtype)




def aggregate(loss: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """Reduce per-token losses (B, C) to a scalar.

    token-mean:              every token in the batch weighs the same (DAPO, Dr. GRPO's recommendation)
    seq-mean-token-mean:     mean over each sequence, then over sequences (original GRPO)
    seq-mean-token-sum:      sum over each sequence, then mean over sequences (REINFORCE on sequences)
    seq-mean-token-sum-norm: sum over each sequence / a constant (max_len), then mean (Dr. GRPO)
    """
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "seq-mean-token-mean":
        return masked_mean(loss, mask, dim=-1).mean()
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(-1).mean()
    if mode == "seq-mean-token-sum-norm":
        return ((loss * mask).sum(-1) / (max_len or loss.shape[-1])).mean()
    raise ValueError(f"unknown loss_agg {mode!r}; known: {', '.join(AGG_MODES)}")


# Bounds on k3 (verl's low_var_kl has the same two): its log-ratio is clamped to +-KL_LOG_RATIO_MAX before the
# exp (exp(88) overflows float32: one token with ref - logp > 88 made k3 inf and the whole update was skipped),
# and k3 itself to at most K3_MAX. A token past a bound gives the KL term no gradient; such a token means the
# policy gives it ~13x less probability than the reference (k3 = 10) or e^20 more or less (the clamp). k1 and k2
# need no exp and are not clamped. Set both to math.inf to get an unbounded k3 back (TRL's).
KL_LOG_RATIO_MAX = 20.0
K3_MAX = 10.0


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman, 'Approximating KL').

    k1 = log r            unbiased, high variance, can be negative
    k2 = (log r)^2 / 2    biased, low variance
    k3 = (r' - 1) - log r'  with r' = ref/policy: unbiased, always >= 0 (GRPO's choice)
    where log r = logp - ref_logp; inside k3 only it is clamped to +-KL_LOG_RATIO_MAX, and k3 is capped at K3_MAX.
    exact is no estimator of samples: the loss reads the whole-vocabulary KL the loop computed (kl_in_loss).
    """
    log_ratio = logp - ref_logp                                                            # (B, C)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        bounded = log_ratio.clamp(-KL_LOG_RATIO_MAX, KL_LOG_RATIO_MAX)
        return (torch.exp(-bounded) - 1 + bounded).clamp(max=K3_MAX)
    if estimator == "exact":
        raise ValueError("kl_estimator=exact is the whole-vocabulary KL of the update's forward (new['ref_kl'], "
                         "full_kl.py), not an estimate from log-probs: it sits in the loss only (kl_in_reward=false)")
    raise ValueError(f"unknown kl_estimator {estimator!r}; known: k1, k2, k3, exact")


def kl_in_reward(batch, cfg) -> Tensor:
    """Per-token KL penalty folded into the reward (B, C): -kl_coef * KL_t, or zeros when the KL is off or
    sits in the loss. No gradient flows through it: it is part of the return, like the score.
    KL_t is the trainer's (batch.old_logprobs, which train.extra_logprobs computes whenever the KL sits in the
    reward), as in verl and TRL: the engine's sampling log-probs differ from it by the rollout/train mismatch
    (engine_dtype, top_k, a lagging engine: docs/mismatch.md), which must not leak into the advantages."""
    if cfg.kl_coef <= 0 or not cfg.kl_in_reward:
        return torch.zeros_like(batch.completion_mask)
    if batch.old_logprobs is None:
        raise ValueError("algo.kl_in_reward needs the trainer's log-probs of the samples (batch.old_logprobs), "
                         "which train.extra_logprobs computes when the KL sits in the reward")
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, cfg.kl_estimator)           # (B, C)
    return -cfg.kl_coef * kl * batch.completion_mask


def sequence_rewards(batch, cfg) -> Tensor:
    """Scalar reward per sample (B,), minus the summed KL penalty when kl_in_reward is on."""
    return batch.rewards.float() + kl_in_reward(batch, cfg).sum(-1)


def token_rewards(batch, cfg, score: Tensor | None = None) -> Tensor:
    """Per-token rewards (B, C): the score (B,) (default: batch.rewards) on the last completion token, plus
    the per-token KL penalty when it sits in the reward. Multi-turn episodes (batch.turn_rewards) keep each
    turn's reward on that turn's last model token, per-step rewards each step's on the step's last token; a score
    other than batch.rewards (a baseline-centred one) moves the difference onto the last model token, so each row
    still sums to the score."""
    mask = batch.completion_mask
    score = batch.rewards.float() if score is None else score
    # the last model token: in a multi-turn episode observation tokens (mask 0) sit between the turns
    C = mask.shape[1]
    last = (torch.arange(C, device=mask.device) * (mask > 0)).argmax(-1)                 # (B,) 0 for an empty row
    if batch.turn_rewards is not None:
        score = score - batch.rewards.float()
    at_end = torch.zeros_like(mask).scatter(1, last[:, None], score[:, None])           # (B, C)
    if batch.turn_rewards is not None:
        at_end = at_end + batch.turn_rewards.float()
    return at_end * mask + kl_in_reward(batch, cfg)


def tis_weights(train_logp: Tensor, sample_logp: Tensor, mask: Tensor, mode: str, cap: float) -> Tensor:
    """Truncated importance sampling (B, C): corrects for the rollout engine sampling from a slightly
    different distribution than the trainer computes (bf16 vs fp32, kernels, vLLM).

    token: w_t = min(pi_train(y_t) / pi_sample(y_t), cap)
    seq:   w   = min(prod_t pi_train / pi_sample, cap), the same on every token of the sequence
    mask:  w_t = rho_t if 1/cap <= rho_t <= cap else 0, rho_t = pi_train(y_t) / pi_sample(y_t): masked importance
           sampling, per token; a token the engine saw far off the trainer's policy gets no loss at all instead
           of a truncated weight (docs/mismatch.md)
    mask_high: w_t = rho_t if rho_t <= cap else 0: only tokens above the cap leave the loss (they still count in
           its token mean), as AReaL's decoupled objective does with its behaviour weight (docs/async.md)
    All are detached: they reweight the gradient, they are not optimised.
    """
    log_w = (train_logp.detach() - sample_logp) * mask                                 # (B, C)
    if mode == "token":
        return log_w.exp().clamp(max=cap) * mask
    if mode == "seq":
        return log_w.sum(-1, keepdim=True).clamp(max=30).exp().clamp(max=cap) * mask   # (B, 1) -> (B, C)
    if mode == "mask":
        inside = log_w.abs() <= math.log(cap)                                          # (B, C) rho in the band
        return torch.where(inside, log_w.exp(), 0.0) * mask                            # where: exp(big) * 0 is nan
    if mode == "mask_high":
        return torch.where(log_w <= math.log(cap), log_w.exp(), 0.0) * mask           # (B, C)
    if mode == "off":
        return mask
    raise ValueError(f"unknown tis {mode!r}; known: off, token, seq, mask, mask_high")


def clipped_policy_loss(new: dict, batch, cfg, loss_agg: str | None = None,
                        clip: tuple[float, float] | None = None) -> tuple[Tensor, dict]:
    """PPO's clipped surrogate on per-token advantages, plus the KL term when it sits in the loss.

        ratio = exp(logp_new - logp_old)
        loss  = agg( w * max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)) + kl_coef * KL )
    w is the truncated importance weight (1 when tis=off). Variants pass their own aggregation and clip
    range; the defaults come from cfg.
    Dual-clip PPO (Ye et al. 2020; verl's default with c = 3), when cfg.dual_clip = c > 1: where A < 0 the loss
    is min(that max, -A * c), so a token whose ratio has grown far past 1 (a sample now much likelier than when
    drawn, with a negative advantage) stops adding gradient at ratio c; clip_frac_dual counts such tokens
    (verl's pg_clipfrac_lower).
    Two clip fractions, both token means over the completion:
      clip_frac      tokens whose ratio lies outside [1 - eps_low, 1 + eps_high], whatever A's sign;
      clip_frac_cut  tokens whose gradient the clip removes: ratio above 1 + eps_high with A > 0, or below
                     1 - eps_low with A < 0 (the max picks the clipped term). verl's pg_clipfrac and TRL's
                     clip_ratio count these; the other tokens outside the range still get their gradient.
    """
    logp, mask, adv = new["logprobs"], batch.completion_mask, batch.advantages               # (B, C) each
    old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    lo, hi = clip if clip is not None else (cfg.clip_eps, cfg.clip_eps_high)
    ratio = torch.exp(logp - old)                                                           # (B, C)
    clipped = ratio.clamp(1 - lo, 1 + hi)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)                                 # (B, C)
    metrics = {"clip_frac": masked_mean(((ratio - clipped).abs() > 0).float(), mask).detach(),
               "clip_frac_cut": masked_mean(clip_cuts(ratio, clipped, adv), mask).detach(),
               "ratio": masked_mean(ratio.detach(), mask)}
    if cfg.dual_clip:
        cap = -adv * cfg.dual_clip                                                          # (B, C)
        capped = (adv < 0) & (per_token > cap)
        metrics["clip_frac_dual"] = masked_mean(capped.float(), mask).detach()
        per_token = torch.where(capped, cap, per_token)
    if cfg.tis != "off":
        w = tis_weights(old, batch.sample_logprobs, mask, cfg.tis, cfg.tis_cap)             # (B, C)
        per_token = per_token * w
        metrics["tis_weight"] = masked_mean(w, mask).detach()
        if cfg.tis in ("mask", "mask_high"):   # the share of tokens whose loss the band removed
            metrics["tis_masked_frac"] = masked_mean((w == 0).float(), mask).detach()
    per_token = per_token + kl_in_loss(logp, batch, cfg, metrics, new.get("ref_kl"))
    loss = aggregate(per_token, mask, loss_agg or cfg.loss_agg, cfg.norm_len)
    metrics["entropy"] = masked_mean(new["entropy"].detach(), mask)
    return loss, metrics


def clip_cuts(ratio: Tensor, clipped: Tensor, adv: Tensor) -> Tensor:
    """1.0 where the clipped surrogate is the larger loss term, so the clip zeroes the gradient (same shape)."""
    return (-adv * clipped > -adv * ratio).float().detach()


def kl_in_loss(logp: Tensor, batch, cfg, metrics: dict, exact: Tensor | None = None) -> Tensor:
    """kl_coef * KL_t (B, C) when the KL sits in the loss (else 0); logs the KL's mean either way it is on.
    exact: with kl_estimator=exact, KL(new || ref) over the whole vocabulary per token (B, C), with its gradient
    (new["ref_kl"]: full_kl.py), taken as it is instead of an estimate from the sampled token's log-probs."""
    if cfg.kl_coef <= 0:
        return torch.zeros_like(logp)
    if cfg.kl_estimator == "exact" and exact is None:
        raise ValueError("kl_estimator=exact needs the update's whole-vocabulary KL (new['ref_kl']): this loss was "
                         "given none (algos/common.py: Algorithm.exact_kl)")
    kl = exact if cfg.kl_estimator == "exact" else kl_estimate(logp, batch.ref_logprobs, cfg.kl_estimator)   # (B, C)
    metrics["kl"] = masked_mean(kl.detach(), batch.completion_mask)
    return torch.zeros_like(logp) if cfg.kl_in_reward else cfg.kl_coef * kl
