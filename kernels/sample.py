"""Sampling one token per row from logits, with its log-prob, in one pass over the vocabulary.

    tok, logp = gumbel_sample(logits (B, V), inv_t (1,) float32, seed (1,) int64, step (1,) int64)
    # tok (B,) long ~ softmax(logits * inv_t), logp (B,) float32 = log softmax(logits * inv_t)[tok]

Why: the decode loop of engines/fast_decode.py samples 256 times per rollout over a 152k vocabulary. The eager
route (scale, log_softmax, exp, multinomial, gather: ~8 kernels, each a trip through B x V float32) reads the
vocabulary many times per token, and torch.multinomial with a user generator cannot sit inside a CUDA graph.
Here the Gumbel-max trick does it in one read of the bf16 logits: argmax(z + g) with g = -log(-log u),
u uniform, is an exact sample of softmax(z), and the same pass keeps an online logsumexp for logp. The kernel
computes it as the exponential race argmax(exp(z - m) / -log u), the same sample for the same u with one log
per column instead of two, reusing the logsumexp's exp; one Philox call gives 4 columns their u.
Each row is split over SPLIT programs (partial max / sum / best), then a tiny kernel combines them.
Every argument is a device tensor, so the kernel can be captured in a CUDA graph and replayed with a new
`step` each token; the noise is Philox (tl.rand4x) keyed by (seed + step, row and column), so a rollout
is reproducible from its seed, which the caller draws from its torch.Generator.

`gumbel_sample_reference` is the torch twin (CPU): same math, noise from torch.rand; it gives a different
(equally valid) sample than the kernel for the same seed.
"""
import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

# programs per row at most, and columns per block: 128 rows alone would leave most of a GPU idle. Large blocks,
# because each block's reductions cost more than its arithmetic (measured: docs/kernels.md, "Sampler")
SPLIT, BLOCK = 64, 4096

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _race(z_ptr, row_off, c, q, V, inv_t, u, m, s, best, best_i):
        # one group of columns: online logsumexp (m, s) and the exponential race, which is Gumbel-max with one
        # log per column: argmax exp(z) / E with E = -log(u) ~ Exp(1) is argmax z + g with g = -log(-log u)
        # (the same sample for the same u), and exp(z - m) is already there for the logsumexp. Columns c + q.
        cols = c + q
        ok = cols < V
        # masked columns become -inf after the scaling: -inf * inv_t is nan at inv_t = 0 (infinite temperature)
        z = tl.where(ok, tl.load(z_ptr + row_off + cols, mask=ok, other=0.0).to(tl.float32) * inv_t, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)           # all -inf so far: exp(-inf - -inf) is nan
        e = tl.where(ok, tl.exp(z - shift), 0.0)                       # (group,) <= 1
        s = s * tl.exp(m - shift) + tl.sum(e, 0)
        race = e / -tl.log(tl.maximum(u, 1e-20))                      # u = 0 would give E = inf: avoided
        top = tl.log(tl.max(race, 0)) + shift                          # the winner's z + g; -inf if e is all 0
        better = top > best
        best_i = tl.where(better, c + tl.argmax(race, 0), best_i)
        best = tl.where(better, top, best)
        return m_new, s, best, best_i

    @triton.jit
    def _gumbel_partial(z_ptr, pm_ptr, ps_ptr, pb_ptr, pi_ptr, inv_t_ptr, seed_ptr, step_ptr, V, stride, span,
                        SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, part) scans columns [part * span, (part + 1) * span): running max m and sum s of
        # exp(z - m) (online logsumexp), and the running best of z + gumbel noise with its column. Each block
        # is 4 groups of BLOCK / 4 columns that share one Philox call (rand4x: 4 uniforms per call)
        row, part = tl.program_id(0), tl.program_id(1)
        inv_t = tl.load(inv_t_ptr)
        seed = tl.load(seed_ptr) + tl.load(step_ptr) * 1000003        # a new stream per token step
        row_off = row.to(tl.int64) * stride
        m = -float("inf")
        s = 0.0
        best = -float("inf")
        best_i = 0
        Q: tl.constexpr = BLOCK // 4
        q = tl.arange(0, Q)
        for c0 in range(part * span, (part + 1) * span, BLOCK):
            u0, u1, u2, u3 = tl.rand4x(seed, row * V + c0 + q)         # offsets unique per (row, block, q)
            m, s, best, best_i = _race(z_ptr, row_off, c0, q, V, inv_t, u0, m, s, best, best_i)
            m, s, best, best_i = _race(z_ptr, row_off, c0 + Q, q, V, inv_t, u1, m, s, best, best_i)
            m, s, best, best_i = _race(z_ptr, row_off, c0 + 2 * Q, q, V, inv_t, u2, m, s, best, best_i)
            m, s, best, best_i = _race(z_ptr, row_off, c0 + 3 * Q, q, V, inv_t, u3, m, s, best, best_i)
        out = row * SPLIT + part
        tl.store(pm_ptr + out, m)
        tl.store(ps_ptr + out, s)
        tl.store(pb_ptr + out, best)
        tl.store(pi_ptr + out, best_i.to(tl.int64))

    @triton.jit
    def _gumbel_combine(z_ptr, pm_ptr, ps_ptr, pb_ptr, pi_ptr, tok_ptr, logp_ptr, inv_t_ptr, V, stride, parts,
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
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)                    # a row without a finite logit: still in bounds
        z_tok = tl.load(z_ptr + row.to(tl.int64) * stride + tok).to(tl.float32) * tl.load(inv_t_ptr)
        tl.store(tok_ptr + row, tok)
        tl.store(logp_ptr + row, z_tok - m - tl.log(s))


def check_sample_args(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor, split: int, **blocks: int):
    """One-line errors for what the kernels cannot take, before any launch (pure shape checks: no host sync, so
    they run inside a CUDA graph capture too). blocks: name -> a column count that must be a power of two."""
    if logits.dim() != 2 or 0 in logits.shape or not logits.is_floating_point():
        raise ValueError(f"logits must be a float (B, V) tensor with B, V >= 1, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    for name, t, dtype in (("inv_t", inv_t, torch.float32), ("seed", seed, torch.long), ("step", step, torch.long)):
        if t.shape != (1,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(f"{name} must be a (1,) {dtype} tensor on {logits.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if split < 1:
        raise ValueError(f"split must be >= 1, got {split}")
    for name, (n, least) in blocks.items():
        if n < least or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {n}")


def gumbel_sample(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor, split: int = SPLIT,
                  block: int = BLOCK, warps: int = 4) -> tuple[Tensor, Tensor]:
    """logits (B, V) any float dtype, inv_t (1,) float32, seed and step (1,) int64 -> tok (B,) long, logp (B,).
    split, block, warps: programs per row at most, columns per block, warps per program (tests use small
    split and block to cover every path)."""
    check_sample_args(logits, inv_t, seed, step, split, block=(block, 4))   # 4 groups of block / 4 columns
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    parts = min(split, triton.cdiv(V, block))                          # a small vocabulary needs fewer
    span = triton.cdiv(triton.cdiv(V, parts), block) * block           # columns per program, whole blocks
    P2 = triton.next_power_of_2(parts)
    part = lambda dtype: torch.empty(B, P2, dtype=dtype, device=logits.device)
    pm, ps, pb, pi = part(torch.float32), part(torch.float32), part(torch.float32), part(torch.long)
    _gumbel_partial[(B, parts)](logits, pm, ps, pb, pi, inv_t, seed, step, V, logits.stride(0), span,
                                SPLIT=P2, BLOCK=block, num_warps=warps)
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _gumbel_combine[(B,)](logits, pm, ps, pb, pi, tok, logp, inv_t, V, logits.stride(0), parts, SPLIT=P2,
                          num_warps=1)
    return tok, logp


def gumbel_sample_reference(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """The torch twin of gumbel_sample (CPU): same contract, noise from a generator keyed by seed and step."""
    z = logits.float() * inv_t                                          # (B, V)
    gen = torch.Generator(device=logits.device).manual_seed(int(seed) + int(step) * 1000003)
    u = torch.rand(z.shape, generator=gen, device=logits.device).clamp(min=1e-20)
    tok = (z - torch.log(-torch.log(u))).argmax(-1)                     # (B,)
    return tok, z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, -1)


# --- inverse-CDF sampler (method "cdf"): one read of the logits for the logsumexp, one uniform per row ----------
# Why: the Gumbel kernel is bound by per-column arithmetic, not by reading the logits: a quarter of a Philox
# call, a log, an IEEE division and an exp per column, and block-wide reductions per group (instruction counts
# and timings: docs/kernels.md, "Sampler"). Sampling by the inverse CDF needs per column only a multiply, a max
# and an exp (the logsumexp itself); one uniform per row picks the part whose cumulative mass crosses u * S, and only that
# part's columns (one block row of 4096) are read again, to walk its cumulative sum. Same distribution as
# softmax(z / T) (float32 cumulative sums: each cut point is off by ~1e-6 of the row's mass, far under the
# bf16 rounding of the logits themselves); a different draw than the Gumbel kernel for the same seed.

if HAS_TRITON:
    @triton.jit
    def _lse_partial(z_ptr, pm_ptr, ps_ptr, inv_t_ptr, V, stride, span, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, part): max m and sum of exp(z - m) over columns [part * span, (part + 1) * span)
        row, part = tl.program_id(0), tl.program_id(1)
        inv_t = tl.load(inv_t_ptr)
        row_off = row.to(tl.int64) * stride
        m = -float("inf")
        s = 0.0
        q = tl.arange(0, BLOCK)
        for c0 in range(part * span, tl.minimum((part + 1) * span, V), BLOCK):
            cols = c0 + q
            ok = cols < V                                              # -inf after scaling (see _race)
            z = tl.where(ok, tl.load(z_ptr + row_off + cols, mask=ok, other=0.0).to(tl.float32) * inv_t, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, 0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)       # all -inf so far: exp(-inf - -inf) is nan
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
            m = m_new
        tl.store(pm_ptr + row * SPLIT + part, m)
        tl.store(ps_ptr + row * SPLIT + part, s)

    @triton.jit
    def _first_above(c, x, idx, fallback_ok, N: tl.constexpr):
        # index of the first entry of cumulative c above x; where rounding leaves none, the last with mass
        hit = tl.min(tl.where(c > x, idx, N), 0)
        return tl.where(hit < N, hit, tl.max(tl.where(fallback_ok, idx, -1), 0))

    @triton.jit
    def _cdf_pick(z_ptr, pm_ptr, ps_ptr, tok_ptr, logp_ptr, inv_t_ptr, seed_ptr, step_ptr, V, stride, span, parts,
                  SPLIT: tl.constexpr, CB: tl.constexpr):
        row = tl.program_id(0)
        inv_t = tl.load(inv_t_ptr)
        j = tl.arange(0, SPLIT)
        pm = tl.load(pm_ptr + row * SPLIT + j, mask=j < parts, other=-float("inf"))
        ps = tl.load(ps_ptr + row * SPLIT + j, mask=j < parts, other=0.0)
        m = tl.max(pm, 0)
        w = tl.where(ps > 0, ps * tl.exp(pm - m), 0.0)                 # (SPLIT,) each part's mass
        total = tl.sum(w, 0)
        u = tl.rand(tl.load(seed_ptr) + tl.load(step_ptr) * 1000003, row)   # one uniform per row and step
        x = u * total
        part = _first_above(tl.cumsum(w, 0), x, j, w > 0, SPLIT)
        # no part with mass (every logit -inf or nan) gives -1: part 0 then, never columns before the row
        part = tl.minimum(tl.maximum(part, 0), parts - 1)
        x = x - tl.sum(tl.where(j < part, w, 0.0), 0)                  # mass left to cross inside the part
        row_off = row.to(tl.int64) * stride
        q = tl.arange(0, CB)
        run = 0.0
        tok = -1
        last_live = 0
        for c0 in range(part * span, tl.minimum((part + 1) * span, V), CB):
            cols = c0 + q
            ok = cols < V
            z = tl.where(ok, tl.load(z_ptr + row_off + cols, mask=ok, other=0.0).to(tl.float32) * inv_t, -float("inf"))
            e = tl.exp(z - m)                                          # (CB,) 0 where z is -inf
            c = tl.cumsum(e, 0) + run
            hit = tl.min(tl.where(c > x, cols, V), 0)
            tok = tl.where((tok < 0) & (hit < V), hit, tok)
            last_live = tl.maximum(last_live, tl.max(tl.where(e > 0, cols, -1), 0))
            run = run + tl.sum(e, 0)
        tok = tl.where(tok < 0, last_live, tok)                        # rounding left x just above the part's sum
        tok = tl.minimum(tl.maximum(tok, 0), V - 1)
        z_tok = tl.load(z_ptr + row_off + tok).to(tl.float32) * inv_t
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(logp_ptr + row, z_tok - m - tl.log(total))


def cdf_sample(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor, split: int = SPLIT, block: int = BLOCK,
               warps: int = 8, pick_block: int = 1024) -> tuple[Tensor, Tensor]:
    """gumbel_sample's contract by the inverse CDF (see above): logits (B, V), inv_t / seed / step (1,) device
    tensors -> tok (B,) long, logp (B,) float32. split, block, warps: the logsumexp pass's programs per row at
    most, columns per step, warps; pick_block: columns per step of the pick's walk."""
    check_sample_args(logits, inv_t, seed, step, split, block=(block, 1), pick_block=(pick_block, 1))
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    parts = min(split, triton.cdiv(V, block))
    span = triton.cdiv(triton.cdiv(V, parts), block) * block
    parts = triton.cdiv(V, span)                                       # whole blocks per part: maybe fewer parts
    P2 = triton.next_power_of_2(parts)
    pm = torch.empty(B, P2, dtype=torch.float32, device=logits.device)
    ps = torch.empty(B, P2, dtype=torch.float32, device=logits.device)
    _lse_partial[(B, parts)](logits, pm, ps, inv_t, V, logits.stride(0), span, SPLIT=P2, BLOCK=block,
                             num_warps=warps)
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _cdf_pick[(B,)](logits, pm, ps, tok, logp, inv_t, seed, step, V, logits.stride(0), span, parts, SPLIT=P2,
                    CB=min(pick_block, triton.next_power_of_2(span)), num_warps=4)
    return tok, logp
