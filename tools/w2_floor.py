"""W2's floor made measurable (issue #23): can cuBLAS matmuls + separate passes reach 1.10x of the three matmuls?

    python3 tools/w2_floor.py --out DIR                  # CUDA only; both W2 shapes; writes DIR/w2_floor.md
    python3 tools/w2_floor.py --out DIR --gemm           # + the Triton-vs-cuBLAS logits GEMM at the chunk sizes

Per shape (W2: N = 32,768 bf16 tokens, rows of --seq tokens, docs/benchmarks.md), in one process:
  (a) the three plain cuBLAS products the loss needs, each alone on --block-token blocks: logits = h @ W.T,
      d h = G @ W, d W = G.T @ h (a fresh product, no accumulation);
  (b) the least memory traffic of any design that writes the logits and runs separate passes over them: read
      them once (statistics), read and write them once (gradient, in place), timed as torch ops over the loss's
      own chunk buffer (a row reduction: the faster of amax and sum; an in-place neg_) at the bandwidth they reach;
  (c) linear_logprob_loss forward + backward (tools/kernel_bench.py's triton_loss) and its parts per chunk, for
      each launch setting of the passes (--launch), each chunk budget (--budgets), and the statistics route
      before row_stats (running state + finish_stats in torch ops) for a same-command before / after.
The table: (a), (b), floor = (a) + (b) against the bar 1.10 x (a), and (c) / (a). With --gemm, also the best
Triton logits GEMM against cuBLAS at the chunk sizes: the other route (passes folded into Triton GEMMs) needs
Triton at >= 1 / 1.10 = 91% of cuBLAS's rate even if its folded passes cost nothing.
"""
import argparse
import os
import subprocess
import sys

import torch
import triton
import triton.testing

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)
import kernel_bench as kb  # noqa: E402
from kernels import logprob  # noqa: E402
from kernels import logprob_loss as loss_module  # noqa: E402

GB = 1e9
DEVICE = "cuda"   # a module setting only so that a CPU smoke run (interpreted Triton) can change it


def bench(f, rep=300):
    return triton.testing.do_bench(f, warmup=50, rep=rep, return_mode="median")


def chunk_tokens(V, budget_bytes, seq, n):
    """Tokens per chunk of linear_logprob_loss for rows of seq tokens (as its plan_chunks packs them)."""
    return min(n, max(1, loss_module.budget_tokens(V, 2, budget_bytes) // seq) * seq)


def matmuls(h, w, block):
    """(a): ms of each plain product over all N tokens, in blocks of `block` tokens."""
    N, H = h.shape
    V = w.shape[0]
    k = -(-N // block)
    hb = h[:block]
    g = torch.randn(block, V, device=h.device, dtype=h.dtype) * 1e-3      # (block, V) a gradient-like G
    logits, dh, dw = torch.empty_like(g), torch.empty(block, H, device=h.device, dtype=h.dtype), torch.empty_like(w)
    out = {"logits h @ W.T": bench(lambda: torch.mm(hb, w.T, out=logits), 500) * k,
           "d h = G @ W": bench(lambda: torch.mm(g, w, out=dh), 500) * k,
           "d W = G.T @ h": bench(lambda: torch.mm(g.T, hb, out=dw), 500) * k}
    del g, logits
    return out


def traffic(m, V, k, device):
    """(b): ms for the passes' least traffic over k chunks of (m, V) bf16 logits, and the bandwidth reached."""
    x = torch.randn(m, V, device=device, dtype=torch.bfloat16)
    read = min(bench(lambda: torch.amax(x, 1)), bench(lambda: x.sum(1, dtype=torch.float32)))
    rw = bench(lambda: x.neg_())
    nbytes = m * V * 2
    del x
    return {"read ms": read * k, "read+write ms": rw * k, "read TB/s": nbytes / read / GB,
            "read+write TB/s": 2 * nbytes / rw / GB, "bytes GB": 3 * nbytes * k / GB}


def old_row_stats(x, targets, inv_t, use_triton):
    """The statistics route before row_stats: a running state, one kernel, then ~10 small torch ops."""
    state = logprob.new_state(x.shape[0], x.device)
    logprob.chunk_stats(x, targets, state, 0, inv_t, use_triton)
    return logprob.finish_stats(state, targets)


def parts(h, w, t, m, settings):
    """(c) per chunk x chunks: the products and the passes, the passes once per launch setting."""
    V, H = w.shape
    k = -(-h.shape[0] // m)
    w, hb, tb = w.detach(), h[:m].detach(), t[:m]
    x = torch.empty(m, V, dtype=h.dtype, device=h.device)
    torch.mm(hb, w.T, out=x)
    lse, ez, g1, g2 = (torch.randn(m, device=h.device) + 12 for _ in range(4))
    dh, gw = torch.empty(m, H, dtype=h.dtype, device=h.device), torch.zeros(V, H, dtype=h.dtype, device=h.device)
    out = {"cuBLAS logits": bench(lambda: torch.mm(hb, w.T, out=x)) * k,
           "d h = G @ W": bench(lambda: torch.mm(x, w, out=dh)) * k,
           "d W += G.T @ h (bf16 addmm)": bench(lambda: gw.addmm_(x.T, hb)) * k,
           "d W = G.T @ h (plain, for reference)": bench(lambda: torch.mm(x.T, hb, out=gw)) * k,
           "stats, before row_stats (default launch)": bench(lambda: old_row_stats(x, tb, 1.0, True)) * k}
    old = dict(logprob.LAUNCH)
    for s in settings:
        logprob.LAUNCH.update(s)
        name = "{BLOCK}/{num_warps}w/split {SPLIT}".format(**s)
        out[f"row_stats {name}"] = bench(lambda: logprob.row_stats(x, tb, 1.0, True)) * k
        out[f"grad pass {name}"] = bench(lambda: logprob.chunk_grad(x, x, tb, lse, ez, g1, g2, 0, 1.0, True)) * k
        torch.mm(hb, w.T, out=x)                                   # the grad pass overwrote the logits
    logprob.LAUNCH.clear()
    logprob.LAUNCH.update(old)
    del x, gw
    return out


def loss_runs(h, w, t, a, b, settings, budgets, rep):
    """(c): linear_logprob_loss fwd+bwd (ms, extra GiB) per launch setting (default budget), per budget (default
    launch), and with the statistics route before row_stats."""
    old, runs = dict(logprob.LAUNCH), {}
    def one(name):
        ms, _, extra = kb.measure(kb.fused_loss, h, w, t, a, b, backward=True, rep=rep)
        runs[name] = (ms, extra)
        print(f"  loss {name}: {ms:.1f} ms, extra {extra:.2f} GiB", flush=True)
    for s in settings:
        logprob.LAUNCH.update(s)
        one("launch {BLOCK}/{num_warps}w/split {SPLIT}, {mib} MiB".format(mib=kb.LOSS["chunk_bytes"] >> 20, **s))
    logprob.LAUNCH.update(old)
    default = kb.LOSS["chunk_bytes"]
    for mib in budgets:
        kb.LOSS["chunk_bytes"] = mib << 20
        one(f"default launch, {mib} MiB")
    kb.LOSS["chunk_bytes"] = default
    new = loss_module.row_stats
    loss_module.row_stats = old_row_stats
    try:
        one("stats route before row_stats, default launch and budget")
    finally:
        loss_module.row_stats = new
    return runs


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=TOOLS, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def shape_report(H, V, args, settings, budgets):
    """All measurements at one shape -> (summary row, markdown lines of its detail)."""
    dev = DEVICE
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    h = (torch.randn(args.n, H, device=dev) * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (args.n,), device=dev)
    a, b = torch.randn(args.n, device=dev), torch.randn(args.n, device=dev)
    m = chunk_tokens(V, kb.LOSS["chunk_bytes"], args.seq, args.n)
    k = -(-args.n // m)
    print(f"\nH={H} V={V}: chunk {m} tokens, {k} chunks", flush=True)
    mm = matmuls(h.detach(), w.detach(), args.block)
    tr = traffic(m, V, k, dev)
    pt = parts(h, w, t, m, settings)
    runs = loss_runs(h, w, t, a, b, settings, budgets, args.rep)
    best_s = min(settings, key=lambda s: pt["row_stats {BLOCK}/{num_warps}w/split {SPLIT}".format(**s)]
                 + pt["grad pass {BLOCK}/{num_warps}w/split {SPLIT}".format(**s)])
    best_b = min(budgets, key=lambda mib: runs[f"default launch, {mib} MiB"][0])
    old_l, old_b = dict(logprob.LAUNCH), kb.LOSS["chunk_bytes"]
    logprob.LAUNCH.update(best_s)
    kb.LOSS["chunk_bytes"] = best_b << 20
    name = "best: launch {BLOCK}/{num_warps}w/split {SPLIT}, {mib} MiB".format(mib=best_b, **best_s)
    ms, _, extra = kb.measure(kb.fused_loss, h, w, t, a, b, backward=True, rep=args.rep)
    runs[name] = (ms, extra)
    logprob.LAUNCH.update(old_l)
    kb.LOSS["chunk_bytes"] = old_b
    floor_a = sum(mm.values())
    floor_b = tr["read ms"] + tr["read+write ms"]
    default = runs["launch {BLOCK}/{num_warps}w/split {SPLIT}, {mib} MiB".format(mib=old_b >> 20, **old_l)][0] \
        if old_l in settings else float("nan")
    best = min(v[0] for v in runs.values())
    row = (f"| {H}x{V} | {floor_a:.1f} | {floor_b:.1f} ({tr['bytes GB']:.0f} GB at {tr['read TB/s']:.2f} / "
           f"{tr['read+write TB/s']:.2f} TB/s) | {floor_a + floor_b:.1f} | **{(floor_a + floor_b) / floor_a:.3f}x** | "
           f"{1.10 * floor_a:.1f} | {default:.1f} ({default / floor_a:.3f}x) | {best:.1f} ({best / floor_a:.3f}x) |")
    lines = [f"\n### H={H}, V={V}: chunk {m} tokens x {k} chunks (default budget {old_b >> 20} MiB)\n",
             "| (a) product, alone, %d-token blocks | ms |" % args.block, "|---|---|"]
    lines += [f"| {n} | {v:.1f} |" for n, v in mm.items()]
    lines += ["", "| (c) part, per chunk x chunks | ms | logits traffic TB/s |", "|---|---|---|"]
    for n, v in pt.items():   # the statistics read the logits once; the gradient pass reads and writes them
        passes = 2 if n.startswith("grad") else 1 if "stats" in n else 0
        lines.append(f"| {n} | {v:.1f} | {passes * m * V * 2 * k / v / GB:.2f} |" if passes else f"| {n} | {v:.1f} | |")
    lines += ["", "| (c) linear_logprob_loss fwd+bwd | ms | extra GiB | / (a) |", "|---|---|---|---|"]
    lines += [f"| {n} | {v[0]:.1f} | {v[1]:.2f} | {v[0] / floor_a:.3f}x |" for n, v in runs.items()]
    del h, w
    torch.cuda.empty_cache()
    return row, lines, m


def parse_settings(text):
    out = []
    for item in filter(None, text.split(";")):
        block, warps, split = map(int, item.split(","))
        out.append(dict(BLOCK=block, num_warps=warps, SPLIT=split))
    return out


def gemm_lines(chunks, args):
    """--gemm: tools/triton_vs_cublas_gemm.py's comparison at each shape's chunk size, as markdown lines."""
    import triton_vs_cublas_gemm as tg
    lines = ["", "### Logits GEMM: best Triton against cuBLAS (sustained TFLOP/s, alternating runs)", "",
             "| shape | tokens | cuBLAS | best Triton (config) | Triton / cuBLAS | + stats epilogue | needed |",
             "|---|---|---|---|---|---|---|"]
    for (H, V), m in chunks:
        for T, r in tg.compare(H, V, sorted({m, 2 * m})).items():
            s = r["sustained_tflops"]
            cub, tri, st = (sum(s[x]) / len(s[x]) for x in ("cublas", "triton", "triton+stats"))
            lines.append(f"| {H}x{V} | {T} | {cub:.0f} | {tri:.0f} {r['best']} | {tri / cub:.3f} | "
                         f"{st:.0f} ({st / cub:.3f}) | >= {1 / 1.10:.3f} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for w2_floor.md")
    ap.add_argument("--shapes", default="896x151936,4096x128256", help="HxV,HxV")
    ap.add_argument("--n", type=int, default=32768, help="tokens")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (sequence)")
    ap.add_argument("--block", type=int, default=8192, help="tokens per block for the plain products (a)")
    ap.add_argument("--launch", default="4096,8,1;4096,8,2;4096,8,4;2048,4,4;2048,4,8;8192,16,2",
                    help="pass launch settings BLOCK,warps,SPLIT;... (the first should be the default)")
    ap.add_argument("--budgets", default="384,480", help="chunk budgets in MiB (W2 allows <= 0.5 GiB extra)")
    ap.add_argument("--rep", type=int, default=1500, help="do_bench ms per loss measurement")
    ap.add_argument("--gemm", action="store_true", help="also Triton vs cuBLAS logits GEMM at the chunk sizes")
    args = ap.parse_args()
    settings, budgets = parse_settings(args.launch), [int(x) for x in args.budgets.split(",")]
    kb.LOSS["seq"] = args.seq
    head = (f"Card: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"commit {commit()}, N={args.n} bf16, rows of {args.seq}.\n`python3 {' '.join(sys.argv)}`\n")
    table = [head, "| shape | (a) 3 products ms | (b) passes' least traffic ms | floor (a)+(b) | floor / (a) | "
             "bar 1.10 x (a) | loss now (default settings) | loss, best setting |", "|---|---|---|---|---|---|---|---|"]
    detail, chunks = [], []
    for shape in args.shapes.split(","):
        H, V = map(int, shape.split("x"))
        row, lines, m = shape_report(H, V, args, settings, budgets)
        table.append(row)
        detail += lines
        chunks.append(((H, V), m))
    if args.gemm:
        detail += gemm_lines(chunks, args)
    text = "\n".join(table + detail) + "\n"
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w2_floor.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
