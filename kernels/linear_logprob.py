"""Per-token log-probs and entropies straight from hidden states, never holding the (N, V) logits.

    hidden (N, H), weight (V, H) (the lm_head, tied to the embedding or not), targets (N,)
        -> logp (N,) = log softmax(hidden @ weight.T / T)[target],  entropy (N,)   (float32)

    from kernels.linear_logprob import linear_logprob_entropy
    logp, ent = linear_logprob_entropy(hidden, weight, targets, temperature, use_triton=True)
    (logp * adv).sum().backward()        # -> hidden.grad (N, H), weight.grad (V, H)

How: tokens are cut into blocks of up to 8192 rows and the vocabulary into blocks sized so that one
(tokens x vocab) logits tile fits `chunk_bytes` (256 MB). For each tile cuBLAS computes the logits and
a Triton kernel (kernels/logprob.py) folds them into a running (max, sum, shifted sum) per token
(an online logsumexp), so the forward keeps only lse and E[z] per token. The backward recomputes each
tile, turns it into d loss / d logits in place (one more Triton pass), and feeds it to two matmuls:
d hidden += G @ W_tile (float32 accumulator per token block) and d W_tile += G.T @ hidden_block.
Peak extra memory is one tile plus one float32 (8192, H) accumulator, whatever N and V are.

Cost: four matmuls of N*V*H (forward, recompute, two gradients) instead of eager's three; the
recompute is what buys the memory. Padded tokens (target < 0) are dropped before the matmuls.
`use_triton=False` runs the same chunked loop with the torch twins of the kernels: the CPU fallback.
Where weight.grad is bf16 and the float32 copy of it would not fit the budget, it accumulates in
bf16 across token blocks (ceil(N / 8192) roundings: 4 at N = 32k).
"""
import math

import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON, check_inputs, chunk_grad, chunk_stats, finish_stats, new_state

TOKENS_PER_BLOCK = 8192
CHUNK_BYTES = 256 * 2**20


def _blocks(total: int, most: int, align: int = 128) -> list[tuple[int, int]]:
    """Split range(total) into equal-ish (start, stop) blocks of at most `most`, aligned for the matmuls."""
    n = math.ceil(total / most)
    align = align if most >= align else 1                         # tests use tiny blocks
    size = min(total, math.ceil(total / n / align) * align)
    return [(i, min(i + size, total)) for i in range(0, total, size)]


def _plan(N: int, V: int, itemsize: int, chunk_bytes: int):
    rows = _blocks(N, TOKENS_PER_BLOCK)
    n_rows = rows[0][1] - rows[0][0]
    cols = _blocks(V, max(128, chunk_bytes // (itemsize * n_rows)))
    return rows, cols


def _tile(buf: Tensor, r: int, c: int) -> Tensor:
    return buf[: r * c].view(r, c)  # contiguous (r, c) view of the flat tile buffer


def _addmm_f32(acc: Tensor, a: Tensor, b: Tensor):
    """acc (float32) += a @ b for a, b of any float dtype, without a full-size temporary where torch allows."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        try:  # cuBLAS: bf16 inputs, float32 accumulate and output, in place (torch >= 2.8)
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        except (TypeError, RuntimeError):
            acc.add_(torch.mm(a, b).float())
    else:
        acc.add_((a @ b).float())


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, use_triton, chunk_bytes):
        (N, H), V = hidden.shape, weight.shape[0]
        ctx.set_materialize_grads(False)                           # unused entropy -> g_ent None, less work
        inv_t = 1.0 / temperature
        rows, cols = _plan(N, V, hidden.element_size(), chunk_bytes)
        state = new_state(N, hidden.device)
        buf = hidden.new_empty((rows[0][1] - rows[0][0]) * (cols[0][1] - cols[0][0]))
        for r0, r1 in rows:
            part = [x[r0:r1] for x in state]                       # views: the kernel updates them in place
            for c0, c1 in cols:
                logits = torch.mm(hidden[r0:r1], weight[c0:c1].T, out=_tile(buf, r1 - r0, c1 - c0))  # (n, v)
                chunk_stats(logits, targets[r0:r1], part, c0, inv_t, use_triton)
        del buf
        logp, entropy, lse, ez = finish_stats(state, targets)
        ctx.save_for_backward(hidden, weight, targets, lse, ez)
        ctx.inv_t, ctx.use_triton, ctx.chunk_bytes = inv_t, use_triton, chunk_bytes
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
        grad_w = torch.zeros(V, H, dtype=w_dtype, device=weight.device) if need_w else None
        buf = hidden.new_empty((rows[0][1] - rows[0][0]) * (cols[0][1] - cols[0][0]))
        for r0, r1 in rows:
            h = hidden[r0:r1]                                      # (n, H)
            acc = torch.zeros(r1 - r0, H, dtype=torch.float32, device=hidden.device) if need_h else None
            for c0, c1 in cols:
                w = weight[c0:c1]                                  # (v, H)
                g = torch.mm(h, w.T, out=_tile(buf, r1 - r0, c1 - c0))  # (n, v) logits, then their gradient
                chunk_grad(g, g, targets[r0:r1], lse[r0:r1], ez[r0:r1], g_logp[r0:r1],
                           None if g_ent is None else g_ent[r0:r1], c0, ctx.inv_t, ctx.use_triton)
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
        return grad_h, grad_w, None, None, None, None


def linear_logprob_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                           use_triton: bool = True, chunk_bytes: int = CHUNK_BYTES) -> tuple[Tensor, Tensor]:
    """hidden (..., H), weight (V, H), targets (...) -> (logp, entropy) float32, shaped like targets."""
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., H) and weight (V, H) do not match: {tuple(hidden.shape)} vs {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one of them")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)} without H")
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # (N, H), (N,)
    check_inputs(targets, weight.shape[0], temperature, hidden.shape[0])
    use_triton = use_triton and HAS_TRITON
    keep = (targets >= 0).nonzero().squeeze(1)                     # (M,) padded tokens cost no matmul
    if keep.numel() == targets.numel():
        logp, ent = _LinearLogprobEntropy.apply(hidden.contiguous(), weight.contiguous(), targets.contiguous(),
                                                float(temperature), use_triton, chunk_bytes)
        return logp.view(shape), ent.view(shape)
    logp = hidden.new_zeros(targets.shape, dtype=torch.float32)
    ent = torch.zeros_like(logp)
    if keep.numel():
        lp, en = _LinearLogprobEntropy.apply(hidden[keep], weight.contiguous(), targets[keep].contiguous(),
                                             float(temperature), use_triton, chunk_bytes)
        logp, ent = logp.index_put((keep,), lp), ent.index_put((keep,), en)
    return logp.view(shape), ent.view(shape)
