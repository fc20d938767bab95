"""Per-token log-probs and entropies straight from hidden states, never holding the (N, V) logits.

    hidden (N, H), weight (V, H) (the lm_head, tied to the embedding or not), targets (N,)
        -> logp (N,) = log softmax(hidden @ weight.T / T)[target],  entropy (N,)   (float32)

    from kernels.linear_logprob import linear_logprob_entropy
    logp, ent = linear_logprob_entropy(hidden, weight, targets, temperature, use_triton=True)
    (logp * adv).sum().backward()        # -> hidden.grad (N, H), weight.grad (V, H)

How: tokens are cut into blocks of up to 8192 rows and the vocabulary into blocks sized so that one
(tokens x vocab) logits tile fits `chunk_bytes` (192 MB). For each tile cuBLAS computes the logits and
a Triton kernel (kernels/logprob.py) folds them into a running (max, sum, shifted sum) per token
(an online logsumexp), so the forward keeps only lse and E[z] per token. The backward recomputes each
tile, turns it into d loss / d logits in place (one more Triton pass), and feeds it to two matmuls:
d hidden += G @ W_tile (float32 accumulator per token block) and d W_tile += G.T @ hidden_block.
Peak extra memory is one tile plus one float32 (8192, H) accumulator, whatever N and V are.

`fuse_matmul=True` swaps the cuBLAS logits + elementwise pass for Triton matmuls (`_fwd_kernel`,
`_bwd_kernel`) whose epilogue does the softmax work in registers: the logits are never rounded to
bf16, so logp is ~1000x closer to float64, but its matmul is slower than cuBLAS's, so the whole is slower
than cuBLAS + elementwise and it is not the default (measured: docs/kernels.md, "Log-prob passes").

Cost: four matmuls of N*V*H (forward, recompute, two gradients) instead of eager's three; the
recompute is what buys the memory. Padded tokens (target < 0) are dropped before the matmuls.
`use_triton=False` runs the same chunked loop with the torch twins of the kernels: the CPU fallback.
Where weight.grad is bf16 and the float32 copy of it would not fit the budget, it accumulates in
bf16 across token blocks (ceil(N / 8192) roundings: 4 at N = 32k).
"""
import math
import os

import torch
from torch import Tensor

from kernels.logprob import (HAS_TRITON, check_inputs, check_linear_inputs, chunk_grad, chunk_stats, finish_stats,
                             hand_to_grad, into_grad_of, new_state)

if HAS_TRITON:
    import triton
    import triton.language as tl

TOKENS_PER_BLOCK = 8192
CHUNK_BYTES = 192 * 2**20  # one logits tile; with the (8192, H) accumulators, peak extra < 0.5 GiB at H = 4096
MAX_COLS = 16384          # vocabulary columns per tile at most (small N would otherwise get very wide tiles)
# Tiles of the fused matmuls: bf16 on Hopper runs wgmma with 128 x 256 output tiles, 3 smem stages.
GEMM = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3)

if HAS_TRITON:
    @triton.jit
    def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """Program pid's (row block, column block) of an (M, N) output in grouped order: GROUP_M row blocks walk a
        column block together, so neighbouring programs share the right operand's tiles in L2."""
        n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        group = GROUP_M * n_n
        first_m = (pid // group) * GROUP_M
        size_m = min(n_m - first_m, GROUP_M)
        return first_m + (pid % group) % size_m, (pid % group) // size_m

    @triton.jit
    def _logits_tile(h_ptr, w_ptr, M, V, H, pid, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        """One (BM, BN) tile of h @ w.T in float32 (h (M, H), w (V, H), both row-major), grouped order."""
        pid_m, pid_n = grouped_tile(pid, M, V, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        a_ptrs = h_ptr + (offs_m % M).to(tl.int64)[:, None] * H + offs_k[None, :]      # (BM, BK)
        b_ptrs = w_ptr + (offs_n % V).to(tl.int64)[None, :] * H + offs_k[:, None]      # (BK, BN) = w.T
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BK)):
            a = tl.load(a_ptrs, mask=offs_k[None, :] < H - k * BK, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < H - k * BK, other=0.0)
            if INTERPRET:  # the CPU interpreter's bf16 dot returns garbage (triton 3.9): do it in float32
                a, b = a.to(tl.float32), b.to(tl.float32)
            if IEEE:  # float32 inputs: full precision (tf32 would miss the 1e-4 bar)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        return acc, offs_m, offs_n, pid_n

    @triton.jit
    def _fwd_kernel(h_ptr, w_ptr, pm_ptr, ps_ptr, pt_ptr, M, V, H, n_tiles_v, inv_t,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # logits tile -> per-row (max, sum exp, shifted sum) of this tile; the logits never reach memory
        acc, offs_m, offs_n, pid_n = _logits_tile(h_ptr, w_ptr, M, V, H, tl.program_id(0), BM, BN, BK, GROUP_M, IEEE, INTERPRET)
        z = tl.where(offs_n[None, :] < V, acc * inv_t, -float("inf"))            # (BM, BN)
        m = tl.max(z, 1)
        shift = tl.where(m == -float("inf"), 0.0, m)
        e = tl.exp(z - shift[:, None])
        out = offs_m.to(tl.int64) * n_tiles_v + pid_n
        mask = offs_m < M
        tl.store(pm_ptr + out, m, mask=mask)
        tl.store(ps_ptr + out, tl.sum(e, 1), mask=mask)
        tl.store(pt_ptr + out, tl.sum(e * tl.where(e > 0, z - shift[:, None], 0.0), 1), mask=mask)

    @triton.jit
    def _bwd_kernel(h_ptr, w_ptr, g_ptr, tgt_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, M, V, H, col0, inv_t,
                    HAS_ENT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP_M: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # logits tile -> d loss / d logits tile, written once in the input dtype: g (M, V) row-major
        acc, offs_m, offs_n, pid_n = _logits_tile(h_ptr, w_ptr, M, V, H, tl.program_id(0), BM, BN, BK, GROUP_M, IEEE, INTERPRET)
        row_ok = offs_m < M
        tgt = tl.load(tgt_ptr + offs_m, mask=row_ok, other=-1)
        valid = tgt >= 0
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
        glp = tl.where(valid, tl.load(glp_ptr + offs_m, mask=row_ok, other=0.0), 0.0)
        z = acc * inv_t
        p = tl.exp(z - lse[:, None])                                              # (BM, BN)
        g = glp[:, None] * (tl.where(offs_n[None, :] == (tgt - col0)[:, None], 1.0, 0.0) - p)
        if HAS_ENT:
            gent = tl.where(valid, tl.load(gent_ptr + offs_m, mask=row_ok, other=0.0), 0.0)
            ez = tl.load(ez_ptr + offs_m, mask=row_ok, other=0.0)
            g -= gent[:, None] * p * (z - ez[:, None])
        ptrs = g_ptr + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :]
        tl.store(ptrs, (g * inv_t).to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < V))


def _grid(M: int, V: int):
    return (triton.cdiv(M, GEMM["BM"]) * triton.cdiv(V, GEMM["BN"]),)


def _gemm_args(h: Tensor):
    return dict(IEEE=h.dtype == torch.float32, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", **GEMM)


def fused_block_stats(h: Tensor, w: Tensor, targets: Tensor, inv_t: float):
    """Whole-vocabulary running state for a token block, logits kept in registers: (max, sum, shifted, z_y)."""
    M, V = h.shape[0], w.shape[0]
    n_tiles = triton.cdiv(V, GEMM["BN"])
    pm, ps, pt = (torch.empty(M, n_tiles, dtype=torch.float32, device=h.device) for _ in range(3))
    _fwd_kernel[_grid(M, V)](h, w, pm, ps, pt, M, V, h.shape[1], n_tiles, inv_t, **_gemm_args(h))
    m = pm.max(1).values                                           # (M,) merge the per-tile states
    alpha = torch.exp(pm - m[:, None])                             # (M, tiles); 0 for all -inf tiles
    dm = torch.where(alpha > 0, pm - m[:, None], 0.0)
    s, t = (alpha * ps).sum(1), (alpha * (pt + dm * ps)).sum(1)
    # the target logit as its own dot product: (M, H) work instead of a gather from every tile
    zy = (h.float() * w[targets.clamp(min=0)].float()).sum(1) * inv_t
    return m, s, t, zy


def fused_tile_grad(h: Tensor, w: Tensor, out: Tensor, targets, lse, ez, g_logp, g_ent, col0: int, inv_t: float):
    """out (M, v) = d loss / d logits for vocabulary rows w = weight[col0:col0 + v], from a recomputed tile."""
    M, V = h.shape[0], w.shape[0]
    _bwd_kernel[_grid(M, V)](h, w, out, targets, lse, ez, g_logp, g_logp if g_ent is None else g_ent,
                             M, V, h.shape[1], col0, inv_t, HAS_ENT=g_ent is not None, **_gemm_args(h))


def _blocks(total: int, most: int, align: int = 128) -> list[tuple[int, int]]:
    """Split range(total) into equal-ish (start, stop) blocks of at most `most`, aligned for the matmuls."""
    n = math.ceil(total / most)
    align = align if most >= align else 1                         # tests use tiny blocks
    size = min(total, math.ceil(total / n / align) * align)
    return [(i, min(i + size, total)) for i in range(0, total, size)]


def _plan(N: int, V: int, itemsize: int, chunk_bytes: int):
    rows = _blocks(N, TOKENS_PER_BLOCK)
    n_rows = rows[0][1] - rows[0][0]
    cols = _blocks(V, max(128, min(MAX_COLS, chunk_bytes // (itemsize * n_rows))))
    return rows, cols


def _tile(buf: Tensor, r: int, c: int) -> Tensor:
    return buf[: r * c].view(r, c)  # contiguous (r, c) view of the flat tile buffer


def _addmm_f32(acc: Tensor, a: Tensor, b: Tensor):
    """acc (float32) += a @ b for a, b of any float dtype; bf16 products are rounded once, then added in float32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))                                   # add_ upcasts on the fly: no float32 temporary


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, use_triton, chunk_bytes, fuse_matmul, into_grad):
        (N, H), V = hidden.shape, weight.shape[0]
        ctx.param = into_grad_of(weight, into_grad)
        ctx.set_materialize_grads(False)                           # unused entropy -> g_ent None, less work
        inv_t = 1.0 / temperature
        rows, cols = _plan(N, V, hidden.element_size(), chunk_bytes)
        state = new_state(N, hidden.device)
        fuse = fuse_matmul and use_triton
        buf = None if fuse else hidden.new_empty((rows[0][1] - rows[0][0]) * (cols[0][1] - cols[0][0]))
        for r0, r1 in rows:
            part = [x[r0:r1] for x in state]                       # views: the kernel updates them in place
            if fuse:
                for x, y in zip(part, fused_block_stats(hidden[r0:r1], weight, targets[r0:r1], inv_t)):
                    x.copy_(y)
                continue
            for c0, c1 in cols:
                logits = torch.mm(hidden[r0:r1], weight[c0:c1].T, out=_tile(buf, r1 - r0, c1 - c0))  # (n, v)
                chunk_stats(logits, targets[r0:r1], part, c0, inv_t, use_triton)
        del buf
        logp, entropy, lse, ez = finish_stats(state, targets)
        ctx.save_for_backward(hidden, weight, targets, lse, ez)
        ctx.inv_t, ctx.use_triton, ctx.chunk_bytes, ctx.fuse = inv_t, use_triton, chunk_bytes, fuse
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ez = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        (N, H), V = hidden.shape, weight.shape[0]
        rows, cols = _plan(N, V, hidden.element_size(), ctx.chunk_bytes)
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        grad_h = torch.empty_like(hidden) if need_h else None
        # several token blocks add into each weight row: in float32 when that fits the budget (see top)
        w_dtype = torch.float32 if V * H * 4 <= ctx.chunk_bytes and len(rows) > 1 else weight.dtype
        param, grad_w = ctx.param, None
        if need_w and param is not None and param.grad is not None and w_dtype == param.grad.dtype:
            grad_w = param.grad                                    # into_grad: add the tiles straight into .grad
        elif need_w:
            grad_w = torch.zeros(V, H, dtype=w_dtype, device=weight.device)
        buf = hidden.new_empty((rows[0][1] - rows[0][0]) * (cols[0][1] - cols[0][0]))
        for r0, r1 in rows:
            h = hidden[r0:r1]                                      # (n, H)
            acc = torch.zeros(r1 - r0, H, dtype=torch.float32, device=hidden.device) if need_h else None
            for c0, c1 in cols:
                w = weight[c0:c1]                                  # (v, H)
                g = _tile(buf, r1 - r0, c1 - c0)                   # (n, v) d loss / d logits
                rows_of = (targets[r0:r1], lse[r0:r1], ez[r0:r1], g_logp[r0:r1], None if g_ent is None else g_ent[r0:r1])
                if ctx.fuse:
                    fused_tile_grad(h, w, g, *rows_of, c0, ctx.inv_t)
                else:                                              # logits through cuBLAS, then in place
                    chunk_grad(torch.mm(h, w.T, out=g), g, *rows_of, c0, ctx.inv_t, ctx.use_triton)
                if need_h:
                    _addmm_f32(acc, g, w)                          # (n, H)
                if need_w:
                    if w_dtype == g.dtype:
                        grad_w[c0:c1].addmm_(g.T, h)               # (v, H)
                    else:
                        _addmm_f32(grad_w[c0:c1], g.T, h)
            if need_h:
                grad_h[r0:r1] = acc
        if need_w and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if need_w and param is not None:                           # into_grad: .grad has it now, autograd gets None
            grad_w = hand_to_grad(param, grad_w)
        return grad_h, grad_w, None, None, None, None, None, None


def linear_logprob_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                           use_triton: bool = True, chunk_bytes: int = CHUNK_BYTES,
                           fuse_matmul: bool = False, into_grad: bool = False) -> tuple[Tensor, Tensor]:
    """hidden (..., H), weight (V, H), targets (...) -> (logp, entropy) float32, shaped like targets.

    into_grad=True (weight a leaf, e.g. the lm_head's Parameter; .backward() only, not torch.autograd.grad):
    the backward adds weight's gradient into weight.grad itself and hands autograd None for it. Why: a head tied
    to the input embedding gets a second gradient at the very end of the backward, and autograd holds the
    first, a (V, H) tensor (272 MB at Qwen2.5-0.5B's shape), until then, through the layers' backward where
    memory peaks. Also no (V, H) temporary when .grad already exists (gradient accumulation)."""
    check_linear_inputs(hidden, weight, targets)
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # (N, H), (N,)
    # the valid tokens' count comes back in the range check's host sync; the compaction (a second sync) only when
    # some are padded
    (n_valid,) = check_inputs(targets, weight.shape[0], temperature, hidden.shape[0], also=(targets >= 0).sum())
    use_triton = use_triton and HAS_TRITON
    if n_valid == targets.numel() and n_valid:                     # (no tokens at all: the empty results below)
        logp, ent = _LinearLogprobEntropy.apply(hidden.contiguous(), weight.contiguous(), targets.contiguous(),
                                                float(temperature), use_triton, chunk_bytes, fuse_matmul, into_grad)
        return logp.view(shape), ent.view(shape)
    logp = hidden.new_zeros(targets.shape, dtype=torch.float32)
    ent = torch.zeros_like(logp)
    if n_valid:
        keep = (targets >= 0).nonzero().squeeze(1)                 # (M,) padded tokens cost no matmul
        lp, en = _LinearLogprobEntropy.apply(hidden[keep], weight.contiguous(), targets[keep].contiguous(),
                                             float(temperature), use_triton, chunk_bytes, fuse_matmul, into_grad)
        logp, ent = logp.index_put((keep,), lp), ent.index_put((keep,), en)
    return logp.view(shape), ent.view(shape)
