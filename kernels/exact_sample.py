"""Log-softmax, sampling and entropy per row for exact_logprobs on a GPU (engines/exact.py, docs/exact.md): one
kernel, called by the engine (sample a token, its log-prob) and by the trainer (a target's log-prob, the entropy),
so a token's log-prob is the same bits on both sides.

    tok, logp, ent = exact_row_logprobs(logits (R, V), inv_t (1,) float32, tgt (R,) long | None, seed, step)

One program per row walks the vocabulary in blocks of BV columns, always from column 0 upwards: a running max m
and a sum s of exp(z - m) (z = logit * inv_t in float32, the sum rescaled when m grows), so lse = m + log(s) has one
order whatever the call (R, the row's place). logp = z[tok] - lse. With tgt None the token is drawn first by the
inverse CDF: one uniform u per row (Philox keyed by seed + step, and the row), then a second walk in the same
order adds exp(z - m) until it passes u * s. With tgt given, a second walk sums p * log p for the entropy.
The flags are runtime arguments, not compile-time ones, so the engine and the trainer run one compiled kernel
(the same instructions for lse); seed and step are device tensors, so the engine's CUDA graph replays it with a
new step each token (no host sync, no generator call inside the graph).
"""
import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

BV = 2048      # columns per block: fixed, so the row's reduction order is fixed
WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["R", "V", "stride", "SAMPLE"])
    def _rows(z_ptr, tgt_ptr, inv_t_ptr, seed_ptr, step_ptr, tok_ptr, logp_ptr, ent_ptr, R, V, stride, SAMPLE,
              BV: tl.constexpr):
        row = tl.program_id(0)
        off = row.to(tl.int64) * stride
        inv_t = tl.load(inv_t_ptr)
        c = tl.arange(0, BV)
        m = -float("inf")
        s = 0.0
        for c0 in range(0, V, BV):                                   # the one order: column 0 upwards
            ok = c0 + c < V
            z = tl.where(ok, tl.load(z_ptr + off + c0 + c, mask=ok, other=0.0).to(tl.float32) * inv_t, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, 0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)       # all -inf so far: exp(-inf - -inf) is nan
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
            m = m_new
        lse = m + tl.log(s)
        if SAMPLE != 0:
            u = tl.rand(tl.load(seed_ptr) + tl.load(step_ptr) * 1000003, row)
            x = u * s                                                # the mass to pass, in exp(z - m) units
            run = 0.0
            tok = -1
            last = 0
            for c0 in range(0, V, BV):
                ok = c0 + c < V
                z = tl.where(ok, tl.load(z_ptr + off + c0 + c, mask=ok, other=0.0).to(tl.float32) * inv_t,
                             -float("inf"))
                e = tl.exp(z - m)
                cum = tl.cumsum(e, 0) + run
                hit = tl.min(tl.where(cum > x, c0 + c, V), 0)
                tok = tl.where((tok < 0) & (hit < V), hit, tok)
                last = tl.maximum(last, tl.max(tl.where(e > 0, c0 + c, -1), 0))
                run = run + tl.sum(e, 0)
            tok = tl.where(tok < 0, last, tok)                         # rounding left u * s above the last sum
            tl.store(tok_ptr + row, tok.to(tl.int64))
        else:
            tok = tl.load(tgt_ptr + row).to(tl.int32)
            ent = 0.0
            for c0 in range(0, V, BV):
                ok = c0 + c < V
                z = tl.where(ok, tl.load(z_ptr + off + c0 + c, mask=ok, other=0.0).to(tl.float32) * inv_t,
                             -float("inf"))
                lp = z - lse
                ent = ent + tl.sum(tl.where(ok, tl.exp(lp) * lp, 0.0), 0)
            tl.store(ent_ptr + row, -ent)
        z_tok = tl.load(z_ptr + off + tok).to(tl.float32) * inv_t
        tl.store(logp_ptr + row, z_tok - lse)


def exact_row_logprobs(logits: Tensor, inv_t: Tensor, tgt: Tensor | None = None, seed: Tensor | None = None,
                       step: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """logits (R, V) -> tok (R,) long, logp (R,) float32, ent (R,) float32 (module doc). tgt None: sample (seed and
    step (1,) int64 device tensors; ent is left unwritten); else tok = tgt and ent is the entropy. Values only."""
    R, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    for name, t, dtype in (("inv_t", inv_t, torch.float32), ("seed", seed, torch.long), ("step", step, torch.long)):
        if t is not None and (t.shape != (1,) or t.dtype != dtype or t.device != logits.device):
            raise ValueError(f"{name} must be a (1,) {dtype} tensor on {logits.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    sample = tgt is None
    if sample and (seed is None or step is None):
        raise ValueError("exact_row_logprobs samples with seed and step tensors: pass both, or a tgt")
    dev = logits.device
    tok = torch.empty(R, dtype=torch.long, device=dev) if sample else tgt.to(torch.long).contiguous()
    logp = torch.empty(R, dtype=torch.float32, device=dev)
    ent = torch.empty(R, dtype=torch.float32, device=dev)
    seed = seed if seed is not None else tok
    step = step if step is not None else tok
    if R:
        _rows[(R,)](logits, tok, inv_t, seed, step, tok, logp, ent, R, V, logits.stride(0), int(sample), BV=BV,
                    num_warps=WARPS)
    return tok, logp, ent
