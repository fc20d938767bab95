"""A decode step's SiLU MLP in two FP8 kernels, nothing between them (engine_dtype=fp8, FAST_DECODE_FP8_MLP=fused):

    rowmax = row_buffer(layers, x)                      # (layers, MAX_ROWS) float32 zeros, once per decode step
    y = fp8_mlp(x, w8gu, sgu, w8d, sd, rowmax, layer)   # x (M, H) -> y (M, H) in x's dtype
                                                        # ~ down(silu(gate(x)) * up(x)), gate/up rows [gate; up]

Why: the split route (kernels/fp8.py's fp8_linear twice, engines/decode_step.py) writes gate/up's output, then
the compiler's kernels compute SiLU-and-multiply, each row's absolute max over all I columns and the e4m3
quotient for the down GEMM (a row's max is needed before any of its values can be rounded): ~12 us per layer
between the two GEMMs at W6 (docs/lora.md). Here:

- `_gate_up_silu`, program n: all M rows times gate's and up's (BN, K) blocks at column tile n (the activation
  tile read once for both), then silu(g) * u in float32, stored in bf16 (M, I), and each row's absolute max over
  the tile (of the stored bf16 values, so that no quotient exceeds 448) atomically maxed into rowmax[layer] as
  int32 bits (non-negative floats order as their bits).
- `_down_rows`, program (n, s): as kernels/fp8_gemm.py's split-K GEMM, but the activations arrive in bf16 with
  their row maxima: each K step's tile is scaled by 448 / max and rounded to e4m3 in registers before the FP8
  product, and the epilogue scales by max / 448 and the channel scales, as the per-row route does. The bf16
  activations are 2.4 MB at W6 against the 68 MB FP8 weight. SWAP computes out^T = W a^T instead (the weight
  first, the re-scaled activations as the second operand: the compiler stages them in shared memory rather
  than feeding the tensor cores from registers); tools/fp8_gemm_bench.py --mlp times both.

rowmax must be zero before a layer's gate/up: the step zeroes one (layers, MAX_ROWS) buffer once (one small
kernel per step, not per layer). The torch twin is `mlp_twin` (the same rounding points in float32).
"""
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fp8 import FP8_MAX, dequantised_mm, quantise_activations
from kernels.fp8_gemm import HAS_TRITON, tiles

MAX_ROWS = 64           # decode-sized M where kernels/fp8_gemm.py's kernel beats cuBLAS on gate/up (fp8_gemm.wins)
BN, WARPS, STAGES = 64, 4, 4   # gate/up's tile: 64 columns of gate and of up per program
# the route a decode step's SiLU MLP takes when both its groups are FP8: "split" (today's: two fp8_linear calls
# and the compiler's kernels between) or "fused" (this file). Read when the step is traced (engines/decode_step.py:
# Step.fp8_mlp_route, which a tool may set per decoder)
MLPS = ("split", "fused")
MLP = os.environ.get("FAST_DECODE_FP8_MLP", "split")
if MLP not in MLPS:
    raise ValueError(f"FAST_DECODE_FP8_MLP={MLP!r}: use one of {', '.join(MLPS)}")
SWAP = False            # the down GEMM as out^T = W a^T (module docstring); tools/fp8_gemm_bench.py --mlp times both
SILU = ("SiLU", "SiLUActivation")   # activation modules whose formula _gate_up_silu applies
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"   # the kernels run on CPU tensors too (tests)


def fits(x: Tensor, p_gu: tuple, p_down: tuple, act) -> bool:
    """Can this layer's MLP take the fused kernels: x (M, H) on CUDA (or under the interpreter) with M <= MAX_ROWS,
    both groups FP8 without biases, SiLU, and dimensions the 8-bit tl.dot takes (multiples of 32)?"""
    if p_gu is None or p_down is None or p_gu[0][0].dtype != torch.float8_e4m3fn \
            or p_down[0][0].dtype != torch.float8_e4m3fn or p_gu[1] is not None or p_down[1] is not None:
        return False
    (w8gu, _), (w8d, _) = p_gu[0], p_down[0]
    I, H = w8d.shape[1], w8d.shape[0]
    return (HAS_TRITON and (x.is_cuda or INTERPRET) and type(act).__name__ in SILU and x.shape[0] <= MAX_ROWS
            and w8gu.shape == (2 * I, H) and I % 32 == 0 and H % 32 == 0)


def row_buffer(layers: int, x: Tensor) -> Tensor:
    """(layers, MAX_ROWS) float32 zeros: each layer's row maxima of its SiLU-and-multiply (fp8_mlp)."""
    return torch.zeros(layers, MAX_ROWS, dtype=torch.float32, device=x.device)


def _bk(K: int) -> int:
    return next(b for b in (128, 64, 32, 16) if K % b == 0)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_up_silu(x_ptr, sx_ptr, w_ptr, sw_ptr, h_ptr, amax_ptr, M, I, K, stride_xm, stride_wn, stride_hm,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Program n: h[:, n BN..] = silu(g) * u over gate's rows n BN.. and up's rows I + n BN.. of w (2 I, K);
        amax[m] = max(amax[m], max |h[m, n BN..]|) (int32 bits)."""
        rm = tl.arange(0, BM)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]                            # (BM, BK)
        g_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]                            # (BK, BN), K-major
        u_ptrs = g_ptrs + I * stride_wn
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):
            x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
            acc_g = tl.dot(x, tl.load(g_ptrs, mask=rn[None, :] < I, other=0.0), acc_g)
            acc_u = tl.dot(x, tl.load(u_ptrs, mask=rn[None, :] < I, other=0.0), acc_u)
            x_ptrs += BK
            g_ptrs += BK
            u_ptrs += BK
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)[:, None]                        # (BM, 1)
        g = acc_g * sx * tl.load(sw_ptr + rn, mask=rn < I, other=0.0)[None, :]
        u = acc_u * sx * tl.load(sw_ptr + I + rn, mask=rn < I, other=0.0)[None, :]
        h = (g / (1.0 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty)                      # (BM, BN)
        ok = (rm[:, None] < M) & (rn[None, :] < I)
        tl.store(h_ptr + rm[:, None] * stride_hm + rn[None, :], h, mask=ok)
        amax = tl.max(tl.where(ok, tl.abs(h.to(tl.float32)), 0.0), axis=1)               # (BM,) >= 0
        tl.atomic_max(amax_ptr + rm, amax.to(tl.int32, bitcast=True), mask=rm < M, sem="relaxed")

    @triton.jit
    def _down_rows(a_ptr, amax_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, PER, stride_am, stride_wn, stride_os,
                   stride_om, QMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SWAP: tl.constexpr):
        """Program (n, s): out[s] = (a / s_a rounded to e4m3) (w8 block) * s_a * sw over columns n BN.. and K range
        [s PER, ...), s_a = amax / QMAX per row (1 for a zero row, as kernels/fp8.py's row_scales)."""
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        sa = tl.load(amax_ptr + rm, mask=rm < M, other=0.0) / QMAX                       # (BM,)
        sa = tl.where(sa > 0, sa, 1.0)
        inv = (1.0 / sa)[:, None]                                                         # (BM, 1)
        k0 = pid_s * PER
        k1 = tl.minimum(k0 + PER, K)
        a_ptrs = a_ptr + rm[:, None] * stride_am + (k0 + rk)[None, :]                     # (BM, BK)
        if SWAP:
            w_ptrs = w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :]                 # (BN, BK)
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            w_ptrs = w_ptr + rn[None, :] * stride_wn + (k0 + rk)[:, None]                 # (BK, BN), K-major
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(k0, k1, BK):
            a = tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0).to(tl.float32)
            a8 = (a * inv).to(w_ptr.dtype.element_ty)                                     # (BM, BK) e4m3
            if SWAP:
                acc = tl.dot(tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0), tl.trans(a8), acc)
            else:
                acc = tl.dot(a8, tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0), acc)
            a_ptrs += BK
            w_ptrs += BK
        sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
        if SWAP:   # acc (BN, BM): out^T's tile
            acc *= sw[:, None] * sa[None, :]
            o_ptrs = out_ptr + pid_s * stride_os + rm[None, :] * stride_om + rn[:, None]
            tl.store(o_ptrs, acc, mask=(rm[None, :] < M) & (rn[:, None] < N))
        else:
            acc *= sa[:, None] * sw[None, :]
            o_ptrs = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
            tl.store(o_ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    def gate_up_launch(x8: Tensor, sx: Tensor, w8: Tensor, sw: Tensor, rowmax: Tensor, layer: int,
                       out_dtype=torch.bfloat16) -> Tensor:
        """x8 (M, K) e4m3, sx (M,), w8 (2 I, K) [gate; up], sw (2 I,) -> h (M, I) in out_dtype; maxes each row's
        |h| into rowmax[layer, :M]."""
        M, K = x8.shape
        I = w8.shape[0] // 2
        h = torch.empty(M, I, dtype=out_dtype, device=x8.device)
        _gate_up_silu[(triton.cdiv(I, BN),)](
            x8, sx, w8, sw, h, rowmax[layer].view(torch.int32), M, I, K, x8.stride(0), w8.stride(0), h.stride(0),
            BM=max(16, 1 << (M - 1).bit_length()), BN=BN, BK=_bk(K), num_warps=WARPS, num_stages=STAGES)
        return h

    def down_launch(a: Tensor, rowmax: Tensor, layer: int, w8: Tensor, sw: Tensor, swap: bool | None = None) -> Tensor:
        """a (M, K) bf16, its row maxima rowmax[layer, :M], w8 (N, K), sw (N,) -> (S, M, N) float32 partial sums
        over K ranges (kernels/fp8_gemm.py's tiles: the same split as the per-row route's down GEMM)."""
        M, K = a.shape
        N = w8.shape[0]
        t = tiles(M, N, K)
        out = torch.empty(t.S, M, N, dtype=torch.float32, device=a.device)
        _down_rows[(triton.cdiv(N, t.BN), t.S)](
            a, rowmax[layer], w8, sw, out, M, N, K, t.per, a.stride(0), w8.stride(0), out.stride(0), out.stride(1),
            QMAX=FP8_MAX, BM=t.BM, BN=t.BN, BK=t.BK, SWAP=SWAP if swap is None else swap, num_warps=t.warps,
            num_stages=t.stages)
        return out

    # opaque custom ops for the compiled step (as kernels/fp8_gemm.py's); gate/up writes the row maxima in place
    @torch.library.custom_op("rlhack::fp8_gate_up_silu", mutates_args=("rowmax",))
    def _gate_up_op(x8: Tensor, sx: Tensor, w8: Tensor, sw: Tensor, rowmax: Tensor, layer: int) -> Tensor:
        return gate_up_launch(x8, sx, w8, sw, rowmax, layer)

    @_gate_up_op.register_fake
    def _(x8, sx, w8, sw, rowmax, layer):
        return x8.new_empty(x8.shape[0], w8.shape[0] // 2, dtype=torch.bfloat16)

    @torch.library.custom_op("rlhack::fp8_down_rows", mutates_args=())
    def _down_op(a: Tensor, rowmax: Tensor, layer: int, w8: Tensor, sw: Tensor) -> Tensor:
        return down_launch(a, rowmax, layer, w8, sw)

    @_down_op.register_fake
    def _(a, rowmax, layer, w8, sw):
        return a.new_empty(tiles(a.shape[0], w8.shape[0], a.shape[1]).S, a.shape[0], w8.shape[0],
                           dtype=torch.float32)


def fp8_mlp(x: Tensor, w8gu: Tensor, sgu: Tensor, w8d: Tensor, sd: Tensor, rowmax: Tensor, layer: int) -> Tensor:
    """x (M, H) -> (M, H) in x's dtype: the SiLU MLP over FP8 weights w8gu (2 I, H) [gate; up] and w8d (H, I) with
    their channel scales, in two kernels (module docstring); rowmax[layer] zero before, the row maxima after.
    Triton only (CUDA, or TRITON_INTERPRET=1): `fits` says where."""
    x8, sx = quantise_activations(x)                                              # (M, H) e4m3, (M, 1)
    h = _gate_up_op(x8, sx.reshape(-1), w8gu, sgu, rowmax, layer)                 # (M, I) bf16
    return _down_op(h, rowmax, layer, w8d, sd).sum(0).to(x.dtype)                 # (M, H)


def mlp_twin(x: Tensor, w8gu: Tensor, sgu: Tensor, w8d: Tensor, sd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp8_mlp's torch twin in float32: (y (M, H), h (M, I) bf16, the row maxima of |h| (M,)). Rounding points as
    the kernels': x per row to e4m3; silu(g) * u in float32, rounded to bf16; h per row (its max over 448) to
    e4m3."""
    x8, sx = quantise_activations(x)
    g, u = dequantised_mm(x8, sx, w8gu, sgu).chunk(2, dim=-1)                     # (M, I) each, float32
    h = (F.silu(g) * u).bfloat16()
    a8, sa = quantise_activations(h)                                              # (M, I), (M, 1)
    return dequantised_mm(a8, sa, w8d, sd), h, h.float().abs().amax(1)
