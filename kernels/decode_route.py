"""A decode step's MoE routing in one Triton kernel: softmax, top-k, the gating weights and the pairs' expert order.

    weight, idx, token, at, offs = route(logits (N, E), top_k, norm, dtype)
    # weight (N, k) dtype: each token's k gating probabilities (renormalised over its k if norm), largest first
    # idx    (N, k) int64: their experts
    # token  (M,)   int64: the token of each (token, expert) pair in expert order (M = N k; stable within an expert)
    # at     (M,)   int64: the place of pair n k + j in that order (token's inverse)
    # offs   (E,)   int32: the end of each expert's block in that order

What it replaces: torch's softmax, topk (two kernels), the weights' normalisation and cast, and engines/moe.py's
counting pass and scatter: six to eight small launches per MoE layer-token at a decode batch, each of a few
microseconds whatever its size, for 128 x 32 numbers. One program does it all: the N x E probabilities fit in
its registers; top-k is k rounds of a row maximum (ties to the lower expert index, where torch's topk leaves
the order of exact ties unspecified); the order by expert follows from the N x E choice matrix A: a pair (n, e)
sits at (pairs of experts below e) + (tokens before n that chose e), an exclusive cumulative sum of A down its
columns (a token takes an expert once, so its own other pairs never precede it). The torch twin
(`route_reference`) is the same contract, for tests and the CPU.
"""
import os
from typing import Optional

import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

# the kernel holds N x E probabilities in one program; engines/moe.py sends larger routings (a prefill) to torch
MAX_TOKENS = 512
# the program's warps; 0 (the default) picks by size: 4 below 128 tokens, else 8, which timed faster than 4 at W10's
# decode batch, alone and in qwen3_moe rollouts (docs/architectures.md, "Busy experts in bigger blocks, the routing
# over several programs"); smaller batches keep 4 (not timed)
WARPS = int(os.environ.get("FAST_DECODE_ROUTE_WARPS", "0"))
if WARPS not in (0, 1, 2, 4, 8, 16, 32):
    raise ValueError(f"FAST_DECODE_ROUTE_WARPS must be 0 (by size) or a power of two up to 32, got {WARPS}")

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _route(z_ptr, sz, g_ptr, sg, H, w_ptr, idx_ptr, tok_ptr, at_ptr, offs_ptr, N, E,
               K: tl.constexpr, NORM: tl.constexpr, NB: tl.constexpr, EB: tl.constexpr, GEMM: tl.constexpr,
               BK: tl.constexpr):
        r = tl.arange(0, NB)
        c = tl.arange(0, EB)
        rm, cm = r < N, c < E
        if GEMM:   # z_ptr: the tokens' hidden states (N, H), g_ptr: the router (E, H); logits rounded as F.linear's
            acc = tl.zeros((NB, EB), tl.float32)
            for k0 in range(0, H, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < H
                xt = tl.load(z_ptr + r[:, None] * sz + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
                gt = tl.load(g_ptr + c[None, :] * sg + kk[:, None], mask=cm[None, :] & km[:, None], other=0.0)
                acc = tl.dot(xt, gt, acc, input_precision="ieee")           # (NB, EB); float32: no TF32 rounding
            z = acc.to(z_ptr.dtype.element_ty).to(tl.float32)
        else:      # z_ptr: the logits (N, E)
            z = tl.load(z_ptr + r[:, None] * sz + c[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
            z = z.to(tl.float32)
        z = tl.where(cm[None, :], z, float("-inf"))                           # (NB, EB) logits
        p = tl.exp(z - tl.max(z, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]                                         # softmax, float32 as the router's
        cur = tl.where(cm[None, :], p, -1.0)
        total = tl.zeros((NB,), tl.float32)
        for j in tl.static_range(K):                                          # k rounds of a row maximum
            best = tl.max(cur, 1)                                             # (NB,)
            ix = tl.min(tl.where(cur == best[:, None], c[None, :], EB), 1)    # its lowest expert index
            cur = tl.where(c[None, :] == ix[:, None], -1.0, cur)
            total += best
        a = ((cur == -1.0) & cm[None, :] & rm[:, None]).to(tl.int32)          # (NB, EB) A: token n took expert e
        before = tl.cumsum(a, 0) - a                                          # tokens before n that took e
        count = tl.sum(a, 0)                                                  # (EB,) pairs per expert
        ends = tl.cumsum(count, 0)
        tl.store(offs_ptr + c, ends, mask=cm)
        place = (ends - count)[None, :] + before                              # (NB, EB) pair (n, e)'s place
        cur = tl.where(cm[None, :], p, -1.0)
        for j in tl.static_range(K):                                          # the same rounds again, storing
            best = tl.max(cur, 1)
            ix = tl.min(tl.where(cur == best[:, None], c[None, :], EB), 1)
            hit = c[None, :] == ix[:, None]                                   # (NB, EB)
            cur = tl.where(hit, -1.0, cur)
            w = best / total if NORM else best
            at = tl.sum(tl.where(hit, place, 0), 1)                           # (NB,) pair (n, j)'s place
            tl.store(idx_ptr + r * K + j, ix.to(tl.int64), mask=rm)
            tl.store(w_ptr + r * K + j, w.to(w_ptr.dtype.element_ty), mask=rm)
            tl.store(at_ptr + r * K + j, at.to(tl.int64), mask=rm)
            tl.store(tok_ptr + at, r.to(tl.int64), mask=rm)

    # an opaque custom op (as kernels/moe_experts.py's): the compiled decode step calls it as it is
    @torch.library.custom_op("rlhack::decode_route", mutates_args=())
    def _route_op(logits: Tensor, router: Optional[Tensor], top_k: int, norm: bool,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        # router given: logits holds the hidden states (N, H) and the kernel computes their logits
        N, E = logits.shape[0], logits.shape[1] if router is None else router.shape[0]
        dev = logits.device
        w = torch.empty(N, top_k, device=dev, dtype=dtype)
        idx = torch.empty(N, top_k, device=dev, dtype=torch.int64)
        token, at = torch.empty(N * top_k, device=dev, dtype=torch.int64), torch.empty(N * top_k, device=dev,
                                                                                       dtype=torch.int64)
        offs = torch.empty(E, device=dev, dtype=torch.int32)
        if N:
            NB = max(16, triton.next_power_of_2(N))
            g = logits if router is None else router
            _route[(1,)](logits, logits.stride(0), g, g.stride(0), logits.shape[1], w, idx, token, at, offs, N, E,
                         K=top_k, NORM=norm, NB=NB, EB=max(16, triton.next_power_of_2(E)), GEMM=router is not None,
                         BK=64 if NB <= 128 else 32, num_warps=WARPS or (4 if NB < 128 else 8))
        return w, idx, token, at, offs

    @_route_op.register_fake
    def _(logits, router, top_k, norm, dtype):
        N, E = logits.shape[0], logits.shape[1] if router is None else router.shape[0]
        i = logits.new_empty(N * top_k, dtype=torch.int64)
        return (logits.new_empty(N, top_k, dtype=dtype), logits.new_empty(N, top_k, dtype=torch.int64), i,
                torch.empty_like(i), logits.new_empty(E, dtype=torch.int32))


def _check(logits: Tensor, top_k: int, E: int | None = None):
    E = logits.shape[-1] if E is None else E
    if logits.dim() != 2 or not 1 <= top_k <= E or logits.shape[0] > MAX_TOKENS:
        raise ValueError(f"route takes logits (N <= {MAX_TOKENS}, E) and 1 <= top_k <= E; got "
                         f"{tuple(logits.shape)}, top_k {top_k}")


def route(logits: Tensor, top_k: int, norm: bool, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The kernel (see the module's docstring) on the router's logits (N, E)."""
    _check(logits, top_k)
    return _route_op(logits if logits.stride(-1) == 1 else logits.contiguous(), None, top_k, norm, dtype)


def route_linear(x: Tensor, router: Tensor, top_k: int, norm: bool) -> tuple[Tensor, ...]:
    """route(F.linear(x, router), top_k, norm, x.dtype) with the router's GEMM in the same kernel: x (N, H),
    router (E, H) of x's dtype, contiguous. The logits are rounded to x's dtype as F.linear's output is; their
    float32 sums may differ from cuBLAS's in the order of the additions."""
    _check(x, top_k, router.shape[0])
    if router.dim() != 2 or router.shape[1] != x.shape[1] or router.dtype != x.dtype or x.stride(-1) != 1 \
            or router.stride(-1) != 1:
        raise ValueError(f"route_linear takes x (N, H) and router (E, H) of one dtype, contiguous; got "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(router.shape)} {router.dtype}")
    return _route_op(x, router, top_k, norm, x.dtype)


# below this many (token, expert) pairs (a decode step's), the expert-sorted order is counted in one fused pass
# over pairs x pairs instead of a sort, which is one slow kernel at these sizes; a prefill's pairs take the sort
COUNT_PAIRS = 2048


def by_expert(flat: Tensor, E: int) -> tuple[Tensor, Tensor, Tensor]:
    """flat (M,) expert of each pair -> order (M,): the pairs stably sorted by expert; place (M,): each pair's
    position in that order (order's inverse); offs (E,) int32: the end of each expert's block in it."""
    M = flat.shape[0]
    i = torch.arange(M, device=flat.device)
    if M > COUNT_PAIRS:
        order = flat.argsort(stable=True)
        # searchsorted, not bincount: its output size would need the host
        offs = torch.searchsorted(flat[order], torch.arange(E, device=flat.device), right=True).to(torch.int32)
        return order, torch.empty_like(order).scatter_(0, order, i), offs
    # a pair's place in the stable order: the pairs of smaller experts, plus the earlier pairs of its own expert
    before = (flat[None, :] < flat[:, None]) | ((flat[None, :] == flat[:, None]) & (i[None, :] < i[:, None]))
    place = before.sum(1)                                                     # (M,)
    offs = (flat[None, :] <= torch.arange(E, device=flat.device)[:, None]).sum(1).to(torch.int32)   # (E,)
    return torch.empty_like(flat).scatter_(0, place, i), place, offs


def route_reference(logits: Tensor, top_k: int, norm: bool, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The torch twin of `route`: softmax in float32, topk, the expert order by `by_expert`'s counting pass."""
    _check(logits, top_k)
    weight, idx = logits.float().softmax(-1).topk(top_k, dim=-1)            # (N, k) each
    if norm:
        weight = weight / weight.sum(-1, keepdim=True)
    order, at, offs = by_expert(idx.reshape(-1), logits.shape[1])
    return weight.to(dtype), idx, order // top_k, at, offs
