"""A decode step's routed experts as two Triton kernels that stream each expert's weights once:

    a = expert_gate_up(x (N, H), token (M,), offs (E,) int32, gate_up (E, 2I, H))   # -> (M, I): SiLU(g) * u
    y = expert_down(a (M, I), offs (E,) int32, down (E, H, I))                      # -> (M, H)

The M (token, expert) pairs come sorted by expert (kernels/decode_route.py: `by_expert`): pair m of expert e lies in
[offs[e-1], offs[e]) and reads token[m]'s row of x. An expert's pairs make blocks of BM rows (one at a decode
batch's mean of ~16 pairs per expert, more where many tokens chose it); one program per (row block, tile of
output columns) loops over the input dimension, so each weight tile is read from memory once per step (an
expert's other blocks, running beside its first, find it in L2). The first kernel gathers x's rows by token
itself and applies SiLU(gate) * up in its epilogue, with the roundings to the activations' dtype that the
layer-by-layer computation has (gate and up rounded, SiLU rounded, the product rounded), so no (M, 2I) product,
copy of x or activation kernel is left between the two.

Why: torch._grouped_mm (a CUTLASS grouped GEMM) read the 32 experts of W10's qwen3_moe at about half the
card's memory rate at this shape (docs/architectures.md, "qwen3_moe at W10's batch"). The torch twins
(`expert_gate_up_reference`, `expert_down_reference`) are the same contract, for tests and the CPU.
"""
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.logprob import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_gemm(x_ptr, tok_ptr, w_ptr, offs_ptr, o_ptr, sx, sw_e, sw_n, so, N, K, E,
                     GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CN: tl.constexpr,
                     SPLIT: tl.constexpr, EB: tl.constexpr):
        # program (row block b, output columns [n CN, n CN + CN)), CN <= BN the columns it owns of its BN-wide
        # tile: o[m, cols] = x[tok[m]] @ w[e, cols]^T over the BM pairs m of block b, all of one expert e; GATED: w
        # holds gate rows [0, N) and up rows [N, 2N), and o = SiLU(gate) * up. SPLIT: the row blocks of every
        # expert numbered in expert order, one per program (an expert's blocks run side by side, its weight tile
        # read from memory once and from L2 by the others); else program (expert e, n), looping over e's blocks
        b, n = tl.program_id(0), tl.program_id(1)
        if SPLIT:
            c = tl.arange(0, EB)
            ends = tl.load(offs_ptr + c, mask=c < E, other=0)                           # (EB,)
            starts = tl.load(offs_ptr + c - 1, mask=(c > 0) & (c < E), other=0)
            blocks = (ends - starts + BM - 1) // BM                                    # each expert's row blocks
            last = tl.cumsum(blocks, 0)                                                # (EB,) their ends, numbered
            e = tl.sum((last <= b).to(tl.int32), 0)                                    # the expert holding block b
            here = c == e
            end = tl.sum(tl.where(here, ends, 0), 0)
            start = tl.sum(tl.where(here, starts + (b - last + blocks) * BM, 0), 0)    # block b's first pair
            stop = tl.minimum(start + BM, end)                                         # (e == E: nothing to do)
        else:
            e = b
            start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
            stop = tl.load(offs_ptr + e)
        cols = n * CN + tl.arange(0, BN)
        cm = (cols < N) & (tl.arange(0, BN) < CN)
        wg = w_ptr + e.to(tl.int64) * sw_e + cols[None, :] * sw_n     # (1, BN) gate (or only) rows' starts
        for m0 in range(start, stop, BM):
            rows = m0 + tl.arange(0, BM)
            rm = rows < stop
            if GATED:   # x's row of each pair: its token's
                t = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)             # (BM,)
            else:       # the pairs' own rows
                t = rows.to(tl.int64)
            xr = x_ptr + t[:, None] * sx
            g = tl.zeros((BM, BN), tl.float32)
            u = tl.zeros((BM, BN), tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < K
                xt = tl.load(xr + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)     # (BM, BK)
                wm = km[:, None] & cm[None, :]
                g = tl.dot(xt, tl.load(wg + kk[:, None], mask=wm, other=0.0), g)          # (BK, BN) tile of w^T
                if GATED:
                    u = tl.dot(xt, tl.load(wg + N * sw_n + kk[:, None], mask=wm, other=0.0), u)
            dt = o_ptr.dtype.element_ty
            if GATED:
                gr = g.to(dt).to(tl.float32)
                act = (gr / (1.0 + tl.exp(-gr))).to(dt).to(tl.float32)   # SiLU of the rounded gate, rounded
                out = act * u.to(dt).to(tl.float32)
            else:
                out = g
            tl.store(o_ptr + rows[:, None] * so + cols[None, :], out.to(dt), mask=rm[:, None] & cm[None, :])


    # opaque custom ops (as kernels/decode_attention.py's): the compiled decode step calls them as they are
    @torch.library.custom_op("rlhack::moe_expert_gemm", mutates_args=())
    def _expert_gemm_op(x: Tensor, tok: Tensor, offs: Tensor, w: Tensor, gated: bool, bm: int, bn: int, bk: int,
                        warps: int, stages: int, cn: int, split: bool) -> Tensor:
        M, n_out = (tok.shape[0], w.shape[1] // 2) if gated else (x.shape[0], w.shape[1])   # rows: the pairs
        out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
        if M:
            E = w.shape[0]
            bk = bk if x.element_size() <= 2 else max(16, bk // 2)   # float32: the same bytes per stage as bf16's
            cn = min(cn or bn, bn)
            # split: at most M / BM full blocks plus one partial block per expert; the programs past the routing's
            # own count (known on the device only) find no rows and end at once
            rows = triton.cdiv(M, bm) + min(E, M) if split else E
            _expert_gemm[(rows, triton.cdiv(n_out, cn))](
                x, tok, w, offs, out, x.stride(0), w.stride(0), w.stride(1), out.stride(0), n_out, w.shape[2], E,
                GATED=gated, BM=bm, BN=bn, BK=bk, CN=cn, SPLIT=split, EB=max(16, triton.next_power_of_2(E)),
                num_warps=warps, num_stages=stages)
        return out

    @_expert_gemm_op.register_fake
    def _(x, tok, offs, w, gated, bm, bn, bk, warps, stages, cn, split):
        return x.new_empty(tok.shape[0], w.shape[1] // 2) if gated else x.new_empty(x.shape[0], w.shape[1])


# (BM, BN, BK, warps, stages) per kernel, chosen by timing in a CUDA graph at W10's qwen3_moe decode shape
# (docs/architectures.md, "Decode attention and experts, timed"); tools/decode_kernel_bench.py --moe times
# candidates. BM 32: one row block holds an expert's pairs at a decode batch (about 16 each at 128 tokens x top-4
# of 32). Settings are for 2-byte dtypes; float32 inputs take half the BK, so the stages still fit in shared
# memory. FAST_DECODE_MOE_SETTINGS="32x128x64x8x3,32x128x64x8x3" (gate_up's, down's; a sixth field: CN,
# expert_gate_up's docstring) overrides them for a run
# gate_up's CN 96: 8 programs of 96 columns per expert (256 over 132 SMs: two to nearly every SM) where 128-column
# tiles made 6 (192: two on 60 SMs, one on the rest)
SETTINGS = {"gate_up": (32, 128, 64, 8, 3, 96), "down": (32, 128, 64, 8, 3)}
# an expert's row blocks (BM pairs each) one per program, side by side (True), or looped over by its programs
# (False, FAST_DECODE_MOE_SPLIT=0: kept for tools/moe_kernel_bench.py's comparison). A decode batch's routing is
# uneven (experts many tokens prefer; GRPO's samples of one prompt share their context), and an expert with more
# than BM pairs set the kernels' time when its programs streamed its weights once per block, one block after the
# other (docs/architectures.md)
SPLIT = os.environ.get("FAST_DECODE_MOE_SPLIT", "1") == "1"
if os.environ.get("FAST_DECODE_MOE_SETTINGS"):
    SETTINGS.update(zip(("gate_up", "down"), (tuple(int(v) for v in c.split("x"))
                                              for c in os.environ["FAST_DECODE_MOE_SETTINGS"].split(","))))


def _check(x: Tensor, offs: Tensor, w: Tensor, M: int, in_dim: int):
    if w.dim() != 3 or w.shape[-1] != in_dim or x.dim() != 2 or x.shape[1] != in_dim:
        raise ValueError(f"expert weights must be (E, out, {in_dim}) for inputs (rows, {in_dim}); got weights "
                         f"{tuple(w.shape)}, inputs {tuple(x.shape)}")
    if offs.shape != (w.shape[0],) or offs.dtype != torch.int32:
        raise ValueError(f"offs must be ({w.shape[0]},) int32 (each expert's end among the {M} sorted pairs), got "
                         f"{offs.dtype} {tuple(offs.shape)}")
    if x.dtype != w.dtype or x.stride(-1) != 1 or w.stride(-1) != 1 or x.device != w.device:
        raise ValueError(f"inputs and weights must share dtype and device, contiguous in their last dimension; got "
                         f"{x.dtype} {x.device}, {w.dtype} {w.device}")



def expert_gate_up(x: Tensor, token: Tensor, offs: Tensor, gate_up: Tensor, cfg: tuple | None = None) -> Tensor:
    """x (N, H), token (M,) int64 (x's row of each sorted pair), offs (E,) int32, gate_up (E, 2I, H) -> (M, I).
    cfg: (BM, BN, BK, warps, stages[, CN]), by default SETTINGS'. CN < BN: each program owns CN of its tile's BN
    columns (the rest masked), so the grid's size can be chosen apart from the tile's power-of-two width."""
    _check(x, offs, gate_up, token.shape[0], x.shape[1])
    return _expert_gemm_op(x, token, offs, gate_up, True, *_full(cfg or SETTINGS["gate_up"]), SPLIT)


def expert_down(a: Tensor, offs: Tensor, down: Tensor, cfg: tuple | None = None) -> Tensor:
    """a (M, I) sorted pairs, offs (E,) int32, down (E, H, I) -> (M, H)."""
    _check(a, offs, down, a.shape[0], a.shape[1])
    return _expert_gemm_op(a, offs, offs, down, False, *_full(cfg or SETTINGS["down"]), SPLIT)   # tok unused


def _full(cfg: tuple) -> tuple:
    """(BM, BN, BK, warps, stages[, CN]) -> with CN (columns a program owns; 0: BN)."""
    return (*cfg, 0) if len(cfg) == 5 else tuple(cfg)


def _experts(offs: Tensor, M: int) -> Tensor:
    """offs (E,) -> (M,) the expert of each sorted pair."""
    return torch.searchsorted(offs, torch.arange(M, device=offs.device, dtype=offs.dtype), right=True)


def expert_gate_up_reference(x: Tensor, token: Tensor, offs: Tensor, gate_up: Tensor) -> Tensor:
    """The torch twin of expert_gate_up (each pair times its own expert's weights; small shapes: tests, CPU)."""
    _check(x, offs, gate_up, token.shape[0], x.shape[1])
    w = gate_up[_experts(offs, token.shape[0])]                        # (M, 2I, H)
    h = torch.einsum("mk,mnk->mn", x[token].float(), w.float()).to(x.dtype)   # (M, 2I)
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def expert_down_reference(a: Tensor, offs: Tensor, down: Tensor) -> Tensor:
    """The torch twin of expert_down."""
    _check(a, offs, down, a.shape[0], a.shape[1])
    w = down[_experts(offs, a.shape[0])]                               # (M, H, I)
    return torch.einsum("mk,mnk->mn", a.float(), w.float()).to(a.dtype)
