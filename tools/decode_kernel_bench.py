"""Decode-step kernels of engines/fast_decode.py, old against new, one GPU, one command (issue 23):

    python tools/decode_kernel_bench.py --out bench_out/decode

- Attention (kernels/decode_attention.py) at W1's decode shape (batch 128, 14 query / 2 KV heads of 64, 320 slots):
  one CUDA graph of 24 calls over 24 layers' caches, so every read comes from memory as in the step, not L2;
  per layer-call time with 64 / 192 / 318 slots filled, for the unsplit kernel and flash-decoding splits.
- Sampler (kernels/sample.py) at 128 x 151,936 bf16 logits: the Gumbel kernel, the inverse-CDF one at a few
  settings; the cuBLAS lm_head (128 x 896 by 896 x 151,936) alone as the floor, and head + sampler in one graph.
Time: median over --reps replays of a graph holding --calls calls, divided by the calls. Writes a markdown table
to OUT/decode_kernels.md and prints it; also checks each variant against the old kernel (attention: max |diff|;
sampler: logp equals log_softmax at the drawn token).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.sample import cdf_sample, gumbel_sample  # noqa: E402


def graph_us(fn, calls: int, reps: int) -> float:
    """Median microseconds per call of `fn` (a closure over static tensors), `calls` calls in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return sorted(times)[len(times) // 2]


# decode shapes (batch, query heads, KV heads, cache slots, head_dim, layers): W1's (Qwen2.5-0.5B) and W10's qwen3
SHAPES = {"w1": (128, 14, 2, 320, 64, 24), "qwen3": (128, 16, 8, 320, 128, 28)}


def attention_rows(reps: int, variants: list[tuple], shape: str = "w1", found: dict | None = None) -> list[str]:
    """variants: (splits, block) or (splits, block, warps, stages). found: filled with {variant name: [us at each
    fill]} for --json."""
    B, nh, nkv, S, D, L = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = [torch.randn(B, (nh + 2 * nkv) * D, device=dev, dtype=dt, generator=g) for _ in range(L)]
    ks = [torch.randn(B, nkv, S, D, device=dev, dtype=dt, generator=g) for _ in range(L)]
    vs = [torch.randn(B, nkv, S, D, device=dev, dtype=dt, generator=g) for _ in range(L)]
    cos, sin = torch.randn(S, D, device=dev, dtype=dt), torch.randn(S, D, device=dev, dtype=dt)
    pos = torch.arange(B, device=dev) % S
    ok = torch.rand(B, S, device=dev, generator=g) > 0.1                # (B, S) a few holes, as left padding
    rows = []
    for filled in (64, 192, 318):
        last = torch.tensor([filled], device=dev)
        want = decode_attention(qkv[0], cos, sin, pos, ks[0], vs[0], ok, last, 0.125, block=128, warps=4, stages=2)
        for var in variants:
            splits, block, warps, stages = (*var, None, None)[:4]
            kw = dict(splits=splits, block=block, warps=warps, stages=stages)
            name = ("1 program per (seq, head)" if splits == 1 else f"split {splits}") + f", block {block}" + (
                f", {warps} warps, {stages} stages" if warps else "")
            def run(kw=kw):
                for i in range(L):
                    decode_attention(qkv[i], cos, sin, pos, ks[i], vs[i], ok, last, 0.125, **kw)
            try:   # a setting past the card's shared memory fails at launch: a row, not the end of the sweep
                got = decode_attention(qkv[0], cos, sin, pos, ks[0], vs[0], ok, last, 0.125, **kw)
                err = (got.float() - want.float()).abs().max().item()
                us = graph_us(run, 1, reps) / L
            except Exception as e:
                rows.append(f"| attention {shape} | {filled} slots | {name} | failed | {type(e).__name__} |")
                continue
            if found is not None:
                found.setdefault(name, {"splits": splits, "block": block, "warps": warps, "stages": stages, "us": []})
                found[name]["us"].append(us)
            rows.append(f"| attention {shape} | {filled} slots | {name} | {us:.2f} | max diff vs 128x4x2 {err:.1e} |")
    if shape == "qwen3":                                               # the q/k norm fused into the prologue
        qw, kw_ = torch.rand(D, device=dev, dtype=dt) + 0.5, torch.rand(D, device=dev, dtype=dt) + 0.5
        def normed():
            for i in range(L):
                decode_attention(qkv[i], cos, sin, pos, ks[i], vs[i], ok, last, 0.125, qk_norm=(qw, kw_, 1e-6))
        rows.append(f"| attention {shape} | {filled} slots | default settings, with qk_norm | "
                    f"{graph_us(normed, 1, reps) / L:.2f} | |")
    return rows


def sampler_rows(reps: int, calls: int, variants: list[tuple]) -> list[str]:
    B, H, V = 128, 896, 151936
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(B, H, device=dev, dtype=dt, generator=g)
    w = torch.randn(V, H, device=dev, dtype=dt, generator=g) * H ** -0.5 * 4    # logits of a few units' spread
    logits = h @ w.T                                                   # (B, V)
    inv_t, seed, step = (torch.tensor([1.0], device=dev), torch.tensor([7], device=dev),
                         torch.tensor([3], device=dev))
    ref = torch.log_softmax(logits.float(), -1)
    head = torch.empty_like(logits)
    rows = [f"| lm_head | {B} x {H} x {V} | cuBLAS matmul (floor) | "
            f"{graph_us(lambda: torch.matmul(h, w.T, out=head), calls, reps):.1f} | |"]
    for name, fn in variants:
        tok, logp = fn(logits, inv_t, seed, step)
        err = (logp - ref.gather(1, tok[:, None]).squeeze(1)).abs().max().item()
        us = graph_us(lambda fn=fn: fn(logits, inv_t, seed, step), calls, reps)
        both = graph_us(lambda fn=fn: fn(torch.matmul(h, w.T, out=head), inv_t, seed, step), calls, reps)
        rows.append(f"| sampler | {B} x {V} bf16 | {name} | {us:.1f} | logp err {err:.1e}; head + it: {both:.1f} us |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for decode_kernels.md")
    ap.add_argument("--reps", type=int, default=50, help="graph replays per measurement (median)")
    ap.add_argument("--calls", type=int, default=10, help="sampler calls per graph")
    ap.add_argument("--splits", default="1:128,4:32,4:64,8:32,8:64,16:16,16:32",
                    help="attention splits:block[:warps:stages], comma-separated")
    ap.add_argument("--shape", default="w1", choices=list(SHAPES), help="the attention's decode shape (SHAPES)")
    ap.add_argument("--attention-only", action="store_true", help="skip the sampler rows")
    ap.add_argument("--json", default="", help="also write each attention variant's times and the fastest unsplit "
                    "one (mean over the fills) here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernel_bench needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    variants = [tuple(int(x) for x in v.split(":")) for v in args.splits.split(",")]
    part = lambda f, **kw: lambda *a: f(*a, **kw)
    samplers = [("gumbel (today: split 64, block 4096, 4 warps)", gumbel_sample)]
    samplers += [(f"cdf: block {blk}, {wp} warps, split {sp}", part(cdf_sample, split=sp, block=blk, warps=wp))
                 for sp, blk, wp in ((64, 4096, 8), (64, 4096, 4), (64, 2048, 4), (128, 2048, 8), (32, 8192, 8))]
    found = {}
    rows = attention_rows(args.reps, variants, args.shape, found)
    if not args.attention_only:
        rows += sampler_rows(args.reps, args.calls, samplers)
    if args.json:
        mean = lambda v: sum(v["us"]) / len(v["us"])
        best = min((v for v in found.values() if v["splits"] == 1 and v["warps"] and len(v["us"]) == 3), key=mean,
                   default=None)
        with open(args.json, "w") as f:
            json.dump({"shape": SHAPES[args.shape], "variants": found, "best_unsplit": best}, f, indent=1)
    text = (f"Decode kernels on {torch.cuda.get_device_name()} (torch {torch.__version__}); "
            f"`python tools/decode_kernel_bench.py {' '.join(sys.argv[1:])}`\n\n"
            "| kernel | shape | variant | us per call (attention: per layer) | check |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    with open(os.path.join(args.out, "decode_kernels.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
