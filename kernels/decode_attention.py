"""The decode step's attention in one kernel: rotary embedding, KV-cache write and attention of one new token
per sequence.

    o = decode_attention(qkv (B, (nh + 2 nkv) D), cos (S, D), sin (S, D), pos (B,) int64,
                         k (B, nkv, S, D), v (B, nkv, S, D), key_ok (B, S) uint8 or bool, last (1,) int64, scale)
    # -> o (B, nh * D). Writes the new token's rotated key and its value into k, v at slot `last`; attends over
    # the slots [0, last] that key_ok allows (slot `last`, the token itself, always); slots after it are never read.
    # A `last` >= S (a device tensor: no host check) writes nothing and attends over the S slots and the token
    o = decode_attention(..., share=(src (B,) int64, shared (1,) int64))
    # the same, reading each row b's slots below shared[0] from row src[b]'s cache: the caller guarantees they
    # hold equal values there (GRPO's samples of one prompt, whose prompt slots the shared prefill copied)

Why: in engines/fast_decode.py's step (W1, docs/benchmarks.md: batch 128, 320 cache slots, 14 query / 2 KV heads
of 64), cuDNN's scaled_dot_product_attention with a boolean mask reads all S slots of every sequence although most
are still empty, and the rotary embedding and the two cache writes around it are three more small kernels per
layer (measured: docs/kernels.md, "Decode attention"). Here one program per (sequence, KV head) rotates the
group's g query heads and its key in registers, stores the key and value in the cache, then reads that head's K/V
once for all g query heads (GQA) up to the slot before `last`, which the graph passes as a device tensor, so each
replay reads only the cache so far; the new token's own key and value enter the online softmax from registers.
With `share`, the rows of one prompt read its slots from one row: the cache still holds every row's copy, but the
programs of a prompt's samples run side by side and fetch the same addresses, which the L2 cache then serves; a
copy per row would be fetched from memory by each. A program may take several KV heads (`heads`): its tiles then
hold each head's block of slots side by side, and each query row's scores outside its own head are masked, so one
dot product per block serves them all. It may take several sequences too (`rows`), tiled the same way; with
`share`, when they read one src, the slots below `shared` are loaded once for all of them. Scores and the online
softmax are float32; P @ V takes P in the cache's dtype (as flash attention does); q and k are rounded to the
cache's dtype after the rotation, as the layer-by-layer computation does.

`decode_attention_reference` (kernels/decode_attention_ref.py) is the torch twin with the same contract (the CPU
path and the tests' yardstick); both check their inputs with its `check_inputs`.
The kernel is wrapped as a torch custom op (mutating k and v), so the decode step that calls it still compiles
as one graph.
"""
import math
import os
from typing import Optional

import torch
from torch import Tensor

from kernels.decode_attention_ref import check_inputs
from kernels.logprob import HAS_TRITON

# split kernel's ticket counters by (device, count): zero between calls (the last split of each (sequence, KV
# head) resets its own), so they live across calls and CUDA-graph replays instead of a memset per layer
_TICKETS: dict[tuple, Tensor] = {}


def _tickets(n: int, device) -> Tensor:
    key = (str(device), n)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _TICKETS[key]


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attention(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, ok_ptr, last_ptr, o_ptr, scale, S,
                          s_qkv, s_cs, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, sok_b, pm_ptr, ps_ptr, pa_ptr, tick_ptr,
                          qn_ptr, kn_ptr, eps, src_ptr, shared_ptr,
                          NH: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, HEADS: tl.constexpr,
                          ROWS: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                          BLOCK: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr, QK_NORM: tl.constexpr,
                          SHARE: tl.constexpr):
        # program (sequences [b0, b0 + ROWS), KV heads [h0, h0 + HEADS), split). Its rows are, sequence by
        # sequence, the HEADS * G query heads of those KV heads (consecutive in qkv), padded to RP; its K/V tiles
        # hold BLOCK slots of each (sequence, head) side by side, and a row's scores outside its own sequence and
        # head are masked, so one tl.dot serves them all
        pb, hb, part = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        b0, h0 = pb * ROWS, hb * HEADS
        r, rr, hr, c, hc, bq, bc, own = _layout(b0, G, HEADS, ROWS, RP, BLOCK)
        d = tl.arange(0, DP)
        dm = d < D
        rm = r < ROWS * HEADS * G
        qm = rm[:, None] & dm[None, :]
        # rotary: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]): each column's partner
        half = D // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        cs = tl.load(pos_ptr + bq) * s_cs + d[None, :]                 # (RP or 1, DP) each row's table entries
        cos = tl.load(cos_ptr + cs, mask=dm[None, :], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs, mask=dm[None, :], other=0.0).to(tl.float32) * sign[None, :]
        row = qkv_ptr + bq * s_qkv                                     # (RP or 1, 1)
        qh = (h0 * G + rr)[:, None] * D                                # (RP, 1) offsets of the rows' query heads
        kh = (h0 + hr)[:, None] * D                                    # (RP, 1) each row's own KV head
        kr = row + NH * D
        q = _rotated(row + qh, d, partner, qm, cos, sin, qn_ptr, dm, eps, D, QK_NORM).to(k_ptr.dtype.element_ty)
        k_new = _rotated(kr + kh, d, partner, qm, cos, sin, kn_ptr, dm, eps, D, QK_NORM).to(k_ptr.dtype.element_ty)
        v_new = tl.load(kr + NKV * D + kh + d[None, :], mask=qm, other=0.0).to(k_ptr.dtype.element_ty)
        last = tl.load(last_ptr)
        # split `part` reads slots [lo, hi) of [0, last): chunks of whole blocks, so the grid stays fixed while
        # the filled length grows between graph replays; splits past the filled length read nothing. A `last` at
        # or past S (the engine sizes S; `last` is a device tensor, so no host code checks it) writes nothing and
        # reads the S slots, where it would write and read past the cache (cost: none measured)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(last, SPLITS), BLOCK), 1) * BLOCK
        lo = part * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, last), S)
        if part == 0:                                                  # one program writes the new K/V: one row
            wm = qm & (r % G == 0)[:, None]                            # of each (sequence, KV head)
            wm = wm & (tl.zeros((RP, 1), tl.int64) + last < S)        # (RP, 1): a scalar mask fails interpreted
            hw = (h0 + hr)[:, None].to(tl.int64)
            tl.store(k_ptr + bq * sk_b + hw * sk_h + last * sk_s + d[None, :], k_new, mask=wm)
            tl.store(v_ptr + bq * sv_b + hw * sv_h + last * sv_s + d[None, :], v_new, mask=wm)
        # split 0 starts from the new token, from registers (its score, weight 1); the others from nothing
        m0 = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale
        first = part == 0
        m = tl.where(first, m0, -float("inf"))                         # (RP,) running max
        s = tl.where(first, tl.full((RP,), 1.0, tl.float32), 0.0)     # running sum
        acc = tl.where(first, v_new.to(tl.float32), 0.0)               # (RP, DP) running output
        hk = (h0 + hc).to(tl.int64)
        kc = k_ptr + (bc * sk_b + hk * sk_h)[:, None] + d[None, :]     # (columns, DP) or (HEADS * BLOCK, DP)
        vc = v_ptr + (bc * sv_b + hk * sv_h)[:, None] + d[None, :]
        okc = ok_ptr + bc * sok_b                                      # each column's key mask (or the one row's)
        mid = lo                                                       # [lo, mid): tiles read once for all sequences
        if SHARE:   # slots below `shared`: row src's copy (the same values), so a prompt's rows fetch one copy
            srcs, shared = tl.load(src_ptr + bc), tl.load(shared_ptr)  # (columns,) or one
            dk, dv = (srcs - bc) * sk_b, (srcs - bc) * sv_b            # offsets from each column's cache to its src's
            if ROWS > 1:   # one src for all of the program's sequences: their whole tiles below shared, once
                one = tl.min(srcs, 0) == tl.max(srcs, 0)
                mid = tl.where(one, tl.minimum(tl.maximum(shared // BLOCK * BLOCK, lo), hi), lo)
        else:
            shared, dk, dv = 0, 0, 0
        # the key mask of the own loop's first tile, fetched before the shared tiles' loop: each loop fetches
        # its next tile's mask a tile early, as the software pipeline does not (its wait was a quarter of qwen3's
        # stalls: docs/kernels.md, "The key mask's load")
        jo = mid + c % BLOCK
        ok0 = tl.load(okc + jo, mask=jo < hi, other=0)
        if SHARE:
            if ROWS > 1:
                m, s, acc = _attend_shared(q, m, s, acc, k_ptr + tl.min(srcs, 0) * sk_b, v_ptr + tl.min(srcs, 0)
                                           * sv_b, ok_ptr + bq * sok_b, lo, mid, h0, hr, rm, d, dm, sk_h,
                                           sk_s, sv_h, sv_s, scale, HEADS, BLOCK, PRECISION)
        m, s, acc = _attend_slots(q, m, s, acc, kc, vc, okc, ok0, c, mid, hi, shared, dk, dv, own, dm,
                                  sk_s, sv_s, scale, BLOCK, PRECISION, SHARE)
        out = o_ptr + bq * so_b + qh + d[None, :]
        if SPLITS == 1:
            o = acc / s[:, None]
            tl.store(out, o.to(o_ptr.dtype.element_ty), mask=qm)
        else:
            _combine(out, qm, m, s, acc, (pb * (NKV // HEADS) + hb) * SPLITS, part,
                     pm_ptr, ps_ptr, pa_ptr, tick_ptr + pb * (NKV // HEADS) + hb, RP, DP, SPLITS)

    @triton.jit
    def _layout(b0, G: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr):
        # the program's rows r (RP,): (sequence, query head) padded to RP, each row's query head rr from h0 * G and
        # KV head hr from h0; its tile columns c: (sequence, head hc, slot); bq, bc: the rows' and the columns'
        # sequences; own (RP, columns): a row's own sequence and head. A padded row owns no column, so the compiler
        # knows its scores are -inf and drops their softmax work: W1's shape (7 of 16 rows real) compiles to 406
        # instructions a block of slots, against 443 where padded rows took a real head's columns (sm_90, triton 3.6)
        r = tl.arange(0, RP)
        c = tl.arange(0, ROWS * HEADS * BLOCK)
        hc = c // BLOCK % HEADS
        if ROWS == 1:   # scalar offsets: the code is then the one-sequence kernel's (414 instructions with vectors)
            rr, hr, bq, bc = r, r // G, b0, b0
            own = hr[:, None] == hc[None, :]
        else:
            rr = r % (HEADS * G)
            hr = rr // G
            ri = tl.minimum(r // (HEADS * G), ROWS - 1)                # in range: the padded rows' loads stay in bounds
            ci = c // (HEADS * BLOCK)
            bq, bc = (b0 + ri)[:, None], b0 + ci                       # (RP, 1), (columns,) int64
            own = ((r // (HEADS * G))[:, None] == ci[None, :]) & (hr[:, None] == hc[None, :])
        return r, rr, hr, c, hc, bq, bc, own

    @triton.jit
    def _attend_slots(q, m, s, acc, kc, vc, okr, okn, c, lo, hi, shared, dk, dv, own, dm, sk_s, sv_s, scale,
                      BLOCK: tl.constexpr, PRECISION: tl.constexpr, SHARE: tl.constexpr):
        # the online softmax (m, s, acc) of q (RP, DP) over the cache's slots [lo, hi): kc, vc (columns, DP)
        # point at slot 0 of each column's (sequence, head), okr (columns,) at its key mask; SHARE: slots below
        # `shared` at offsets dk, dv (columns,)
        for s0 in range(lo, hi, BLOCK):
            j = s0 + c % BLOCK
            jm = j < hi
            ok = (okn != 0) & jm
            jn = j + BLOCK                                             # the next tile's, fetched a tile early
            okn = tl.load(okr + jn, mask=jn < hi, other=0)
            kv = jm[:, None] & dm[None, :]
            ko, vo = j * sk_s, j * sv_s                                # (HEADS * BLOCK,) offsets in row b
            if SHARE:
                ko += tl.where(j < shared, dk, 0)
                vo += tl.where(j < shared, dv, 0)
            k = tl.load(kc + ko[:, None], mask=kv, other=0.0)          # (columns, DP)
            v = tl.load(vc + vo[:, None], mask=kv, other=0.0)
            m, s, acc = _online(q, m, s, acc, k, v, own & ok[None, :], scale, PRECISION)
        return m, s, acc

    @triton.jit
    def _attend_shared(q, m, s, acc, ks, vs, okq, lo, hi, h0, hr, rm, d, dm, sk_h, sk_s, sv_h, sv_s, scale,
                       HEADS: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        # slots [lo, hi) of one src (ks, vs: its cache rows) for all of the program's rows: tiles of BLOCK slots of
        # each head, read once; okq (RP, 1): each row's own key mask
        c = tl.arange(0, HEADS * BLOCK)
        hc = c // BLOCK
        kc = ks + (h0 + hc)[:, None].to(tl.int64) * sk_h + d[None, :]
        vc = vs + (h0 + hc)[:, None].to(tl.int64) * sv_h + d[None, :]
        own = (hr[:, None] == hc[None, :]) & rm[:, None]              # (RP, HEADS * BLOCK)
        jn = lo + c % BLOCK
        okn = tl.load(okq + jn[None, :], mask=rm[:, None] & (jn < hi)[None, :], other=0)   # (RP, HEADS * BLOCK)
        for s0 in range(lo, hi, BLOCK):
            j = s0 + c % BLOCK
            jm = j < hi
            ok = okn != 0
            jn = j + BLOCK                                             # the next tile's mask, a tile early
            okn = tl.load(okq + jn[None, :], mask=rm[:, None] & (jn < hi)[None, :], other=0)
            kv = jm[:, None] & dm[None, :]
            k = tl.load(kc + j[:, None] * sk_s, mask=kv, other=0.0)    # (HEADS * BLOCK, DP)
            v = tl.load(vc + j[:, None] * sv_s, mask=kv, other=0.0)
            m, s, acc = _online(q, m, s, acc, k, v, own & ok & jm[None, :], scale, PRECISION)
        return m, s, acc

    @triton.jit
    def _online(q, m, s, acc, k, v, visible, scale, PRECISION: tl.constexpr):
        # one tile's step of the online softmax: scores (RP, columns) float32, P @ V with P in the cache's dtype;
        # the columns a row may not see (visible false) score -inf
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        sc = tl.where(visible, sc, -float("inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)           # nothing visible yet: exp(-inf - -inf) is nan
        p_ = tl.exp(sc - shift[:, None])
        alpha = tl.exp(m - shift)
        s = s * alpha + tl.sum(p_, 1)
        acc = acc * alpha[:, None] + tl.dot(p_.to(v.dtype), v, input_precision=PRECISION)
        return m_new, s, acc

    @triton.jit
    def _rotated(x_row, d, partner, m, cos, sin, w_ptr, dm, eps, D: tl.constexpr, NORM: tl.constexpr):
        # the heads at offsets x_row (RP, 1) in float32: qwen3's RMSNorm of each head first where NORM, then the
        # rotation (cos, sin (RP, DP), sin signed); x2 holds the same values at their rotary partners
        x = tl.load(x_row + d[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + partner[None, :], mask=m, other=0.0).to(tl.float32)
        if NORM:
            x, x2 = _head_norm(x, x2, w_ptr, d, partner, dm, eps, D)
        return x * cos + x2 * sin

    @triton.jit
    def _head_norm(x, x2, w_ptr, d, partner, dm, eps, D: tl.constexpr):
        # transformers' Qwen3RMSNorm per row of x (rows, DP) float32, and of x2 (x's columns at their rotary
        # partners): w * (x * rsqrt(mean(x^2) + eps)) with its roundings to the activations' dtype, which is the
        # weight's (decode_attention checks)
        dt = w_ptr.dtype.element_ty
        r = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)                 # (rows,)
        w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + partner, mask=dm, other=0.0).to(tl.float32)
        x = (w[None, :] * (x * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2[None, :] * (x2 * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        return x, x2

    @triton.jit
    def _combine(o_ptrs, qm, m, s, acc, base, part, pm_ptr, ps_ptr, pa_ptr, tick_ptr,
                 GP: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr):
        # flash-decoding's reduction, in the kernel: each split stores its (max, sum, output) partials, then
        # takes a ticket; the last of the (sequence, KV head)'s splits to arrive merges them and resets the
        # counter for the next replay (no second kernel per layer in the graph)
        gi = tl.arange(0, GP)
        d = tl.arange(0, DP)
        mine = (base + part) * GP + gi                                 # (GP,) rows of this split's partials
        tl.store(pm_ptr + mine, m)
        tl.store(ps_ptr + mine, s)
        tl.store(pa_ptr + mine[:, None] * DP + d[None, :], acc)
        ticket = tl.atomic_add(tick_ptr, 1, sem="acq_rel")             # releases the stores above
        if ticket == SPLITS - 1:
            tl.store(tick_ptr, 0)
            r = (base + tl.arange(0, SPLITS))[:, None] * GP + gi[None, :]           # (SPLITS, GP)
            pm = tl.load(pm_ptr + r, cache_modifier=".cg")
            ps = tl.load(ps_ptr + r, cache_modifier=".cg")
            mx = tl.max(pm, 0)                                         # (GP,) finite: split 0 holds the new token
            w = tl.where(pm == -float("inf"), 0.0, tl.exp(pm - mx[None, :]))       # (SPLITS, GP)
            tot = tl.sum(ps * w, 0)                                    # (GP,)
            o = tl.zeros((GP, DP), tl.float32)
            for i in tl.static_range(SPLITS):
                ri = (base + i) * GP + gi
                wi = tl.sum(tl.where(tl.arange(0, SPLITS)[:, None] == i, w, 0.0), 0)   # (GP,) row i of w
                o += tl.load(pa_ptr + ri[:, None] * DP + d[None, :], cache_modifier=".cg") * wi[:, None]
            tl.store(o_ptrs, (o / tot[:, None]).to(o_ptrs.dtype.element_ty), mask=qm)

    # An opaque custom op, not a triton_op: inductor then calls it as it is instead of lowering the kernel into
    # its own code, which failed to compile inside the decode step (torch 2.11)
    @torch.library.custom_op("rlhack::decode_attention", mutates_args=("k", "v"))
    def _decode_attention_op(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k: Tensor, v: Tensor,
                             key_ok: Tensor, last: Tensor, scale: float, block: int, warps: int, stages: int,
                             splits: int, q_norm: Optional[Tensor], k_norm: Optional[Tensor], eps: float,
                             heads: int = 1, src: Optional[Tensor] = None, shared: Optional[Tensor] = None,
                             rows: int = 1) -> Tensor:
        args = (qkv, cos, sin, pos, k, v, key_ok, last, scale, splits, q_norm, k_norm, eps, src, shared)
        setting = (block, warps, stages, heads, rows)
        at = entry(k.shape[3])
        small = SMALL.get(at) if setting == DEFAULTS.get(at) and at not in OVERRIDDEN else None
        if small is None or (qkv.device, at) not in _TOO_SMALL:
            try:
                return _launch(*args, *setting)
            except triton.runtime.errors.OutOfResources as e:
                if small is None:
                    raise too_big(k.shape[3], setting, e) from None
            _TOO_SMALL.add((qkv.device, at))   # nothing was launched; later calls go straight to the small setting
        b, w, st, hd, rw = small
        try:
            return _launch(*args, b, w, st, math.gcd(hd, k.shape[1]), math.gcd(rw, k.shape[0]))
        except triton.runtime.errors.OutOfResources as e:
            raise too_big(k.shape[3], small, e) from None

    def _launch(qkv, cos, sin, pos, k, v, key_ok, last, scale, splits, q_norm, k_norm, eps, src, shared, block, warps,
                stages, heads, rows) -> Tensor:
        B, nkv, S, D = k.shape
        nh = qkv.shape[1] // D - 2 * nkv
        out = torch.empty(B, nh * D, dtype=qkv.dtype, device=qkv.device)
        G = nh // nkv
        RP, DP = max(16, triton.next_power_of_2(rows * heads * G)), max(16, triton.next_power_of_2(D))
        groups = B // rows * (nkv // heads)                            # (sequences' group, heads' group) pairs
        n = groups * splits if splits > 1 else 1                       # partials: only a split run needs them
        pm, ps = (torch.empty(n * RP, dtype=torch.float32, device=qkv.device) for _ in range(2))
        pa = torch.empty(n * RP * DP, dtype=torch.float32, device=qkv.device)
        _decode_attention[(B // rows, nkv // heads, splits)](
            qkv, cos, sin, pos, k, v, key_ok, last, out, scale, S, qkv.stride(0), cos.stride(0),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0),
            key_ok.stride(0), pm, ps, pa, _tickets(groups if splits > 1 else 1, qkv.device),
            cos if q_norm is None else q_norm, cos if k_norm is None else k_norm, eps,
            pos if src is None else src, last if shared is None else shared,
            NH=nh, NKV=nkv, G=G, HEADS=heads, ROWS=rows, RP=RP, D=D, DP=DP, BLOCK=block,
            PRECISION="ieee" if k.dtype == torch.float32 else "tf32",   # float32: no TF32 rounding
            SPLITS=splits, QK_NORM=q_norm is not None, SHARE=src is not None, num_warps=warps,
            num_stages=stages)
        return out

    @_decode_attention_op.register_fake
    def _(qkv, cos, sin, pos, k, v, key_ok, last, scale, block, warps, stages, splits, q_norm, k_norm, eps, heads=1,
          src=None, shared=None, rows=1):
        return qkv.new_empty(qkv.shape[0], qkv.shape[1] - 2 * k.shape[1] * k.shape[3])


# unsplit launch settings (block, warps, stages, heads, rows) by head_dim, each chosen by timing candidates at a
# real decode shape (64: W1's, 128: qwen3's) over many layers' caches, so that reads come from memory as in the
# decode step; 256 takes small tiles because large K and V tiles, double-buffered, would not fit in shared memory.
# heads: KV heads per program; rows: sequences per program. qwen3's (2 query heads a KV head) takes one KV head
# of 4 sequences: 8 of the dot's 16 rows used instead of 4, tiles of 4 x 32 slots, and with share= the samples of
# one prompt read its shared slots once for 4 of them instead of each moving them through the L2. W1's keeps one
# sequence: its 7 query heads a KV head already fill most of the dot's rows, and 2 sequences timed slower there.
# How they were picked: docs/architectures.md, "Decode attention and experts, timed", and docs/kernels.md, "What
# the shared prompt still costs".
# FAST_DECODE_ATTN="128=32x4x2x1x4,..." overrides entries for a run (tools/decode_kernel_bench.py --shape qwen3,w1
# [--share 8:64] times the candidates)
SETTINGS = {64: (64, 4, 3, 1, 1), 128: (32, 4, 2, 1, 4), 256: (32, 4, 2, 1, 1)}
DEFAULTS = dict(SETTINGS)
# where a default's tiles do not fit a card's shared memory (128: 2 stages of 4 x 32 slots, 128 KB; cards of
# compute capability 8.6 and 8.9 give a program about 100 KB), the op launches this instead: 48 KB of tiles
SMALL = {128: (16, 4, 3, 2, 1)}
_TOO_SMALL: set = set()   # (device, head_dim entry) where the default did not fit
OVERRIDDEN = set()   # head_dims whose entry FAST_DECODE_ATTN set (too_big names it)
for _item in filter(None, os.environ.get("FAST_DECODE_ATTN", "").split(",")):
    _d, _s = _item.split("=")
    SETTINGS[int(_d)] = (*(int(x) for x in _s.split("x")), 1, 1)[:5]
    OVERRIDDEN.add(int(_d))


def too_big(D: int, setting: tuple, e: Exception) -> Exception:
    """The one-line error for a launch setting whose tiles do not fit the card (Triton's OutOfResources, e):
    a UserError naming FAST_DECODE_ATTN where the setting came from it, else a ValueError naming the arguments."""
    from config_tree import UserError
    at = entry(D)
    what = "x".join(map(str, setting))
    if at in OVERRIDDEN and tuple(SETTINGS[at][:3]) == tuple(setting[:3]):
        default = "x".join(map(str, DEFAULTS.get(at, (32, 4, 2, 1, 1))))
        return UserError(f"FAST_DECODE_ATTN={at}={what} (block x warps x stages x KV heads x sequences a program) "
                         f"needs more shared memory than this GPU has ({str(e).splitlines()[0][:120]}): "
                         f"use a smaller block or fewer stages, or unset it (the default at head_dim {at}: {default})")
    return ValueError(f"decode_attention: block x warps x stages x heads x rows {what} at head_dim {D} does not fit "
                      f"this GPU ({str(e).splitlines()[0][:120]})")


def entry(D: int) -> int:
    """SETTINGS' key for head_dim D: the next power of two, at least 16."""
    return max(16, 1 << (D - 1).bit_length())


def settings(D: int) -> tuple[int, int, int, int, int]:
    """(block, warps, stages, heads, rows) of the unsplit kernel at head_dim D: SETTINGS' entry at the next
    power of two."""
    at = entry(D)
    return SETTINGS.get(at) or (SETTINGS[64] if at < 64 else (32, 4, 2, 1, 1))


def decode_attention(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k: Tensor, v: Tensor, key_ok: Tensor,
                     last: Tensor, scale: float, block: int | None = None, warps: int | None = None,
                     stages: int | None = None, splits: int = 1, qk_norm: tuple | None = None,
                     heads: int | None = None, share: tuple | None = None, rows: int | None = None) -> Tensor:
    """See the module's docstring. The Triton kernel (CUDA, or TRITON_INTERPRET=1); block, warps, stages: the
    kernel's settings, by default SETTINGS' for this head_dim (`settings`). splits > 1: flash-decoding, each
    (sequence, KV head)'s filled slots cut into `splits` chunks of whole blocks, one program each (the grid is
    fixed; the chunk follows `last`), merged in the kernel by the last split to finish; block 32 by default
    (chunks of whole blocks: small blocks let short caches use several splits). qk_norm (q weight (D,), k weight
    (D,), eps): RMSNorm each head of q and k before the rotation, as transformers' Qwen3RMSNorm does. heads: KV
    heads per program (a power of two; cut to the largest that divides the model's KV heads). share (src (B,)
    int64, shared (1,) int64): read row b's slots below shared[0] from row src[b] (equal there: the caller's
    promise, which the kernel cannot check without reading both). rows: sequences per program (a power of two;
    cut to the largest that divides the batch; by default the setting's where heads and block are the setting's
    too, else 1), their tiles side by side; with share, when they all read one src, its slots below shared are
    read once for all of them (the tiles then differ in shape from an unshared call's, so the two agree to
    rounding, not bit for bit)."""
    b, w, st, hd, rw = settings(k.shape[-1]) if k.dim() == 4 else (128, 4, 2, 1, 1)
    # the setting's sequences a program only with its own heads and block: a caller's heads or block with the
    # default's 4 sequences could ask for tiles past any card's shared memory
    rows = rows or (rw if splits == 1 and heads is None and block is None else 1)
    block, warps, stages = block or (b if splits == 1 else 32), warps or w, stages or st
    heads = heads or (hd if splits == 1 else 1)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two >= 1, got {splits}")
    if heads < 1 or heads & (heads - 1):
        raise ValueError(f"heads must be a power of two >= 1, got {heads}")
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two >= 1, got {rows}")
    if block < 16 or block & (block - 1):   # tl.dot takes no dimension under 16
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    check_inputs(qkv, cos, sin, pos, k, v, key_ok, last, qk_norm, share)
    qw, kw, eps = qk_norm or (None, None, 0.0)
    src, shared = share or (None, None)
    return _decode_attention_op(qkv, cos, sin, pos, k, v, key_ok, last, float(scale), block, warps, stages, splits,
                                qw, kw, float(eps), math.gcd(heads, k.shape[1]), src, shared,
                                math.gcd(rows, k.shape[0]))
