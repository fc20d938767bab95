"""A Triton FP8 x FP8 GEMM for the decode step's few rows (kernels/fp8.py's default GEMM where `wins`):

    parts = fp8_gemm(x8, sx, w8, sw)     # x8 (M, K) e4m3, sx (M,) float32, w8 (N, K) e4m3, sw (N,) float32
                                         # -> parts (S, M, N) float32, parts.sum(0) = (x8 sx) @ (w8 sw).T

Why beside torch._scaled_mm: at a decode step's few rows the GEMM only streams the weight, and cuBLAS's FP8
kernels read it well below the card's bandwidth at W6's shapes (docs/lora.md, "FP8 rollout weights"). Program
(n, s) multiplies all M rows by the weight's (BN, PER) block at column tile n and K range s with the tensor cores'
FP8 product (float32 accumulation) and scales its partial sums by the row and channel scales. The K split (S
ranges) is what fills the card for a narrow output (down_proj: 56 column tiles of 64 for 132 multiprocessors):
`tiles` picks it; `wins` says where the kernel beat cuBLAS. The caller adds the S partial sums in a fixed order
(`parts.sum(0)` in fp8.fp8_linear): no atomics, so a rollout is reproducible, and inside the compiled step
inductor unrolls a sum of so few terms into the kernel that reads the GEMM's output (the residual add,
SiLU-and-multiply) instead of giving it a kernel of its own. The activations arrive quantised per row
(fp8.quantise_activations, which inside the compiled step fuses into the norm or the SiLU-and-multiply that
produced them).

The torch twin is kernels/fp8.py's `dequantised_mm` (the same values up to the order of the sums).
"""
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

MAX_ROWS = 128          # decode-sized M; more rows (a prefill: compute-bound) go to _scaled_mm (fp8.fp8_linear)
SMS = 132               # multiprocessors the K split fills: the cards it was tuned on (docs/lora.md names them)


class Tiles(NamedTuple):
    BM: int             # rows per program: M padded to a power of two, >= 16 (tl.dot's least)
    BN: int             # columns per program
    BK: int             # K per step of a program's loop; divides K
    S: int              # programs along K (the split)
    per: int            # K per split, a multiple of BK; the last split may hold less
    warps: int
    stages: int


def tiles(M: int, N: int, K: int, BN: int = 64, BK: int = 128, warps: int = 4, stages: int = 4,
          waves: float | None = None) -> Tiles:
    """The launch of an (M, K) x (K, N) product: BN x BK tiles (BK shrunk to a power of two dividing K), and the
    fewest K ranges that give at least `waves` x SMS programs (2 for up to 64 rows, 1 above: a 128-row program
    holds twice the registers), so a narrow output is split and a wide one (gate/up, the head) is not. The
    defaults were the fastest of tools/fp8_gemm_bench.py's grid at W6's shapes (docs/lora.md). Raises on K not a
    multiple of 16."""
    if K % 16:
        raise ValueError(f"fp8_gemm needs K % 16 == 0, got K = {K}")
    BM = max(16, 1 << (M - 1).bit_length())
    waves = (2 if BM <= 64 else 1) if waves is None else waves
    BK = next(b for b in (BK, 128, 64, 32, 16) if b <= BK and K % b == 0)
    nk, n_tiles = K // BK, -(-N // BN)
    want = min(nk, max(1, -(-int(waves * SMS) // n_tiles)))            # K ranges wanted
    per = -(-nk // want)                                               # K blocks per range
    return Tiles(BM, BN, BK, -(-nk // per), per * BK, warps, stages)


def wins(M: int, N: int, K: int) -> bool:
    """Does this kernel beat torch._scaled_mm here? Up to 64 rows, and up to MAX_ROWS where the output is narrow
    enough to be split over K; a wide output at 65-128 rows (gate/up, the head) went faster through cuBLAS
    (tools/fp8_gemm_bench.py, docs/lora.md). A K that is not a multiple of 32 goes through cuBLAS too: Triton's
    NVIDIA backend compiles an 8-bit tl.dot only with K steps of at least 32 (the interpreter takes 16)."""
    return K % 32 == 0 and (M <= 64 or (M <= MAX_ROWS and tiles(M, N, K).S > 1))


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_gemm(x_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, PER, stride_xm, stride_wn, stride_os, stride_om,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Program (n, s): rows 0..M of columns [n BN, (n + 1) BN) over K's range [s PER, (s + 1) PER), scaled by
        sx (rows) and sw (columns), into out[s] (float32)."""
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        k0 = pid_s * PER
        k1 = tl.minimum(k0 + PER, K)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :]                     # (BM, BK)
        w_ptrs = w_ptr + rn[None, :] * stride_wn + (k0 + rk)[:, None]                     # (BK, BN), K-major
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(k0, k1, BK):
            x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0)
            acc = tl.dot(x, w, acc)
            x_ptrs += BK
            w_ptrs += BK
        acc *= tl.load(sx_ptr + rm, mask=rm < M, other=0.0)[:, None]
        acc *= tl.load(sw_ptr + rn, mask=rn < N, other=0.0)[None, :]
        o_ptrs = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
        tl.store(o_ptrs, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    def launch(x8: Tensor, sx: Tensor, w8: Tensor, sw: Tensor, t: Tiles) -> Tensor:
        """The kernel with tiles t (tools/fp8_gemm_bench.py tries several): (S, M, N) float32."""
        M, K = x8.shape
        N = w8.shape[0]
        out = torch.empty(t.S, M, N, dtype=torch.float32, device=x8.device)
        _fp8_gemm[(triton.cdiv(N, t.BN), t.S)](
            x8, sx, w8, sw, out, M, N, K, t.per, x8.stride(0), w8.stride(0), out.stride(0), out.stride(1),
            BM=t.BM, BN=t.BN, BK=t.BK, num_warps=t.warps, num_stages=t.stages)
        return out

    # an opaque custom op (as kernels/decode_attention.py's): the compiled decode step calls it as it is
    @torch.library.custom_op("rlhack::fp8_gemm", mutates_args=())
    def _fp8_gemm_op(x8: Tensor, sx: Tensor, w8: Tensor, sw: Tensor) -> Tensor:
        return launch(x8, sx, w8, sw, tiles(x8.shape[0], w8.shape[0], x8.shape[1]))

    @_fp8_gemm_op.register_fake
    def _(x8, sx, w8, sw):
        return x8.new_empty(tiles(x8.shape[0], w8.shape[0], x8.shape[1]).S, x8.shape[0], w8.shape[0],
                            dtype=torch.float32)


def fp8_gemm(x8: Tensor, sx: Tensor, w8: Tensor, sw: Tensor) -> Tensor:
    """x8 (M, K) e4m3 (M <= MAX_ROWS, contiguous rows), sx (M,) float32, w8 (N, K) e4m3 contiguous, sw (N,)
    float32 -> (S, M, N) float32 partial sums over K ranges; their sum is (x8 * sx[:, None]) @ (w8 * sw[:, None]).T.
    Triton only (CUDA, or TRITON_INTERPRET=1)."""
    M, K = x8.shape
    if M > MAX_ROWS or w8.shape[1] != K or K % 16 or x8.stride(1) != 1 or not w8.is_contiguous():
        raise ValueError(f"fp8_gemm takes x8 (M <= {MAX_ROWS}, K) with K % 16 == 0 and contiguous rows, w8 "
                         f"(N, K) contiguous; got x8 {tuple(x8.shape)}, w8 {tuple(w8.shape)}")
    return _fp8_gemm_op(x8, sx.reshape(M).contiguous(), w8, sw)
