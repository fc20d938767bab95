"""The decode GEMM candidates for engine_dtype=fp8 at W6's shapes (Qwen2.5-7B: q/k/v fused, o, gate/up fused, down,
the head), one GPU, one command (#38):

    python tools/fp8_gemm_bench.py --out $OUT/gemm                  # M = 64 and 128 rows, every tile config
    python tools/fp8_gemm_bench.py --out $OUT/gemm --rows 64,128 --quick-rows 128
    python tools/fp8_gemm_bench.py --out $OUT/gemm --rows 64 --shapes gate_up,down --configs 64,256,4,3 --waves 2,3
    python tools/fp8_gemm_bench.py --out $OUT/gemm --rows 0 --refresh      # the per-rollout refresh alone

Each candidate is timed as replays of a CUDA graph holding many calls (as the decode step runs: a standalone
launch's host cost would hide a 10 us kernel), over enough weight copies that the weights do not stay in L2: bf16
cuBLAS (F.linear), torch._scaled_mm (FP8, rowwise scales), kernels/fp8_gemm.py's FP8 x FP8 kernel over a grid of
tiles and K splits (one graph per tile config, the graphs replayed in turn, 7 rounds; its partial sums' addition not
included: in the step it fuses into the next kernel; "+ sum" times it as a kernel of its own), and the activation
quantisation alone (eager, several kernels: an upper bound of what it adds when fused). Also the card's copy
bandwidth (a 1 GiB device-to-device copy, bytes read plus written), the ceiling for the GB/s column (weight bytes
over time). --refresh: what each rollout's refresh of the FP8 copies costs at W6 (engines/decode_weights.refresh on
a 2-layer model of W6's widths with LoRA r=16 on every projection, tools/lora_decode_bench.py's build; the layers'
time x 14 plus the head's: a 28-layer rollout's), eager as in a rollout, for each decode_weights.FP8_REFRESH,
against its floor (bf16 W read twice and the e4m3 copy written, at the copy bandwidth). Writes OUT/fp8_gemm.json and
prints a table.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # tools/: bench, lora_decode_bench
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


def refresh_rows(gbs: float, shape: str = "w6", device: str = "cuda") -> dict:
    """Seconds per W6 rollout of decode_weights.refresh on the fp8 route, per FP8_REFRESH (median of 5 after one;
    shape "small" on the CPU: a smoke run of this code, the torch route both times)."""
    import time
    from bench import SHAPES as WORKLOADS
    from engines import decode_weights
    from lora_decode_bench import build
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    model = build({**WORKLOADS[shape], "num_hidden_layers": 2}, 16, torch.device(device), torch.bfloat16)
    inner = model.get_base_model()
    layers, head = inner.model.layers, inner.lm_head
    elements = sum(p.numel() for n, p in inner.named_parameters() if "layers.0." in n and "lora" not in n
                   and p.dim() == 2 and "o_proj" not in n)
    res = {"fp8_elements_per_layer": elements, "head_elements": head.weight.numel()}
    for how in ("torch", "triton"):
        decode_weights.FP8_REFRESH = how
        for part, args in (("layers", (layers, None)), ("head", ([], head))):
            prev, times = [], []
            for _ in range(6):
                sync()
                t0 = time.perf_counter()
                prev = decode_weights.refresh(args[0], prev, None, "fp8", args[1])
                sync()
                times.append(time.perf_counter() - t0)
            res[f"{how}_{part}_s"] = sorted(times[1:])[2]
        res[f"{how}_rollout_s"] = res[f"{how}_layers_s"] * 14 + res[f"{how}_head_s"]
        print(f"refresh {how}: {json.dumps({k: v for k, v in res.items() if k.startswith(how)})}", flush=True)
    total = 28 * elements + head.weight.numel()
    res["floor_rollout_s"] = 5 * total / (gbs * 1e9)                  # 2 bytes read twice, 1 written
    del model, layers, head, inner, prev
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def shape_rows(name: str, N: int, K: int, M: int, quick: bool, configs=None, waves=WAVES) -> dict:
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
    cands, fns = {}, {}
    for BN, BK, warps, stages in configs or (QUICK if quick else CONFIGS):
        for wv in waves:
            t = tiles(M, N, K, BN=BN, BK=BK, warps=warps, stages=stages, waves=wv)
            key = _key(t)
            if key in cands:
                continue
            try:
                err = ((launch(x8, sxv, q[0][0], q[0][1], t).sum(0) - ref).norm() / ref.norm()).item()
                cands[key] = (err, t)
                fns[key] = lambda t=t: [launch(x8, sxv, w8, s, t) for w8, s in q]
            except Exception as e:                                    # e.g. out of shared memory at this tile
                print(f"  {name} M={M} {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    us = alternate_us(fns, est, copies)                               # key -> us per call
    best = min(us, key=us.get)
    err, t = cands[best]
    row.update(triton=us[best], triton_tiles=best, triton_rel_err=err,
               triton_sum=graph_us(lambda: [launch(x8, sxv, w8, s, t).sum(0).to(torch.bfloat16) for w8, s in q],
                                   est, copies),
               default_tiles=str(tiles(M, N, K)), default=us.get(_key(tiles(M, N, K))),
               all={k: round(v, 2) for k, v in sorted(us.items(), key=lambda kv: kv[1])})
    return row


def alternate_us(fns: dict, est_us: float, calls: int, rounds: int = 7) -> dict:
    """Median microseconds per call of each fn (which makes `calls` GEMM calls), each captured once in a CUDA graph
    of about 3 ms of them, the graphs replayed in turn, `rounds` times: a drift of the card's clocks (or another
    process on it) reaches every candidate alike."""
    reps = max(1, min(200, int(3000 / max(est_us * calls, 1))))
    graphs = {}
    for key, fn in fns.items():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        graphs[key] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[key]):
            for _ in range(reps):
                fn()
    times = {key: [] for key in graphs}
    for _ in range(rounds):
        for key, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times[key].append(a.elapsed_time(b) * 1000 / (reps * calls))
    return {key: sorted(v)[len(v) // 2] for key, v in times.items()}


def _key(t) -> str:
    return f"BN{t.BN} BK{t.BK} w{t.warps} s{t.stages} S{t.S}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="64,128")
    p.add_argument("--quick-rows", default="", help="row counts that try three tile configs instead of all")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {','.join(SHAPES)}")
    p.add_argument("--configs", default="", help="tile configs BN,BK,warps,stages separated by ';' (default: the "
                   "built-in grid)")
    p.add_argument("--waves", default=",".join(map(str, WAVES)), help="K splits to try, as waves of programs")
    p.add_argument("--refresh", action="store_true", help="also time the fp8 route's refresh at W6 (first)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    names = a.shapes.split(",")
    if set(names) - set(SHAPES):
        p.error(f"--shapes: some of {','.join(SHAPES)}, got {a.shapes}")
    try:
        configs = [tuple(map(int, c.split(","))) for c in a.configs.split(";") if c]
        waves = tuple(float(w) for w in a.waves.split(","))
        assert all(len(c) == 4 for c in configs)
    except (ValueError, AssertionError):
        p.error(f"--configs: BN,BK,warps,stages;... and --waves: numbers, got {a.configs!r}, {a.waves!r}")
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBs": copy_gbs(), "rows": []}
    print(f"{res['device']}: copy {res['copy_GBs']:.0f} GB/s", flush=True)
    if a.refresh:
        res["refresh"] = refresh_rows(res["copy_GBs"])
        print(f"refresh: {json.dumps(res['refresh'])}", flush=True)
        with open(os.path.join(a.out, "fp8_gemm.json"), "w") as f:
            json.dump(res, f, indent=1)
    for M in [int(m) for m in a.rows.split(",") if int(m) > 0]:
        for name in names:
            N, K = SHAPES[name]
            r = shape_rows(name, N, K, M, str(M) in a.quick_rows.split(","), configs, waves)
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
