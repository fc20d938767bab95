"""Sampling one token per row from logits, with its log-prob, in one pass over the vocabulary.

    tok, logp = gumbel_sample(logits (B, V), inv_t (1,) float32, seed (1,) int64, step (1,) int64)
    # tok (B,) long ~ softmax(logits * inv_t), logp (B,) float32 = log softmax(logits * inv_t)[tok]

Why: the decode loop of fast_decode.py samples 256 times per rollout over a 152k vocabulary. The eager
route (scale, log_softmax, exp, multinomial, gather: ~8 kernels, each a trip through B x V float32) cost
~0.3 ms per token on an H200, and torch.multinomial with a user generator cannot sit inside a CUDA graph.
Here the Gumbel-max trick does it in one read of the bf16 logits: argmax(z + g) with g = -log(-log u),
u uniform, is an exact sample of softmax(z), and the same pass keeps an online logsumexp for logp.
Each row is split over SPLIT programs (partial max / sum / best), then a tiny kernel combines them.
Every argument is a device tensor, so the kernel can be captured in a CUDA graph and replayed with a new
`step` each token; the noise is Philox (tl.rand) keyed by (seed + step, row * V + column), so a rollout
is reproducible from its seed, which the caller draws from its torch.Generator.

`gumbel_sample_reference` is the torch twin (CPU): same math, noise from torch.rand; it gives a different
(equally valid) sample than the kernel for the same seed.
"""
import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

SPLIT = 16   # programs per row: 128 rows alone would leave most of a GPU idle (one program per SM)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gumbel_partial(z_ptr, pm_ptr, ps_ptr, pb_ptr, pi_ptr, inv_t_ptr, seed_ptr, step_ptr, V, stride, span,
                        SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, part) scans columns [part * span, (part + 1) * span): running max m and sum s of
        # exp(z - m) (online logsumexp), and the running best of z + gumbel noise with its column
        row, part = tl.program_id(0), tl.program_id(1)
        inv_t = tl.load(inv_t_ptr)
        seed = tl.load(seed_ptr) + tl.load(step_ptr) * 1000003        # a new stream per token step
        m = -float("inf")
        s = 0.0
        best = -float("inf")
        best_i = 0
        for c0 in range(part * span, (part + 1) * span, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_ptr + row.to(tl.int64) * stride + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
            u = tl.rand(seed, row * V + cols)                          # [0, 1), Philox
            g = -tl.log(-tl.log(tl.maximum(u, 1e-20)))                 # u = 0 would give -inf: avoided
            score = tl.where(ok, z + g, -float("inf"))
            i = tl.argmax(score, 0)
            top = tl.max(score, 0)
            better = top > best
            best_i = tl.where(better, c0 + i, best_i)
            best = tl.where(better, top, best)
            m_new = tl.maximum(m, tl.max(z, 0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)       # all -inf so far: exp(-inf - -inf) is nan
            s = s * tl.exp(m - shift) + tl.sum(tl.where(ok, tl.exp(z - shift), 0.0), 0)
            m = m_new
        out = row * SPLIT + part
        tl.store(pm_ptr + out, m)
        tl.store(ps_ptr + out, s)
        tl.store(pb_ptr + out, best)
        tl.store(pi_ptr + out, best_i.to(tl.int64))

    @triton.jit
    def _gumbel_combine(z_ptr, pm_ptr, ps_ptr, pb_ptr, pi_ptr, tok_ptr, logp_ptr, inv_t_ptr, stride, parts,
                        SPLIT: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, SPLIT)
        k = row * SPLIT + j
        pm = tl.load(pm_ptr + k, mask=j < parts, other=-float("inf"))
        ps = tl.load(ps_ptr + k, mask=j < parts, other=0.0)
        pb = tl.load(pb_ptr + k, mask=j < parts, other=-float("inf"))
        m = tl.max(pm, 0)
        s = tl.sum(tl.where(ps > 0, ps * tl.exp(pm - m), 0.0), 0)
        tok = tl.load(pi_ptr + row * SPLIT + tl.argmax(pb, 0))
        z_tok = tl.load(z_ptr + row.to(tl.int64) * stride + tok).to(tl.float32) * tl.load(inv_t_ptr)
        tl.store(tok_ptr + row, tok)
        tl.store(logp_ptr + row, z_tok - m - tl.log(s))


def gumbel_sample(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor, split: int = SPLIT,
                  block: int = 1024) -> tuple[Tensor, Tensor]:
    """logits (B, V) any float dtype, inv_t (1,) float32, seed and step (1,) int64 -> tok (B,) long, logp (B,).
    split, block: programs per row at most, columns per load (tests use small ones to cover every path)."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    parts = min(split, triton.cdiv(V, block))                          # a small vocabulary needs fewer
    span = triton.cdiv(triton.cdiv(V, parts), block) * block           # columns per program, whole blocks
    P2 = triton.next_power_of_2(parts)
    part = lambda dtype: torch.empty(B, P2, dtype=dtype, device=logits.device)
    pm, ps, pb, pi = part(torch.float32), part(torch.float32), part(torch.float32), part(torch.long)
    _gumbel_partial[(B, parts)](logits, pm, ps, pb, pi, inv_t, seed, step, V, logits.stride(0), span,
                                SPLIT=P2, BLOCK=block, num_warps=4)
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _gumbel_combine[(B,)](logits, pm, ps, pb, pi, tok, logp, inv_t, logits.stride(0), parts, SPLIT=P2,
                          num_warps=1)
    return tok, logp


def gumbel_sample_reference(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """The torch twin of gumbel_sample (CPU): same contract, noise from a generator keyed by seed and step."""
    z = logits.float() * inv_t                                          # (B, V)
    gen = torch.Generator(device=logits.device).manual_seed(int(seed) + int(step) * 1000003)
    u = torch.rand(z.shape, generator=gen, device=logits.device).clamp(min=1e-20)
    tok = (z - torch.log(-torch.log(u))).argmax(-1)                     # (B,)
    return tok, z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
