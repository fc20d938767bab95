"""W2's and W9's losses against their products in interleaved rounds, with their floors measured in the same process
(issue 38 item 4: W2 at H=896 <= 1.30x its three products; issue 37: W9 at H=896 <= 1.3x its four). One card.

    python3 tools/bench_passes.py --out DIR                                   # H=896 (12 rounds), H=4096 (1 round)
    python3 tools/bench_passes.py --out DIR --baseline /tmp/base --rounds 16  # + the losses of another checkout
    python3 tools/bench_passes.py --out DIR --baseline /tmp/base --rounds 8 --workloads W2 --no-floor   # W2 only

Why rounds: the same loss timed twice within one command moved by more than the bars' margin (docs/kernels.md, "W2
and W9 at H=896 in interleaved rounds"), so every method and its basis are timed once per round, in an order
rotated by one each round, and the table gives medians over the rounds (of each time, and of each round's ratio to
its basis), so that a drift of the card's clock hits them all alike.

Per shape (N = 32,768 bf16 tokens; W2's loss sum(logp * a + entropy * b) over rows of 256 tokens, as
tools/kernel_bench.py's fused_loss; W9's reverse KL, sum(kl * a), as tools/bench_w9.py):
 1. (first shape only) the passes alone on one loss chunk of real logits, x the chunks: W2's row_stats and gradient
    pass (kernels/logprob.py) at each of PASS_SETTINGS, W9's row_kl and gradient pass (kernels/fused_kl.py);
 2. (first shape only) the floor's parts: the products in 8192-token blocks (a) and at each loss's chunk, d W
    accumulated as the loss does it (a') (tools/w2_floor.py `matmuls`, tools/w9_floor.py `products`), and the
    passes' least traffic (b) (their `traffic` probes: torch's reduction and in-place op on a chunk);
 3. rounds: the basis (the (N, H) x (H, V) logits product in 8192-token blocks: W2's basis is 3 of it, W9's 4), W2's
    and W9's losses forward + backward as shipped, the same from --baseline's kernels/logprob_loss.py and
    kernels/fused_kl.py (loaded beside this checkout's, so the before and after share the command; with its
    kernels/logprob.py too when the folder holds one), and the variants of VARIANTS; extra GiB (tools/bench_w9.py's
    count) once per method.
--workloads W2 leaves W9 out of all three steps; --no-floor skips step 2.
"""
import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys

import torch
import triton

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TOOLS))
sys.path.insert(0, TOOLS)
import w2_floor  # noqa: E402  (products, traffic probe, commit reader)
from bench_w9 import extra_gib  # noqa: E402
import w9_floor  # noqa: E402
fkl = importlib.import_module("kernels.fused_kl")   # the modules: kernels/ exports functions of these names
lpl = importlib.import_module("kernels.logprob_loss")
logprob = importlib.import_module("kernels.logprob")

GiB, GB, SEQ = 2**30, 1e9, 256
DEV = "cuda"
# name -> (module attribute overrides, shapes it runs at): settings the defaults were chosen against
VARIANTS = {"W2, no token cap": (dict(lpl=dict(MAX_CHUNK_TOKENS=1 << 30)), (4096,))}
# W2's passes alone (step 1): name -> kernels/logprob.py LAUNCH overrides (BLOCK, num_warps, SPLIT) to time beside
# the defaults; the kernels tried this way and removed since: docs/kernels.md, "W2's passes: one reduction a step"
PASS_SETTINGS = {"default": {}}


def load_baseline(folder):
    """--baseline's logprob_loss.py and fused_kl.py as modules of their own (they import this checkout's kernels/
    linear_logprob.py, whose interface they share, and the folder's logprob.py when it has one, else this
    checkout's: it stands in for kernels.logprob only while they load, so their names bind to its functions)."""
    mods, ours = {}, sys.modules["kernels.logprob"]
    names = (["logprob"] if os.path.isfile(os.path.join(folder, "logprob.py")) else []) + ["logprob_loss", "fused_kl"]
    try:
        for name in names:
            spec = importlib.util.spec_from_file_location(f"baseline_{name}", os.path.join(folder, f"{name}.py"))
            mods[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mods[name])
            if name == "logprob":
                sys.modules["kernels.logprob"] = mods[name]
    finally:
        sys.modules["kernels.logprob"] = ours
    return mods


def w2_step(mod, h, w, t, a, b):
    B = h.shape[0] // SEQ
    a2, b2 = a.view(B, SEQ), b.view(B, SEQ)
    loss = mod.linear_logprob_loss(h.view(B, SEQ, -1), w, t.view(B, SEQ), 1.0,
                                   lambda rows, lp, en: (lp * a2[rows] + en * b2[rows]).sum())[0]
    loss.backward()


def w9_step(mod, hs, ws, ht, wt, aw):
    mod.fused_kl_loss(hs, ws, ht, wt, aw, chunk_bytes=mod.LOSS_CHUNK_BYTES)[0].backward()   # read now: VARIANTS


def passes(h, w, hs, ws, ht, wt, m2, m9, w9=True):
    """Step 1: {name: ms x chunks} of each pass on one chunk of real logits."""
    N, V = h.shape[0], w.shape[0]
    k2, k9 = -(-N // m2), -(-N // m9)
    bench = w2_floor.bench
    x = h[:m2] @ w.T                                                          # (m2, V) real logits
    tgt = torch.randint(0, V, (m2,), device=h.device)
    out = {}
    for name, over in PASS_SETTINGS.items():
        restore = apply(dict(logprob=dict(LAUNCH={**logprob.LAUNCH, **over})))
        try:
            out[f"W2 row_stats, {name}"] = bench(lambda: logprob.row_stats(x, tgt, 1.0, True), 100) * k2
            lse, ez, g1, g2 = logprob.row_stats(x, tgt, 1.0, True)
            out[f"W2 gradient pass, {name}"] = bench(lambda: logprob.chunk_grad(x, x, tgt, lse, ez, g1, g2, 0, 1.0,
                                                                                True), 100) * k2
            x = h[:m2] @ w.T                         # the gradient pass rewrote x in place: real logits again
        finally:
            restore()
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in out.items() if k.endswith(name)), flush=True)
    if not w9:
        return out
    zs, zt = hs[:m9] @ ws.T, ht[:m9] @ wt.T                                   # (m9, V) each
    kl, g = torch.empty(m9, device=h.device), torch.rand(m9, device=h.device)
    out["W9 row_kl"] = bench(lambda: fkl.row_kl(zs, zt, 1.0, True, True, kl), 100) * k9
    lse_s, lse_t = fkl.row_kl(zs, zt, 1.0, True, True, kl)
    out["W9 gradient pass"] = bench(lambda: fkl.tile_grad(zs, zt, lse_s, lse_t, kl, g, 1.0, True, True,
                                                          fkl.LOSS_LAUNCH), 100) * k9
    return out


def floor_parts(h, w, hs, ws, ht, wt, m2, m9, w9=True):
    """Step 2: {workload: ((a) parts, (a') parts, (b) ms)}."""
    N, V = h.shape[0], w.shape[0]
    k2, k9 = -(-N // m2), -(-N // m9)
    block = min(8192, N)
    g = torch.randn(m2, V, device=h.device, dtype=h.dtype) * 1e-3             # (m2, V) a gradient-like G
    z, dh, dw = torch.empty_like(g), torch.empty(m2, h.shape[1], device=h.device, dtype=h.dtype), torch.zeros_like(w)
    c2 = {"logits": w2_floor.bench(lambda: torch.mm(h[:m2], w.T, out=z), 100) * k2,
          "d h": w2_floor.bench(lambda: torch.mm(g, w, out=dh), 100) * k2,
          "d W += (bf16 addmm)": w2_floor.bench(lambda: dw.addmm_(g.T, h[:m2]), 100) * k2}
    t2 = w2_floor.traffic(m2, V, k2, h.device)
    out = {"W2": (w2_floor.matmuls(h, w, block), c2, t2["read ms"] + t2["read+write ms"])}
    if w9:
        out["W9"] = (w9_floor.products(hs, ws, ht, wt, block, False), w9_floor.products(hs, ws, ht, wt, m9, True),
                     w9_floor.traffic(m9, V, k9, h.device)["ms"])
    return out


def apply(overrides):
    """Set module attributes (VARIANTS); -> the function that restores them."""
    mods, old = {"lpl": lpl, "fkl": fkl, "logprob": logprob}, []
    for key, attrs in overrides.items():
        for k, v in attrs.items():
            old.append((mods[key], k, getattr(mods[key], k)))
            setattr(mods[key], k, v)
    return lambda: [setattr(m, k, v) for m, k, v in old]


def methods(H, inputs, base, w9_on=True):
    """name -> (overrides, step, leaves, basis multiple)."""
    h, w, t, a, b, hs, ws, ht, wt, aw = inputs
    buf = torch.empty(min(8192, h.shape[0]), w.shape[0], dtype=h.dtype, device=h.device)

    def product():
        for r0 in range(0, h.shape[0], 8192):
            torch.mm(h.detach()[r0:r0 + 8192], w.detach().T, out=buf[: min(8192, h.shape[0] - r0)])
    w2 = lambda mod: (lambda: w2_step(mod, h, w, t, a, b))                                # noqa: E731
    w9 = lambda mod: (lambda: w9_step(mod, hs, ws, ht, wt, aw))                           # noqa: E731
    out = {"product (8192-token blocks)": ({}, product, [], 0),
           "W2 linear_logprob_loss": ({}, w2(lpl), [h, w], 3), "W9 fused_kl_loss": ({}, w9(fkl), [hs, ws], 4)}
    if base:
        out["W2, baseline"] = ({}, w2(base["logprob_loss"]), [h, w], 3)
        out["W9, baseline"] = ({}, w9(base["fused_kl"]), [hs, ws], 4)
    if not w9_on:
        out = {n: v for n, v in out.items() if not n.startswith("W9")}
    for name, (overrides, shapes) in VARIANTS.items():
        if H in shapes and (w9_on or name.startswith("W2")):
            out[name] = (overrides, w2(lpl) if name.startswith("W2") else w9(fkl), [h, w] if name.startswith("W2")
                         else [hs, ws], 3 if name.startswith("W2") else 4)
    return out


def timed(run, calls):
    """Median ms of `calls` runs after one warm-up, each timed by CUDA events (the inputs are far larger than L2)."""
    run()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in marks:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in marks)


def rounds(meths, n_rounds, calls):
    """Step 3: {name: [ms per round]}, each round in an order rotated by one."""
    names = list(meths)
    times = {n: [] for n in names}
    for r in range(n_rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            overrides, step, leaves, _ = meths[n]
            restore = apply(overrides)
            try:
                def run():
                    step()
                    for x in leaves:
                        x.grad = None
                times[n].append(timed(run, calls))
            finally:
                restore()
        print(f"  round {r + 1}: " + ", ".join(f"{times[n][-1]:.1f}" for n in names), flush=True)
    return times


def shape_report(H, V, args, base, first):
    dev, N = DEV, args.n
    torch.manual_seed(0)
    h = (torch.randn(N, H, device=dev) * 2).to(torch.bfloat16).requires_grad_()         # W2's inputs (kernel_bench)
    w = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device=dev)
    a, b = torch.randn(N, device=dev), torch.randn(N, device=dev)
    hs = torch.randn(N, H, device=dev).to(torch.bfloat16).requires_grad_()              # W9's (bench_w9)
    ws = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16).requires_grad_()
    ht = torch.randn(N, H, device=dev).to(torch.bfloat16)
    wt = (torch.randn(V, H, device=dev) / H**0.5).to(torch.bfloat16)
    aw = torch.rand(N, device=dev)
    m2 = w2_floor.chunk_tokens(V, lpl.CHUNK_BYTES, SEQ, N)
    m9 = fkl.loss_rows(N, V, 2, fkl.LOSS_CHUNK_BYTES)
    print(f"\nH={H} V={V}: W2 chunk {m2} tokens, W9 chunk {m9} tokens", flush=True)
    det = [x.detach() for x in (h, w, hs, ws)]
    w9_on = "W9" in args.workloads
    sweep = passes(*det[:2], *det[2:], ht, wt, m2, m9, w9_on) if first else {}
    for n, v in sweep.items():
        print(f"  {n}: {v:.2f} ms", flush=True)
    floor = floor_parts(*det[:2], *det[2:], ht, wt, m2, m9, w9_on) if first and args.floor else None
    meths = methods(H, (h, w, t, a, b, hs, ws, ht, wt, aw), base, w9_on)
    extra = {}
    for n, (overrides, step, leaves, _) in meths.items():
        if leaves:
            restore = apply(overrides)
            try:
                extra[n] = extra_gib(step, leaves)
            finally:
                restore()
    times = rounds(meths, args.rounds if first else args.later_rounds, args.calls)
    return dict(H=H, V=V, N=N, m2=m2, m9=m9, sweep=sweep, floor=floor, times=times, extra=extra,
                mult={n: v[3] for n, v in meths.items()})


def report(r):
    times, mult = r["times"], r["mult"]
    prod = times["product (8192-token blocks)"]
    lines = [f"\n### H={r['H']}, V={r['V']} (W2 chunk {r['m2']} tokens, W9 chunk {r['m9']})\n",
             f"{len(prod)} rounds. Time: median over rounds (min-max); ratio: median over rounds of the round's time "
             "over its basis (3 or 4 products of the same round).\n",
             "| method | ms, median (min-max) | extra GiB | / basis, median (min-max) |", "|---|---|---|---|"]
    for n, v in times.items():
        k = mult[n]
        rat = [x / (k * p) for x, p in zip(v, prod)] if k else []
        rs = f"**{statistics.median(rat):.3f}x** ({min(rat):.3f}-{max(rat):.3f})" if rat else "-"
        ex = f"{r['extra'][n]:.2f}" if n in r["extra"] else "-"
        lines.append(f"| {n} | {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) | {ex} | {rs} |")
    if r["sweep"]:
        lines += ["", "| pass (one chunk x chunks) | ms | logits traffic TB/s |", "|---|---|---|"]
        for n, v in r["sweep"].items():
            m, reads = (r["m2"], 1) if n.startswith("W2") else (r["m9"], 2)
            rw = reads + 1 if "gradient" in n else reads                      # tiles read, plus the one written
            lines.append(f"| {n} | {v:.2f} | {rw * m * r['V'] * 2 * -(-r['N'] // m) / v / GB:.2f} |")
    if r["floor"]:
        lines += ["", "| workload | (a) products, 8192 blocks | (a') at the chunk | (b) passes' least traffic | "
                  "(a)+(b) / (a) | (a')+(b) / (a) |", "|---|---|---|---|---|---|"]
        for wl, (a, c, b) in r["floor"].items():
            fa, fc = sum(a.values()), sum(c.values())
            lines.append(f"| {wl} | {fa:.1f} ({', '.join(f'{v:.1f}' for v in a.values())}) | {fc:.1f} "
                         f"({', '.join(f'{v:.1f}' for v in c.values())}) | {b:.1f} | {(fa + b) / fa:.3f}x | "
                         f"{(fc + b) / fa:.3f}x |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_passes.md and .json")
    ap.add_argument("--shapes", default="896x151936,4096x128256", help="HxV,HxV (the first gets --rounds)")
    ap.add_argument("--n", type=int, default=32768, help="tokens (a multiple of 256)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds at the first shape")
    ap.add_argument("--later-rounds", type=int, default=1, help="rounds at the other shapes")
    ap.add_argument("--calls", type=int, default=1, help="timed calls per method per round (their median)")
    ap.add_argument("--baseline", default=None, help="a folder with another checkout's logprob_loss.py, fused_kl.py "
                    "(and logprob.py: its kernels then run under them)")
    ap.add_argument("--workloads", default="W2,W9", help="W2,W9 or W2 alone")
    ap.add_argument("--no-floor", dest="floor", action="store_false", help="skip step 2, the floor's parts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("bench_passes needs a CUDA device")
    try:
        args.shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    except ValueError:
        ap.error(f"--shapes takes HxV,HxV, got {args.shapes!r}")
    args.workloads = args.workloads.split(",")
    if not set(args.workloads) <= {"W2", "W9"} or "W2" not in args.workloads:
        ap.error(f"--workloads takes W2,W9 or W2, got {','.join(args.workloads)!r}")
    if args.n % SEQ or args.n <= 0:
        ap.error(f"--n must be a positive multiple of {SEQ}, got {args.n}")
    if args.baseline and not all(os.path.isfile(os.path.join(args.baseline, f"{n}.py"))
                                 for n in ("logprob_loss", "fused_kl")):
        ap.error(f"--baseline {args.baseline} must hold logprob_loss.py and fused_kl.py")
    base = load_baseline(args.baseline) if args.baseline else None
    head = (f"Card: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"commit {w2_floor.commit()}, N={args.n} bf16.\n`python3 {' '.join(sys.argv)}`\n")
    results, lines = [], [head]
    for i, (H, V) in enumerate(args.shapes):
        results.append(shape_report(H, V, args, base, i == 0))
        lines += report(results[-1])
        text = "\n".join(lines) + "\n"
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_passes.md"), "w") as f:   # after each shape: a later one may fail
            f.write(text)
        with open(os.path.join(args.out, "bench_passes.json"), "w") as f:
            json.dump(results, f, default=str)
        print("\n".join(report(results[-1])), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
