"""W9 benchmark (docs/benchmarks.md): per-token full-vocabulary KL between a student and a teacher, from both hidden
states and both heads, one GPU, one command.

    python tools/bench_w9.py                            # both W2 shapes, N = 32768 bf16 tokens, every method
    python tools/bench_w9.py --shapes 896x151936 --n 8192 --methods ours,compile
    python tools/bench_w9.py --tiny                     # CPU smoke run: toy shapes, eager and ours (torch twin)

Methods, same card, same process: `eager` (kernels/fused_kl.py: fused_kl_reference, both (N, V) log-softmaxes in
float32), `compile` (torch.compile of it), `ours` (fused_kl: cuBLAS tiles + Triton passes, gradient recomputed in the
backward: 6 matmuls), `ours_loss` (fused_kl_loss: the per-token weights known up front, the gradient computed in
the forward over whole-vocabulary row chunks: 4 matmuls), `liger` (Liger-Kernel's LigerFusedLinearJSD at
jsd_beta=1, its reverse KL; a scalar mean, skipped when liger_kernel is not importable or refuses beta=1), and
the matmul floor: the (N, H) x (H, V) product timed alone in 8192-row blocks, x4 (student and teacher logits,
d hidden, d weight: what any exact method must compute) and x6 (fused_kl: the two logits products once more in
the backward).
The teacher has the student's shape (--teacher-hidden to change it) and no gradient; the loss is sum(kl * a) with
random a, reverse KL (--forward for KL(teacher || student)). Forward runs under no_grad.
Time: median of triton.testing.do_bench (CUDA) or of --rep wall-clock runs (--tiny). Memory: peak allocated above
the inputs, minus the student's hidden and weight gradients every method returns ("extra"). OOM prints as nan.
Error: relative L2 of kl and both gradients against float64 on the first 1024 tokens.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.fused_kl import fused_kl, fused_kl_loss, fused_kl_reference  # noqa: E402

GiB = 2**30
METHODS = ("eager", "compile", "ours", "ours_loss", "liger")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="896x151936,4096x128256", help="HxV,HxV: W2's shapes")
    p.add_argument("--n", type=int, default=32768, help="tokens")
    p.add_argument("--teacher-hidden", type=int, default=0, help="teacher hidden size (0 = the student's)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--forward", action="store_true", help="forward KL(teacher || student) instead of reverse")
    p.add_argument("--rep", type=int, default=400, help="do_bench ms per measurement (CUDA), runs (--tiny)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: N=64, 32x512 and 48x700, float32")
    p.add_argument("--out", default="", help="also write the results as json to this file")
    args = p.parse_args()
    bad = set(args.methods.split(",")) - set(METHODS)
    if bad:
        p.error(f"unknown method(s) {', '.join(sorted(bad))}; choose from {', '.join(METHODS)}")
    if not args.tiny and not torch.cuda.is_available():
        p.error("W9 needs a CUDA device; --tiny runs the toy CPU version")
    try:
        args.shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        p.error(f"--shapes must look like 896x151936,4096x128256, got {args.shapes!r}")
    if args.tiny:
        args.n, args.shapes, args.rep = 64, [(32, 512), (48, 700)], min(args.rep, 5)
    return args


def method_fns(names, reverse):
    fns = {"eager": lambda hs, ws, ht, wt, a: fused_kl_reference(hs, ws, ht, wt, 1.0, reverse),
           "ours": lambda hs, ws, ht, wt, a: fused_kl(hs, ws, ht, wt, 1.0, reverse),
           "ours_loss": lambda hs, ws, ht, wt, a: fused_kl_loss(hs, ws, ht, wt, a, 1.0, reverse)}   # (loss, kl)
    if "compile" in names:
        fns["compile"] = torch.compile(fns["eager"])
    if "liger" in names:
        try:
            from liger_kernel.transformers import LigerFusedLinearJSD
            jsd = LigerFusedLinearJSD(jsd_beta=1.0 if reverse else 0.0, temperature=1.0)
            fns["liger"] = lambda hs, ws, ht, wt, a: jsd(hs, ws, ht, wt, None)   # no labels: a mean over all tokens
        except (ImportError, AssertionError, TypeError) as e:
            print(f"liger: skipped ({type(e).__name__}: {e})".splitlines()[0])
    return {n: fns[n] for n in names if n in fns}


def timed(f, rep, cuda):
    if cuda:
        import triton.testing
        return triton.testing.do_bench(f, warmup=50, rep=rep, return_mode="median")
    f()
    runs = []
    for _ in range(rep):
        t0 = time.perf_counter()
        f()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def extra_gib(step, leaves) -> float:
    """Peak allocated by step() above what was allocated before, minus the leaves' gradients (every method returns
    those), GiB; the leaves' gradients cleared before and after."""
    for x in leaves:
        x.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = sum(x.grad.numel() * x.grad.element_size() for x in leaves if x.grad is not None)
    for x in leaves:
        x.grad = None
    return (torch.cuda.max_memory_allocated() - base - grads) / GiB


def measure(fn, hs, ws, ht, wt, a, backward, rep):
    """-> (ms, extra GiB) of fn forward (no_grad) or forward + backward of sum(kl * a)."""
    cuda = hs.is_cuda

    def step():
        out = fn(hs, ws, ht, wt, a)
        if backward:
            loss = out[0] if isinstance(out, tuple) else out if out.dim() == 0 else (out * a).sum()
            loss.backward()
    hs.grad = ws.grad = None
    gc.collect()
    try:
        with torch.set_grad_enabled(backward):
            step()                                                      # warm-up (compiles) outside the peak
            hs.grad = ws.grad = None
            extra = extra_gib(step, (hs, ws)) if cuda else None       # not measured off CUDA
            ms = timed(lambda: (step(), setattr(hs, "grad", None), setattr(ws, "grad", None)), rep, cuda)
    except torch.OutOfMemoryError:
        ms, extra = float("nan"), float("nan")
    hs.grad = ws.grad = None
    return ms, extra


def matmul_ms(h, w, rep, rows=8192):
    """One (N, H) x (H, V) product in blocks of `rows` tokens (the floor's unit)."""
    buf = torch.empty(min(rows, h.shape[0]), w.shape[0], dtype=h.dtype, device=h.device)

    def run():
        for r0 in range(0, h.shape[0], rows):
            torch.mm(h[r0:r0 + rows], w.T, out=buf[: min(rows, h.shape[0] - r0)])
    return timed(run, rep, h.is_cuda)


def errors(fn, hs, ws, ht, wt, reverse, n=1024):
    """Relative L2 error of kl, d hidden, d weight against float64 on the first n tokens (None for a scalar loss)."""
    h, w = hs[:n].detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    a = torch.randn(h.shape[0], device=h.device)
    out = fn(h, w, ht[:n], wt, a)
    if isinstance(out, tuple):                                      # ours_loss: (sum(a * kl), kl)
        out[0].backward()
        kl = out[1]
    elif out.dim() == 0:
        return None
    else:
        kl = out
        (kl * a).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = fused_kl_reference(h64, w64, ht[:n].double(), wt.double(), 1.0, reverse).double()
    (ref * a.double()).sum().backward()
    r = lambda x, y: ((x.double() - y).norm() / y.norm()).item()  # noqa: E731
    return {"kl": r(kl.detach(), ref.detach()), "d_hidden": r(h.grad, h64.grad), "d_weight": r(w.grad, w64.grad)}


def run_shape(args, H, V, fns):
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    gen = torch.Generator(device).manual_seed(0)
    Ht = args.teacher_hidden or H
    hs = torch.randn(args.n, H, device=device, generator=gen).to(dtype).requires_grad_()
    ws = (torch.randn(V, H, device=device, generator=gen) / H ** 0.5).to(dtype).requires_grad_()
    ht = torch.randn(args.n, Ht, device=device, generator=gen).to(dtype)
    wt = (torch.randn(V, Ht, device=device, generator=gen) / Ht ** 0.5).to(dtype)
    a = torch.rand(args.n, device=device, generator=gen)
    out = {"shape": f"{H}x{V}", "teacher_hidden": Ht, "n": args.n, "dtype": str(dtype), "device": device}
    mm = matmul_ms(hs.detach(), ws.detach(), args.rep)
    mm_t = mm if Ht == H else matmul_ms(ht, wt, args.rep)
    out["floor4_ms"], out["floor6_ms"] = 3 * mm + mm_t, 4 * mm + 2 * mm_t
    for name, fn in fns.items():
        fwd, fwd_gib = measure(fn, hs, ws, ht, wt, a, False, args.rep)
        both, both_gib = measure(fn, hs, ws, ht, wt, a, True, args.rep)
        out[name] = {"fwd_ms": fwd, "fwd_extra_gib": fwd_gib, "fwd_bwd_ms": both, "fwd_bwd_extra_gib": both_gib,
                     "error": errors(fn, hs, ws, ht, wt, not args.forward)}
        print(f"{H}x{V} {name}: fwd {fwd:.2f} ms, fwd+bwd {both:.2f} ms, extra {both_gib} GiB", flush=True)
    return out


def table(results, names) -> str:
    """Forward + backward ms / extra GiB per method, the floors, and ours against its own floor (ours: 6 products,
    ours_loss: 4)."""
    lines = ["| shape H x V | " + " | ".join(f"{n} (ms / GiB)" for n in names)
             + " | 4 matmuls | 6 matmuls | ours / 6 mm | ours_loss / 4 mm |", "|---|" + "---|" * (len(names) + 4)]
    for r in results:
        gib = lambda x: "-" if x is None else f"{x:.2f}"   # noqa: E731
        cells = [f"{r[n]['fwd_bwd_ms']:.1f} / {gib(r[n]['fwd_bwd_extra_gib'])}" if n in r else "-" for n in names]
        ratios = [f"{r[n]['fwd_bwd_ms'] / r[floor]:.2f}x" if n in r else "-"
                  for n, floor in (("ours", "floor6_ms"), ("ours_loss", "floor4_ms"))]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {r['floor4_ms']:.1f} | {r['floor6_ms']:.1f} | "
                     + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main():
    args = parse_args()
    names = args.methods.split(",")
    if args.tiny:
        # compile needs a C toolchain, Liger needs CUDA
        names = [n for n in names if n in ("eager", "ours", "ours_loss")]
        torch.set_num_threads(1)
    fns = method_fns(names, not args.forward)
    results = [run_shape(args, H, V, fns) for H, V in args.shapes]
    direction = "KL(teacher || student)" if args.forward else "KL(student || teacher)"
    print(f"\nW9, {direction}, forward + backward, N = {args.n}, "
          f"{torch.cuda.get_device_name() if not args.tiny else 'CPU (--tiny)'}:\n")
    print(table(results, list(fns)))
    for r in results:
        for n in fns:
            if r[n]["error"]:
                print(f"{r['shape']} {n} relative error vs float64: "
                      + ", ".join(f"{k} {v:.2e}" for k, v in r[n]["error"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
