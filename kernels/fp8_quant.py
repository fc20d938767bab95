"""The fp8 routes' refresh as one Triton kernel per projection: its LoRA adapters merged and the sum quantised per
output channel (engines/decode_weights.py: fp8_group with FP8_REFRESH = "triton"):

    merge_quantise(w, a, b, (w8, scale))     # w (N, K), a (R, K) float32 or None, b (N, R) float32 or None
                                             # -> w8 (N, K) e4m3, scale (N,) float32: w + b @ a ~ w8 * scale[:, None]

Why: the torch route (lora.dense_weight, then kernels/fp8.py's quantise_rows) runs several eager passes over each
weight at every rollout, float32 temporaries included; at W6 that refresh was ~0.24 s of a 1.27 s FP8 rollout
(docs/lora.md). Here program i takes BR rows: a first sweep over K computes w + b a on the fly (a (BR, R) x (R, BK)
product per step, exact float32) and the rows' absolute max; a second sweep recomputes the sum and writes it over
the scale, rounded to e4m3. W is read twice, the FP8 copy written once: ~5 bytes per element against the torch
route's ~49. The sum is not rounded to bf16 first (the torch route's dense_weight does), so the two can differ by
one e4m3 step where that rounding crosses a boundary.

The torch twin: `merged_twin` (the float32 sum, kernels/fp8.py's quantise_rows).
"""
import torch
from torch import Tensor

from kernels.fp8 import FP8_MAX, quantise_rows
from kernels.logprob import HAS_TRITON

BR, BK = 32, 128                    # rows per program; K per step


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _merged(w_ptr, a_ptr, bt, rows, ks, rr, N, K, R, stride_w, stride_a, LORA: tl.constexpr):
        """(BR, BK) float32: w + b a over rows and columns ks (bt: b's (BR, RP) rows, loaded once)."""
        m = (rows[:, None] < N) & (ks[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=m, other=0.0).to(tl.float32)
        if LORA:
            a = tl.load(a_ptr + rr[:, None] * stride_a + ks[None, :], mask=(rr[:, None] < R) & (ks[None, :] < K),
                        other=0.0)                                                          # (RP, BK)
            w += tl.dot(bt, a, input_precision="ieee")
        return w

    @triton.jit
    def _merge_quantise(w_ptr, a_ptr, b_ptr, w8_ptr, s_ptr, N, K, R, stride_w, stride_a, stride_b, stride_w8,
                        QMAX: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
                        LORA: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rr = tl.arange(0, RP)
        bt = tl.zeros((BR, RP), dtype=tl.float32)
        if LORA:
            bt = tl.load(b_ptr + rows[:, None] * stride_b + rr[None, :], mask=(rows[:, None] < N) & (rr[None, :] < R),
                         other=0.0)                                                         # (BR, RP)
        amax = tl.zeros((BR,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            w = _merged(w_ptr, a_ptr, bt, rows, k0 + tl.arange(0, BK), rr, N, K, R, stride_w, stride_a, LORA)
            amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
        s = tl.math.div_rn(amax, tl.full((BR,), QMAX, tl.float32))                       # as quantise_rows
        s = tl.where(s > 0, s, 1.0)
        tl.store(s_ptr + rows, s, mask=rows < N)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            w = _merged(w_ptr, a_ptr, bt, rows, ks, rr, N, K, R, stride_w, stride_a, LORA)
            q = tl.math.div_rn(w, tl.broadcast_to(s[:, None], (BR, BK)))
            tl.store(w8_ptr + rows[:, None] * stride_w8 + ks[None, :], q.to(w8_ptr.dtype.element_ty),
                     mask=(rows[:, None] < N) & (ks[None, :] < K))


@torch.no_grad()
def merge_quantise(w: Tensor, a: Tensor | None, b: Tensor | None, out: tuple[Tensor, Tensor]):
    """Write (w + b @ a) quantised per row into out = (w8 (N, K) e4m3, scale (N,) float32); a, b None: w alone.
    w, w8 with contiguous rows. A float32 w8 gets the quotient unrounded (the interpreted test: triton 3.9's
    interpreter rounds to e4m3 unfaithfully). Triton only (CUDA, or TRITON_INTERPRET=1)."""
    w8, scale = out
    N, K = w.shape
    R = 0 if a is None else a.shape[0]
    if w.stride(1) != 1 or w8.stride(1) != 1 or w8.shape != w.shape or (R and (a.shape[1] != K or b.shape != (N, R))):
        raise ValueError(f"merge_quantise takes w (N, K), a (R, K), b (N, R) and w8 (N, K) with contiguous rows; got w "
                         f"{tuple(w.shape)}, a {None if a is None else tuple(a.shape)}, b "
                         f"{None if b is None else tuple(b.shape)}, w8 {tuple(w8.shape)}")
    a = a.float().contiguous() if R else w                          # placeholders when there is no adapter
    b = b.float().contiguous() if R else w
    RP = max(16, 1 << (max(R, 1) - 1).bit_length())                # tl.dot's least inner size
    _merge_quantise[(triton.cdiv(N, BR),)](w, a, b, w8, scale, N, K, R, w.stride(0), a.stride(0), b.stride(0),
                                           w8.stride(0), QMAX=FP8_MAX, BR=BR, BK=BK, RP=RP, LORA=R > 0,
                                           num_warps=4)


def merged_twin(w: Tensor, a: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor]:
    """merge_quantise's torch twin: (w8, scale) of the float32 sum w + b @ a."""
    return quantise_rows(w.float() if a is None else w.float() + b.float() @ a.float())
