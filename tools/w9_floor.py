"""W9's floor made measurable (issue 37): can cuBLAS products + separate passes reach 1.3x of the four products?

    python3 tools/w9_floor.py --out DIR                 # CUDA only; both W2 shapes; writes DIR/w9_floor.md
    python3 tools/w9_floor.py --out DIR --budgets 256,448 --launch "4096,8,1;2048,4,4"

Per shape (N = 32,768 bf16 tokens, the teacher shaped as the student, reverse KL), in one process:
  (a) the four products any exact method needs, each alone over N tokens in --block-token blocks: zs = hs @ Ws.T,
      zt = ht @ Wt.T, d hs = G @ Ws, d Ws = G.T @ hs (a fresh product): the bar's basis, as tools/bench_w9.py's
      "4 matmuls";
  (a') the same four at fused_kl_loss's chunk (kernels/fused_kl.py `loss_rows`: whole-vocabulary rows, as many as
      two bf16 buffers fit the budget), d Ws accumulated chunk after chunk as the loss does;
  (b) the least memory traffic of any design that writes both logits tiles and runs separate passes over them:
      the statistics read both tiles once, the gradient reads both and writes the student's in place: three reads
      and one read + write of an (m, V) tile per chunk, timed as torch ops (a row reduction, the faster of amax and
      sum; an in-place neg_) at the bandwidth they reach;
  (c) fused_kl_loss's own passes per chunk (row_kl, the in-place gradient pass) for each launch setting, and the
      whole loss forward + backward (ms, extra GiB as tools/bench_w9.py counts it) per setting and per budget.
The table: (a), (b), floor (a) + (b) and, with the chunk's own products, (a') + (b), against the bar 1.3 x (a);
then the loss and its ratio to (a).
  (d) --fused (--fused-only: (d) alone): the route that skips the statistics pass: both logits products in one
      Triton kernel with each tile's statistics in its epilogue (_logits_kl_kernel, here since it loses: kernels/
      fused_kl.py keeps cuBLAS), or cuBLAS's teacher product and the kernel's student product reading the teacher's
      tile; per chunk against cuBLAS + row_kl, a plain Triton GEMM's rate (tools/triton_vs_cublas_gemm.py), the
      loss with each route swapped in (`fused_logits_in_loss`), and the rate the route would need for the bar.
"""
import argparse
import contextlib
import importlib
import os
import sys

import torch
import triton
import triton.language as tl

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)
import bench_w9  # noqa: E402
import w2_floor  # noqa: E402  (its timer, traffic probe, setting parser and commit reader)
from w2_floor import bench, commit, parse_settings  # noqa: E402
import triton_vs_cublas_gemm  # noqa: E402
from kernels.linear_logprob import grouped_tile  # noqa: E402
from kernels.fused_kl import (LOSS_CHUNK_BYTES, LOSS_LAUNCH, _merge_kernel, fused_kl_loss, loss_rows,  # noqa: E402
                              row_kl, tile_grad)
fused_kl_module = importlib.import_module("kernels.fused_kl")   # the module: kernels/ exports a function of that name

GB = 1e9
BAR = 1.3


@triton.jit
def _logits_kl_kernel(hs_ptr, ws_ptr, ht_ptr, wt_ptr, zs_ptr, zt_ptr, part_ptr, M, V, KS, KT, stride_z, inv_t,
                      REVERSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP: tl.constexpr, STAGES: tl.constexpr, LOAD_T: tl.constexpr):
    # one (BM, BN) tile of both logits products, zs = hs @ ws.T and zt = ht @ wt.T (K = KS, KT), stored in bf16
    # (or the inputs' dtype), and the tile's statistics of the rounded values into part (5, M, S), S =
    # cdiv(V, BN), as _part_kernel writes them: no pass reads the tiles back for the statistics.
    # LOAD_T: zt is already in memory (a cuBLAS product): the tile is read, not computed.
    # Tiles walk GROUP row tiles per column tile, so neighbouring programs share the weights' tiles in L2.
    pm, pn = grouped_tile(tl.program_id(0), M, V, BM, BN, GROUP)
    npn = tl.cdiv(V, BN)                                 # column tiles: the statistics' columns per row
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rows_in, cols_in = rows % M, cols % V            # past the edge: repeat real rows / columns, masked later
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, KS, BK, num_stages=STAGES):
        kk = k + tl.arange(0, BK)
        a = tl.load(hs_ptr + rows_in[:, None].to(tl.int64) * KS + kk[None, :], mask=kk[None, :] < KS, other=0.0)
        b = tl.load(ws_ptr + cols_in[:, None].to(tl.int64) * KS + kk[None, :], mask=kk[None, :] < KS, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    zs = acc.to(zs_ptr.dtype.element_ty)                # (BM, BN) as stored: the statistics see what the gradient will
    ok = (rows < M)[:, None] & (cols < V)[None, :]
    at = rows[:, None].to(tl.int64) * stride_z + cols[None, :]
    tl.store(zs_ptr + at, zs, mask=ok)
    if LOAD_T:
        zt = tl.load(zt_ptr + at, mask=ok, other=0.0)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, KT, BK, num_stages=STAGES):
            kk = k + tl.arange(0, BK)
            a = tl.load(ht_ptr + rows_in[:, None].to(tl.int64) * KT + kk[None, :], mask=kk[None, :] < KT,
                        other=0.0)
            b = tl.load(wt_ptr + cols_in[:, None].to(tl.int64) * KT + kk[None, :], mask=kk[None, :] < KT,
                        other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        zt = acc.to(zt_ptr.dtype.element_ty)
        tl.store(zt_ptr + at, zt, mask=ok)
    if REVERSE:
        zp, zq = zs.to(tl.float32) * inv_t, zt.to(tl.float32) * inv_t
    else:
        zp, zq = zt.to(tl.float32) * inv_t, zs.to(tl.float32) * inv_t
    real = (cols < V)[None, :]
    zp = tl.where(real, zp, -float("inf"))
    zq = tl.where(real, zq, -float("inf"))
    mp = tl.max(zp, 1)                                  # (BM,) finite: every tile holds a real column
    ep = tl.exp(zp - mp[:, None])                       # 0 on columns past V
    sp = tl.sum(ep, 1)
    a_ = tl.sum(ep * tl.where(real, zp - zq, 0.0), 1)
    mq = tl.max(zq, 1)
    sq = tl.sum(tl.exp(zq - mq[:, None]), 1)
    out = part_ptr + rows.to(tl.int64) * npn + pn
    live = rows < M
    tl.store(out, mp, mask=live)
    tl.store(out + M * npn, sp, mask=live)
    tl.store(out + 2 * M * npn, a_, mask=live)
    tl.store(out + 3 * M * npn, mq, mask=live)
    tl.store(out + 4 * M * npn, sq, mask=live)


# (BM, BN, BK, warps, stages, GROUP) for _logits_kl_kernel: the fastest at H=896 first
FUSED_CONFIGS = [(128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 8), (64, 128, 64, 4, 4, 8), (128, 128, 128, 8, 2, 8)]


def triton_logits_kl(hs, ws, ht, wt, zs, zt, inv_t, reverse, kl, cfg=FUSED_CONFIGS[0], load_t=False):
    """kernels/fused_kl.py `logits_kl` with the statistics in the products' epilogue: hs (m, Hs), ws (V, Hs), ht (m,
    Ht), wt (V, Ht) -> zs, zt (m, V) written, kl (m,) written, -> (lse_s, lse_t) (m,) each float32. One launch of
    _logits_kl_kernel (load_t: zt by cuBLAS first, only zs in the kernel), then the per-row merge."""
    BM, BN, BK, warps, stages, group = cfg
    (m, ks), V, kt = hs.shape, ws.shape[0], ht.shape[1]
    S = triton.cdiv(V, BN)
    part = torch.empty(5, m, S, dtype=torch.float32, device=hs.device)       # mp, sp, a, mq, sq per (row, tile)
    if load_t:
        torch.mm(ht, wt.T, out=zt)
    _logits_kl_kernel[(triton.cdiv(m, BM) * S,)](hs, ws, ht, wt, zs, zt, part, m, V, ks, kt, zs.stride(0), inv_t,
                                                 REVERSE=reverse, BM=BM, BN=BN, BK=BK, GROUP=group, STAGES=stages,
                                                 LOAD_T=load_t, num_warps=warps, num_stages=stages)
    lse = torch.empty(2, m, dtype=torch.float32, device=hs.device)
    _merge_kernel[(m,)](part, lse[0], lse[1], kl, m, S, REVERSE=reverse, BLOCK_S=triton.next_power_of_2(S))
    return lse[0], lse[1]


@contextlib.contextmanager
def fused_logits_in_loss(cfg, load_t=False):
    """fused_kl_loss with triton_logits_kl as its per-chunk logits step (bf16 / fp16 inputs), restored on exit."""
    old = fused_kl_module.logits_kl
    fused_kl_module.logits_kl = lambda hs, ws, ht, wt, zs, zt, inv_t, reverse, use_triton, kl: triton_logits_kl(
        hs, ws, ht, wt, zs, zt, inv_t, reverse, kl, cfg, load_t)
    try:
        yield
    finally:
        fused_kl_module.logits_kl = old


def products(hs, ws, ht, wt, rows, accumulate):
    """ms of the four products over all N tokens in chunks of `rows` tokens (accumulate: d W += per chunk, in
    the dtype fused_kl_loss would use, else a fresh d W = G.T @ h)."""
    (N, H), V = hs.shape, ws.shape[0]
    k = -(-N // rows)
    h, t = hs[:rows], ht[:rows]
    g = torch.randn(rows, V, device=hs.device, dtype=hs.dtype) * 1e-3           # (rows, V) a gradient-like G
    z, dh = torch.empty_like(g), torch.empty(rows, H, device=hs.device, dtype=hs.dtype)
    f32 = accumulate and V * H * 4 <= LOSS_CHUNK_BYTES and rows < N
    dw = torch.zeros(V, H, device=hs.device, dtype=torch.float32 if f32 else hs.dtype)
    out = {"zs = hs @ Ws.T": bench(lambda: torch.mm(h, ws.T, out=z)) * k,
           "zt = ht @ Wt.T": bench(lambda: torch.mm(t, wt.T, out=z)) * k,
           "d hs = G @ Ws": bench(lambda: torch.mm(g, ws, out=dh)) * k}
    if accumulate and f32:
        out["d Ws += G.T @ hs (float32)"] = bench(lambda: dw.add_(torch.mm(g.T, h))) * k
    elif accumulate:
        out["d Ws += G.T @ hs (bf16 addmm)"] = bench(lambda: dw.addmm_(g.T, h)) * k
    else:
        out["d Ws = G.T @ hs"] = bench(lambda: torch.mm(g.T, h, out=dw)) * k
    del g, z, dw
    return out


def traffic(m, V, k, device):
    """(b): ms of three reads and one read + write of an (m, V) bf16 tile per chunk, over k chunks (w2_floor's
    probe times one read and one read + write of such a tile)."""
    t = w2_floor.traffic(m, V, k, device)
    return {"ms": 3 * t["read ms"] + t["read+write ms"], "read TB/s": t["read TB/s"],
            "read+write TB/s": t["read+write TB/s"], "GB": t["bytes GB"] * 5 / 3}

def gib(x):
    return "-" if x is None else f"{x:.2f}"


def name_of(s):
    return "{BLOCK}/{num_warps}w/split {SPLIT}".format(**s)


def passes(hs, ws, ht, wt, m, settings):
    """(c): ms of row_kl and the gradient pass per chunk x chunks, per launch setting, on real logits."""
    N, V = hs.shape[0], ws.shape[0]
    k = -(-N // m)
    zs, zt = hs[:m] @ ws.T, ht[:m] @ wt.T                                       # (m, V) each
    g, kl = torch.rand(m, device=hs.device), torch.empty(m, device=hs.device)
    old, out = dict(LOSS_LAUNCH), {}
    for s in settings:
        LOSS_LAUNCH.update(s)
        lse_s, lse_t = row_kl(zs, zt, 1.0, True, True, kl)
        out[f"row_kl {name_of(s)}"] = bench(lambda: row_kl(zs, zt, 1.0, True, True, kl)) * k
        # in place: later runs see the gradient, not logits, in zs (the same work per element)
        out[f"grad pass {name_of(s)}"] = bench(lambda: tile_grad(zs, zt, lse_s, lse_t, kl, g, 1.0, True, True,
                                                                 LOSS_LAUNCH)) * k
        torch.mm(hs[:m], ws.T, out=zs)
    LOSS_LAUNCH.clear()
    LOSS_LAUNCH.update(old)
    return out


def loss_runs(hs, ws, ht, wt, a, settings, budgets, rep):
    """(c): fused_kl_loss forward + backward (ms, extra GiB) per launch setting at the default budget, per budget
    at the default launch."""
    old, runs = dict(LOSS_LAUNCH), {}

    def one(name, budget):
        fn = lambda hs, ws, ht, wt, a: fused_kl_loss(hs, ws, ht, wt, a, chunk_bytes=budget)  # noqa: E731
        runs[name] = bench_w9.measure(fn, hs, ws, ht, wt, a, True, rep)
        print(f"  loss {name}: {runs[name][0]:.1f} ms, extra {gib(runs[name][1])} GiB", flush=True)
    for s in settings:
        LOSS_LAUNCH.update(s)
        one(f"launch {name_of(s)}, {LOSS_CHUNK_BYTES >> 20} MiB", LOSS_CHUNK_BYTES)
    LOSS_LAUNCH.clear()
    LOSS_LAUNCH.update(old)
    for mib in budgets:
        if mib << 20 != LOSS_CHUNK_BYTES:
            one(f"default launch, {mib} MiB", mib << 20)
    return runs


def fused_logits(H, V, T, sustained_ms=600, rounds=2):
    """Per chunk of T tokens: both logits products with the KL statistics in their epilogue (triton_logits_kl, each
    of FUSED_CONFIGS, checked against row_kl) against what they replace (two cuBLAS products + row_kl) and the two
    cuBLAS products alone, alternating so that all see the same clock: {quick, best, sustained ms}."""
    ws = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16)
    wt = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16)
    hs, ht = (torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(2))
    zs, zt = (torch.empty(T, V, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kl, kl_ref = torch.empty(T, device="cuda"), torch.empty(T, device="cuda")
    cublas = lambda: (torch.mm(hs, ws.T, out=zs), torch.mm(ht, wt.T, out=zt))               # noqa: E731
    cublas_rowkl = lambda: (cublas(), row_kl(zs, zt, 1.0, True, True, kl))                  # noqa: E731
    cublas_rowkl()
    kl_ref.copy_(kl)
    quick = {}
    for cfg in FUSED_CONFIGS:
        try:
            f = lambda: triton_logits_kl(hs, ws, ht, wt, zs, zt, 1.0, True, kl, cfg)          # noqa: E731
            f()
            err = ((kl - kl_ref).abs().max() / kl_ref.abs().max()).item()
            quick[str(cfg)] = (bench(f, 150) if err < 1e-2 else float("inf"), err)
        except Exception as e:   # a config that does not fit shared memory or registers fails: go on
            quick[str(cfg)] = (float("inf"), f"{type(e).__name__}: {str(e)[:100]}")
        print(H, T, cfg, quick[str(cfg)], flush=True)
    best = min(FUSED_CONFIGS, key=lambda c: quick[str(c)][0])
    fused = lambda: triton_logits_kl(hs, ws, ht, wt, zs, zt, 1.0, True, kl, best)            # noqa: E731
    half = lambda: triton_logits_kl(hs, ws, ht, wt, zs, zt, 1.0, True, kl, best, True)       # noqa: E731
    sus = {"cublas": [], "cublas+row_kl": [], "fused": [], "half": []}
    for _ in range(rounds):
        for name, f in zip(sus, (cublas, cublas_rowkl, fused, half)):
            sus[name].append(bench(f, sustained_ms))
    print(H, T, "best", best, sus, flush=True)
    return {"quick": quick, "best": best, "sustained_ms": {n: min(v) for n, v in sus.items()}}


def plain_gemm(H, V, T):
    """The best plain Triton GEMM (TMA loads, no epilogue; tools/triton_vs_cublas_gemm.py, three of its configs)
    against cuBLAS for one (T, H) x (H, V) product: (cuBLAS, Triton, Triton + max / sum-exp epilogue) TFLOP/s."""
    configs = [(128, 256, 64, 8, 3, False, 0), (128, 128, 64, 4, 4, False, 0), (128, 256, 64, 8, 3, False, 1)]
    r = triton_vs_cublas_gemm.compare(H, V, [T], configs, sustained_ms=300, rounds=2)[T]["sustained_tflops"]
    return tuple(max(r[k]) for k in ("cublas", "triton", "triton+stats"))


def inputs(n, H, V, dev="cuda"):
    """W9's operands, bf16: student hidden hs (n, H) and head ws (V, H) with gradients, teacher ht, wt alike
    without, and the per-token loss weights a (n,)."""
    hs = torch.randn(n, H, device=dev).to(torch.bfloat16).requires_grad_()
    ws = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
    ht = torch.randn(n, H, device=dev).to(torch.bfloat16)
    wt = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16)
    return hs, ws, ht, wt, torch.rand(n, device=dev)


def fused_report(H, V, args, a_ms=None):
    """--fused: the statistics-in-the-epilogue route at the loss's chunk: its logits step, a plain Triton GEMM's
    rate, and the loss with the route swapped in; what the route would need to reach the bar."""
    m = loss_rows(args.n, V, 2, LOSS_CHUNK_BYTES)
    k = -(-args.n // m)
    r = fused_logits(H, V, m)
    c, c2, f, h = (r["sustained_ms"][x] for x in ("cublas", "cublas+row_kl", "fused", "half"))
    cub, tri, tri_stats = plain_gemm(H, V, m)
    hs, ws, ht, wt, a = inputs(args.n, H, V)
    fn = lambda hs, ws, ht, wt, a: fused_kl_loss(hs, ws, ht, wt, a)                           # noqa: E731
    loss = {"cuBLAS products + row_kl (shipped)": bench_w9.measure(fn, hs, ws, ht, wt, a, True, args.rep)}
    for name, load_t in (("both products in the kernel", False), ("cuBLAS zt, zs in the kernel", True)):
        with fused_logits_in_loss(r["best"], load_t):
            loss[name] = bench_w9.measure(fn, hs, ws, ht, wt, a, True, args.rep)
    del hs, ws, ht, wt
    torch.cuda.empty_cache()
    lines = [f"\n### H={H}, V={V}: the statistics in the logits products' epilogue, {m}-token chunks x {k}\n",
             f"Best of {len(FUSED_CONFIGS)} tile configs (BM, BN, BK, warps, stages, GROUP): {r['best']}.\n",
             "| per chunk | ms | x chunks | two cuBLAS products' rate / this |", "|---|---|---|---|",
             f"| 2 cuBLAS products | {c:.3f} | {c * k:.1f} | 1 |",
             f"| 2 cuBLAS products + row_kl (shipped) | {c2:.3f} | {c2 * k:.1f} | {c / c2:.3f} |",
             f"| Triton: both products + statistics epilogue | {f:.3f} | {f * k:.1f} | {c / f:.3f} |",
             f"| cuBLAS zt + Triton zs reading zt in its epilogue | {h:.3f} | {h * k:.1f} | {c / h:.3f} |",
             "", f"Plain Triton GEMM (TMA, no KL epilogue), one ({m}, {H}) x ({H}, {V}) product, TFLOP/s: cuBLAS "
             f"{cub:.0f}, Triton {tri:.0f} (**{tri / cub:.3f}** of cuBLAS), Triton + max / sum-exp epilogue "
             f"{tri_stats:.0f} ({tri_stats / cub:.3f}).", "",
             "| fused_kl_loss fwd+bwd, logits step | ms | extra GiB | / (a) |", "|---|---|---|---|"]
    lines += [f"| {n} | {v[0]:.1f} | {gib(v[1])} | "
              f"{'-' if a_ms is None else f'{v[0] / a_ms:.3f}x'} |" for n, v in loss.items()]
    if a_ms is not None:     # the logits step's budget: the bar less everything else the shipped loss spends
        rest = loss["cuBLAS products + row_kl (shipped)"][0] - c2 * k
        need = BAR * a_ms - rest
        lines += ["", f"To reach the bar ({BAR * a_ms:.1f} ms) with the rest of the shipped loss ({rest:.1f} ms) "
                  f"unchanged, the logits step may take {need:.1f} ms ({need / k:.3f} per chunk): both products "
                  f"and their statistics at >= **{c * k / need:.3f}** of the two cuBLAS products' rate."]
    return lines


def shape_report(H, V, args, settings, budgets):
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    hs, ws, ht, wt, a = inputs(args.n, H, V)
    m = loss_rows(args.n, V, 2, LOSS_CHUNK_BYTES)
    k = -(-args.n // m)
    print(f"\nH={H} V={V}: chunk {m} tokens, {k} chunks", flush=True)
    mm = products(hs.detach(), ws.detach(), ht, wt, args.block, False)
    mm_c = products(hs.detach(), ws.detach(), ht, wt, m, True)
    tr = traffic(m, V, k, hs.device)
    pt = passes(hs.detach(), ws.detach(), ht, wt, m, settings)
    runs = loss_runs(hs, ws, ht, wt, a, settings, budgets, args.rep)
    fa, fc, fb = sum(mm.values()), sum(mm_c.values()), tr["ms"]
    default = runs[f"launch {name_of(LOSS_LAUNCH)}, {LOSS_CHUNK_BYTES >> 20} MiB"] \
        if LOSS_LAUNCH in settings else (float("nan"), float("nan"))
    best_name = min(runs, key=lambda n: runs[n][0])
    best = runs[best_name]
    row = (f"| {H}x{V} | {fa:.1f} | {fb:.1f} ({tr['GB']:.0f} GB at {tr['read TB/s']:.2f} / "
           f"{tr['read+write TB/s']:.2f} TB/s) | {fa + fb:.1f} (**{(fa + fb) / fa:.3f}x**) | "
           f"{fc + fb:.1f} ({(fc + fb) / fa:.3f}x) | {BAR * fa:.1f} | {default[0]:.1f} ({default[0] / fa:.3f}x, "
           f"{gib(default[1])} GiB) | {best[0]:.1f} ({best[0] / fa:.3f}x, {gib(best[1])} GiB; {best_name}) |")
    lines = [f"\n### H={H}, V={V}: chunk {m} tokens x {k} chunks (default budget {LOSS_CHUNK_BYTES >> 20} MiB)\n",
             f"| product | (a) {args.block}-token blocks, ms | (a') {m}-token chunks, ms |", "|---|---|---|"]
    lines += [f"| {n} | {v:.1f} | {c:.1f} |" for (n, v), c in zip(mm.items(), mm_c.values())]
    lines += ["", "| (c) pass, per chunk x chunks | ms | logits traffic TB/s |", "|---|---|---|"]
    for n, v in pt.items():     # row_kl reads both tiles; the gradient pass reads both and writes one
        nbytes = (3 if n.startswith("grad") else 2) * m * V * 2 * k
        lines.append(f"| {n} | {v:.1f} | {nbytes / v / GB:.2f} |")
    lines += ["", "| (c) fused_kl_loss fwd+bwd | ms | extra GiB | / (a) |", "|---|---|---|---|"]
    lines += [f"| {n} | {v[0]:.1f} | {gib(v[1])} | {v[0] / fa:.3f}x |" for n, v in runs.items()]
    del hs, ws, ht, wt
    torch.cuda.empty_cache()
    return row, lines, fa


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for w9_floor.md")
    ap.add_argument("--shapes", default="896x151936,4096x128256", help="HxV,HxV")
    ap.add_argument("--n", type=int, default=32768, help="tokens")
    ap.add_argument("--block", type=int, default=8192, help="tokens per block for the plain products (a)")
    ap.add_argument("--launch", default="4096,8,1;4096,8,2;4096,8,4;2048,4,8",
                    help="pass launch settings BLOCK,warps,SPLIT;... (include the default to get its row)")
    ap.add_argument("--budgets", default="256,448", help="chunk budgets in MiB (W9 allows <= 0.5 GiB extra)")
    ap.add_argument("--rep", type=int, default=400, help="do_bench ms per loss measurement")
    ap.add_argument("--fused", action="store_true",
                    help="also time the logits products with the KL statistics in their epilogue (and the loss so)")
    ap.add_argument("--fused-only", action="store_true", help="--fused and nothing else")
    args = ap.parse_args()
    args.fused = args.fused or args.fused_only
    if not torch.cuda.is_available():
        ap.error("w9_floor needs a CUDA device")
    try:
        settings, budgets = parse_settings(args.launch), [int(x) for x in args.budgets.split(",")]
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    except ValueError:
        ap.error("--launch is BLOCK,warps,SPLIT;..., --budgets MiB,MiB, --shapes HxV,HxV")
    head = (f"Card: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"commit {commit()}, N={args.n} bf16, reverse KL.\n`python3 {' '.join(sys.argv)}`\n")
    table = [head, "| shape | (a) 4 products ms | (b) passes' least traffic ms | floor (a)+(b) | with the chunk's "
             "products (a')+(b) | bar 1.3 x (a) | loss, defaults | loss, best |", "|---|---|---|---|---|---|---|---|"]
    detail = []
    for H, V in shapes:
        a_ms = None
        if not args.fused_only:
            row, lines, a_ms = shape_report(H, V, args, settings, budgets)
            table.append(row)
            detail += lines
        if args.fused:
            detail += fused_report(H, V, args, a_ms)
    text = "\n".join(table + detail) + "\n"
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w9_floor.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
