"""Small shared pieces of the losses: masked means, loss aggregation, KL estimators."""
import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim=None) -> Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def aggregate(loss: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """Reduce per-token losses (B, C) to a scalar.

    token-mean:              every token in the batch weighs the same (DAPO, Dr. GRPO)
    seq-mean-token-mean:     mean over each sequence, then over sequences (original GRPO)
    seq-mean-token-sum:      sum over each sequence, then mean over sequences
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
    raise ValueError(f"unknown loss_agg {mode!r}; known: token-mean, seq-mean-token-mean, "
                     "seq-mean-token-sum, seq-mean-token-sum-norm")


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman, 'Approximating KL').

    k1 = log r            unbiased, high variance, can be negative
    k2 = (log r)^2 / 2    biased, low variance
    k3 = (r' - 1) - log r'  with r' = ref/policy: unbiased, always >= 0 (GRPO's choice)
    where log r = logp - ref_logp.
    """
    log_ratio = logp - ref_logp                                   # (B, C)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown kl_estimator {estimator!r}; known: k1, k2, k3")
