"""The decode GEMM candidates for engine_dtype=fp8 at W6's shapes (Qwen2.5-7B: q/k/v fused, o, gate/up fused, down,
the head), one GPU, one command (#38):

    python tools/fp8_gemm_bench.py --out $OUT/gemm                  # M = 64 and 128 rows, every tile config
    python tools/fp8_gemm_bench.py --out $OUT/gemm --rows 64,128 --quick-rows 128

Each candidate is timed as replays of a CUDA graph holding many calls (as the decode step runs: a standalone
launch's host cost would hide a 10 us kernel), over enough weight copies that the weights do not stay in L2:
bf16 cuBLAS (F.linear), torch._scaled_mm (FP8, rowwise scales), kernels/fp8_gemm.py's FP8 x FP8 kernel over a
grid of tiles and K splits (its partial sums' addition not included: in the step it fuses into the next kernel;
"+ sum" times it as a kernel of its own), and the activation quantisation alone (eager, several kernels: an upper
bound of what it adds when fused). Also the card's copy bandwidth (a 1 GiB device-to-device copy, bytes read plus
written), the ceiling for the GB/s column (weight bytes over time). Writes OUT/fp8_gemm.json and prints a table.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch
import torch.nn.functional as F

from kernels.fp8 import dequantised_mm, quantise_activations, quantise_rows
from kernels.fp8_gemm import launch, tiles
from tools.decode_kernel_bench import graph_us as graph_replay_us

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
          "head": (152064, 3584)}                                     # name: (N, K) at W6
CONFIGS = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 128, 4, 6), (128, 256, 4, 3),
           (128, 256, 8, 4), (256, 128, 8, 3)]                        # (BN, BK, warps, stages)
QUICK = [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4)]
WAVES = (0, 1, 2, 4)                                                  # K split for >= waves x SMS programs; 0: none


def graph_us(fn, est_us: float, calls: int = 1) -> float:
    """Median microseconds per call of fn (which makes `calls` GEMM calls), replayed from one CUDA graph that holds
    about 3 ms of them (decode_kernel_bench.graph_us)."""
    reps = max(1, min(200, int(3000 / max(est_us * calls, 1))))
    return graph_replay_us(fn, reps, 7) / calls


def copy_gbs() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a), 300)
    return 2 * a.numel() / us / 1e3


def shape_rows(name: str, N: int, K: int, M: int, quick: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    copies = max(1, math.ceil(256e6 / (N * K)))                       # >= 256 MB of FP8 weights per pass
    w16 = [w] + [w.clone() for _ in range(copies - 1)]
    q = [quantise_rows(v) for v in w16]                               # (w8, scale) per copy
    x8, sx = quantise_activations(x)                                  # (M, K), (M, 1)
    sxv = sx.view(-1)
    est = N * K / 3e6                                                 # us at 3 TB/s for the FP8 bytes
    row = {"N": N, "K": K, "M": M, "fp8_MB": N * K / 1e6}
    row["bf16"] = graph_us(lambda: [F.linear(x, v) for v in w16], 2 * est, copies)
    row["scaled_mm"] = graph_us(lambda: [torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=s[None],
                                                           out_dtype=torch.bfloat16) for w8, s in q], est, copies)
    row["quant"] = graph_us(lambda: quantise_activations(x), 5)
    ref = dequantised_mm(x8, sx, q[0][0], q[0][1])                    # (M, N) float32
    cands = {}
    for BN, BK, warps, stages in QUICK if quick else CONFIGS:
        for waves in WAVES:
            t = tiles(M, N, K, BN=BN, BK=BK, warps=warps, stages=stages, waves=waves)
            key = f"BN{t.BN} BK{t.BK} w{t.warps} s{t.stages} S{t.S}"
            if key in cands:
                continue
            try:
                err = ((launch(x8, sxv, q[0][0], q[0][1], t).sum(0) - ref).norm() / ref.norm()).item()
                cands[key] = (graph_us(lambda: [launch(x8, sxv, w8, s, t) for w8, s in q], est, copies), err, t)
            except Exception as e:                                    # e.g. out of shared memory at this tile
                print(f"  {name} M={M} {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    best = min(cands, key=lambda k: cands[k][0])
    us, err, t = cands[best]
    row.update(triton=us, triton_tiles=best, triton_rel_err=err,
               triton_sum=graph_us(lambda: [launch(x8, sxv, w8, s, t).sum(0).to(torch.bfloat16) for w8, s in q],
                                   est, copies),
               default_tiles=str(tiles(M, N, K)), default=cands.get(_key(tiles(M, N, K)), (None,))[0],
               all={k: round(v[0], 2) for k, v in sorted(cands.items(), key=lambda kv: kv[1][0])})
    return row


def _key(t) -> str:
    return f"BN{t.BN} BK{t.BK} w{t.warps} s{t.stages} S{t.S}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="64,128")
    p.add_argument("--quick-rows", default="", help="row counts that try three tile configs instead of all")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBs": copy_gbs(), "rows": []}
    print(f"{res['device']}: copy {res['copy_GBs']:.0f} GB/s", flush=True)
    for M in map(int, a.rows.split(",")):
        for name, (N, K) in SHAPES.items():
            r = shape_rows(name, N, K, M, str(M) in a.quick_rows.split(","))
            r["name"] = name
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(a.out, "fp8_gemm.json"), "w") as f:
                json.dump(res, f, indent=1)
    gbs = lambda r, k, b: f"{r[k]:.1f} ({b * r['fp8_MB'] / r[k]:.2f})" if r.get(k) else "-"
    print("\nus per call (TB/s of weight read), CUDA-graph replays;", res["device"])
    print("| GEMM | M | bf16 | scaled_mm | triton best | + sum | default tiles | quant | best tiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['name']} | {r['M']} | {gbs(r, 'bf16', 2)} | {gbs(r, 'scaled_mm', 1)} | {gbs(r, 'triton', 1)} | "
              f"{r['triton_sum']:.1f} | {gbs(r, 'default', 1)} | {r['quant']:.1f} "
              f"| {r['triton_tiles']} (err {r['triton_rel_err']:.1e}) |")


if __name__ == "__main__":
    main()
