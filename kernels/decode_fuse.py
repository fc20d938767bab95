"""A decode step's RMSNorm fused into the GEMM after it (issue 38 item 2): fewer kernels per layer-token.

A decode step at batch 128 is latency-bound per kernel (docs/speed.md), so the elementwise kernels between the
GEMMs cost about what their launch does. `norm_linear` folds three of them into the two GEMMs whose input is a
norm of the residual stream (q/k/v and gate/up):

    y, x = norm_linear(x, res, g, eps, w, b)            # x (M, K) + res (M, K) -> x; y = rmsnorm(x) g @ w^T + b
    a, x = norm_linear(x, res, g, eps, w, None, glu=True)    # w = [gate; up] (2N, K) -> a = silu(gate) * up (M, N)

- The residual add (res: the last GEMM's output, or None) is the prologue: each program adds its rows' tile of
  x and res, the programs of the first output block store the sum (the new residual stream, returned as x).
- RMSNorm without a pass of its own: (x * rstd * g) @ w^T = rstd * ((x * g) @ w^T), so the K loop feeds x * g to
  the dot and accumulates each row's sum of squares alongside; rstd scales the accumulator in the epilogue. The
  rounding differs from transformers' norm (which rounds x * rstd to the weight's dtype before the * g): the
  output agrees within bf16 rounding, not bit for bit.
- glu: the program's output columns n of both halves of w (gate rows n, up rows N + n), two accumulators, and
  silu(gate) * up in the epilogue: the activation kernel goes too.

`norm_linear_reference` is the torch twin (transformers' formulas: rounded as the modules round). The engine
(engines/decode_step.py) calls the kernel on CUDA for layers whose norms and activation it covers
(`NORMS`, SiLU) and keeps its module route elsewhere. Launch settings: `SETTINGS`; timed in docs/kernels.md
("Norm + GEMM fusion in the decode step").
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:                                   # CPU-only installs: the torch twin only
    HAS_TRITON = False

# the norm modules whose formula is weight * (x * rsqrt(mean(x^2) + eps)) with attributes weight and
# variance_epsilon (transformers' RMSNorm of these families); gemma's (1 + w) and olmo2's post-norms are not
NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
# (rows, output columns, K step, warps, stages) per kind: "linear" (q/k/v: N = 1152 at W1) and "glu"
# (gate/up: N = 4864 each half at W1)
SETTINGS = {"linear": (128, 32, 128, 4, 3), "glu": (128, 32, 128, 4, 3)}


def norm_linear_reference(x: Tensor, res: Optional[Tensor], g: Tensor, eps: float, w: Tensor, b: Optional[Tensor],
                          glu: bool = False) -> tuple[Tensor, Tensor]:
    """x, res (M, K) (res may be None), g (K,), w (N, K) or glu (2N, K), b (N,) or None -> (y (M, N), x + res)."""
    if res is not None:
        x = x + res
    xf = x.float()
    h = g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)      # (M, K)
    y = F.linear(h, w, b)
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, x


if HAS_TRITON:
    @triton.jit
    def _norm_linear(x_ptr, r_ptr, xo_ptr, g_ptr, w_ptr, b_ptr, y_ptr, M, N, K, eps,
                     HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)                             # (BM,) rows
        rn = pid_n * BN + tl.arange(0, BN)                             # (BN,) output columns
        mm, nm = rm < M, rn < N
        acc = tl.zeros((BM, BN), tl.float32)
        acc2 = tl.zeros((BM, BN), tl.float32)
        ss = tl.zeros((BM,), tl.float32)                               # each row's sum of squares
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            km = rk < K
            xm = mm[:, None] & km[None, :]
            at = rm[:, None] * K + rk[None, :]                         # (BM, BK)
            x = tl.load(x_ptr + at, mask=xm, other=0.0)
            if HAS_RES:   # the residual add, rounded to x's dtype as torch's add is; block 0 keeps the sum
                x = (x.to(tl.float32) + tl.load(r_ptr + at, mask=xm, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
                if pid_n == 0:
                    tl.store(xo_ptr + at, x, mask=xm)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            gk = tl.load(g_ptr + rk, mask=km, other=0.0).to(tl.float32)
            a = (xf * gk[None, :]).to(w_ptr.dtype.element_ty)         # (BM, BK)
            wm = nm[None, :] & km[:, None]
            w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=wm, other=0.0)          # (BK, BN)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GLU:
                w2 = tl.load(w_ptr + (rn + N)[None, :] * K + rk[:, None], mask=wm, other=0.0)
                acc2 = tl.dot(a, w2, acc2, input_precision=PRECISION)
        rstd = 1.0 / tl.sqrt(ss / K + eps)                             # (BM,)
        acc = acc * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
        if GLU:
            acc = acc * tl.sigmoid(acc) * (acc2 * rstd[:, None])       # silu(gate) * up
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])

    # an opaque custom op (as kernels/decode_attention.py's): torch.compile calls it as it is inside the step
    @torch.library.custom_op("rlhack::norm_linear", mutates_args=())
    def _norm_linear_op(x: Tensor, res: Optional[Tensor], g: Tensor, eps: float, w: Tensor, b: Optional[Tensor],
                        glu: bool, bm: int, bn: int, bk: int, warps: int, stages: int) -> tuple[Tensor, Tensor]:
        M, K = x.shape
        N = w.shape[0] // 2 if glu else w.shape[0]
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        xo = torch.empty_like(x) if res is not None else x.new_empty(0)
        grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
        _norm_linear[grid](x, x if res is None else res, xo, g, w, w if b is None else b, y, M, N, K, eps,
                           HAS_RES=res is not None, HAS_BIAS=b is not None, GLU=glu, BM=bm, BN=bn, BK=bk,
                           PRECISION="ieee" if w.dtype == torch.float32 else "tf32",   # float32: no TF32 rounding
                           num_warps=warps, num_stages=stages)
        return y, xo

    @_norm_linear_op.register_fake
    def _(x, res, g, eps, w, b, glu, bm, bn, bk, warps, stages):
        N = w.shape[0] // 2 if glu else w.shape[0]
        return x.new_empty(x.shape[0], N), (torch.empty_like(x) if res is not None else x.new_empty(0))


def norm_linear(x: Tensor, res: Optional[Tensor], g: Tensor, eps: float, w: Tensor, b: Optional[Tensor],
                glu: bool = False, settings: tuple | None = None) -> tuple[Tensor, Tensor]:
    """The Triton kernel (CUDA, or TRITON_INTERPRET=1): see the module's docstring. x, res (M, K) contiguous,
    g (K,), w (N, K) (glu: (2N, K)) contiguous, b (N,) or None -> (y (M, N), x + res, or x when res is None).
    settings: (rows, columns, K step, warps, stages), by default SETTINGS' for the kind."""
    bm, bn, bk, warps, stages = settings or SETTINGS["glu" if glu else "linear"]
    if glu and w.shape[0] % 2:
        raise ValueError(f"norm_linear(glu=True) needs [gate; up] weights with an even row count, got {w.shape[0]}")
    y, xo = _norm_linear_op(x.contiguous(), None if res is None else res.contiguous(), g, float(eps),
                            w, b, glu, bm, bn, bk, warps, stages)
    return y, (x if res is None else xo)
