"""Decode-step kernels of engines/fast_decode.py, old against new, one GPU, one command (issue 23):

    python tools/decode_kernel_bench.py --out bench_out/decode

- Attention (kernels/decode_attention.py) at W1's decode shape (batch 128, 14 query / 2 KV heads of 64, 320 slots)
  or qwen3's (--shape w1,qwen3: 16 query / 8 KV heads of 128, 28 layers): one CUDA graph of a call per layer
  over the layers' caches, so every read comes from memory as in the step, not L2; per layer-call time with
  64 / 192 / 318 slots filled (--fills), for the unsplit kernel (KV heads a program: --splits' fifth field) and
  flash-decoding splits. --share 8:64: GRPO's layout after the shared prefill (groups of 8 sequences holding one
  64-slot prompt, read through the kernel's share=), so the prompt's reads are the L2's as in the rollout.
- Experts (kernels/moe_experts.py, --moe) at W10's qwen3_moe decode shape (128 tokens x top-4 of 32, hidden 1024,
  expert MLP 768) against torch's grouped GEMM route, in one graph over 8 layers' weights; --copy: a 2 GiB
  device copy, the card's rate in the same command.
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
from torch import Tensor

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


def shared_prompt(caches: list[Tensor], ok: Tensor, n: int, prompt: int) -> tuple[Tensor, Tensor]:
    """The layout the shared prefill leaves (engines/fast_prefill.py): sequences in groups of n, each group's
    first `prompt` slots (K/V of every cache (B, kv heads, S, D) in caches, and the key mask ok (B, S)) copied from
    its first sequence, in place. Returns decode_attention's share=(src (B,), shared (1,))."""
    B = ok.shape[0]
    src = torch.arange(B, device=ok.device) // n * n
    for c in caches:
        c[:, :, :prompt] = c[src, :, :prompt]
    ok[:, :prompt] = ok[src, :prompt]
    return src, torch.tensor([prompt], device=ok.device)


def attention_inputs(shape: str, share: tuple | None, layers: int | None = None) -> tuple:
    """Random bf16 decode-attention inputs at SHAPES[shape] for `layers` layers (default: the shape's): qkv, the
    K and V caches (lists of a tensor per layer), cos, sin, pos, the key mask (a few holes, as left padding) and
    the share= keyword ({} without share: see attention_rows)."""
    B, nh, nkv, S, D, L = SHAPES[shape]
    L = layers or L
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = [torch.randn(B, (nh + 2 * nkv) * D, device=dev, dtype=dt, generator=g) for _ in range(L)]
    ks = [torch.randn(B, nkv, S, D, device=dev, dtype=dt, generator=g) for _ in range(L)]
    vs = [torch.randn(B, nkv, S, D, device=dev, dtype=dt, generator=g) for _ in range(L)]
    cos, sin = torch.randn(S, D, device=dev, dtype=dt), torch.randn(S, D, device=dev, dtype=dt)
    pos = torch.arange(B, device=dev) % S
    ok = torch.rand(B, S, device=dev, generator=g) > 0.1                # (B, S)
    extra = dict(share=shared_prompt(ks + vs, ok, *share)) if share else {}
    return qkv, ks, vs, cos, sin, pos, ok, extra


def profile_once(shape: str, share: tuple | None, filled: int) -> str:
    """One call of the default-settings kernel with `filled` slots, as the engine makes it (qwen3's shape with its
    q/k norm), between cudaProfilerStart and cudaProfilerStop after three warm-up calls, so that `ncu
    --profile-from-start off` (or nsys's capture range) takes exactly that launch, with cold caches by ncu's
    default cache control."""
    qkv, ks, vs, cos, sin, pos, ok, extra = attention_inputs(shape, share, layers=1)
    D = ks[0].shape[-1]
    if shape == "qwen3":
        extra["qk_norm"] = tuple(torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2)) + (1e-6,)
    last = torch.tensor([filled], device="cuda")
    call = lambda: decode_attention(qkv[0], cos, sin, pos, ks[0], vs[0], ok, last, 0.125, **extra)
    for _ in range(3):                                                  # compiled and warm
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return f"| attention {shape} | {filled} slots | one call for a profiler, default settings | | |"


def attention_rows(reps: int, variants: list[tuple], shape: str = "w1", found: dict | None = None,
                   share: tuple | None = None, fills: tuple = (64, 192, 318)) -> list[str]:
    """variants: (splits, block), (splits, block, warps, stages) or (splits, block, warps, stages, heads: KV heads
    per program[, rows: sequences per program]). found: filled with {variant name: [us at each fill]} for --json.
    share (n, prompt): sequences in groups of n hold one prompt's K/V in their first `prompt` slots, and every call
    passes share=(src, shared), as the engine does after the shared prefill. fills: the cache slots filled before
    the call."""
    qkv, ks, vs, cos, sin, pos, ok, extra = attention_inputs(shape, share)
    B, nh, nkv, S, D, L = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    rows = []
    for filled in fills:
        last = torch.tensor([filled], device=dev)
        want = decode_attention(qkv[0], cos, sin, pos, ks[0], vs[0], ok, last, 0.125, block=128, warps=4, stages=2,
                                heads=1)
        gb = B * nkv * (filled + 1) * D * 2 * ks[0].element_size() / 1e9   # K and V read (and the new slot written)
        for var in variants:
            splits, block, warps, stages, heads, seqs = (*var, None, None, None, None)[:6]
            kw = dict(splits=splits, block=block, warps=warps, stages=stages, heads=heads, rows=seqs, **extra)
            name = ("1 program per (seq, head)" if splits == 1 else f"split {splits}") + f", block {block}" + (
                f", {warps} warps, {stages} stages" if warps else "") + (
                f", {heads} KV heads a program" if heads else "") + (
                f", {seqs} sequences a program" if seqs else "") + (", shared prompt" if share else "")
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
                found.setdefault(name, {"splits": splits, "block": block, "warps": warps, "stages": stages,
                                        "heads": heads, "rows": seqs, "us": []})
                found[name]["us"].append(us)
            rows.append(f"| attention {shape} | {filled} slots | {name} | {us:.2f} | {gb / us * 1e6 / 1e3:.2f} TB/s"
                        f"{' (as if unshared)' if share else ''}; "
                        f"max diff vs 128x4x2 {err:.1e} |")
    if shape == "qwen3":                                               # the q/k norm fused into the prologue
        qw, kw_ = torch.rand(D, device=dev, dtype=dt) + 0.5, torch.rand(D, device=dev, dtype=dt) + 0.5
        def normed():
            for i in range(L):
                decode_attention(qkv[i], cos, sin, pos, ks[i], vs[i], ok, last, 0.125, qk_norm=(qw, kw_, 1e-6),
                                 **extra)
        rows.append(f"| attention {shape} | {filled} slots | default settings, with qk_norm | "
                    f"{graph_us(normed, 1, reps) / L:.2f} | |")
    return rows


# W10's qwen3_moe at decode: tokens, hidden, expert MLP width, experts, experts per token
MOE_SHAPE = (128, 1024, 768, 32, 4)


def moe_weights(layers: int, g: torch.Generator) -> tuple[list[Tensor], list[Tensor], Tensor, float]:
    """Random bf16 expert weights at MOE_SHAPE for `layers` layers on the GPU: gate/up (E, 2I, H) and down
    (E, H, I) per layer, a decode batch x (N, H), and one layer's expert bytes in GB."""
    N, H, I, E, _ = MOE_SHAPE
    dev, dt = "cuda", torch.bfloat16
    gus = [torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5 for _ in range(layers)]
    dns = [torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5 for _ in range(layers)]
    x = torch.randn(N, H, device=dev, dtype=dt, generator=g)
    return gus, dns, x, (gus[0].numel() + dns[0].numel()) * 2 / 1e9


def moe_rows(reps: int, variants: list[tuple], layers: int = 8, found: dict | None = None) -> list[str]:
    """W10's qwen3_moe experts at decode (128 tokens, top-4 of 32, hidden 1024, expert MLP 768): torch's grouped
    GEMM route (gather, grouped GEMM, SiLU x up, grouped GEMM) against kernels/moe_experts.py's two kernels at each
    variant (gate_up's (BM, BN, BK, warps, stages) + down's), in one CUDA graph over `layers` layers' weights."""
    from kernels.decode_route import by_expert
    from kernels.moe_experts import expert_down, expert_gate_up
    N, H, I, E, k = MOE_SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    gus, dns, x, gb = moe_weights(layers, g)
    flat = torch.rand(N, E, device="cuda", generator=g).topk(k, -1).indices.reshape(-1)
    order, _, offs = by_expert(flat, E)
    token = order // k
    def grouped(i):
        h = torch._grouped_mm(x[token], gus[i].transpose(1, 2), offs=offs)
        a, u = h.chunk(2, -1)
        return torch._grouped_mm((torch.nn.functional.silu(a) * u).contiguous(), dns[i].transpose(1, 2), offs=offs)
    want = grouped(0).float()
    us = graph_us(lambda: [grouped(i) for i in range(layers)], 1, reps) / layers
    if found is not None:
        found.update(grouped_us=us, variants=[])
    rows = [f"| moe experts | {E} x ({2 * I}x{H} + {H}x{I}), {N * k} pairs | torch._grouped_mm + SiLU | {us:.2f} | "
            f"{gb / us * 1e3:.2f} TB/s; counts {torch.bincount(flat, minlength=E).min().item()}-"
            f"{torch.bincount(flat, minlength=E).max().item()} |"]
    for cu, cd in variants:
        try:
            got = expert_down(expert_gate_up(x, token, offs, gus[0], cu), offs, dns[0], cd).float()
            err = ((got - want).norm() / want.norm()).item()
            us = graph_us(lambda: [expert_down(expert_gate_up(x, token, offs, gus[i], cu), offs, dns[i], cd)
                                   for i in range(layers)], 1, reps) / layers
            ug = graph_us(lambda: [expert_gate_up(x, token, offs, gus[i], cu) for i in range(layers)], 1, reps) / layers
        except Exception as e:
            rows.append(f"| moe experts | | triton {cu} + {cd} | failed | {type(e).__name__} |")
            continue
        if found is not None:
            found["variants"].append({"gate_up": cu, "down": cd, "us": us, "gate_up_us": ug, "rel_err": err})
        rows.append(f"| moe experts | | triton gate_up {cu} + down {cd} | {us:.2f} | {gb / us * 1e3:.2f} TB/s "
                    f"(gate_up alone {ug:.2f} us); rel. err vs grouped {err:.1e} |")
    return rows + block_rows(reps, x, gus, dns, layers, found)


def block_rows(reps: int, x, gus, dns, layers: int, found: dict | None) -> list[str]:
    """The whole routed-experts block of a decode step (router GEMM, routing, the experts' kernels, the weighted
    sum), compiled as the step compiles it, with torch's routing (softmax, topk, the counting pass) against
    kernels/decode_route.py's kernel (after the router's own GEMM, or with the GEMM inside), in one CUDA graph
    over `layers` layers: the rows differ by their routing alone."""
    import engines.moe as moe
    N, H = x.shape
    E = gus[0].shape[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    routers = [torch.randn(E, H, device="cuda", generator=g).mul(H ** -0.5).to(x.dtype) for _ in range(layers)]
    rows, want = [], None
    before = moe.ROUTER
    for name, decode, router in (("torch routing", False, "gemm"), ("router GEMM, then decode_route", True, "gemm"),
                                 ("decode_route with the GEMM inside", True, "kernel")):
        moe.ROUTER = router                                            # read when the block is traced
        block = torch.compile(lambda r, gu, dn, d=decode: moe.routed_experts(x, r, 4, True, gu, dn,
                                                                             torch.nn.functional.silu, "triton",
                                                                             decode=d), fullgraph=True, dynamic=False)
        step = lambda i: block(routers[i], gus[i], dns[i])            # tensors as arguments: one compile
        got = step(0).float()
        want = got if want is None else want
        us = graph_us(lambda: [step(i) for i in range(layers)], 1, reps) / layers
        rows.append(f"| moe block | router + routing + experts + sum | {name}, compiled | {us:.2f} | rel. diff "
                    f"{((got - want).norm() / want.norm()).item():.1e} |")
        if found is not None:
            found[f"block: {name}"] = us
    moe.ROUTER = before
    return rows


def copy_row(reps: int) -> str:
    """The card's copy rate: a 2 GiB device-to-device copy, bytes read plus written."""
    a = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), 1, reps)
    return f"| copy | 2 GiB -> 2 GiB | torch copy_ (read + write) | {us:.1f} | {2 * 2 ** 31 / us / 1e6:.2f} TB/s |"


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
                    help="attention splits:block[:warps:stages[:heads[:rows]]], comma-separated; or per shape, "
                    "'w1=...;qwen3=...'")
    ap.add_argument("--shape", default="w1", help="the attention's decode shapes (SHAPES: w1, qwen3), comma-separated")
    ap.add_argument("--attention-only", action="store_true", help="skip the sampler rows")
    ap.add_argument("--share", default="", help="N:P: sequences in groups of N share a P-slot prompt, read through "
                    "share= (GRPO's samples after the shared prefill; W10: 8:64)")
    ap.add_argument("--fills", default="64,192,318", help="the attention's filled cache slots, comma-separated")
    ap.add_argument("--moe", default="", help="also time qwen3_moe's experts: kernels/moe_experts.py's settings "
                    "BM:BN:BK:warps:stages[:CN][/the same for down], comma-separated ('default': SETTINGS)")
    ap.add_argument("--copy", action="store_true", help="also time a 2 GiB device copy (the card's rate)")
    ap.add_argument("--json", default="", help="also write each attention variant's times and the fastest unsplit "
                    "one (mean over the fills) here")
    ap.add_argument("--once", type=int, default=None, metavar="FILL",
                    help="instead of timing: each --shape's kernel called once at FILL slots (with --share) between "
                    "cudaProfilerStart and Stop, for `ncu --profile-from-start off` (docs/kernels.md)")
    args = ap.parse_args()
    try:   # the options' numbers, checked before any GPU work
        fills = tuple(int(x) for x in args.fills.split(","))
        share = tuple(int(x) for x in args.share.split(":")) if args.share else None
        if any(f < 0 for f in fills) or (share and (len(share) != 2 or min(share) < 1)) or (args.once or 0) < 0:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--fills takes slot counts >= 0 (64,192,318), --share N:P with N, P >= 1 (8:64), --once a "
                         f"slot count >= 0; got --fills {args.fills!r} --share {args.share!r} --once {args.once}")
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernel_bench needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    parse = lambda text: [tuple(int(x) for x in v.split(":")) for v in text.split(",")]
    shapes = args.shape.split(",")
    per_shape = dict(item.split("=") for item in args.splits.split(";")) if "=" in args.splits else {}
    if any(sh not in SHAPES for sh in shapes):
        raise SystemExit(f"--shape takes {', '.join(SHAPES)}; got {args.shape!r}")
    part = lambda f, **kw: lambda *a: f(*a, **kw)
    samplers = [("gumbel (today: split 64, block 4096, 4 warps)", gumbel_sample)]
    samplers += [(f"cdf: block {blk}, {wp} warps, split {sp}", part(cdf_sample, split=sp, block=blk, warps=wp))
                 for sp, blk, wp in ((64, 4096, 8), (64, 4096, 4), (64, 2048, 4), (128, 2048, 8), (32, 8192, 8))]
    if args.once is not None:
        print("\n".join(profile_once(sh, share, args.once) for sh in shapes))
        return
    found = {}
    rows = [copy_row(args.reps)] if args.copy else []
    for sh in shapes:
        rows += attention_rows(args.reps, parse(per_shape.get(sh, args.splits)), sh, found.setdefault(sh, {}),
                               share, fills)
        print("\n".join(rows), flush=True)
    if args.moe:
        from kernels.moe_experts import SETTINGS as MOE
        ints = lambda text: tuple(int(x) for x in text.split(":"))
        def pair(v):   # gate_up's and down's settings: "a/b", ten fields (five each), or one for both
            if v == "default":
                return MOE["gate_up"], MOE["down"]
            if "/" in v:
                return tuple(ints(t) for t in v.split("/"))
            t = ints(v)
            return (t[:5], t[5:]) if len(t) == 10 else (t, t)
        rows += moe_rows(args.reps, [pair(v) for v in args.moe.split(",")], found=found.setdefault("moe", {}))
    if not args.attention_only:
        rows += sampler_rows(args.reps, args.calls, samplers)
    if args.json:
        mean = lambda v: sum(v["us"]) / len(v["us"])
        whole = lambda v: v["splits"] == 1 and v["warps"] and len(v["us"]) == len(fills)   # timed at every fill
        best = {sh: min(filter(whole, found[sh].values()), key=mean, default=None) for sh in shapes}
        with open(args.json, "w") as f:
            json.dump({"shapes": {sh: SHAPES[sh] for sh in shapes}, "variants": found, "best_unsplit": best}, f,
                      indent=1)
    text = (f"Decode kernels on {torch.cuda.get_device_name()} (torch {torch.__version__}); "
            f"`python tools/decode_kernel_bench.py {' '.join(sys.argv[1:])}`\n\n"
            "| kernel | shape | variant | us per call (attention: per layer) | check |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    with open(os.path.join(args.out, "decode_kernels.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
