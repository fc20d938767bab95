"""Kernels, imported directly by the code that runs them. Each entry point below picks the fused Triton version
where it runs (CUDA tensors and an importable triton, or TRITON_INTERPRET=1 for tests on CPU) and the torch
reference twin elsewhere, so the caller never checks the device:

    from kernels import token_logprobs, linear_logprobs, linear_logprob_loss_kernel, sample_token, decode_attention_kernel
    logp, ent = token_logprobs(logits, targets, temperature)                          # logits (..., V)
    logp, ent = linear_logprobs(hidden, lm_head_weight, targets, temperature)         # hidden (..., H)
    loss, logp, ent = linear_logprob_loss_kernel(hidden, lm_head_weight, targets, temperature, loss_fn)
        # loss_fn(rows, logp (b, C), entropy (b, C)) -> scalar; the gradient is computed in the forward
        # (3 matmuls instead of 4): see kernels/logprob_loss.py for when a loss qualifies
    tok, logp = sample_token(logits, inv_t, seed, step)     # (B, V) -> (B,), (B,): Gumbel-max
    o = decode_attention_kernel(qkv, cos, sin, pos, k, v, key_ok, last, scale)   # rotary + cache write +
                                                            # attention of one new token per sequence

Targets < 0 mark padded tokens: logp = entropy = 0 there, and no gradient flows from them.
"""
import os

from torch import Tensor

from kernels.decode_attention import decode_attention, decode_attention_reference
from kernels.fused_kl import fused_kl, fused_kl_reference  # noqa: F401  (full-vocabulary KL: kernels/fused_kl.py)
from kernels.linear_logprob import linear_logprob_entropy
from kernels.logprob_loss import linear_logprob_loss
from kernels.logprob import HAS_TRITON, logprob_entropy, logprob_entropy_reference
from kernels.sample import cdf_sample, gumbel_sample, gumbel_sample_reference


def use_triton(*tensors: Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or all(t.is_cuda for t in tensors)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """logits (..., V), targets (...) -> (logp, entropy), each shaped like targets."""
    shape = targets.shape
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if use_triton(logits):
        logp, ent = logprob_entropy(flat, tgt, temperature)
    else:
        logp, ent = logprob_entropy_reference(flat, tgt, temperature)
    return logp.view(shape), ent.view(shape)


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                    into_grad: bool = False) -> tuple[Tensor, Tensor]:
    """hidden (..., H), lm_head weight (V, H), targets (...) -> (logp, entropy), each shaped like targets.
    Gradients flow to hidden and weight (into_grad: straight into weight.grad, see kernels/linear_logprob.py);
    the (N, V) logits are never held whole on either path."""
    return linear_logprob_entropy(hidden, weight, targets, temperature, use_triton=use_triton(hidden, weight),
                                  into_grad=into_grad)


def linear_logprob_loss_kernel(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, loss_fn,
                               rows_per_chunk: int | None = None, into_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """hidden (B, C, H), weight (V, H), targets (B, C) -> (loss, logp (B, C), entropy (B, C)); loss.backward()
    gives hidden.grad and weight.grad (into_grad: straight into weight.grad). loss_fn(rows: slice, logp (b, C),
    entropy (b, C)) -> that chunk's scalar."""
    return linear_logprob_loss(hidden, weight, targets, temperature, loss_fn, rows_per_chunk,
                               use_triton=use_triton(hidden, weight), into_grad=into_grad)


SAMPLERS = ("gumbel", "cdf")


def sample_token(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor, method: str = "gumbel") -> tuple[Tensor, Tensor]:
    """logits (B, V), inv_t / seed / step (1,) device tensors -> tok (B,), logp (B,): one token per row at
    temperature 1 / inv_t, noise keyed by seed and step (kernels/sample.py; the decode graph replays it).
    method: "gumbel" (exponential race) or "cdf" (inverse CDF, one uniform per row): same distribution,
    different draws for the same seed; the CPU twin is the Gumbel one for both."""
    if method not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {method!r}")
    if not use_triton(logits):
        return gumbel_sample_reference(logits, inv_t, seed, step)
    return (cdf_sample if method == "cdf" else gumbel_sample)(logits, inv_t, seed, step)


def decode_attention_kernel(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k: Tensor, v: Tensor,
                            key_ok: Tensor, last: Tensor, scale: float, splits: int = 1) -> Tensor:
    """qkv (B, (nh + 2 nkv) D), rotary tables cos/sin (S, D), pos (B,), caches k/v (B, nkv, S, D), key_ok (B, S),
    last (1,) -> (B, nh D): rotary, the new K/V written at slot `last`, and attention over the slots up to it
    (kernels/decode_attention.py). splits > 1: the kernel's flash-decoding form (the CPU twin ignores it)."""
    if use_triton(qkv):
        return decode_attention(qkv, cos, sin, pos, k, v, key_ok, last, scale, splits=splits)
    return decode_attention_reference(qkv, cos, sin, pos, k, v, key_ok, last, scale)
