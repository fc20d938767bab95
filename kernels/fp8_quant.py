"""The fp8 routes' refresh as two Triton kernels per projection: its LoRA adapters merged and the sum quantised per
output channel (engines/decode_weights.py: fp8_group with FP8_REFRESH = "triton", the default):

    merge_quantise(w, a, b, (w8, scale))     # w (N, K), a (R, K) float32 or None, b (N, R) float32 or None
                                             # -> w8 (N, K) e4m3, scale (N,) float32: w + b @ a ~ w8 * scale[:, None]
    merge_quantise(w, a, b, out, scaling)    # w + (b @ a) * scaling: a peft adapter's own A, B and alpha / r

Why: the torch route (lora.dense_weight, then kernels/fp8.py's quantise_rows) runs several eager passes over each
weight at every rollout, float32 temporaries included (docs/lora.md). Here the merged weight w + (b a) * scaling is
never stored: `_row_amax`, program (i, s), computes it on the fly over BR rows and the K range s and writes the
rows' partial absolute max; `_quantise`, program (i, j), reduces those partials to the rows' scales and writes the
(BR, BQ) tile of the sum over its scale, rounded to e4m3. The (BR, R) x (R, cols) product runs on the tensor cores
as three TF32 products ("tf32x3": float32's accuracy): on the FMA units ("ieee") it cost more than the weight's
reads (docs/lora.md).
W is read twice, the FP8 copy written once: ~5 bytes per element against the torch route's ~49. Both grids cover
the card whatever the weight's shape (the K split of `_row_amax` for the narrow ones: a 7B's k_proj has 16 row
blocks). The sum is not rounded to bf16 first (the torch route's dense_weight does), so the two can differ by
one e4m3 step where that rounding, or a near-tie of the conversion, crosses a boundary.

The torch twin: `merged_twin` (the float32 sum, kernels/fp8.py's quantise_rows).
"""
import torch
from torch import Tensor

from kernels.fp8 import FP8_MAX, quantise_rows
from kernels.fp8_gemm import SMS
from kernels.logprob import HAS_TRITON

BR, BK, BQ = 32, 128, 256           # rows per program; K per step of _row_amax; columns per program of _quantise
PRECISION = "tf32x3"                # the adapters' product: float32's accuracy on the tensor cores (module docstring)
WAVES = 8                           # _row_amax splits K until it has WAVES x SMS programs (kernels/fp8_gemm.py's
                                    # multiprocessors), so a narrow weight still keeps every one reading


def amax_split(N: int, K: int) -> tuple[int, int]:
    """(S, PER): _row_amax's K ranges, PER columns each (a multiple of BK; the last may hold less)."""
    nk = -(-K // BK)
    want = min(nk, max(1, -(-WAVES * SMS // -(-N // BR))))
    per = -(-nk // want)
    return -(-nk // per), per * BK


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _merged(w_ptr, a_ptr, bt, rows, ks, rr, N, K, R, stride_w, stride_a, scaling, LORA: tl.constexpr,
                PREC: tl.constexpr):
        """(BR, cols) float32: w + (b a) * scaling over rows and columns ks (bt: b's (BR, RP) rows, loaded once)."""
        m = (rows[:, None] < N) & (ks[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * stride_w + ks[None, :], mask=m, other=0.0).to(tl.float32)
        if LORA:
            a = tl.load(a_ptr + rr[:, None] * stride_a + ks[None, :], mask=(rr[:, None] < R) & (ks[None, :] < K),
                        other=0.0)                                                          # (RP, cols)
            w += tl.dot(bt, a, input_precision=PREC) * scaling
        return w

    @triton.jit
    def _b_rows(b_ptr, rows, rr, N, R, stride_b, LORA: tl.constexpr, BR: tl.constexpr, RP: tl.constexpr):
        """(BR, RP) float32: b's rows (zeros past R, and without adapters)."""
        if LORA:
            return tl.load(b_ptr + rows[:, None] * stride_b + rr[None, :], mask=(rows[:, None] < N) & (rr[None, :] < R),
                           other=0.0)
        return tl.zeros((BR, RP), dtype=tl.float32)

    @triton.jit
    def _row_amax(w_ptr, a_ptr, b_ptr, part_ptr, N, K, R, PER, stride_w, stride_a, stride_b, scaling,
                  BR: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, LORA: tl.constexpr, PREC: tl.constexpr):
        """Program (i, s): part[s, rows] = max |w + (b a) * scaling| over rows i BR.. and K range [s PER, ...)."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        s = tl.program_id(1)
        rr = tl.arange(0, RP)
        bt = _b_rows(b_ptr, rows, rr, N, R, stride_b, LORA, BR, RP)
        amax = tl.zeros((BR,), dtype=tl.float32)
        for k0 in range(s * PER, tl.minimum(s * PER + PER, K), BK):
            w = _merged(w_ptr, a_ptr, bt, rows, k0 + tl.arange(0, BK), rr, N, K, R, stride_w, stride_a, scaling,
                        LORA, PREC)
            amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
        tl.store(part_ptr + s * N + rows, amax, mask=rows < N)

    @triton.jit
    def _quantise(w_ptr, a_ptr, b_ptr, part_ptr, w8_ptr, s_ptr, N, K, R, S, stride_w, stride_a, stride_b, stride_w8,
                  scaling, QMAX: tl.constexpr, BR: tl.constexpr, BQ: tl.constexpr, RP: tl.constexpr,
                  SP: tl.constexpr, LORA: tl.constexpr, PREC: tl.constexpr):
        """Program (i, j): the rows' scales from the S partial maxima, then the (BR, BQ) tile at columns j BQ..
        over them, rounded to e4m3; the programs of column block 0 store the scales."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        j = tl.program_id(1)
        ss = tl.arange(0, SP)
        part = tl.load(part_ptr + ss[:, None] * N + rows[None, :], mask=(ss[:, None] < S) & (rows[None, :] < N),
                       other=0.0)                                                           # (SP, BR)
        amax = tl.max(part, axis=0)
        s = tl.math.div_rn(amax, tl.full((BR,), QMAX, tl.float32))                       # as quantise_rows
        s = tl.where(s > 0, s, 1.0)
        if j == 0:
            tl.store(s_ptr + rows, s, mask=rows < N)
        rr = tl.arange(0, RP)
        bt = _b_rows(b_ptr, rows, rr, N, R, stride_b, LORA, BR, RP)
        ks = j * BQ + tl.arange(0, BQ)
        w = _merged(w_ptr, a_ptr, bt, rows, ks, rr, N, K, R, stride_w, stride_a, scaling, LORA, PREC)
        q = tl.math.div_rn(w, tl.broadcast_to(s[:, None], (BR, BQ)))
        tl.store(w8_ptr + rows[:, None] * stride_w8 + ks[None, :], q.to(w8_ptr.dtype.element_ty),
                 mask=(rows[:, None] < N) & (ks[None, :] < K))


@torch.no_grad()
def merge_quantise(w: Tensor, a: Tensor | None, b: Tensor | None, out: tuple[Tensor, Tensor], scaling: float = 1.0):
    """Write (w + (b @ a) * scaling) quantised per row into out = (w8 (N, K) e4m3, scale (N,) float32); a, b None:
    w alone. w, w8 with contiguous rows. A float32 w8 gets the quotient unrounded (the interpreted test: triton
    3.9's interpreter rounds to e4m3 unfaithfully). Triton only (CUDA, or TRITON_INTERPRET=1)."""
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
    S, per = amax_split(N, K)
    part = torch.empty(S, N, dtype=torch.float32, device=w.device)  # (S, N): the K ranges' row maxima
    nb = triton.cdiv(N, BR)
    _row_amax[(nb, S)](w, a, b, part, N, K, R, per, w.stride(0), a.stride(0), b.stride(0), float(scaling),
                       BR=BR, BK=BK, RP=RP, LORA=R > 0, PREC=PRECISION, num_warps=4)
    _quantise[(nb, triton.cdiv(K, BQ))](w, a, b, part, w8, scale, N, K, R, S, w.stride(0), a.stride(0), b.stride(0),
                                        w8.stride(0), float(scaling), QMAX=FP8_MAX, BR=BR, BQ=BQ, RP=RP,
                                        SP=max(2, triton.next_power_of_2(S)), LORA=R > 0, PREC=PRECISION,
                                        num_warps=4)


def merged_twin(w: Tensor, a: Tensor | None, b: Tensor | None, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """merge_quantise's torch twin: (w8, scale) of the float32 sum w + (b @ a) * scaling."""
    return quantise_rows(w.float() if a is None else w.float() + (b.float() @ a.float()) * scaling)
