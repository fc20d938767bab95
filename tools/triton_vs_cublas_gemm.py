"""Can a Triton GEMM match cuBLAS at W2's logits shape (docs/benchmarks.md) on a power-capped GPU? (docs/kernels.md)

    python3 tools/triton_vs_cublas_gemm.py          # CUDA only; writes $OUT/gemm.json (OUT defaults to /tmp)

logits (T, V) = h (T, H) @ W.T with W (V, H): T = 1536 and 3072 tokens (chunks of the fused log-prob kernel),
H = 4096, V = 128,256. Short runs pick the best of a few tile configs (with and without warp specialisation),
then sustained do_bench runs of 1.5 s alternate cuBLAS, that Triton config, and the same kernel with the
epilogue a fused log-prob design needs (per-row max and sum of exp over each column tile), so that all three
see the same clock under the card's power cap."""
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def mm(a_desc, b_desc, c_desc, pm_ptr, ps_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
       GROUP: tl.constexpr, STATS: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr):
    # c (M, N) = a (M, K) @ b (N, K).T, one (BM, BN) tile per program; programs walk GROUP row tiles per column
    # tile, so neighbouring programs share b's tiles in L2
    pid = tl.program_id(0)
    npm, npn = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP * npn
    g = pid // width
    first_m = g * GROUP
    gm = min(npm - first_m, GROUP)
    pm_ = first_m + (pid % width) % gm
    pn_ = (pid % width) // gm
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=WS):
        a = a_desc.load([pm_ * BM, k])
        b = b_desc.load([pn_ * BN, k])
        acc = tl.dot(a, b.T, acc)
    c_desc.store([pm_ * BM, pn_ * BN], acc.to(tl.bfloat16))
    if STATS:   # what a fused log-prob kernel adds: each row's max and sum of exp over this column tile
        cols = pn_ * BN + tl.arange(0, BN)
        z = tl.where((cols < N)[None, :], acc, -float("inf"))
        m = tl.max(z, 1)
        s = tl.sum(tl.exp(z - m[:, None]), 1)
        rows = pm_ * BM + tl.arange(0, BM)
        tl.store(pm_ptr + rows * npn + pn_, m, mask=rows < M)
        tl.store(ps_ptr + rows * npn + pn_, s, mask=rows < M)


def run(h, w, out, cfg, stats):
    BM, BN, BK, warps, stages, ws = cfg
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
    grid = (triton.cdiv(M, BM) * npn,)
    return lambda: mm[grid](a, b, c, pm, ps, M, N, K, BM=BM, BN=BN, BK=BK, GROUP=8, STATS=stats, STAGES=stages, WS=ws,
                            num_warps=warps)


res = {"device": torch.cuda.get_device_name()}
H, V = 4096, 128256
w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
# (BM, BN, BK, warps, stages, warp_specialize)
configs = [(128, 256, 64, 8, 3, False), (128, 256, 64, 8, 4, False), (256, 128, 64, 8, 3, False),
           (128, 128, 64, 4, 4, False), (128, 128, 64, 8, 4, False), (128, 256, 128, 8, 2, False),
           (128, 256, 64, 8, 3, True), (256, 128, 64, 8, 3, True)]
for T in (1536, 3072):
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(T, V, device="cuda", dtype=torch.bfloat16)
    ref = h @ w.T
    flop = 2 * T * H * V
    tf = lambda ms: flop / ms / 1e9
    cub = lambda: torch.mm(h, w.T, out=out)
    quick = {}
    for cfg in configs:     # short runs to pick the best config, checked against cuBLAS's result
        try:
            f = run(h, w, out, cfg, False)
            f()
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            quick[str(cfg)] = (tf(triton.testing.do_bench(f, warmup=50, rep=200)), err)
        except Exception as e:
            quick[str(cfg)] = (0.0, f"{type(e).__name__}: {str(e)[:100]}")
        print(T, cfg, quick[str(cfg)], flush=True)
    best = max(configs, key=lambda c: quick[str(c)][0] if isinstance(quick[str(c)][1], float) else 0)
    f_plain, f_stats = run(h, w, out, best, False), run(h, w, out, best, True)
    sustained = {"cublas": [], "triton": [], "triton+stats": []}
    for _ in range(3):      # ~1.5 s each, alternating
        for name, f in (("cublas", cub), ("triton", f_plain), ("triton+stats", f_stats)):
            sustained[name].append(round(tf(triton.testing.do_bench(f, warmup=100, rep=1500)), 1))
    print(T, "best", best, json.dumps(sustained), flush=True)
    res[f"T{T}"] = {"quick_tflops": quick, "best": best, "sustained_tflops": sustained}
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gemm.json"), "w"), indent=1)
