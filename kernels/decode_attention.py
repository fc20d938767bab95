"""Attention of one new token per sequence over a static KV cache, in one kernel: the decode step's attention.

    o = decode_attention(q (B, nh, 1, D), k (B, nkv, S, D), v (B, nkv, S, D), key_ok (B, S) uint8 or bool,
                         last (1,) int64, scale)          # -> (B, nh, D); slots after `last` are never read

Why: in fast_decode.py's step at W1's shape (batch 128, 320 cache slots, 14 query / 2 KV heads of 64),
cuDNN's scaled_dot_product_attention with a boolean mask took ~12 us per layer per token on an H100, ~18% of
the decode's GPU time. It reads all S slots of every sequence although most are still empty. Here one program
per (sequence, KV head) reads that head's K/V once for all g query heads of its group (GQA) and stops at the
last written slot, which the graph passes as a device tensor (`last`), so each replay reads only the cache so
far. Scores and the online softmax are float32; P @ V takes P in the cache's dtype (as flash attention does).

`decode_attention_reference` is the torch twin with the same contract (the CPU path and the tests' yardstick).
The kernel is wrapped as a torch custom op, so the decode step that calls it still compiles as one graph.
"""
import torch
from torch import Tensor

from kernels.logprob import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attention(q_ptr, k_ptr, v_ptr, ok_ptr, last_ptr, o_ptr, scale,
                          sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, sok_b,
                          G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                          BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        b, h = tl.program_id(0).to(tl.int64), tl.program_id(1)        # sequence, KV head
        gi = tl.arange(0, GP)                                          # query heads of this group (padded)
        d = tl.arange(0, DP)
        qm = (gi[:, None] < G) & (d[None, :] < D)
        q = tl.load(q_ptr + b * sq_b + (h * G + gi)[:, None] * sq_h + d[None, :], mask=qm, other=0.0)  # (GP, DP)
        n = tl.load(last_ptr) + 1                                      # slots [0, n) hold keys
        m = tl.full((GP,), -float("inf"), tl.float32)                  # running max, sum, output
        s = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        for s0 in range(0, n, BLOCK):
            j = s0 + tl.arange(0, BLOCK)
            jm = j < n
            ok = (tl.load(ok_ptr + b * sok_b + j, mask=jm, other=0) != 0) & jm
            kv = jm[:, None] & (d[None, :] < D)
            k = tl.load(k_ptr + b * sk_b + h * sk_h + j[:, None] * sk_s + d[None, :], mask=kv, other=0.0)  # (BLOCK, DP)
            v = tl.load(v_ptr + b * sv_b + h * sv_h + j[:, None] * sv_s + d[None, :], mask=kv, other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale   # (GP, BLOCK) float32
            sc = tl.where(ok[None, :], sc, -float("inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)       # no key yet: exp(-inf - -inf) would be nan
            p = tl.exp(sc - shift[:, None])
            alpha = tl.exp(m - shift)
            s = s * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        o = acc / tl.where(s > 0, s, 1.0)[:, None]                     # a query with no visible key gives 0
        tl.store(o_ptr + b * so_b + (h * G + gi)[:, None] * so_h + d[None, :], o.to(o_ptr.dtype.element_ty), mask=qm)

    # An opaque custom op, not a triton_op: inductor then calls it as it is instead of lowering the kernel into
    # its own code, which failed to compile inside the decode step (torch 2.11, H100)
    @torch.library.custom_op("rlhack::decode_attention", mutates_args=())
    def _decode_attention_op(q: Tensor, k: Tensor, v: Tensor, key_ok: Tensor, last: Tensor, scale: float,
                             block: int, warps: int, stages: int) -> Tensor:
        B, nh, _, D = q.shape
        nkv = k.shape[1]
        out = torch.empty(B, nh, D, dtype=q.dtype, device=q.device)
        G = nh // nkv
        _decode_attention[(B, nkv)](
            q, k, v, key_ok, last, out, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), key_ok.stride(0),
            G=G, GP=max(16, triton.next_power_of_2(G)), D=D, DP=max(16, triton.next_power_of_2(D)), BLOCK=block,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",   # float32: no TF32 rounding
            num_warps=warps, num_stages=stages)
        return out

    @_decode_attention_op.register_fake
    def _(q, k, v, key_ok, last, scale, block, warps, stages):
        return q.new_empty(q.shape[0], q.shape[1], q.shape[3])


def _check(q: Tensor, k: Tensor, v: Tensor, key_ok: Tensor, last: Tensor):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be (B, heads, 1, head_dim), got {tuple(q.shape)}")
    B, nh, _, D = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != B or k.shape[3] != D or nh % k.shape[1]:
        raise ValueError(f"k, v must be (B, kv_heads, S, head_dim) with heads % kv_heads == 0; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_ok.shape != (B, k.shape[2]) or key_ok.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"key_ok must be bool or uint8 (B, S) = ({B}, {k.shape[2]}), got {key_ok.dtype} "
                         f"{tuple(key_ok.shape)}")
    if last.shape != (1,) or last.dtype != torch.long:
        raise ValueError(f"last must be a (1,) int64 tensor, got {last.dtype} {tuple(last.shape)}")
    if key_ok.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k, v and key_ok must be contiguous in their last dimension")


def decode_attention(q: Tensor, k: Tensor, v: Tensor, key_ok: Tensor, last: Tensor, scale: float,
                     block: int = 128, warps: int = 4, stages: int = 2) -> Tensor:
    """q (B, nh, 1, D), k and v (B, nkv, S, D), key_ok (B, S) uint8 or bool, last (1,) int64: the last slot to
    read -> (B, nh, D) in q's dtype. The Triton kernel (CUDA, or TRITON_INTERPRET=1). block, warps, stages:
    the kernel's settings; the defaults were the fastest of 27 at W1's decode shape on an H100."""
    _check(q, k, v, key_ok, last)
    return _decode_attention_op(q, k, v, key_ok, last, float(scale), block, warps, stages)


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, key_ok: Tensor, last: Tensor,
                               scale: float) -> Tensor:
    """The torch twin: the same contract, in float32 (the slots after `last` are masked, not skipped)."""
    _check(q, k, v, key_ok, last)
    B, nh, _, D = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    ok = key_ok.bool() & (torch.arange(S, device=q.device) <= last)     # (B, S)
    sc = (q.float().reshape(B, nkv, g, D) @ k.float().transpose(-1, -2)) * scale   # (B, nkv, g, S)
    sc = sc.masked_fill(~ok[:, None, None], float("-inf"))
    p = torch.nan_to_num(sc.softmax(-1))                                 # a row with no visible key: 0
    return (p @ v.float()).reshape(B, nh, D).to(q.dtype)
