"""Can a Triton GEMM match cuBLAS at W2's logits shapes (docs/benchmarks.md) on a power-capped GPU? (docs/kernels.md)

    python3 tools/triton_vs_cublas_gemm.py                        # CUDA only; writes $OUT/gemm.json (OUT: /tmp)
    python3 tools/triton_vs_cublas_gemm.py --shapes 896x151936:1280,1536 --out DIR
    (tools/w2_floor.py --gemm calls compare() at both W2 shapes and puts the result in its table)

logits (T, V) = h (T, H) @ W.T with W (V, H), T = the fused log-prob kernel's chunk sizes. Short runs pick the
best of a few tile configs (with and without warp specialisation, and a persistent variant that walks several
tiles per program so one tile's output store overlaps the next tile's loads: at H = 896 a tile has only 14
K-steps of 64, so the store is ~1/4 of its time), then sustained do_bench runs of 1.5 s alternate cuBLAS, that
Triton config, and the same kernel with the epilogue a fused log-prob design needs (per-row max and sum of exp
over each column tile), so that all three see the same clock under the card's power cap."""
import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def mm(a_desc, b_desc, c_desc, pm_ptr, ps_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
       GROUP: tl.constexpr, STATS: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr, PROGRAMS: tl.constexpr):
    # c (M, N) = a (M, K) @ b (N, K).T in (BM, BN) tiles; program p takes tiles p, p + PROGRAMS, ... (PROGRAMS = 0:
    # one tile per program); tiles walk GROUP row tiles per column tile, so neighbours share b's tiles in L2
    npm, npn = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP * npn
    if PROGRAMS > 0:
        step = PROGRAMS
    else:
        step = npm * npn
    for tile in range(tl.program_id(0), npm * npn, step):
        first_m = (tile // width) * GROUP
        gm = min(npm - first_m, GROUP)
        pm_ = first_m + (tile % width) % gm
        pn_ = (tile % width) // gm
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=WS):
            a = a_desc.load([pm_ * BM, k])
            b = b_desc.load([pn_ * BN, k])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([pm_ * BM, pn_ * BN], acc.to(c_desc.dtype))
        if STATS:   # what a fused log-prob kernel adds: each row's max and sum of exp over this column tile
            cols = pn_ * BN + tl.arange(0, BN)
            z = tl.where((cols < N)[None, :], acc, -float("inf"))
            m = tl.max(z, 1)
            s = tl.sum(tl.exp(z - m[:, None]), 1)
            rows = pm_ * BM + tl.arange(0, BM)
            tl.store(pm_ptr + rows * npn + pn_, m, mask=rows < M)
            tl.store(ps_ptr + rows * npn + pn_, s, mask=rows < M)


def run(h, w, out, cfg, stats):
    BM, BN, BK, warps, stages, ws, persistent = cfg
    M, K = h.shape
    N = w.shape[0]
    a = TensorDescriptor.from_tensor(h, [BM, BK])
    b = TensorDescriptor.from_tensor(w, [BN, BK])
    c = TensorDescriptor.from_tensor(out, [BM, BN])
    npn = triton.cdiv(N, BN)
    pm = ps = out
    if stats:
        pm = torch.empty(M, npn, device=h.device, dtype=torch.float32)
        ps = torch.empty_like(pm)
    tiles = triton.cdiv(M, BM) * npn
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 4
    programs = persistent * sms
    grid = (min(tiles, programs) if programs else tiles,)
    return lambda: mm[grid](a, b, c, pm, ps, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=8, STATS=stats, STAGES=stages,
                            WS=ws, PROGRAMS=programs, num_warps=warps)


# (BM, BN, BK, warps, stages, warp_specialize, persistent: programs per SM, 0 = one tile per program)
CONFIGS = [(128, 256, 64, 8, 3, False, 0), (128, 256, 64, 8, 4, False, 0), (256, 128, 64, 8, 3, False, 0),
           (128, 128, 64, 4, 4, False, 0), (128, 128, 64, 8, 4, False, 0), (128, 256, 128, 8, 2, False, 0),
           (128, 256, 64, 8, 3, True, 0), (256, 128, 64, 8, 3, True, 0),
           (128, 256, 64, 8, 3, False, 1), (128, 128, 64, 4, 4, False, 2), (128, 128, 128, 8, 3, False, 2)]


def compare(H, V, tokens, configs=CONFIGS, sustained_ms=1500, rounds=3):
    """{T: quick TFLOP/s per config, the best config, sustained TFLOP/s of cuBLAS / best Triton / Triton + stats}."""
    res = {}
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
    for T in tokens:
        h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(T, V, device="cuda", dtype=torch.bfloat16)
        ref = h @ w.T
        tf = lambda ms: 2 * T * H * V / ms / 1e9   # noqa: E731
        quick = {}
        for cfg in configs:     # short runs to pick the best config, checked against cuBLAS's result
            try:
                f = run(h, w, out, cfg, False)
                out.zero_()
                f()
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                speed = tf(triton.testing.do_bench(f, warmup=50, rep=200))
                quick[str(cfg)] = (speed if err < 1e-2 else 0.0, err)
            except Exception as e:  # a config that does not fit shared memory (or this triton) fails: go on
                quick[str(cfg)] = (0.0, f"{type(e).__name__}: {str(e)[:100]}")
            print(H, T, cfg, quick[str(cfg)], flush=True)
        best = max(configs, key=lambda c: quick[str(c)][0])
        f_plain, f_stats = run(h, w, out, best, False), run(h, w, out, best, True)
        cub = lambda: torch.mm(h, w.T, out=out)   # noqa: E731
        sustained = {"cublas": [], "triton": [], "triton+stats": []}
        for _ in range(rounds):      # alternating, so that all three see the same clock
            for name, f in (("cublas", cub), ("triton", f_plain), ("triton+stats", f_stats)):
                sustained[name].append(round(tf(triton.testing.do_bench(f, warmup=100, rep=sustained_ms)), 1))
        print(H, T, "best", best, json.dumps(sustained), flush=True)
        res[T] = {"quick_tflops": quick, "best": best, "sustained_tflops": sustained}
        del h, out, ref
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x128256:1536,3072", help="HxV:T,T;HxV:T,...")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="folder for gemm.json")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name()}
    for spec in args.shapes.split(";"):
        shape, tokens = spec.split(":")
        H, V = map(int, shape.split("x"))
        res[shape] = {f"T{T}": r for T, r in compare(H, V, [int(x) for x in tokens.split(",")]).items()}
    os.makedirs(args.out, exist_ok=True)
    json.dump(res, open(os.path.join(args.out, "gemm.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
