"""tools/kernel_sweep.py's families for the exact path's Triton kernels (engines/exact.py, docs/exact.md), each against
its torch twin:

  exact_gemm  kernels/exact_gemm.py: exact_linear's `_gemm` with each TILES class's tile (rows of 1, odd sizes and
              sizes no tile divides, bias or none) -> float64 F.linear; exact_rmsnorm in each of its NORM_MODES -> the
              mode's formula in torch
  exact_attn  kernels/exact_attention.py: exact_attention, trainer-like calls (whole sequences) and decode-like ones
              (one token per row at a late position), GQA groups 1/3/7, a sliding window or none, caches whose length
              no key block divides, both cache layouts the engine makes -> softmax attention in float64
  exact_cat   exact_linear_cat: 2 or 3 weights side by side (q/k/v, gate/up), biases on all, some or none, sizes
              that take the one-launch path and sizes that fall back to a concatenated copy -> float64 F.linear
  exact_silu  exact_silu_mul: [gate | up] -> SiLU(gate) rounded, times up; one and two column blocks
  exact_rope  kernels/exact_attention.py exact_rope_cache: rotary on q and k (views of one projection) and the K/V
              cache write at distinct (row, position)s, both cache layouts -> rotate_half in float32, v itself, and
              every other slot untouched
  exact_rows  kernels/exact_sample.py exact_row_logprobs: sampling and target modes over vocabularies of one block,
              one past a block and Qwen's, rows with half their columns banned -> log_softmax; the sampled token's
              log-prob equal to the target mode's (the engine's and the trainer's)
Under the interpreter their tl.dot is an explicit product (kernels/exact_gemm.py EXPLICIT_DOT), so bfloat16 runs
there too, with bands doubled for its truncating casts (`BF16_ULPS`).
"""
import math

import torch
import torch.nn.functional as F

from tools.kernel_families import BF16, BF16_ULPS, F32, QWEN_V, gen, worst_excess


# --- exact_gemm ----------------------------------------------------------------------------------------------------

def check_exact_gemm(device, op, M, K, N, dtype, bias=False, mode=0) -> float:
    """op "linear": exact_linear(x, w, b) against float64 F.linear on the same values; op "norm": exact_rmsnorm of x
    (M, K) in `mode` against that mode's formula in float32. tests/test_exact_kernels.py's tolerances (relative to
    the value: float32 1e-5, bfloat16 one ulp, the norm two; the bfloat16 ones doubled under the interpreter:
    BF16_ULPS). Returns the worst error as a fraction of the tolerance."""
    from kernels.exact_gemm import exact_linear, exact_rmsnorm, shape_class
    g = gen("exact_gemm", op, M, K, N, dtype, bias, mode)
    x = torch.randn(M, K, generator=g).to(dtype)
    if op == "linear":
        w, b = torch.randn(N, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
        with torch.no_grad():
            y = exact_linear(x.to(device), w.to(device), b.to(device) if bias else None)
        assert y.shape == (M, N) and y.dtype == dtype, (y.shape, y.dtype, shape_class(N, K))
        want = F.linear(x.double(), w.double(), b.double() if bias else None)
        err = worst_excess(y, want, 1e-5 if dtype == F32 else BF16_ULPS * 2 ** -7, 1e-3)
    else:
        w = (1 + 0.5 * torch.randn(K, generator=g)).to(dtype)
        eps = 1e-6
        with torch.no_grad():
            y = exact_rmsnorm(x.to(device), w.to(device), eps, mode)
        xh = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)    # (M, K) float32
        want = (w.float() * xh.to(dtype).float(), w.float() * xh, xh * (1 + w.float()))[mode]
        assert y.shape == (M, K) and y.dtype == dtype, (y.shape, y.dtype)
        err = worst_excess(y, want, 2 * BF16_ULPS * 2 ** -7, 1e-5)
    assert err <= 1, f"error {err:.3g} x the tolerance"
    return err


# (M, K, N) by TILES class (kernels/exact_gemm.py shape_class; tests/test_kernel_edges.py checks the names): M of 1,
# odd, and past one row tile; K and N that no tile divides. The interpreter's: one shape per class but the
# vocabulary's (its 128-column tiles over 16,384 columns take seconds; tests/test_exact_kernels.py interprets that
# tile)
GEMM_SHAPES = {"narrow": [(1, 896, 128), (3, 100, 200), (65, 70, 40)], "long_k": [(1, 4864, 896), (17, 600, 257)],
               "other": [(3, 896, 1152), (33, 100, 300)], "wide": [(5, 896, 4864), (17, 70, 300)],
               "vocab": [(1, 64, 16384), (130, 100, 16400)]}
# besides GEMM_SHAPES (Qwen's whole head, (M, 896, 151936), is tests/test_exact_kernels.py's GPU test: the
# interpreter cannot check it here in minutes)
GEMM_SHAPES_GPU = {"long_k": [(129, 4864, 896)]}
GEMM_SHAPES_CPU = {"narrow": [(3, 70, 40)], "long_k": [(5, 600, 257)], "other": [(19, 100, 300)],
                   "wide": [(17, 70, 300)]}


def exact_gemm_cases(size):
    shapes = GEMM_SHAPES_CPU if size == "cpu" else {c: GEMM_SHAPES[c] + (GEMM_SHAPES_GPU.get(c, []) if size == "gpu"
                                                                         else []) for c in GEMM_SHAPES}
    for i, (M, K, N) in enumerate(M_K_N for group in shapes.values() for M_K_N in group):
        for dtype in (F32, BF16):
            for bias in (False, True):
                if size == "gpu" or bias == (dtype == BF16) or (size == "sanitizer" and bias == i % 2):
                    yield dict(op="linear", M=M, K=K, N=N, dtype=dtype, bias=bias)
    # (rows, hidden): one row of 7; rows past a warp's worth; a hidden size one past a power of two
    norms = [(1, 7), (3, 64), (130, 896), (2, 4097)] if size != "cpu" else [(1, 7), (3, 200)]
    for i, (M, H) in enumerate(norms):
        for dtype in (F32, BF16):
            for mode in (0, 1, 2):
                if size != "sanitizer" or i == 0 or mode == i % 3:   # memcheck: every mode at one size
                    yield dict(op="norm", M=M, K=H, N=H, dtype=dtype, mode=mode)


# --- exact_attn ----------------------------------------------------------------------------------------------------

def attention_twin(q, rows, pos, kc, vc, window, scale):
    """Softmax attention in float64 of tokens (rows, pos) over caches (B, nkv, L, D): keys at slots <= pos (and
    within the window) -> (N, nh, D). One product per cache row (its tokens together), not a copy of it per token."""
    N, nh, D = q.shape
    nkv, L = kc.shape[1], kc.shape[2]
    out = torch.empty(N, nh, D, dtype=torch.float64)
    t = torch.arange(L)
    for b in rows.unique().tolist():
        at = (rows == b).nonzero()[:, 0]                                               # (n,) its tokens
        k = kc[b].double().repeat_interleave(nh // nkv, 0)                             # (nh, L, D)
        v = vc[b].double().repeat_interleave(nh // nkv, 0)
        p = pos[at]
        ok = t[None] <= p[:, None]                                                     # (n, L)
        if window:
            ok &= p[:, None] - t[None] < window
        s = torch.einsum("nhd,hld->nhl", q[at].double(), k) * scale                   # (n, nh, L)
        out[at] = torch.einsum("nhl,hld->nhd", s.masked_fill(~ok[:, None], -math.inf).softmax(-1), v)
    return out


def check_exact_attn(device, call, B, nh, nkv, D, L, window, block, dtype, layout) -> float:
    """exact_attention over caches (B, nkv, L, D) (layout "heads": contiguous; "slots": the (B, L, nkv, D) tensor
    seen through a transpose, as engines/exact.py's out-of-place cache write leaves it), call "train": every
    position of sequences of several lengths (1 and L among them); "decode": one token per row at a late position,
    rows out of order. tests/test_exact_kernels.py's tolerance (max abs: float32 1e-4, bfloat16 0.05)."""
    from kernels.exact_attention import exact_attention
    g = gen("exact_attn", call, B, nh, nkv, D, L, window, block, layout)
    shape = (B, nkv, L, D) if layout == "heads" else (B, L, nkv, D)
    kc, vc = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    if layout == "slots":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)                                 # (B, nkv, L, D) views
    if call == "train":
        lens = torch.tensor(([1, L, max(1, L // 2 + 3)] * B)[:B])
        rows = torch.repeat_interleave(torch.arange(B), lens)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    else:
        rows = torch.randperm(B, generator=g)
        pos = L - 1 - torch.randint(0, min(L, 5), (B,), generator=g)
    q = torch.randn(len(rows), nh, D, generator=g).to(dtype)
    scale = D ** -0.5
    put = lambda t: t.to(device)
    with torch.no_grad():
        o = exact_attention(put(q), put(rows), put(pos), put(kc), put(vc), window, scale, block)
    assert o.shape == q.shape and o.dtype == dtype, (o.shape, o.dtype)
    want = attention_twin(q, rows, pos, kc, vc, window, scale)
    tol = 1e-4 if dtype == F32 else 0.05
    err = (o.double().cpu() - want).abs().max().item() if torch.isfinite(o).all() else math.inf
    assert err <= tol, f"error {err} > {tol}"
    return err


def exact_attn_cases(size):
    if size == "cpu":   # float32 and bfloat16 alike: the interpreter's dot is an explicit product here
        for call, B, nh, nkv, D, L, window, block, dtype, layout in (
                ("train", 2, 6, 2, 16, 17, None, 16, F32, "heads"), ("decode", 3, 14, 2, 40, 70, 7, 16, BF16, "slots"),
                ("train", 2, 2, 2, 16, 17, 5, 16, BF16, "slots"), ("decode", 1, 2, 1, 32, 64, None, 64, F32, "heads")):
            yield dict(call=call, B=B, nh=nh, nkv=nkv, D=D, L=L, window=window, block=block, dtype=dtype, layout=layout)
        return
    # every (head_dim, heads, dtype, call) once, the (cache length, window, key block, layout) settings in turn:
    # a length no key block divides, a window shorter than the sequence and one longer than the cache
    settings = ((50, None, 64, "heads"), (131, 7, 64, "slots"), (64, 4096, 16, "heads"))
    i = 0
    for D in (40, 64, 128):
        for nh, nkv in ((4, 4), (6, 2), (14, 2)):          # MHA, 3 per group, Qwen2.5-0.5B's 7 per group
            for dtype in (F32, BF16):
                for call in ("train", "decode"):
                    L, window, block, layout = settings[i % len(settings)]
                    i += 1
                    yield dict(call=call, B=3, nh=nh, nkv=nkv, D=D, L=L, window=window, block=block, dtype=dtype,
                               layout=layout)
    if size == "gpu":                                       # a real batch at a late position of a long cache
        yield dict(call="decode", B=64, nh=14, nkv=2, D=64, L=1000, window=None, block=64, dtype=BF16,
                   layout="slots")


# --- the fused kernels: exact_linear_cat, exact_silu_mul, exact_rope_cache, exact_row_logprobs -------

def check_exact_cat(device, M, K, ns, bias, dtype) -> float:
    """exact_linear_cat(x, ws, bs): 2 or 3 weights side by side (sizes ns; bias "all", "some" (the middle one
    None) or "none") against float64 F.linear on the concatenation, in exact_linear's band."""
    from kernels.exact_gemm import exact_linear_cat
    g = gen("exact_cat", M, K, ns, bias, dtype)
    x = torch.randn(M, K, generator=g).to(dtype)
    ws = [torch.randn(n, K, generator=g).to(dtype) for n in ns]
    bs = [torch.randn(n, generator=g).to(dtype) if bias == "all" or (bias == "some" and i != 1) else None
          for i, n in enumerate(ns)]
    put = lambda t: None if t is None else t.to(device)
    with torch.no_grad():
        y = exact_linear_cat(put(x), [put(w) for w in ws], [put(b) for b in bs])
    assert y.shape == (M, sum(ns)) and y.dtype == dtype, (y.shape, y.dtype)
    b64 = None if bias == "none" else torch.cat([b.double() if b is not None else torch.zeros(n, dtype=torch.float64)
                                                 for b, n in zip(bs, ns)])
    want = F.linear(x.double(), torch.cat(ws).double(), b64)
    err = worst_excess(y, want, 1e-5 if dtype == F32 else BF16_ULPS * 2 ** -7, 1e-3)
    assert err <= 1, f"error {err:.3g} x the tolerance"
    return err


def check_exact_silu(device, M, I, dtype) -> float:
    """exact_silu_mul([gate | up]) against silu(gate) rounded to the dtype, times up (float32), rounded: float32
    1e-5 relative, bfloat16 two ulps (the rounded SiLU may land one ulp apart)."""
    from kernels.exact_gemm import exact_silu_mul
    g = gen("exact_silu", M, I, dtype)
    gu = (torch.randn(M, 2 * I, generator=g) * 3).to(dtype)
    with torch.no_grad():
        y = exact_silu_mul(gu.to(device))
    assert y.shape == (M, I) and y.dtype == dtype, (y.shape, y.dtype)
    want = F.silu(gu[:, :I].float()).to(dtype).float() * gu[:, I:].float()
    err = worst_excess(y, want, 1e-5 if dtype == F32 else 2 * BF16_ULPS * 2 ** -7, 1e-6)
    assert err <= 1, f"error {err:.3g} x the tolerance"
    return err


def check_exact_rope(device, B, nh, nkv, D, L, N, dtype, layout) -> float:
    """exact_rope_cache on q, k, v views of one (N, (nh + 2 nkv) D) projection (as the engine calls it), N tokens at
    distinct (row, position)s of caches (B, nkv, L, D) (layout as exact_attn's): the rotated q and the K cache's
    written slots against rotate_half in float32 (float32 1e-6 relative, bfloat16 two ulps), V's
    written slots equal to v, and every other slot untouched."""
    from kernels.exact_attention import exact_rope_cache
    g = gen("exact_rope", B, nh, nkv, D, L, N, dtype, layout)
    qkv = torch.randn(N, (nh + 2 * nkv) * D, generator=g).to(dtype)
    q, k, v = (t.view(N, -1, D) for t in qkv.split([nh * D, nkv * D, nkv * D], -1))
    ang = torch.arange(L)[:, None] * 0.1 / (1 + torch.arange(D // 2))[None].repeat(1, 2)    # (L, D)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slot = torch.randperm(B * L, generator=g)[:N]
    rows, pos = slot // L, slot % L
    shape = (B, nkv, L, D) if layout == "heads" else (B, L, nkv, D)
    kc, vc = (torch.randn(*shape, generator=g).to(dtype) for _ in range(2))
    if layout == "slots":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    put = lambda t: t.to(device)
    qkv_d = put(qkv)
    qd, kd, vd = (t.view(N, -1, D) for t in qkv_d.split([nh * D, nkv * D, nkv * D], -1))
    kcd, vcd = put(kc), put(vc)
    with torch.no_grad():
        qo = exact_rope_cache(qd, kd, vd, put(rows), put(pos), put(cos), put(sin), kcd, vcd)
    c, s = cos[pos].float()[:, None], sin[pos].float()[:, None]                         # (N, 1, D)
    rot = lambda x: x.float() * c + torch.cat((-x.float()[..., D // 2:], x.float()[..., :D // 2]), -1) * s
    band = (1e-6, 1e-6) if dtype == F32 else (2 * BF16_ULPS * 2 ** -7, 1e-6)   # bf16: a rounding may flip
    kcd, vcd = kcd.cpu(), vcd.cpu()
    err = max(worst_excess(qo, rot(q), *band), worst_excess(kcd[rows, :, pos], rot(k), *band))
    assert err <= 1, f"error {err:.3g} x the tolerance"
    assert torch.equal(vcd[rows, :, pos], v), "V cache's written slots differ from v"
    kept = torch.ones(B, L, dtype=torch.bool)
    kept[rows, pos] = False
    for new, old in ((kcd, kc), (vcd, vc)):
        assert torch.equal(new.transpose(1, 2)[kept], old.transpose(1, 2)[kept]), "a slot not written changed"
    return err


def check_exact_rows(device, R, V, dtype, inv_t, banned) -> float:
    """exact_row_logprobs: sampling (seed, step tensors) and target mode. The drawn token inside the row at a
    finite logit, its log-prob that of log_softmax(z * inv_t) within 1e-4; the target mode's log-prob of the same
    token the same bits (the engine's and the trainer's); the entropy within 1e-3 (tests/test_exact_kernels.py).
    banned: row 0 (and every other) has its first half of columns at -inf."""
    from kernels.exact_sample import exact_row_logprobs
    g = gen("exact_rows", R, V, dtype, inv_t, banned)
    z = torch.randn(R, V, generator=g) * 3
    if banned:
        z[::2, :V // 2] = -math.inf
    z = z.to(dtype)
    put = lambda t: t.to(device)
    it = torch.tensor([inv_t])
    tok, lp, _ = exact_row_logprobs(put(z), put(it), seed=put(torch.tensor([5])), step=put(torch.tensor([3])))
    _, lp2, ent = exact_row_logprobs(put(z), put(it), tgt=tok)
    tok, lp, lp2, ent = tok.cpu(), lp.cpu(), lp2.cpu(), ent.cpu()
    assert ((tok >= 0) & (tok < V)).all(), f"token outside the row: {tok.min().item()}..{tok.max().item()}"
    ref = torch.log_softmax(z.double() * inv_t, -1)                                     # (R, V)
    picked = ref[torch.arange(R), tok]
    assert torch.isfinite(picked).all(), "drew a banned (-inf) column"
    assert torch.equal(lp, lp2), "sampled and target log-probs of one token differ"
    want_ent = -(ref.exp() * ref.nan_to_num(neginf=0.0)).sum(-1)
    err = max((lp.double() - picked).abs().max().item(), (ent.double() - want_ent).abs().max().item() / 10)
    assert err <= 1e-4, f"log-prob or entropy (/10) off by {err}"
    return err


def exact_cat_cases(size):
    # (M, K, ns): q/k/v of a GQA model (896 = 14 x 64, 128, 128) and gate/up (4864, 4864); sizes that leave a
    # program's columns across two weights (exact_linear_cat then copies them into one); one row, odd rows
    shapes = [(1, 896, (896, 128, 128)), (37, 24, (32, 16, 16)), (3, 64, (100, 36)), (130, 70, (300, 300))]
    if size == "gpu":
        shapes.append((129, 896, (4864, 4864)))
    if size == "cpu":
        shapes = [(37, 24, (32, 16, 16)), (3, 64, (100, 36))]
    for i, (M, K, ns) in enumerate(shapes):
        for dtype in (F32, BF16):
            for bias in ("all", "some", "none"):
                if size == "gpu" or bias == ("all", "some", "none")[(i + (dtype == BF16)) % 3]:
                    yield dict(M=M, K=K, ns=ns, bias=bias, dtype=dtype)


def exact_silu_cases(size):
    shapes = [(1, 7), (3, 1024), (130, 1100)] + ([(129, 4864)] if size == "gpu" else [])
    for M, I in shapes if size != "cpu" else [(1, 7), (3, 1100)]:
        for dtype in (F32, BF16):
            yield dict(M=M, I=I, dtype=dtype)


def exact_rope_cases(size):
    # (B, nh, nkv, D, L, N): the random model's heads, Qwen2.5-0.5B's (14/2 x 64), an odd head count (HP pads),
    # D = 40 (DP pads), one token
    shapes = [(2, 2, 1, 32, 16, 1), (3, 14, 2, 64, 50, 37), (2, 6, 2, 40, 33, 20), (3, 4, 4, 128, 20, 9)]
    if size == "gpu":
        shapes.append((64, 14, 2, 64, 320, 128))
    if size == "cpu":
        shapes = [(2, 2, 1, 32, 16, 1), (2, 6, 2, 40, 33, 20)]
    for i, (B, nh, nkv, D, L, N) in enumerate(shapes):
        for dtype in (F32, BF16):
            yield dict(B=B, nh=nh, nkv=nkv, D=D, L=L, N=N, dtype=dtype,
                       layout=("heads", "slots")[(i + (dtype == BF16)) % 2])


def exact_rows_cases(size):
    # (R, V): vocabularies of one block (16), one past a block (2049) and Qwen's; one row, odd rows
    shapes = [(1, 16), (3, 2049), (130, 1000), (3, QWEN_V)]
    if size == "cpu":
        shapes = [(1, 16), (3, 2049)]
    for R, V in shapes:
        for dtype in (F32, BF16):
            for inv_t in (1.0, 1 / 0.7):
                if size == "gpu" or inv_t == (1.0 if dtype == F32 else 1 / 0.7):
                    yield dict(R=R, V=V, dtype=dtype, inv_t=inv_t, banned=R > 1)


FAMILIES = {"exact_gemm": (exact_gemm_cases, check_exact_gemm), "exact_cat": (exact_cat_cases, check_exact_cat),
            "exact_silu": (exact_silu_cases, check_exact_silu), "exact_attn": (exact_attn_cases, check_exact_attn),
            "exact_rope": (exact_rope_cases, check_exact_rope), "exact_rows": (exact_rows_cases, check_exact_rows)}
