"""Per-token KL between a student's and a teacher's next-token distributions, straight from both hidden states and
both heads, never holding the (N, V) logits.

    hidden_s (N, Hs), weight_s (V, Hs)  the student (policy): gets gradients
    hidden_t (N, Ht), weight_t (V, Ht)  the teacher (or the reference policy): a constant, no gradient
        -> kl (N,) float32:  reverse=True   KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)   (on-policy distillation)
                             reverse=False  KL(p_t || p_s)                                   (forward KL, as in SFT)
    with p = softmax(hidden @ weight.T / temperature).

    from kernels.fused_kl import fused_kl, fused_kl_loss, fused_kl_reference
    kl = fused_kl(h_s, w_s, h_t, w_t, temperature=1.0, reverse=True)   # Triton where it runs, else the torch twin
    (kl * token_weight).sum().backward()                               # -> h_s.grad (N, Hs), w_s.grad (V, Hs)
    loss, kl = fused_kl_loss(h_s, w_s, h_t, w_t, token_weight)         # the same loss, 4 matmuls instead of 6

Math, with zs, zt the scaled logits, lse their logsumexps and P the distribution the expectation is under (the
student for reverse, the teacher for forward), Q the other:
    KL(P || Q) = E_P[zP - zQ] - lse_P + lse_Q
    d KL(p_s || p_t) / d zs = p_s * (log p_s - log p_t - KL)        d KL(p_t || p_s) / d zs = p_s - p_t
so the forward keeps a running (max, sum exp, sum exp * (zP - zQ)) for P and (max, sum exp) for Q per token (an
online logsumexp over both), and the backward needs only lse_s, lse_t and KL per token.

How (the cuBLAS + elementwise pattern of kernels/linear_logprob.py): tokens are cut into blocks of up to 8192 rows
and the vocabulary into blocks sized so that the two (tokens x vocab) logits tiles fit `chunk_bytes`. For each tile
cuBLAS computes both tiles and a Triton kernel (`_stats_kernel`) folds them into the running state. The backward
recomputes both tiles, turns the student's into d loss / d zs in place (`_grad_kernel`), and feeds it to two
matmuls: d hidden_s += G @ W_s (float32 accumulator per token block) and d W_s += G.T @ hidden_s.
Cost: six matmuls of N*V*H (two forward, two recomputed, two gradients) against eager's four; the recompute is what
buys the memory: one pair of tiles plus a float32 (8192, Hs) accumulator, whatever N and V are.
`fused_kl_loss(h_s, w_s, h_t, w_t, weights)` -> (sum(weights * kl), kl) is the same with the per-token weights
known before the call (distillation's mask over its token count): each row chunk holds the whole vocabulary
(`loss_rows`: two (rows, V) buffers in `LOSS_CHUNK_BYTES`), so its KL is known before its gradient, and the
gradient is computed in the forward: four matmuls, no recompute. Per chunk: both logits products, `row_kl` (the
statistics in `LOSS_LAUNCH["SPLIT"]` programs per row, `_part_kernel`, merged per row into lse_s, lse_t and KL,
`_merge_kernel`), the gradient pass in place, d hidden = G @ W_s and d W_s += G.T @ hidden_s. The backward hands
the stored gradients to autograd scaled in place, so it runs once per forward (no retain_graph replay).
`use_triton=False` runs the same loops with the torch twins of the kernels (`stats_twin`, `grad_twin`): the CPU
path; `fused_kl_reference` is the eager formula, the (N, V) ground truth.
"""
import os

import torch
from torch import Tensor

from kernels.linear_logprob import _addmm_f32, _blocks, _tile
from kernels.logprob import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

TOKENS_PER_BLOCK = 8192
CHUNK_BYTES = 256 * 2**20  # both logits tiles together: with the (8192, H) accumulator, < 0.5 GiB extra at H <= 4096
LOSS_CHUNK_BYTES = 448 * 2**20  # fused_kl_loss's two (rows, V) buffers: its only extra memory, under 0.5 GiB
MAX_COLS = 16384           # vocabulary columns per tile at most


def fused_kl_reference(hidden_s: Tensor, weight_s: Tensor, hidden_t: Tensor, weight_t: Tensor,
                       temperature: float = 1.0, reverse: bool = True) -> Tensor:
    """The eager formula: both (N, V) log-softmaxes in float32 -> kl (N,)."""
    ls = torch.log_softmax((hidden_s @ weight_s.T).float() / temperature, dim=-1)            # (N, V)
    lt = torch.log_softmax((hidden_t @ weight_t.T).float() / temperature, dim=-1).detach()   # (N, V)
    p, lp, lq = (ls.exp(), ls, lt) if reverse else (lt.exp(), lt, ls)
    return (p * (lp - lq)).sum(-1)                                                           # (N,)


if HAS_TRITON:
    @triton.jit
    def _stats_kernel(zp_ptr, zq_ptr, stride, mp_ptr, sp_ptr, a_ptr, mq_ptr, sq_ptr, n_cols, inv_t,
                      BLOCK: tl.constexpr):
        # one program per row of a tile: fold zp, zq (columns [0, n_cols)) into the row's running state
        # mp, sp = max and sum exp(zp - mp); a = sum exp(zp - mp) * (zp - zq); mq, sq the same for zq
        row = tl.program_id(0).to(tl.int64)
        mp, sp, a = tl.load(mp_ptr + row), tl.load(sp_ptr + row), tl.load(a_ptr + row)
        mq, sq = tl.load(mq_ptr + row), tl.load(sq_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n_cols
            zp = tl.load(zp_ptr + row * stride + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
            zq = tl.load(zq_ptr + row * stride + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
            mp_new = tl.maximum(mp, tl.max(zp, 0))          # finite: every block holds a real column
            ep = tl.exp(zp - mp_new)                         # 0 on masked columns
            alpha = tl.exp(mp - mp_new)                      # 0 while mp is still -inf
            a = alpha * a + tl.sum(ep * tl.where(ok, zp - zq, 0.0), 0)
            sp = alpha * sp + tl.sum(ep, 0)
            mp = mp_new
            mq_new = tl.maximum(mq, tl.max(zq, 0))
            sq = tl.exp(mq - mq_new) * sq + tl.sum(tl.exp(zq - mq_new), 0)
            mq = mq_new
        tl.store(mp_ptr + row, mp)
        tl.store(sp_ptr + row, sp)
        tl.store(a_ptr + row, a)
        tl.store(mq_ptr + row, mq)
        tl.store(sq_ptr + row, sq)

    @triton.jit
    def _part_kernel(zp_ptr, zq_ptr, stride, part_ptr, n, S, n_cols, inv_t, per, BLOCK: tl.constexpr):
        # program (row, j): columns [j * per, (j + 1) * per) of whole-vocabulary rows, from a fresh state, into
        # part (5, n, S): mp, sp, a, mq, sq of that column range (as _stats_kernel keeps them)
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        c0 = j * per
        c1 = tl.minimum(c0 + per, n_cols)
        mp, sp, a = -float("inf"), 0.0, 0.0
        mq, sq = -float("inf"), 0.0
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < c1
            zp = tl.load(zp_ptr + row * stride + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
            zq = tl.load(zq_ptr + row * stride + cols, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
            mp_new = tl.maximum(mp, tl.max(zp, 0))          # finite: every step holds a real column
            ep = tl.exp(zp - mp_new)
            alpha = tl.exp(mp - mp_new)
            a = alpha * a + tl.sum(ep * tl.where(ok, zp - zq, 0.0), 0)
            sp = alpha * sp + tl.sum(ep, 0)
            mp = mp_new
            mq_new = tl.maximum(mq, tl.max(zq, 0))
            sq = tl.exp(mq - mq_new) * sq + tl.sum(tl.exp(zq - mq_new), 0)
            mq = mq_new
        at = part_ptr + row * S + j
        tl.store(at, mp)
        tl.store(at + n * S, sp)
        tl.store(at + 2 * n * S, a)
        tl.store(at + 3 * n * S, mq)
        tl.store(at + 4 * n * S, sq)

    @triton.jit
    def _merge_kernel(part_ptr, lse_s_ptr, lse_t_ptr, kl_ptr, n, S, REVERSE: tl.constexpr, BLOCK_S: tl.constexpr):
        # a row's S partial states (_part_kernel) -> its lse_s, lse_t and KL (every part saw real columns: finite)
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK_S)
        ok = k < S
        at = part_ptr + row * S + k
        pm = tl.load(at, mask=ok, other=-float("inf"))
        mp = tl.max(pm, 0)
        w = tl.exp(pm - mp)                                  # 0 on padding
        sp = tl.sum(w * tl.load(at + n * S, mask=ok, other=0.0), 0)
        a = tl.sum(w * tl.load(at + 2 * n * S, mask=ok, other=0.0), 0)
        qm = tl.load(at + 3 * n * S, mask=ok, other=-float("inf"))
        mq = tl.max(qm, 0)
        sq = tl.sum(tl.exp(qm - mq) * tl.load(at + 4 * n * S, mask=ok, other=0.0), 0)
        lse_p, lse_q = mp + tl.log(sp), mq + tl.log(sq)
        tl.store(kl_ptr + row, a / sp - lse_p + lse_q)
        if REVERSE:
            tl.store(lse_s_ptr + row, lse_p)
            tl.store(lse_t_ptr + row, lse_q)
        else:
            tl.store(lse_s_ptr + row, lse_q)
            tl.store(lse_t_ptr + row, lse_p)

    @triton.jit
    def _grad_kernel(zs_ptr, zt_ptr, stride, lse_s_ptr, lse_t_ptr, kl_ptr, g_ptr, n_cols, inv_t, per,
                     REVERSE: tl.constexpr, BLOCK: tl.constexpr):
        # d loss / d (unscaled) student logits, written in place over zs: g * p_s * (log p_s - log p_t - KL) / T
        # (reverse) or g * (p_s - p_t) / T (forward). Program (row, j) writes columns [j * per, (j + 1) * per).
        row = tl.program_id(0).to(tl.int64)
        c0 = tl.program_id(1) * per
        c1 = tl.minimum(c0 + per, n_cols)
        ls, lt = tl.load(lse_s_ptr + row), tl.load(lse_t_ptr + row)
        k, g = tl.load(kl_ptr + row), tl.load(g_ptr + row)
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < c1
            logp_s = tl.load(zs_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32) * inv_t - ls
            logp_t = tl.load(zt_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32) * inv_t - lt
            p_s = tl.exp(logp_s)
            if REVERSE:
                d = p_s * (logp_s - logp_t - k)
            else:
                d = p_s - tl.exp(logp_t)
            tl.store(zs_ptr + row * stride + cols, (d * (g * inv_t)).to(zs_ptr.dtype.element_ty), mask=ok)


# fused_kl_loss's passes over whole-vocabulary rows: columns per kernel step, warps, and SPLIT programs per row
# (each a contiguous column range; the statistics' partial states merged per row by a second launch): a chunk of
# a few hundred rows, one program each, leaves the statistics pass short of the card's bandwidth. The fastest of
# the settings tools/w9_floor.py swept (docs/kernels.md, "W9").
LOSS_LAUNCH = dict(BLOCK=2048, num_warps=4, SPLIT=8)


def _launch(n_cols: int, split: int = 1, block: int = 4096, num_warps: int = 8) -> tuple[int, int, dict]:
    """(columns per program, programs per row, kernel settings) for rows of n_cols columns."""
    block = min(block, triton.next_power_of_2(triton.cdiv(n_cols, split)))
    per = triton.cdiv(triton.cdiv(n_cols, split), block) * block   # a multiple of BLOCK: no empty program
    return per, triton.cdiv(n_cols, per), dict(BLOCK=block, num_warps=max(1, min(num_warps, block // 512)))


def stats_twin(zp: Tensor, zq: Tensor, state: list[Tensor], inv_t: float):
    """torch twin of _stats_kernel: zp, zq (n, v) -> state (mp, sp, a, mq, sq), each (n,) float32, in place."""
    mp, sp, a, mq, sq = state
    zp, zq = zp.float() * inv_t, zq.float() * inv_t                    # (n, v)
    mp_new = torch.maximum(mp, zp.max(1).values)                        # (n,)
    ep = torch.exp(zp - mp_new[:, None])
    alpha = torch.exp(mp - mp_new)
    a.mul_(alpha).add_((ep * (zp - zq)).sum(1))
    sp.mul_(alpha).add_(ep.sum(1))
    mp.copy_(mp_new)
    mq_new = torch.maximum(mq, zq.max(1).values)
    sq.mul_(torch.exp(mq - mq_new)).add_(torch.exp(zq - mq_new[:, None]).sum(1))
    mq.copy_(mq_new)


def grad_twin(zs: Tensor, zt: Tensor, lse_s: Tensor, lse_t: Tensor, kl: Tensor, g: Tensor, inv_t: float, reverse: bool):
    """torch twin of _grad_kernel: zs (n, v) becomes d loss / d student logits."""
    logp_s = zs.float() * inv_t - lse_s[:, None]                       # (n, v)
    logp_t = zt.float() * inv_t - lse_t[:, None]
    p_s = logp_s.exp()
    d = p_s * (logp_s - logp_t - kl[:, None]) if reverse else p_s - logp_t.exp()
    zs.copy_(d * (g * inv_t)[:, None])


def tile_stats(zp: Tensor, zq: Tensor, state: list[Tensor], inv_t: float, use_triton: bool):
    if not use_triton:
        return stats_twin(zp, zq, state, inv_t)
    _, _, kw = _launch(zp.shape[1])
    _stats_kernel[(zp.shape[0],)](zp, zq, zp.stride(0), *state, zp.shape[1], inv_t, **kw)


def row_kl(zs: Tensor, zt: Tensor, inv_t: float, reverse: bool, use_triton: bool, kl: Tensor):
    """Whole-vocabulary rows of both logits (m, V) -> (lse_s, lse_t), each (m,) float32, and KL into kl (m,):
    LOSS_LAUNCH["SPLIT"] programs per row, then a merge per row (the torch twin: one running state)."""
    m = zs.shape[0]
    zp, zq = (zs, zt) if reverse else (zt, zs)
    if not use_triton:
        inf = torch.full((m,), -float("inf"), dtype=torch.float32, device=zs.device)
        state = [inf, torch.zeros_like(inf), torch.zeros_like(inf), inf.clone(), torch.zeros_like(inf)]
        stats_twin(zp, zq, state, inv_t)
        mp, sp, a, mq, sq = state
        lse_p, lse_q = mp + sp.log(), mq + sq.log()                     # (m,)
        kl.copy_(a / sp - lse_p + lse_q)
        return (lse_p, lse_q) if reverse else (lse_q, lse_p)
    per, split, kw = _launch(zs.shape[1], LOSS_LAUNCH["SPLIT"], LOSS_LAUNCH["BLOCK"], LOSS_LAUNCH["num_warps"])
    part = torch.empty(5, m, split, dtype=torch.float32, device=zs.device)   # mp, sp, a, mq, sq per (row, split)
    _part_kernel[(m, split)](zp, zq, zs.stride(0), part, m, split, zs.shape[1], inv_t, per, **kw)
    lse = torch.empty(2, m, dtype=torch.float32, device=zs.device)
    _merge_kernel[(m,)](part, lse[0], lse[1], kl, m, split, REVERSE=reverse,
                        BLOCK_S=triton.next_power_of_2(split))
    return lse[0], lse[1]


def logits_kl(hs: Tensor, ws: Tensor, ht: Tensor, wt: Tensor, zs: Tensor, zt: Tensor, inv_t: float, reverse: bool,
              use_triton: bool, kl: Tensor):
    """One fused_kl_loss chunk's logits and statistics: zs (m, V) := hs @ ws.T, zt := ht @ wt.T (cuBLAS), then
    row_kl: kl (m,) written, -> (lse_s, lse_t). A function of its own so that tools/w9_floor.py can time the loss
    with another route for this step (the statistics in the products' epilogue, docs/kernels.md "W9")."""
    torch.mm(hs, ws.T, out=zs)
    torch.mm(ht, wt.T, out=zt)
    return row_kl(zs, zt, inv_t, reverse, use_triton, kl)


def tile_grad(zs: Tensor, zt: Tensor, lse_s, lse_t, kl, g, inv_t: float, reverse: bool, use_triton: bool,
              launch: dict | None = None):
    """zs (n, v) := d loss / d student logits; launch: LOSS_LAUNCH-like settings (None: one program per row)."""
    if not use_triton:
        return grad_twin(zs, zt, lse_s, lse_t, kl, g, inv_t, reverse)
    launch = launch or dict(SPLIT=1, BLOCK=4096, num_warps=8)
    per, split, kw = _launch(zs.shape[1], launch["SPLIT"], launch["BLOCK"], launch["num_warps"])
    _grad_kernel[(zs.shape[0], split)](zs, zt, zs.stride(0), lse_s, lse_t, kl, g, zs.shape[1], inv_t, per,
                                       REVERSE=reverse, **kw)


def _plan(N: int, V: int, itemsize: int, chunk_bytes: int, rows_per_block: int):
    rows = _blocks(N, rows_per_block)
    n = rows[0][1] - rows[0][0]
    return rows, _blocks(V, max(128, min(MAX_COLS, chunk_bytes // (2 * itemsize * n))))


class _FusedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, ht, wt, temperature, reverse, use_triton, chunk_bytes, rows_per_block):
        N, V = hs.shape[0], ws.shape[0]
        inv_t = 1.0 / temperature
        rows, cols = _plan(N, V, hs.element_size(), chunk_bytes, rows_per_block)
        size = (rows[0][1] - rows[0][0]) * (cols[0][1] - cols[0][0])
        buf_s, buf_t = hs.new_empty(size), ht.new_empty(size)
        inf = torch.full((N,), -float("inf"), dtype=torch.float32, device=hs.device)
        state = [inf, torch.zeros_like(inf), torch.zeros_like(inf), inf.clone(), torch.zeros_like(inf)]
        for r0, r1 in rows:
            part = [x[r0:r1] for x in state]                            # views: updated in place
            for c0, c1 in cols:
                zs = torch.mm(hs[r0:r1], ws[c0:c1].T, out=_tile(buf_s, r1 - r0, c1 - c0))   # (n, v)
                zt = torch.mm(ht[r0:r1], wt[c0:c1].T, out=_tile(buf_t, r1 - r0, c1 - c0))   # (n, v)
                tile_stats(*((zs, zt) if reverse else (zt, zs)), part, inv_t, use_triton)
        del buf_s, buf_t
        mp, sp, a, mq, sq = state
        lse_p, lse_q = mp + sp.log(), mq + sq.log()                     # (N,)
        kl = a / sp - lse_p + lse_q
        lse_s, lse_t = (lse_p, lse_q) if reverse else (lse_q, lse_p)
        ctx.save_for_backward(hs, ws, ht, wt, lse_s, lse_t, kl)
        ctx.args = (inv_t, reverse, use_triton, chunk_bytes, rows_per_block)
        return kl

    @staticmethod
    def backward(ctx, g):
        hs, ws, ht, wt, lse_s, lse_t, kl = ctx.saved_tensors
        inv_t, reverse, use_triton, chunk_bytes, rows_per_block = ctx.args
        need_h, need_w = ctx.needs_input_grad[:2]
        (N, H), V = hs.shape, ws.shape[0]
        rows, cols = _plan(N, V, hs.element_size(), chunk_bytes, rows_per_block)
        g = g.float().contiguous()
        grad_h = torch.empty_like(hs) if need_h else None
        # several token blocks add into each weight row: in float32 when that fits the budget
        w_dtype = torch.float32 if V * H * 4 <= chunk_bytes and len(rows) > 1 else ws.dtype
        grad_w = torch.zeros(V, H, dtype=w_dtype, device=ws.device) if need_w else None
        size = (rows[0][1] - rows[0][0]) * (cols[0][1] - cols[0][0])
        buf_s, buf_t = hs.new_empty(size), ht.new_empty(size)
        for r0, r1 in rows:
            h = hs[r0:r1]                                               # (n, H)
            acc = torch.zeros(r1 - r0, H, dtype=torch.float32, device=hs.device) if need_h else None
            for c0, c1 in cols:
                w = ws[c0:c1]                                           # (v, H)
                zs = torch.mm(h, w.T, out=_tile(buf_s, r1 - r0, c1 - c0))                 # (n, v)
                zt = torch.mm(ht[r0:r1], wt[c0:c1].T, out=_tile(buf_t, r1 - r0, c1 - c0))  # (n, v)
                tile_grad(zs, zt, lse_s[r0:r1], lse_t[r0:r1], kl[r0:r1], g[r0:r1], inv_t, reverse, use_triton)
                if need_h:
                    _addmm_f32(acc, zs, w)                              # (n, H)
                if need_w and w_dtype == zs.dtype:
                    grad_w[c0:c1].addmm_(zs.T, h)                       # (v, H)
                elif need_w:
                    _addmm_f32(grad_w[c0:c1], zs.T, h)
            if need_h:
                grad_h[r0:r1] = acc
        if need_w and grad_w.dtype != ws.dtype:
            grad_w = grad_w.to(ws.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def check_kl_inputs(hidden_s: Tensor, weight_s: Tensor, hidden_t: Tensor, weight_t: Tensor, temperature: float):
    """One-line errors, before any launch, for shapes and dtypes the loop cannot take."""
    for name, h, w in (("student", hidden_s, weight_s), ("teacher", hidden_t, weight_t)):
        if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1]:
            raise ValueError(f"{name} hidden (N, H) and weight (V, H) do not match: "
                             f"{tuple(h.shape)} vs {tuple(w.shape)}")
        if h.dtype != w.dtype or not h.dtype.is_floating_point:
            raise ValueError(f"{name} hidden is {h.dtype} but weight is {w.dtype}: give one floating dtype")
    if hidden_s.shape[0] != hidden_t.shape[0] or weight_s.shape[0] != weight_t.shape[0]:
        raise ValueError(f"student and teacher must share tokens N and vocabulary V: hidden {tuple(hidden_s.shape)} "
                         f"vs {tuple(hidden_t.shape)}, weight {tuple(weight_s.shape)} vs {tuple(weight_t.shape)}")
    if len({t.device for t in (hidden_s, weight_s, hidden_t, weight_t)}) != 1:
        raise ValueError("student and teacher tensors must be on one device")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def fused_kl(hidden_s: Tensor, weight_s: Tensor, hidden_t: Tensor, weight_t: Tensor, temperature: float = 1.0,
             reverse: bool = True, use_triton: bool | None = None, chunk_bytes: int = CHUNK_BYTES,
             rows_per_block: int = TOKENS_PER_BLOCK) -> Tensor:
    """-> kl (N,) float32 (see top). Gradients flow to hidden_s and weight_s; the teacher's side is a constant.
    use_triton None: the Triton kernels on CUDA tensors (or under TRITON_INTERPRET=1), the torch twins elsewhere."""
    check_kl_inputs(hidden_s, weight_s, hidden_t, weight_t, temperature)
    if use_triton is None:
        use_triton = os.environ.get("TRITON_INTERPRET") == "1" or hidden_s.is_cuda
    if hidden_s.shape[0] == 0:
        return hidden_s.new_zeros(0, dtype=torch.float32) + 0 * weight_s.sum()
    return _FusedKL.apply(hidden_s.contiguous(), weight_s.contiguous(), hidden_t.detach().contiguous(),
                          weight_t.detach().contiguous(), float(temperature), bool(reverse), use_triton and HAS_TRITON,
                          int(chunk_bytes), int(rows_per_block))


def loss_rows(N: int, V: int, itemsize: int, chunk_bytes: int) -> int:
    """Tokens per fused_kl_loss chunk: two (rows, V) logits buffers in chunk_bytes, whole multiples of 128 rows
    (the products' tile height) once there are more than 128."""
    n = max(1, min(N, chunk_bytes // (2 * itemsize * V)))
    return n // 128 * 128 if 128 < n < N else n


class _FusedKLLoss(torch.autograd.Function):
    """sum_i weights_i * kl_i with its gradient computed in the forward: four matmuls instead of six (see
    fused_kl_loss). Row chunks hold the whole vocabulary, so each row's lse and KL are known before its gradient."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, weights, temperature, reverse, use_triton, chunk_bytes, want_grad):
        (N, H), V = hs.shape, ws.shape[0]
        inv_t = 1.0 / temperature
        n = loss_rows(N, V, hs.element_size(), chunk_bytes)
        buf_s, buf_t = hs.new_empty(n * V), ht.new_empty(n * V)
        kl_out = torch.empty(N, dtype=torch.float32, device=hs.device)
        need_h, need_w = (want_grad and x for x in ctx.needs_input_grad[:2])   # want_grad: False under no_grad
        grad_h = torch.empty_like(hs) if need_h else None
        # several row chunks add into each weight row: in float32 when that fits the budget, else in the weight's dtype
        w_dtype = torch.float32 if V * H * 4 <= chunk_bytes and n < N else ws.dtype
        grad_w = torch.zeros(V, H, dtype=w_dtype, device=ws.device) if need_w else None
        g_all = weights.float().contiguous()
        for r0 in range(0, N, n):
            r1 = min(r0 + n, N)
            zs, zt, kl = _tile(buf_s, r1 - r0, V), _tile(buf_t, r1 - r0, V), kl_out[r0:r1]   # (m, V), (m, V), (m,)
            lse_s, lse_t = logits_kl(hs[r0:r1], ws, ht[r0:r1], wt, zs, zt, inv_t, reverse, use_triton, kl)
            if not (need_h or need_w):
                continue
            tile_grad(zs, zt, lse_s, lse_t, kl, g_all[r0:r1], inv_t, reverse, use_triton, LOSS_LAUNCH)  # zs := G
            if need_h:
                torch.mm(zs, ws, out=grad_h[r0:r1])                              # (m, H)
            if need_w and w_dtype == zs.dtype:
                grad_w.addmm_(zs.T, hs[r0:r1])                                   # (V, H)
            elif need_w:
                _addmm_f32(grad_w, zs.T, hs[r0:r1])
        del buf_s, buf_t
        if need_w and grad_w.dtype != ws.dtype:
            grad_w = grad_w.to(ws.dtype)
        # kept on ctx rather than saved for backward: the backward hands these very buffers to autograd, so no
        # second copy of d weight (V x H) is ever alive
        ctx.grads = (grad_h, grad_w)
        ctx.mark_non_differentiable(kl_out)
        return (kl_out * g_all).sum(), kl_out

    @staticmethod
    def backward(ctx, g_loss, g_kl):
        if ctx.grads is None:
            raise RuntimeError("fused_kl_loss computes its gradient in the forward and hands it over once: "
                               "call it again instead of backward(retain_graph=True) twice")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # scaled in place by d out / d loss (usually 1): the buffers are ours alone
        grad_h = grad_h.mul_(g_loss) if grad_h is not None else None
        grad_w = grad_w.mul_(g_loss) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def fused_kl_loss(hidden_s: Tensor, weight_s: Tensor, hidden_t: Tensor, weight_t: Tensor, weights: Tensor,
                  temperature: float = 1.0, reverse: bool = True, use_triton: bool | None = None,
                  chunk_bytes: int = LOSS_CHUNK_BYTES) -> tuple[Tensor, Tensor]:
    """-> (loss = sum(weights * kl), kl (N,) detached), weights (N,) known before the call (a mask over the token
    count, say). The gradient is computed in the forward, so each (rows x V) logits buffer is made once: four
    matmuls of N*V*H instead of fused_kl's six, for two (rows x V) buffers of at most chunk_bytes together;
    backward only scales the stored gradients. Only the loss carries a gradient; kl is for metrics."""
    check_kl_inputs(hidden_s, weight_s, hidden_t, weight_t, temperature)
    if weights.shape != hidden_s.shape[:1]:
        raise ValueError(f"weights must be ({hidden_s.shape[0]},) like the tokens, got {tuple(weights.shape)}")
    if use_triton is None:
        use_triton = os.environ.get("TRITON_INTERPRET") == "1" or hidden_s.is_cuda
    loss, kl = _FusedKLLoss.apply(hidden_s.contiguous(), weight_s.contiguous(), hidden_t.detach().contiguous(),
                                  weight_t.detach().contiguous(), weights.detach(), float(temperature), bool(reverse),
                                  use_triton and HAS_TRITON, int(chunk_bytes), torch.is_grad_enabled())
    return loss, kl.detach()
