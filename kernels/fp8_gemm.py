"""A Triton GEMM for the decode step's FP8 weights with bf16 activations (weight-only FP8: kernels/fp8.py's second
GEMM, `fp8.GEMM = "triton"`):

    y = fp8_weight_gemm(x, w8, scale)        # x (M, K) bf16, w8 (N, K) e4m3, scale (N,) float32 -> (M, N) in x's dtype

Why beside torch._scaled_mm: at a decode step's few rows (M <= 128) the GEMM only streams the weight, and cuBLAS's
FP8 kernels read it well below the card's bandwidth at these shapes (docs/speed.md's probe); they also need the
activations quantised first (one more kernel per GEMM). Here each program converts a (BN, BK) tile of the FP8
weight to bf16 in registers and multiplies with tensor cores, the per-channel scale applied in the epilogue; the
activations stay bf16, so the engine's only rounding beyond bf16 is the weights'. A narrow
output (down_proj's 3584 columns) gives too few column tiles to fill the card, so the K range is split over
programs (SPLIT) and the float32 partial sums are added by one reduction after. Rows beyond 128 (a prefill) take
_scaled_mm: there the GEMM is compute-bound and FP8's tensor cores win.
Off by default: at W6's shape the rollout through it was slower than through _scaled_mm (docs/lora.md, "FP8 rollout
weights").

The torch twin is kernels/fp8.py's dequantised product (the same values up to the order of the sums).
"""
import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

MAX_ROWS = 128          # decode-sized M; more rows go to _scaled_mm (fp8.fp8_linear)
SMS = 132               # multiprocessors the K split is sized for: >= 2 programs on each (docs/lora.md)


def tiles(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, SPLIT) for an (M, K) x (K, N) product: BM the rows padded to a power of two (>= 16, tl.dot's
    least), BN 128 where that still gives two waves of column tiles, else 64; BK the largest power of two <= 128
    dividing K; SPLIT the smallest divisor of K / BK (<= 16) giving >= 2 * SMS programs, else the largest."""
    BM = max(16, 1 << (M - 1).bit_length())
    BN = 128 if N >= 128 * 2 * SMS else 64
    BK = next(b for b in (128, 64, 32, 16) if K % b == 0)
    n_tiles, nk = -(-N // BN), K // BK
    divisors = [d for d in range(1, 17) if nk % d == 0]
    split = next((d for d in divisors if n_tiles * d >= 2 * SMS), divisors[-1])
    return BM, BN, BK, split


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fp8_weight_gemm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_SPLIT: tl.constexpr):
        """Program (n, s): rows 0..M of columns [n BN, (n + 1) BN) over K's s-th range of K_SPLIT; writes its
        scaled float32 partial sums to out[s] (or, one split, the result in out's dtype)."""
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (pid_s * K_SPLIT + rk)[None, :]           # (BM, BK)
        w_ptrs = w_ptr + rn[None, :] * stride_wn + (pid_s * K_SPLIT + rk)[:, None]           # (BK, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K_SPLIT, BK):
            x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0)
            acc += tl.dot(x, w.to(x.dtype))
            x_ptrs += BK
            w_ptrs += BK
        acc *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        o_ptrs = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    # an opaque custom op (as kernels/decode_attention.py's): the compiled decode step calls it as it is
    @torch.library.custom_op("rlhack::fp8_weight_gemm", mutates_args=())
    def _fp8_weight_gemm_op(x: Tensor, w8: Tensor, scale: Tensor) -> Tensor:
        M, K = x.shape
        N = w8.shape[0]
        BM, BN, BK, split = tiles(M, N, K)
        out = torch.empty(split, M, N, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
        _fp8_weight_gemm[(triton.cdiv(N, BN), split)](
            x, w8, scale, out, M, N, K, x.stride(0), w8.stride(0), out.stride(0), out.stride(1),
            BM=BM, BN=BN, BK=BK, K_SPLIT=K // split, num_warps=4, num_stages=4)
        return out[0] if split == 1 else out.sum(0).to(x.dtype)

    @_fp8_weight_gemm_op.register_fake
    def _(x, w8, scale):
        return x.new_empty(x.shape[0], w8.shape[0])


def fp8_weight_gemm(x: Tensor, w8: Tensor, scale: Tensor) -> Tensor:
    """x (M, K) float (M <= MAX_ROWS, contiguous rows), w8 (N, K) e4m3 contiguous, scale (N,) float32 ->
    x @ (w8 * scale[:, None]).T, (M, N) in x's dtype. Triton only (CUDA, or TRITON_INTERPRET=1)."""
    M, K = x.shape
    if M > MAX_ROWS or w8.shape[1] != K or K % 16 or x.stride(1) != 1 or not w8.is_contiguous():
        raise ValueError(f"fp8_weight_gemm takes x (M <= {MAX_ROWS}, K) with K % 16 == 0 and contiguous rows, w8 "
                         f"(N, K) contiguous; got x {tuple(x.shape)}, w8 {tuple(w8.shape)}")
    return _fp8_weight_gemm_op(x, w8, scale)
