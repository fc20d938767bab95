"""W2 benchmark (docs/benchmarks.md): per-token log-prob + entropy from hidden states, one GPU, one command.

    python tools/kernel_bench.py                      # both W2 shapes, N = 32768, bf16
    python tools/kernel_bench.py --shapes 896x151936 --n 8192 --methods triton,compile

Methods, all on the same card in the same process: eager PyTorch (materialised logits; `eager_logp`
is log-prob only via cross_entropy, as W2's peers), torch.compile of `eager`, these kernels
(`triton`: the default, cuBLAS logits + Triton passes, gradient recomputed in backward (4 matmuls);
`triton_fused`: Triton matmuls with the softmax in their epilogue; `triton_logp`: entropy left out of the
loss; `triton_loss`: linear_logprob_loss, the gradient computed in the forward (3 matmuls), rows of --seq
tokens), Liger-Kernel's fused linear cross entropy (log-prob only:
it has no entropy output; skipped if liger_kernel is not importable), and a matmul floor (the one
(N, H) x (H, V) product, timed in 8192-row blocks, times 3 or 4). OOM prints as nan.
Forward runs under no_grad (how rollout / reference log-probs are taken); forward+backward uses the loss
sum(logp * a + entropy * b) with random a, b, so both gradient paths are exercised (Liger: sum of CE).
Time: median of triton.testing.do_bench. Memory: peak allocated above the inputs, minus the hidden and
weight gradients that every method must return ("extra"); "peak" keeps the gradients in.
Correctness: relative L2 error of outputs and gradients against float64 on the first 1024 tokens; for
triton_loss also the error its bf16 accumulation of d weight (one rounding per chunk) adds at full N,
against the same loop accumulating in float32.
"""
import argparse
import gc
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import linear_logprob  # noqa: E402
from kernels.linear_logprob import linear_logprob_entropy  # noqa: E402
from kernels import logprob_loss as loss_module  # noqa: E402
from kernels.logprob import logprob_entropy, logprob_entropy_reference  # noqa: E402

GiB = 2**30


def eager(h, w, t, temperature):
    z = (h @ w.T).float() / temperature                          # (N, V) materialised, softmax in float32
    lse = torch.logsumexp(z, -1)                                   # (N,)
    logp = z.gather(-1, t[:, None]).squeeze(-1) - lse
    return logp, lse - (torch.softmax(z, -1) * z).sum(-1)


def eager_logp(h, w, t, temperature):                             # log-prob only, as W2's peers
    return -torch.nn.functional.cross_entropy((h @ w.T).float() / temperature, t, reduction="none"), None


def fused(h, w, t, temperature):
    return linear_logprob_entropy(h, w, t, temperature, use_triton=True)


def fused_matmul(h, w, t, temperature):                           # Triton matmuls with the softmax epilogue
    return linear_logprob_entropy(h, w, t, temperature, use_triton=True, fuse_matmul=True)


def fused_logp(h, w, t, temperature):                             # entropy not in the loss: less backward work
    return linear_logprob_entropy(h, w, t, temperature, use_triton=True)[0], None


LOSS = dict(seq=256, chunk_bytes=loss_module.CHUNK_BYTES)         # set from --seq and --loss-budgets


def fused_loss(h, w, t, temperature, a, b):
    """Gradient in the forward: loss = sum(logp * a + entropy * b) over rows of LOSS["seq"] tokens."""
    C = LOSS["seq"] if h.shape[0] % LOSS["seq"] == 0 else 1
    B = h.shape[0] // C
    a2, b2 = a.view(B, C), b.view(B, C)
    return loss_module.linear_logprob_loss(h.view(B, C, -1), w, t.view(B, C), temperature,
                                           lambda rows, lp, en: (lp * a2[rows] + en * b2[rows]).sum(),
                                           chunk_bytes=LOSS["chunk_bytes"])


fused_loss.takes_weights = True                                     # builds its own loss from a, b


def liger_fn():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        print(f"liger: not importable ({e}); skipped")
        return None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda h, w, t, temperature: (-loss(w, h, t), None)   # -sum CE = sum logp


def measure(fn, h, w, t, a, b, backward, rep=1500):
    def step():
        if getattr(fn, "takes_weights", False):
            loss = fn(h, w, t, 1.0, a, b)[0]
            if backward:
                loss.backward()
            return
        lp, en = fn(h, w, t, 1.0)
        if backward:
            loss = lp if lp.dim() == 0 else (lp * a).sum() if en is None else (lp * a + en * b).sum()
            loss.backward()
    h.grad = w.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    with torch.set_grad_enabled(backward):
        step()                                                     # warm-up (compiles) outside the peak
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = sum(x.grad.numel() * x.grad.element_size() for x in (h, w) if x.grad is not None)
        h.grad = w.grad = None
        ms = triton.testing.do_bench(step, warmup=200, rep=rep, grad_to_none=[h, w], return_mode="median")
    return ms, peak / GiB, (peak - grads) / GiB


def matmul_ms(h, w, rows=8192):
    buf = torch.empty(rows, w.shape[0], dtype=h.dtype, device=h.device)
    def run():
        for r0 in range(0, h.shape[0], rows):
            torch.mm(h[r0:r0 + rows], w.T, out=buf[: min(rows, h.shape[0] - r0)])
    return triton.testing.do_bench(run, warmup=100, rep=500, return_mode="median")


def profile(h, w, t):
    """Where the time of one (token block x vocabulary block) tile goes, x the number of tiles (ms)."""
    from kernels import logprob
    rows, cols = linear_logprob._plan(h.shape[0], w.shape[0], h.element_size(), linear_logprob.CHUNK_BYTES)
    n, v, H = rows[0][1], cols[0][1], h.shape[1]
    k = len(rows) * len(cols)
    hb, wb, tb = h[:n].detach(), w[:v].detach(), t[:n] % v  # targets inside the tile
    x = torch.empty(n, v, dtype=h.dtype, device=h.device)
    st = logprob.new_state(n, h.device)
    lse, ez, g1, g2 = (torch.randn(n, device=h.device) + 12 for _ in range(4))
    acc, gw = torch.zeros(n, H, device=h.device), torch.zeros(v, H, dtype=h.dtype, device=h.device)
    ops = {"cuBLAS logits tile": lambda: torch.mm(hb, wb.T, out=x),
           "G @ W + add to fp32": lambda: acc.add_(torch.mm(x, wb)),
           "G.T @ h into bf16 grad": lambda: gw.addmm_(x.T, hb),
           "fused fwd (Triton matmul)": lambda: linear_logprob.fused_block_stats(hb, wb, tb, 1.0),
           "fused bwd tile (Triton matmul)": lambda: linear_logprob.fused_tile_grad(hb, wb, x, tb, lse, ez, g1, g2, 0, 1.0)}
    for blk, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8)):
        def go(f, blk=blk, warps=warps):
            logprob.LAUNCH.update(BLOCK=blk, num_warps=warps)
            f()
        ops[f"stats kernel {blk}/{warps}w"] = lambda go=go: go(lambda: logprob.chunk_stats(x, tb, st, 0, 1.0, True))
        ops[f"grad kernel {blk}/{warps}w"] = lambda go=go: go(lambda: logprob.chunk_grad(x, x, tb, lse, ez, g1, g2, 0, 1.0, True))
    old = dict(logprob.LAUNCH)
    torch.mm(hb, wb.T, out=x)
    print(f"profile: tile {n} x {v}, {k} tiles; per-tile ms x {k}:")
    for name, f in ops.items():
        ms = triton.testing.do_bench(f, warmup=50, rep=200, return_mode="median")
        print(f"  {name:32s} {ms:7.3f} -> {ms * k:6.1f} ms", flush=True)
    logprob.LAUNCH.update(old)


def check_error(fn, h, w, t, n=1024):
    """Relative error of fn vs float64 on the first n tokens (fresh gradients), at temperature 0.8."""
    hs, ts = h[:n].detach().clone().requires_grad_(), t[:n]
    ws = w.detach().clone().requires_grad_()
    a, b = torch.randn(n, device=h.device), torch.randn(n, device=h.device)
    if getattr(fn, "takes_weights", False):
        loss, lp, en = fn(hs, ws, ts, 0.8, a, b)
        loss.backward()
        lp, en = lp.reshape(-1), en.reshape(-1)
    else:
        lp, en = fn(hs, ws, ts, 0.8)
        (lp * a + en * b).sum().backward()
    h64, w64 = hs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
    rl, re = logprob_entropy_reference(h64 @ w64.T, ts, 0.8)
    (rl * a.double() + re * b.double()).sum().backward()
    r = lambda x, y: ((x.double() - y).norm() / y.norm()).item()  # noqa: E731
    return {"logp": r(lp, rl), "entropy": r(en, re), "d_hidden": r(hs.grad, h64.grad), "d_weight": r(ws.grad, w64.grad)}


def accumulation_error(h, w, t, a, b):
    """triton_loss's d weight (bf16 addmm, one rounding per chunk) vs the same loop with a float32 accumulator."""
    C = LOSS["seq"] if h.shape[0] % LOSS["seq"] == 0 else 1
    B = h.shape[0] // C
    a2, b2 = a.view(B, C), b.view(B, C)
    fn = lambda rows, lp, en: (lp * a2[rows] + en * b2[rows]).sum()   # noqa: E731
    budget = max(1, LOSS["chunk_bytes"] // (w.shape[0] * h.element_size()))
    chunks, k = [], 0
    for r0, r1 in loss_module.plan_chunks([C] * B, budget):
        chunks.append((r0, r1, k, k + (r1 - r0) * C))
        k += (r1 - r0) * C
    with torch.no_grad():
        args = (h.detach(), w.detach(), t, (B, C), 1.0, fn, chunks, None, True, False, True)
        w_bf16 = loss_module.chunked_loss(*args, False)[4]
        w_f32 = loss_module.chunked_loss(*args, True)[4]            # float32 accumulator, rounded once at the end
    err = ((w_bf16.double() - w_f32.double()).norm() / w_f32.double().norm()).item()
    return err, len(chunks)


def profile_loss(h, w, t):
    """Where triton_loss's time goes: one chunk's parts (ms) x the number of chunks."""
    from kernels import logprob
    V, H = w.shape
    C = LOSS["seq"]
    m = min(h.shape[0], max(1, LOSS["chunk_bytes"] // (V * h.element_size() * C)) * C)   # tokens per chunk
    k = -(-h.shape[0] // m)
    hb, wb, tb = h[:m].detach(), w.detach(), t[:m]
    x = torch.empty(m, V, dtype=h.dtype, device=h.device)
    st = logprob.new_state(m, h.device)
    lse, ez, g1, g2 = (torch.randn(m, device=h.device) + 12 for _ in range(4))
    dh, gw = torch.empty(m, H, dtype=h.dtype, device=h.device), torch.zeros(V, H, dtype=h.dtype, device=h.device)
    torch.mm(hb, wb.T, out=x)
    ops = {"cuBLAS logits (m, V)": lambda: torch.mm(hb, wb.T, out=x),
           "stats kernel": lambda: logprob.chunk_stats(x, tb, st, 0, 1.0, True),
           "grad kernel (in place)": lambda: logprob.chunk_grad(x, x, tb, lse, ez, g1, g2, 0, 1.0, True),
           "d h = G @ W": lambda: torch.mm(x, wb, out=dh),
           "d W += G.T @ h (bf16 addmm)": lambda: gw.addmm_(x.T, hb),
           "d W = G.T @ h (first chunk)": lambda: torch.mm(x.T, hb, out=gw)}
    print(f"profile triton_loss: chunk {m} tokens x {V}, {k} chunks; per-chunk ms x {k}:")
    total = 0.0
    for name, f in ops.items():
        ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
        total += ms * k if "first" not in name else 0.0
        print(f"  {name:30s} {ms:7.3f} -> {ms * k:6.1f} ms", flush=True)
    print(f"  sum (all chunks addmm)          {total:6.1f} ms", flush=True)
    # would a side stream hide the elementwise passes behind the matmuls? one chunk's stats + grad passes
    # (on a second buffer) launched beside its logits matmul, against the three back to back
    x2, side, main = x.clone(), torch.cuda.Stream(), torch.cuda.current_stream()
    def beside():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            logprob.chunk_stats(x2, tb, st, 0, 1.0, True)
            logprob.chunk_grad(x2, x2, tb, lse, ez, g1, g2, 0, 1.0, True)
        torch.mm(hb, wb.T, out=x)
        main.wait_stream(side)
    def serial():
        logprob.chunk_stats(x2, tb, st, 0, 1.0, True)
        logprob.chunk_grad(x2, x2, tb, lse, ez, g1, g2, 0, 1.0, True)
        torch.mm(hb, wb.T, out=x)
    for name, f in (("logits + stats + grad, serial", serial), ("same, passes on a side stream", beside)):
        print(f"  {name:30s} {triton.testing.do_bench(f, warmup=25, rep=100, return_mode='median'):7.3f}", flush=True)
    del x, x2, gw


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="896x151936,4096x128256", help="HxV,HxV,...")
    ap.add_argument("--n", type=int, default=32768, help="tokens")
    ap.add_argument("--methods", default="eager,eager_logp,compile,liger,triton,triton_logp,triton_fused,triton_loss")
    ap.add_argument("--profile", action="store_true", help="time the parts of one tile first")
    ap.add_argument("--logits-n", type=int, default=8192, help="tokens for the from-logits kernel; 0 skips it")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (sequence) for triton_loss")
    ap.add_argument("--loss-budgets", default="", help="triton_loss chunk budgets (MiB) to time first, e.g. 256,384,480")
    ap.add_argument("--profile-loss", action="store_true", help="time triton_loss's parts per chunk first")
    ap.add_argument("--rep", type=int, default=1500, help="do_bench repetition time (ms) per measurement")
    ap.add_argument("--sweep", default="", help="fused-matmul tiles to time first: 'BM,BN,BK,stages,warps;...'")
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    print(f"card: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  N={args.n} bf16")
    methods = {"eager": eager, "eager_logp": eager_logp, "compile": torch.compile(eager, dynamic=False),
               "triton": fused, "triton_logp": fused_logp, "triton_fused": fused_matmul, "triton_loss": fused_loss}
    LOSS["seq"] = args.seq
    if "liger" in args.methods:
        methods["liger"] = liger_fn()
    rows = []
    for shape in args.shapes.split(","):
        H, V = map(int, shape.split("x"))
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))   # fresh inputs every run
        h = (torch.randn(args.n, H, device=dev) * 2).to(dtype).requires_grad_()
        w = (torch.randn(V, H, device=dev) / H**0.5).to(dtype).requires_grad_()
        t = torch.randint(0, V, (args.n,), device=dev)
        a, b = torch.randn(args.n, device=dev), torch.randn(args.n, device=dev)
        print(f"\nH={H} V={V}")
        for name, fn in (("triton", fused), ("triton_fused", fused_matmul), ("triton_loss", fused_loss), ("eager", eager)):
            if name not in args.methods.split(","):
                continue
            print(f"{name} error vs float64 (first 1024 tokens): "
                  + ", ".join(f"{k} {v:.1e}" for k, v in check_error(fn, h, w, t).items()), flush=True)
        if "triton_loss" in args.methods:
            err, n_chunks = accumulation_error(h, w, t, a, b)
            print(f"triton_loss d_weight: bf16 accumulation over {n_chunks} chunks vs float32 accumulator: {err:.1e}")
        if args.profile:
            profile(h, w, t)
        for mib in filter(None, args.loss_budgets.split(",")):
            LOSS["chunk_bytes"] = int(mib) * 2**20
            if args.profile_loss:
                profile_loss(h, w, t)
            b_ms, b_peak, b_extra = measure(fused_loss, h, w, t, a, b, backward=True, rep=args.rep)
            print(f"triton_loss budget {mib} MiB: fwd+bwd {b_ms:.1f} ms, extra {b_extra:.2f} GiB", flush=True)
        LOSS["chunk_bytes"] = loss_module.CHUNK_BYTES
        if args.profile_loss:
            profile_loss(h, w, t)
        for cfg in filter(None, args.sweep.split(";")):
            BM, BN, BK, stages, warps = map(int, cfg.split(","))
            old = dict(linear_logprob.GEMM)
            linear_logprob.GEMM.update(BM=BM, BN=BN, BK=BK, num_stages=stages, num_warps=warps)
            try:
                f_ms, _, _ = measure(fused, h, w, t, a, b, backward=False)
                b_ms, _, _ = measure(fused, h, w, t, a, b, backward=True)
                print(f"tiles {cfg}: fwd {f_ms:.1f} ms, fwd+bwd {b_ms:.1f} ms", flush=True)
            except Exception as e:  # a tile that does not fit shared memory fails to compile: report, go on
                print(f"tiles {cfg}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            linear_logprob.GEMM.clear()
            linear_logprob.GEMM.update(old)
        mm = matmul_ms(h.detach(), w.detach())
        rows.append((shape, "matmul x3 / x4", None, (3 * mm, 4 * mm), None))
        for name in args.methods.split(","):
            fn = methods.get(name)
            if fn is None:
                continue
            res = []
            for backward in (False, True):
                try:
                    res.append(measure(fn, h, w, t, a, b, backward, rep=args.rep))
                except torch.OutOfMemoryError:
                    res.append((float("nan"),) * 3)                # reported as nan: did not fit the card
                    h.grad = w.grad = None
            (f_ms, _, f_extra), (b_ms, b_peak, b_extra) = res
            rows.append((shape, name, (f_ms, f_extra), (b_ms, None), (b_peak, b_extra)))
            print(f"{name:13s} fwd {f_ms:7.1f} ms {f_extra:6.2f} GiB | fwd+bwd {b_ms:7.1f} ms "
                  f"peak {b_peak:6.2f} GiB extra {b_extra:6.2f} GiB", flush=True)
        del h, w
    if args.logits_n:  # the from-logits kernel (kernels/logprob.py), as models.py calls it today
        V = int(args.shapes.split(",")[0].split("x")[1])
        x = (torch.randn(args.logits_n, V, device=dev) * 2).to(dtype).requires_grad_()
        t = torch.randint(0, V, (args.logits_n,), device=dev)
        a, b = torch.randn(args.logits_n, device=dev), torch.randn(args.logits_n, device=dev)
        print(f"\nfrom logits ({args.logits_n}, {V}) bf16:")
        for name, fn in (("eager", logprob_entropy_reference), ("triton", logprob_entropy)):
            def step(backward, fn=fn):
                lp, en = fn(x, t, 1.0)
                if backward:
                    (lp * a + en * b).sum().backward()
            f_ms = triton.testing.do_bench(lambda: step(False), warmup=100, rep=500, return_mode="median")
            b_ms = triton.testing.do_bench(lambda: step(True), warmup=100, rep=500, grad_to_none=[x], return_mode="median")
            print(f"  {name:7s} fwd {f_ms:6.2f} ms  fwd+bwd {b_ms:6.2f} ms", flush=True)
        del x
    print(f"\n| shape HxV | method | fwd ms | fwd extra GiB | fwd+bwd ms | fwd+bwd peak GiB | fwd+bwd extra GiB |")
    print("|---|---|---|---|---|---|---|")
    for shape, name, f, bwd, mem in rows:
        if f is None:
            print(f"| {shape} | {name} | {bwd[0] / 3:.1f} (one) | | {bwd[0]:.1f} / {bwd[1]:.1f} | | |")
        else:
            print(f"| {shape} | {name} | {f[0]:.1f} | {f[1]:.2f} | {bwd[0]:.1f} | {mem[0]:.2f} | {mem[1]:.2f} |")


if __name__ == "__main__":
    main()
