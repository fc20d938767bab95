"""Batch-invariant GEMM and RMSNorm for exact_logprobs on a GPU (engines/exact.py, docs/exact.md).

`exact_linear(x, w, b)`: x (M, K) @ w (N, K)^T + b -> (M, N), one launch. One tile configuration per weight shape
(`tile_of`: by N and K only, never by M, never autotuned at run time), no split-K, K reduced tile after tile from
k = 0 upwards into one float32 accumulator: every output element is the same sequence of MMA steps over its own row
of x and column of w^T, whatever M is and wherever the row sits (M is a runtime argument that Triton is told not
to specialise on). So a token's row has the same bits in a one-token decode step as in the trainer's 40k-row
forward.

`exact_linear_cat(x, ws, bs)`: the same over up to three weights side by side (q/k/v, gate/up) in one launch, the
bits of exact_linear on their concatenation, without the concatenated copy.

`exact_rmsnorm(x, w, eps, mode)`: one program per row, the row's sum of squares in one fixed reduction; the three
conventions of the families engines/families.py covers (`NORM_MODES`). `exact_silu_mul(gu)`: silu(gate) * up.

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
    "long_k": (64, 16, 64, 4, 4),
    "vocab": (128, 128, 64, 8, 3),
    "wide": (64, 64, 64, 4, 3),
    "other": (64, 32, 64, 4, 4),
}
# TILES-END


def shape_class(N: int, K: int) -> str:
    """The TILES class of a weight (N outputs, K inputs; a group's concatenation counts as one): vocab (N >= 16384:
    the head), narrow (N <= 256: a lone k or v projection of a GQA model), long_k (K >= 2 N: the down projection),
    wide (N >= 4 K: gate/up), other (q/k/v, o)."""
    if N >= 16384:
        return "vocab"
    if N <= 256:
        return "narrow"
    if K >= 2 * N:
        return "long_k"
    return "wide" if N >= 4 * K else "other"


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
    def _gemm(x_ptr, w0_ptr, w1_ptr, w2_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, M, N, K, n1, n2, sx, sy,
              HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              EXPLICIT: tl.constexpr):
        # up to three weights side by side, each (n_i, K) contiguous: output columns [0, n1) from w0, [n1, n2) from
        # w1, [n2, N) from w2 (n1 and n2 multiples of BN, so a program's columns come from one weight)
        pm, pn = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)   # m fastest: programs share w's tile
        c0 = pn * BN
        w_ptr = tl.where(c0 >= n2, w2_ptr, tl.where(c0 >= n1, w1_ptr, w0_ptr))
        b_ptr = tl.where(c0 >= n2, b2_ptr, tl.where(c0 >= n1, b1_ptr, b0_ptr))
        first = tl.where(c0 >= n2, n2, tl.where(c0 >= n1, n1, 0))      # the weight's first output column
        rm = pm * BM + tl.arange(0, BM)
        rn = c0 + tl.arange(0, BN)
        rw = rn - first                                                # the column's row in its own weight
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):                                     # one order: k = 0, BK, 2 BK, ...
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rw[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = dot(a, b, acc, PRECISION, EXPLICIT)                  # (BM, BN) float32
        if HAS_BIAS:
            acc += tl.load(b_ptr + rw, mask=rn < N, other=0.0).to(tl.float32)[None, :]
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
    return exact_linear_cat(x, [w], [b])


def exact_linear_cat(x: Tensor, ws: list, bs: list) -> Tensor:
    """x (M, K) through 1 to 3 weights side by side (each (N_i, K), with bias b_i or None) -> (M, sum N_i): the bits of
    exact_linear(x, torch.cat(ws), torch.cat(bs)), in one launch without the concatenated copy. The tile is the
    concatenation's (`tile_of(sum N_i, K)`), so the engine and the trainer, which both call this on the same group
    (q/k/v, gate/up), take the same one."""
    tensors = [x, *ws, *[b for b in bs if b is not None]]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("kernels/exact_gemm.py gives values only: call it under torch.no_grad()")
    if not 1 <= len(ws) <= 3 or len(bs) != len(ws):
        raise ValueError(f"exact_linear_cat takes 1 to 3 weights, each with a bias or None; got {len(ws)}, {len(bs)}")
    M, K = x.shape
    ns = [w.shape[0] for w in ws]
    N = sum(ns)
    t = tile_of(N, K)
    x = x.contiguous()
    if any(n % t["BN"] for n in ns[:-1]):       # a program's columns would straddle two weights: one copy instead
        ws, bs, ns = [torch.cat([w.to(x.dtype) for w in ws])], [_cat_bias(bs, ns, x)], [N]
    ws = [w.to(x.dtype).contiguous() for w in ws]
    has_bias = any(b is not None for b in bs)
    bs = [(b if b is not None else x.new_zeros(n)) if has_bias else w for b, w, n in zip(bs, ws, ns)]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    n1 = ns[0]
    n2 = n1 + (ns[1] if len(ns) > 1 else 0)
    ws, bs = (ws + [ws[-1]] * 2)[:3], (bs + [bs[-1]] * 2)[:3]
    grid = (triton.cdiv(M, t["BM"]), triton.cdiv(N, t["BN"]))
    _gemm[grid](x, *ws, *bs, y, M, N, K, n1 if len(ns) > 1 else N, n2 if len(ns) > 2 else N, x.stride(0), y.stride(0),
                HAS_BIAS=has_bias, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                BM=t["BM"], BN=t["BN"], BK=t["BK"], EXPLICIT=EXPLICIT_DOT, num_warps=t["num_warps"],
                num_stages=t["num_stages"])
    return y


def _cat_bias(bs: list, ns: list, x: Tensor) -> Tensor | None:
    if all(b is None for b in bs):
        return None
    return torch.cat([b if b is not None else x.new_zeros(n) for b, n in zip(bs, ns)])


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


if HAS_TRITON:
    @triton.jit
    def _silu_mul(g_ptr, y_ptr, I, sg, BI: tl.constexpr):
        # program (row, block of columns): silu(gate) * up for gate = g[:, :I], up = g[:, I:]; each element alone
        r, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        c = cb * BI + tl.arange(0, BI)
        ok = c < I
        gate = tl.load(g_ptr + r * sg + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(g_ptr + r * sg + I + c, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)   # rounded as torch's silu
        tl.store(y_ptr + r * I + c, (act * up).to(y_ptr.dtype.element_ty), mask=ok)


def exact_silu_mul(gu: Tensor) -> Tensor:
    """gu (N, 2 I) = [gate | up] -> silu(gate) * up (N, I), in one launch; each element computed alone."""
    if torch.is_grad_enabled() and gu.requires_grad:
        raise RuntimeError("kernels/exact_gemm.py gives values only: call it under torch.no_grad()")
    N, I2 = gu.shape
    I = I2 // 2
    if gu.stride(1) != 1:
        gu = gu.contiguous()
    y = torch.empty(N, I, device=gu.device, dtype=gu.dtype)
    if N:
        _silu_mul[(N, triton.cdiv(I, 1024))](gu, y, I, gu.stride(0), BI=1024, num_warps=4)
    return y
