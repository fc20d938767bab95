"""Batch-invariant GEMM and RMSNorm for exact_logprobs on a GPU (engines/exact.py, docs/exact.md).

`exact_linear(x, w, b)`: x (M, K) @ w (N, K)^T + b -> (M, N), one launch. One tile configuration per weight shape
(`tile_of`: by N and K only, never by M, never autotuned at run time), no split-K, K reduced tile after tile from
k = 0 upwards into one float32 accumulator: every output element is the same sequence of MMA steps over its own row
of x and column of w^T, whatever M is and wherever the row sits (M is a runtime argument that Triton is told not
to specialise on). So a token's row has the same bits in a one-token decode step as in the trainer's 40k-row
forward.

`exact_rmsnorm(x, w, eps, mode)`: one program per row, the row's sum of squares in one fixed reduction; the three
conventions of the families engines/families.py covers (`NORM_MODES`).

Both run under TRITON_INTERPRET=1 on a CPU for the tests (tests/test_exact_kernels.py); the engine's CPU path is
the torch twin in engines/exact.py (`rowwise`), which keeps invariance by calling the library on one shape.
"""
import os

import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

# One tile configuration per weight shape class, chosen by the weight's (N, K) alone (`tile_of`), never by M: a row's
# K order (BK, from k = 0 up) and its tile (BM, BN, warps: the MMA instructions) are then the same in a decode step
# and in the trainer's call on the same weight. The classes exist because a decode step's M is small: with one
# tile for all, a narrow output (k, v) gets few programs and a long K (the down projection) runs serially in few.
# (BM, BN, BK, num_warps, num_stages); tools/exact_gemm_tiles.py times candidates on a card and can rewrite this.
# TILES-BEGIN
TILES = {
    "narrow": (64, 16, 64, 4, 4),
    "long_k": (16, 32, 128, 4, 4),
    "vocab": (128, 128, 64, 8, 3),
    "other": (32, 32, 128, 4, 3),
}
# TILES-END


def shape_class(N: int, K: int) -> str:
    """The TILES class of a weight (N outputs, K inputs): vocab (N >= 16384: the head), narrow (N <= 256: the k and
    v projections of a GQA model), long_k (K >= 2 N: the down projection), other (q, o, gate, up)."""
    if N >= 16384:
        return "vocab"
    if N <= 256:
        return "narrow"
    return "long_k" if K >= 2 * N else "other"


def tile_of(N: int, K: int) -> dict:
    """The fixed launch configuration for a weight (N, K): one per weight, whatever the call's M."""
    BM, BN, BK, warps, stages = TILES[shape_class(N, K)]
    return dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)

# transformers' RMSNorm conventions: 0 llama-like `w * x_hat.to(dtype)`, 1 olmo2 `(w * x_hat).to(dtype)`,
# 2 gemma `(x_hat * (1 + w)).to(dtype)` (x_hat = x * rsqrt(mean(x^2) + eps) in float32)
NORM_MODES = {"Qwen2RMSNorm": 0, "LlamaRMSNorm": 0, "Qwen3RMSNorm": 0, "MistralRMSNorm": 0, "Phi3RMSNorm": 0,
              "SmolLM3RMSNorm": 0, "Qwen3MoeRMSNorm": 0, "Olmo2RMSNorm": 1, "Gemma3RMSNorm": 2}

# The interpreter's tl.dot is numpy's matmul, whose BLAS may round a row differently by its place in the tile (a
# GPU's MMA instruction computes every output element alike); under TRITON_INTERPRET=1 `dot` is an explicit
# product and sum instead, so the CPU tests check the rest of each kernel (masks, tile and block order).
EXPLICIT_DOT = os.environ.get("TRITON_INTERPRET") == "1"

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a, b, acc, PRECISION: tl.constexpr, EXPLICIT: tl.constexpr):
        """acc + a (m, k) @ b (k, n), float32."""
        if EXPLICIT:
            return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        else:
            return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit(do_not_specialize=["M"])
    def _gemm(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx, sw, sy, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EXPLICIT: tl.constexpr):
        pm, pn = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)   # m fastest: programs share w's tile
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):                                     # one order: k = 0, BK, 2 BK, ...
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * sw + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = dot(a, b, acc, PRECISION, EXPLICIT)                  # (BM, BN) float32
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sy + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _rmsnorm(x_ptr, w_ptr, y_ptr, H, sx, sy, eps, MODE: tl.constexpr, BH: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BH)
        ok = c < H
        x = tl.load(x_ptr + r * sx + c, mask=ok, other=0.0).to(tl.float32)           # (BH,)
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        xh = x * tl.math.rsqrt(tl.sum(x * x, 0) / H + eps)
        if MODE == 0:
            y = w * xh.to(x_ptr.dtype.element_ty).to(tl.float32)
        elif MODE == 1:
            y = w * xh
        else:
            y = xh * (1.0 + w)
        tl.store(y_ptr + r * sy + c, y.to(y_ptr.dtype.element_ty), mask=ok)


def exact_linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """x (M, K) @ w (N, K)^T (+ b (N,)) -> (M, N) in x's dtype, each row's bits independent of M (module doc).
    Forward values only: no autograd (the trainer differentiates the ordinary forward: update.py ExactValues)."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        raise RuntimeError("kernels/exact_gemm.py gives values only: call it under torch.no_grad()")
    M, K = x.shape
    N = w.shape[0]
    x, w = x.contiguous(), w.to(x.dtype).contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    t = tile_of(N, K)
    grid = (triton.cdiv(M, t["BM"]), triton.cdiv(N, t["BN"]))
    _gemm[grid](x, w, b if b is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                HAS_BIAS=b is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                BM=t["BM"], BN=t["BN"], BK=t["BK"], EXPLICIT=EXPLICIT_DOT, num_warps=t["num_warps"],
                num_stages=t["num_stages"])
    return y


def exact_rmsnorm(x: Tensor, w: Tensor, eps: float, mode: int) -> Tensor:
    """x (N, H) -> (N, H), each row normalised alone (`NORM_MODES` for mode); values only, as exact_linear."""
    N, H = x.shape
    x = x.contiguous()
    out = torch.promote_types(x.dtype, w.dtype) if mode == 0 else x.dtype
    y = torch.empty(N, H, device=x.device, dtype=out)
    if N:
        _rmsnorm[(N,)](x, w.contiguous(), y, H, x.stride(0), y.stride(0), eps, MODE=mode,
                       BH=triton.next_power_of_2(H), num_warps=4)
    return y
