"""tools/kernel_sweep.py's families for the exact path's Triton kernels (engines/exact.py, docs/exact.md), each against
its torch twin:

  exact_gemm  kernels/exact_gemm.py: exact_linear's `_gemm` with each TILES class's tile (rows of 1, odd sizes and
              sizes no tile divides, bias or none) -> float64 F.linear; exact_rmsnorm in each of its NORM_MODES -> the
              mode's formula in torch
  exact_attn  kernels/exact_attention.py: exact_attention, trainer-like calls (whole sequences) and decode-like ones
              (one token per row at a late position), GQA groups 1/3/7, a sliding window or none, caches whose length
              no key block divides, both cache layouts the engine makes -> softmax attention in float64
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


def exact_gemm_cases(size):
    # (M, K, N): each TILES class (kernels/exact_gemm.py shape_class) with M of 1, odd, and past one row tile;
    # K and N that no tile divides
    shapes = {"narrow": [(1, 896, 128), (3, 100, 200), (65, 70, 40)],
              "long_k": [(1, 4864, 896), (17, 600, 257)],
              "other": [(3, 896, 1152), (33, 100, 300)],
              "vocab": [(1, 64, 16384), (130, 100, 16400)]}
    if size == "gpu":
        shapes["vocab"].append((3, 896, QWEN_V))
        shapes["long_k"].append((129, 4864, 896))
    if size == "cpu":   # the interpreter: an explicit product per tile; one shape per class but the vocabulary's
        # (its 128-column tiles over 16,384 columns take seconds; tests/test_exact_kernels.py interprets that tile)
        shapes = {"narrow": [(3, 70, 40)], "long_k": [(5, 600, 257)], "other": [(19, 100, 300)]}
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


FAMILIES = {"exact_gemm": (exact_gemm_cases, check_exact_gemm), "exact_attn": (exact_attn_cases, check_exact_attn)}
