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
"""
import argparse
import os
import sys

import torch
import triton

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)
import bench_w9  # noqa: E402
import w2_floor  # noqa: E402  (its timer, traffic probe, setting parser and commit reader)
from w2_floor import bench, commit, parse_settings  # noqa: E402
from kernels.fused_kl import (LOSS_CHUNK_BYTES, LOSS_LAUNCH, LOSS_LOGITS, fused_kl_loss, logits_kl,  # noqa: E402
                              loss_rows, row_kl, tile_grad)

GB = 1e9
BAR = 1.3


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


# (BM, BN, BK, warps, stages, GROUP) for _logits_kl_kernel
FUSED_CONFIGS = [(128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 128, 64, 4, 3, 8), (128, 256, 64, 8, 3, 8),
                 (64, 256, 64, 4, 3, 8), (256, 128, 64, 8, 3, 8), (128, 128, 128, 8, 2, 8), (64, 128, 64, 4, 4, 8)]


def as_settings(cfg, load_t=False):
    BM, BN, BK, warps, stages, group = cfg
    return dict(BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages, GROUP=group, LOAD_T=load_t)


def fused_logits(H, V, tokens, configs=FUSED_CONFIGS, sustained_ms=600, rounds=2):
    """Both logits products with the KL statistics in their epilogue (kernels/fused_kl.py `logits_kl`: one Triton
    kernel + the per-row merge) against what they replace (two cuBLAS products + row_kl) and against the two cuBLAS
    products alone, per chunk of T tokens: {T: quick ms per config, best, sustained ms of the three}."""
    res = {}
    ws = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16)
    wt = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16)
    for T in tokens:
        hs, ht = (torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(2))
        zs, zt = (torch.empty(T, V, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kl, kl_ref = torch.empty(T, device="cuda"), torch.empty(T, device="cuda")
        torch.mm(hs, ws.T, out=zs), torch.mm(ht, wt.T, out=zt)
        row_kl(zs, zt, 1.0, True, True, kl_ref)
        quick = {}
        for cfg in configs:
            try:
                f = lambda: logits_kl(hs, ws, ht, wt, zs, zt, 1.0, True, kl, as_settings(cfg))   # noqa: E731
                f()
                err = ((kl - kl_ref).abs().max() / kl_ref.abs().max()).item()
                quick[str(cfg)] = (bench(f, 150) if err < 1e-2 else float("inf"), err)
            except Exception as e:   # a config that does not fit shared memory or registers fails: go on
                quick[str(cfg)] = (float("inf"), f"{type(e).__name__}: {str(e)[:100]}")
            print(H, T, cfg, quick[str(cfg)], flush=True)
        best = min(configs, key=lambda c: quick[str(c)][0])
        fused = lambda: logits_kl(hs, ws, ht, wt, zs, zt, 1.0, True, kl, as_settings(best))   # noqa: E731
        cublas = lambda: (torch.mm(hs, ws.T, out=zs), torch.mm(ht, wt.T, out=zt))               # noqa: E731
        cublas_rowkl = lambda: (cublas(), row_kl(zs, zt, 1.0, True, True, kl))                # noqa: E731
        half = lambda: logits_kl(hs, ws, ht, wt, zs, zt, 1.0, True, kl, as_settings(best, True))   # noqa: E731
        sus = {"cublas 2 products": [], "cublas 2 products + row_kl": [], "fused": [], "cublas zt + fused zs": []}
        for _ in range(rounds):      # alternating, so that all see the same clock
            for name, f in zip(sus, (cublas, cublas_rowkl, fused, half)):
                sus[name].append(bench(f, sustained_ms))
        tf = 2 * 2 * T * H * V / 1e9
        print(H, T, "best", best, {n: [f"{v:.3f} ms ({tf / v:.0f} TFLOP/s)" for v in x] for n, x in sus.items()},
              flush=True)
        res[T] = {"quick_ms": quick, "best": best, "sustained_ms": sus}
        del hs, ht, zs, zt
    return res


def fused_report(H, V, args):
    """--fused: the fused logits kernel at the loss's chunk (and --fused-tokens), then the loss with it on."""
    m = loss_rows(args.n, V, 2, LOSS_CHUNK_BYTES)
    k = -(-args.n // m)
    res = fused_logits(H, V, sorted({m, *args.fused_tokens}))
    lines = [f"\n### H={H}, V={V}: both logits products with the KL statistics in their epilogue\n",
             "| tokens | best (BM, BN, BK, warps, stages, GROUP) | 2 cuBLAS products ms | + row_kl ms | fused ms |"
             " fused / cuBLAS products | x chunks: fused - (products + row_kl) ms | cuBLAS zt + fused zs ms |",
             "|---|---|---|---|---|---|---|---|"]
    for T, r in res.items():
        c, c2, f, h = (min(v) for v in r["sustained_ms"].values())
        lines.append(f"| {T} | {r['best']} | {c:.3f} | {c2:.3f} | {f:.3f} | {f / c:.3f} | "
                     f"{(f - c2) * -(-args.n // T):+.1f} | {h:.3f} ({(h - c2) * -(-args.n // T):+.1f}) |")
    best = res[m]["best"]
    dev = "cuda"
    hs = torch.randn(args.n, H, device=dev).to(torch.bfloat16).requires_grad_()
    ws = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
    ht = torch.randn(args.n, H, device=dev).to(torch.bfloat16)
    wt = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16)
    a = torch.rand(args.n, device=dev)
    old = dict(LOSS_LOGITS)
    lines += ["", f"| fused_kl_loss fwd+bwd, {m}-token chunks x {k} | ms | extra GiB |", "|---|---|---|"]
    for name, setting in (("cuBLAS logits + row_kl", dict(FUSED=False)),
                          (f"fused logits {best}", dict(FUSED=True, **as_settings(best))),
                          (f"cuBLAS zt + fused zs {best}", dict(FUSED=True, **as_settings(best, True)))):
        LOSS_LOGITS.update(setting)
        fn = lambda hs, ws, ht, wt, a: fused_kl_loss(hs, ws, ht, wt, a)  # noqa: E731
        ms, extra = bench_w9.measure(fn, hs, ws, ht, wt, a, True, args.rep)
        lines.append(f"| {name} | {ms:.1f} | {gib(extra)} |")
        print(lines[-1], flush=True)
    LOSS_LOGITS.clear()
    LOSS_LOGITS.update(old)
    del hs, ws, ht, wt
    torch.cuda.empty_cache()
    return lines


def shape_report(H, V, args, settings, budgets):
    dev = "cuda"
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    hs = torch.randn(args.n, H, device=dev).to(torch.bfloat16).requires_grad_()
    ws = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
    ht = torch.randn(args.n, H, device=dev).to(torch.bfloat16)
    wt = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16)
    a = torch.rand(args.n, device=dev)
    m = loss_rows(args.n, V, 2, LOSS_CHUNK_BYTES)
    k = -(-args.n // m)
    print(f"\nH={H} V={V}: chunk {m} tokens, {k} chunks", flush=True)
    mm = products(hs.detach(), ws.detach(), ht, wt, args.block, False)
    mm_c = products(hs.detach(), ws.detach(), ht, wt, m, True)
    tr = traffic(m, V, k, dev)
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
    return row, lines


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
    ap.add_argument("--fused-tokens", default="", help="more chunk sizes for --fused, e.g. 1536,4096")
    args = ap.parse_args()
    args.fused = args.fused or args.fused_only
    args.fused_tokens = [int(x) for x in args.fused_tokens.split(",") if x]
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
        if args.fused:
            detail += fused_report(H, V, args)
        if args.fused_only:
            continue
        row, lines = shape_report(H, V, args, settings, budgets)
        table.append(row)
        detail += lines
    text = "\n".join(table + detail) + "\n"
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w9_floor.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
