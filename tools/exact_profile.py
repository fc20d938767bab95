"""Where an exact W1 rollout's time goes, on a GPU (docs/exact.md: what bounds it).

    python3 tools/exact_profile.py --out DIR       # DIR/exact_profile.json and DIR/exact_profile.txt

0. exact_attention alone in a CUDA graph at W1's decode step and the trainer's micro-batch.
1. The W1 engine rollout (tools/bench_workload.py's model and prompts: 128 rows x 256 new tokens) under
   exact_logprobs, warmed up, then timed; the decode step's parts timed apart with CUDA events: the graph's replay
   (one step's forward and logits) and the eager work around it (`engines/exact_decode.py: ExactDecoder.sample`'s loop).
2. One more rollout under torch.profiler: its CUDA kernels by total time, with launches per decode step.
3. The decode GEMMs timed inside a CUDA graph (triton.testing.do_bench_cudagraph, so no host launch cost) for
   each candidate tile at M = 128 (a decode step) and the best few at M = 10240 (the trainer's exact micro-batch),
   against cuBLAS (`F.linear`) in a graph; shapes include the concatenated q/k/v and gate/up weights.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch
import torch.nn.functional as F

TILES = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 64, 64, 4, 4), (32, 32, 128, 4, 3), (32, 64, 64, 4, 4),
         (64, 16, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3),
         (32, 128, 64, 4, 3), (128, 32, 64, 4, 4)]
SHAPES = {"qkv (cat)": (1152, 896), "k, v": (128, 896), "q, o": (896, 896), "gate_up (cat)": (9728, 896),
          "gate, up": (4864, 896), "down": (896, 4864), "head": (151936, 896)}


def say(lines: list, s: str):
    print(s, flush=True)
    lines.append(s)


def rollout_part(a, res: dict, lines: list):
    from bench_workload import W, build_model, prompt_texts, sync
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from engines.exact_decode import sample
    from models import encode_prompts, load_model
    path = "/tmp/w1_model"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    build_model(path, dtype)
    model, tok = load_model(path, dev, dtype)
    prompts = encode_prompts(tok, prompt_texts(128)[:W["prompts"]])
    sampling = SamplingParams(1.0, 1.0, W["new"])
    gen = torch.Generator(device=dev).manual_seed(0)
    eng = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, exact=True)
    go = lambda: eng.generate(prompts, W["samples"], sampling, gen)
    t0 = time.perf_counter()
    go()
    sync()
    say(lines, f"exact rollout, first (capture): {time.perf_counter() - t0:.3f} s")
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        go()
        sync()
        times.append(time.perf_counter() - t0)
    res["rollout_s"] = times
    say(lines, f"exact rollout, 3 more: {', '.join(f'{t:.3f}' for t in times)} s")
    dec = eng.decoder
    st = next(iter(dec.states.values()))
    ev = lambda: torch.cuda.Event(enable_timing=True)
    if st["graph"] is not None:      # from position 64 and column 0: 256 steps stay inside the cache and the outputs
        st["pos"].fill_(64)
        st["step"].zero_()
        s, e = ev(), ev()
        s.record()
        for _ in range(256):
            st["graph"].replay()
        e.record()
        torch.cuda.synchronize()
        res["graph_replay_ms"] = s.elapsed_time(e) / 256
        say(lines, f"decode graph replay (forward, logits, sampling, one step): {res['graph_replay_ms']:.3f} ms")
    logits = st.get("logits")
    if logits is None:
        logits = torch.randn(len(prompts) * W["samples"], W["vocab_size"], device=dev, dtype=dtype)
    sync()
    t0 = time.perf_counter()
    for _ in range(256):
        tk, lp = sample(dec.ex, logits, 1.0, gen)
        bool((tk == -1).all())                         # the loop's per-step host sync
    sync()
    res["sample_eager_ms"] = (time.perf_counter() - t0) * 1000 / 256
    say(lines, f"eager sample() + host sync, one step (outside the graph now): {res['sample_eager_ms']:.3f} ms")
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        go()
        sync()
    ev_ = [e for e in p.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in ev_)
    say(lines, f"profiled rollout: GPU kernel time {total / 1e6:.3f} s; per decode step (/256), us and launches:")
    top = sorted(ev_, key=lambda e: -e.self_device_time_total)[:40]
    res["kernels"] = [(e.key[:100], e.self_device_time_total / 256, e.count / 256) for e in top]
    for k, us, c in res["kernels"]:
        say(lines, f"{us:9.1f} us {c:8.2f}x  {k}")
    cpu = sorted([e for e in p.key_averages() if e.device_type.name == "CPU"], key=lambda e: -e.self_cpu_time_total)
    say(lines, "host (CPU self time per step, us): " + "; ".join(f"{e.key[:40]} {e.self_cpu_time_total / 256:.0f}"
                                                              for e in cpu[:12]))


def gemm_part(res: dict, lines: list):
    import triton.testing
    import kernels.exact_gemm as eg
    torch.cuda.empty_cache()                          # the rollout part's model and caches are gone
    g = torch.Generator(device="cuda").manual_seed(0)
    graph_ms = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=10)

    def ours(x, w, tile):
        cls = eg.shape_class(*w.shape)
        old = eg.TILES[cls]
        eg.TILES[cls] = tile
        try:
            eg.exact_linear(x, w)                         # compile outside the capture
            return graph_ms(lambda: eg.exact_linear(x, w))
        finally:
            eg.TILES[cls] = old

    res["gemm"] = {}
    with torch.no_grad():
        for name, (N, K) in SHAPES.items():
            w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
            xs = {m: torch.randn(m, K, device="cuda", generator=g, dtype=torch.bfloat16) for m in (128, 10240)}
            cub = {m: graph_ms(lambda: F.linear(xs[m], w)) for m in xs}
            now = eg.TILES[eg.shape_class(N, K)]
            t128 = sorted((ours(xs[128], w, t), t) for t in TILES)
            best = [t for _, t in t128[:4]] + ([now] if now not in [t for _, t in t128[:4]] else [])
            t10k = {t: ours(xs[10240], w, t) for t in best}
            d128 = dict((t, ms) for ms, t in t128)
            res["gemm"][name] = {"cublas": cub, "m128": {str(t): ms for ms, t in t128},
                                 "m10240": {str(t): ms for t, ms in t10k.items()}, "current": str(now)}
            say(lines, f"{name} {N}x{K}: cuBLAS {cub[128] * 1e3:.1f} / {cub[10240] * 1e3:.1f} us; current {now} "
                       f"{d128[now] * 1e3:.1f} / {t10k[now] * 1e3:.1f} us; best at 128: " +
                "; ".join(f"{t} {d128[t] * 1e3:.1f} / {t10k[t] * 1e3:.1f}" for t in best[:4]))


def attention_part(res: dict, lines: list):
    """exact_attention at W1's decode step (128 tokens over a 384-slot cache) and the trainer's micro-batch (32
    sequences of 320 tokens), in a CUDA graph."""
    import triton.testing
    import kernels.exact_attention as ea
    g = torch.Generator(device="cuda").manual_seed(0)
    nh, nkv, D = 14, 2, 64
    res["attention"] = {}
    with torch.no_grad():
        for name, B, L, per in (("decode", 128, 384, 1), ("train", 32, 320, 320)):
            kc, vc = (torch.randn(B, nkv, L, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
            if per == 1:
                rows = torch.arange(B, device="cuda")
                pos = torch.randint(64, 320, (B,), device="cuda", generator=g)
            else:
                rows = torch.arange(B, device="cuda").repeat_interleave(per)
                pos = torch.arange(per, device="cuda").repeat(B)
            q = torch.randn(len(rows), nh, D, device="cuda", generator=g, dtype=torch.bfloat16)
            fn = lambda: ea.exact_attention(q, rows, pos, kc, vc, None, 0.125, 64)
            fn()
            us = triton.testing.do_bench_cudagraph(fn, rep=10) * 1e3
            res["attention"][name] = us
            say(lines, f"attention {name}: {us:.1f} us")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--skip", default="", help="comma-separated parts to skip: attention, rollout, gemm")
    p.add_argument("--small", action="store_true", help="bench_workload's toy shape (a CPU smoke run of the rollout)")
    a = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
    import bench_workload
    if a.small:
        bench_workload.W.update(bench_workload.SHAPES["small"])
    if not torch.cuda.is_available() and not a.small:
        sys.exit("tools/exact_profile.py profiles a GPU: no CUDA device here (--small: a CPU smoke run)")
    res, lines = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}, []
    say(lines, f"device: {res['device']}, torch {torch.__version__}")
    for name, fn in [("attention", attention_part), ("rollout", rollout_part), ("gemm", gemm_part)]:
        if name in a.skip.split(","):
            continue
        try:
            fn(a, res, lines) if name == "rollout" else fn(res, lines)
        except Exception as e:       # a part that fails leaves the others' figures
            say(lines, f"{name} failed: {type(e).__name__}: {e}")
        with open(os.path.join(a.out, "exact_profile.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "exact_profile.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
