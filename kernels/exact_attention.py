"""Attention for exact_logprobs on a GPU (engines/exact.py, docs/exact.md): one launch per layer, the same
arithmetic for a token in a one-token decode step over the cache as in the trainer's full-sequence forward.

`exact_attention(q, rows, pos, kc, vc, window, scale, block)`: q (N, nh, D) of tokens at (rows, pos), caches
kc, vc (B, nkv, L, D) with slot = position -> (N, nh, D). One program per (token, KV head): its query tile is
that token's GQA group of query heads (padded to GP >= 16 rows), so the tile holds the same values whichever
call the token is in. Keys go in blocks of `block` slots in slot order, from the first block its window reaches
to the block holding its own position, nothing after: the online softmax (running max, rescaled sum and
p @ V in float32; tl.dot of fixed shapes) takes the same steps on both sides. Slots past the position or outside
the window are masked to -inf (their weight is exactly 0, whatever the slot holds).

`exact_rope_cache(q, k, v, rows, pos, cos, sin, kc, vc)`: the rotary embedding of q and k and the K/V cache write,
one launch per layer, each element computed alone.
"""
import torch
from torch import Tensor

from kernels.exact_gemm import EXPLICIT_DOT
from kernels.logprob import HAS_TRITON

WARPS = 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kernels.exact_gemm import dot

    @triton.jit(do_not_specialize=["L", "sk_b", "sk_h"])
    def _attend(q_ptr, rows_ptr, pos_ptr, k_ptr, v_ptr, o_ptr, L, window, scale,
                sq_n, sq_h, sk_b, sk_h, sk_s, so_n, so_h,
                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                PRECISION: tl.constexpr, EXPLICIT: tl.constexpr):
        n, h = tl.program_id(0).to(tl.int64), tl.program_id(1)          # token, KV head
        gi = tl.arange(0, GP)
        d = tl.arange(0, DP)
        qm = (gi[:, None] < G) & (d[None, :] < D)
        q = tl.load(q_ptr + n * sq_n + (h * G + gi)[:, None] * sq_h + d[None, :], mask=qm, other=0.0)   # (GP, DP)
        p = tl.load(pos_ptr + n)
        base = tl.load(rows_ptr + n).to(tl.int64) * sk_b + h * sk_h
        first = tl.where(window > 0, tl.maximum(p - window + 1, 0), 0)    # the first slot its window reaches
        m = tl.full((GP,), -1.0e30, tl.float32)                          # finite: exp(m - m_new) is never nan
        s = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        for j0 in range((first // BLOCK) * BLOCK, p + 1, BLOCK):        # slot order, up to the token's own block
            j = j0 + tl.arange(0, BLOCK)
            kv = (j[:, None] < L) & (d[None, :] < D)
            k = tl.load(k_ptr + base + j[:, None] * sk_s + d[None, :], mask=kv, other=0.0)   # (BLOCK, DP)
            v = tl.load(v_ptr + base + j[:, None] * sk_s + d[None, :], mask=kv, other=0.0)
            sc = dot(q, tl.trans(k), tl.zeros((GP, BLOCK), tl.float32), PRECISION, EXPLICIT) * scale   # (GP, BLOCK)
            sc = tl.where(((j <= p) & (j >= first))[None, :], sc, -float("inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            e = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            s = s * alpha + tl.sum(e, 1)
            acc = dot(e.to(v.dtype), v, acc * alpha[:, None], PRECISION, EXPLICIT)
            m = m_new
        o = acc / s[:, None]
        tl.store(o_ptr + n * so_n + (h * G + gi)[:, None] * so_h + d[None, :], o.to(o_ptr.dtype.element_ty), mask=qm)


def exact_attention(q: Tensor, rows: Tensor, pos: Tensor, kc: Tensor, vc: Tensor, window: int | None, scale: float,
                    block: int) -> Tensor:
    """See the module's docstring; values only (no autograd). Every call with the same model and block compiles
    to one kernel: the shapes that vary between calls (N, L) are runtime arguments that change no arithmetic."""
    if torch.is_grad_enabled() and (q.requires_grad or kc.requires_grad or vc.requires_grad):
        raise RuntimeError("kernels/exact_attention.py gives values only: call it under torch.no_grad()")
    N, nh, D = q.shape
    B, nkv, L, _ = kc.shape
    assert vc.stride() == kc.stride(), "k and v caches must share a layout"
    q, o = q.contiguous(), torch.empty_like(q)
    if N:
        _attend[(N, nkv)](q, rows.contiguous(), pos.contiguous(), kc, vc, o, L, window or 0, scale,
                          q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), o.stride(0), o.stride(1),
                          G=nh // nkv, GP=max(16, triton.next_power_of_2(nh // nkv)), D=D,
                          DP=max(16, triton.next_power_of_2(D)), BLOCK=max(16, block),
                          PRECISION="ieee" if q.dtype == torch.float32 else "tf32", EXPLICIT=EXPLICIT_DOT,
                          num_warps=WARPS)
    return o


if HAS_TRITON:
    @triton.jit
    def _rope_cache(q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, qo_ptr,
                    sq_n, sk_n, sv_n, sc_l, sk_b, sk_h, sk_s,
                    NH: tl.constexpr, NKV: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        # one program per token: rotate its q heads into qo, its k heads into the K cache at (row, pos), copy its
        # v heads into the V cache; every element alone (x * cos + partner * sin), so no element depends on a call
        n = tl.program_id(0).to(tl.int64)
        p = tl.load(pos_ptr + n).to(tl.int64)
        r = tl.load(rows_ptr + n).to(tl.int64)
        h = tl.arange(0, HP)
        d = tl.arange(0, DP)
        half: tl.constexpr = D // 2
        pd = tl.where(d < half, d + half, d - half)                    # rotate_half's partner column
        sign = tl.where(d < half, -1.0, 1.0)
        c = tl.load(cos_ptr + p * sc_l + d, mask=d < D, other=0.0).to(tl.float32)[None, :]    # (1, DP)
        s = tl.load(sin_ptr + p * sc_l + d, mask=d < D, other=0.0).to(tl.float32)[None, :] * sign[None, :]
        qm = (h[:, None] < NH) & (d[None, :] < D)
        qa = tl.load(q_ptr + n * sq_n + h[:, None] * D + d[None, :], mask=qm, other=0.0).to(tl.float32)
        qb = tl.load(q_ptr + n * sq_n + h[:, None] * D + pd[None, :], mask=qm, other=0.0).to(tl.float32)
        tl.store(qo_ptr + n * (NH * D) + h[:, None] * D + d[None, :], (qa * c + qb * s).to(qo_ptr.dtype.element_ty),
                 mask=qm)
        km = (h[:, None] < NKV) & (d[None, :] < D)
        ka = tl.load(k_ptr + n * sk_n + h[:, None] * D + d[None, :], mask=km, other=0.0).to(tl.float32)
        kb = tl.load(k_ptr + n * sk_n + h[:, None] * D + pd[None, :], mask=km, other=0.0).to(tl.float32)
        at = r * sk_b + h[:, None] * sk_h + p * sk_s + d[None, :]
        tl.store(kc_ptr + at, (ka * c + kb * s).to(kc_ptr.dtype.element_ty), mask=km)
        v = tl.load(v_ptr + n * sv_n + h[:, None] * D + d[None, :], mask=km, other=0.0)
        tl.store(vc_ptr + at, v.to(vc_ptr.dtype.element_ty), mask=km)


def exact_rope_cache(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, pos: Tensor, cos: Tensor, sin: Tensor,
                     kc: Tensor, vc: Tensor) -> Tensor:
    """Rotary on q (N, nh, D) and k (N, nkv, D) (rotate_half form, tables cos, sin (L, D)), k and v written into
    the caches kc, vc (B, nkv, L', D) at (rows, pos) -> rotated q (N, nh, D). One launch for what took a dozen
    elementwise kernels; each element is computed alone (x * cos + partner * sin in float32, rounded once), so its
    bits do not depend on the call. q, k, v may be views of one (N, ...) projection output (heads contiguous)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("kernels/exact_attention.py gives values only: call it under torch.no_grad()")
    N, nh, D = q.shape
    nkv = k.shape[1]
    if q.stride(1) != D or k.stride(1) != D or v.stride(1) != D or q.stride(2) != 1 or D % 2:
        raise ValueError(f"exact_rope_cache needs heads contiguous in q, k, v and an even head size, got {D}")
    assert vc.stride() == kc.stride() and cos.stride() == sin.stride(), "caches and tables must share layouts"
    qo = torch.empty(N, nh, D, device=q.device, dtype=q.dtype)
    if N:
        _rope_cache[(N,)](q, k, v, rows.contiguous(), pos.contiguous(), cos, sin, kc, vc, qo,
                          q.stride(0), k.stride(0), v.stride(0), cos.stride(0), kc.stride(0), kc.stride(1),
                          kc.stride(2), NH=nh, NKV=nkv, HP=triton.next_power_of_2(max(nh, nkv)), D=D,
                          DP=triton.next_power_of_2(D), num_warps=4)
    return qo
