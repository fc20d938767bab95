"""W1's update phase alone, per setting: wall time, peak memory and its kernels grouped by kind, in one process.

    python tools/update_bench.py --out DIR                       # the default variants on one GPU
    python tools/update_bench.py --variants ckpt,ckpt:keep0.7,ckpt:fused --updates 5 --out DIR
    python tools/update_bench.py --small --out /tmp/u            # CPU smoke run at toy shapes

tools/bench.py times whole train.py steps, so each of its variants compiles the decode step and samples too; this
builds W1's update alone: the bench's random Qwen2.5-0.5B-shape
model (tools/bench_workload.py), one on-policy GRPO batch of 128 rows x (64 prompt + 256 completion) tokens (every
W1 completion runs to full length), the layers compiled and the optimizer built as train.py builds them
(run_setup.build_models, fused AdamW), then update.update() as train.py calls it. Per variant: `--warmup` updates
(compile), then `--updates` timed ones (host clock around a synchronised call), then
one under torch.profiler, whose kernels are grouped by `kind`. Variants are flags joined by ':':
  ckpt      grad_checkpointing=true (the recompute inside the compiled layers)
  keepF     activation_budget=F (with ckpt)
  fused     fused_loss=true
  autotune  inductor's max_autotune_gemm for the layers (Triton GEMM templates, epilogues fused into them)
  cdt       inductor's coordinate_descent_tuning (the layers' pointwise and reduction kernels tuned)
Each variant's results go to DIR/update_bench.jsonl as soon as it ends (a cut run keeps the finished ones), the
tables to DIR/update_bench.md; one variant failing does not stop the others.
"""
import argparse
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root: tools/ import the project
import torch

import algos, engines, envs, rewards, tasks  # noqa: F401,E401  (registers the algorithms and config sections)
import bench_workload
from bench_workload import SHAPES, W, build_model

# kernel name -> kind, first match wins (names as CUDA, cuBLAS, cuDNN, Triton and inductor give them)
KINDS = [
    ("head log-probs", r"_stats_kernel|_grad_kernel|logprob|_lse_"),
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    ("attention", r"flash|fmha|attention|cudnn|sdpa"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|Kernel2|wgmma|matmul|triton_tem_|_mm_|splitK"),
    ("embedding", r"embedding|index_put|indexing_backward|scatter|sort|radix"),
    ("elementwise/norm/rope (inductor)", r"^triton_(poi|red|per)_"),
    ("copies/casts", r"copy|cast|memcpy|Memcpy|cat_|CatArray"),
    ("memset/fill", r"memset|Memset|fill|zero"),
    ("reductions (clip, metrics)", r"reduce|norm|Reduce"),
]


def kind(name: str) -> str:
    return next((k for k, pat in KINDS if re.search(pat, name, re.IGNORECASE)), "other")


def parse(variant: str) -> dict:
    flags, budget = variant.split(":"), 0.0
    for f in flags:
        if f.startswith("keep"):
            budget = float(f[4:])
        elif f not in ("ckpt", "fused", "autotune", "cdt", "base"):
            raise SystemExit(f"unknown flag '{f}' in variant '{variant}': use ckpt, keepF, fused, autotune, cdt")
    return dict(ckpt="ckpt" in flags, budget=budget, fused="fused" in flags,
                autotune="autotune" in flags, cdt="cdt" in flags)


def experience(vocab: int, seed: int):
    """One W1 batch on the host, as the rollout hands it over: 16 groups of 8, every completion full length."""
    from buffer import Experience
    B, P, C = W["prompts"] * W["samples"], W["prompt_len"], W["new"]
    g = torch.Generator().manual_seed(seed)
    return Experience(input_ids=torch.randint(1, vocab, (B, P + C), generator=g),
                      attention_mask=torch.ones(B, P + C, dtype=torch.long), completion_mask=torch.ones(B, C),
                      sample_logprobs=-torch.rand(B, C, generator=g) * 5, rewards=torch.rand(B, generator=g),
                      group_ids=torch.arange(B) // W["samples"], versions=torch.zeros(B, dtype=torch.long),
                      truncated=torch.ones(B, dtype=torch.bool))


def learner_for(model_dir: str, v: dict, device):
    import config
    import registry
    import run_setup
    import update
    cfg = config.parse([f"model={model_dir}", f"micro_batch_size={W['prompts'] * W['samples']}", "compile=true",
                        f"grad_checkpointing={v['ckpt']}", f"activation_budget={v['budget']}",
                        f"fused_loss={v['fused']}", "lr=1e-6",
                        f"samples_per_prompt={W['samples']}"])
    config.fill_defaults(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = run_setup.build_models(cfg, device, dtype, fsdp=False)[0]
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    algo = registry.get("algo", cfg.algo.name)
    return update.Learner(policy, optimizer, schedule, algo, cfg, device)


def one_update(learner, step: int) -> dict:
    import update
    from buffer import OnPolicyBuffer
    b = experience(learner.policy.config.vocab_size, seed=step)
    b.advantages = learner.algo.advantages(b, learner.cfg.algo)
    buffer = OnPolicyBuffer()
    buffer.add(b)
    return update.update(learner, buffer, torch.Generator().manual_seed(step), step=step, n_samples=len(b.rewards))


def profile_update(learner, step: int) -> dict:
    """One update under torch.profiler: its kernels' time by kind and by name, and the GPU's busy share."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    bench_workload.sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        one_update(learner, step)
        bench_workload.sync()
    wall = time.perf_counter() - t0
    # kernels, memsets and copies on the GPU's timeline; not the annotations laid over them ("Optimizer.step#...",
    # which span their kernels and the gaps between them)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and "#" not in e.name]
    by_name: dict[str, list[float]] = {}
    spans = []
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)          # ms
        spans.append((e.time_range.start, e.time_range.end))
    busy, reach = 0.0, float("-inf")
    for a, b in sorted(spans):                                                        # us, overlaps counted once
        busy += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    by_kind: dict[str, list] = {}
    for name, ds in by_name.items():
        k = by_kind.setdefault(kind(name), [0.0, 0])
        k[0], k[1] = k[0] + sum(ds), k[1] + len(ds)
    return {"profiled_wall_ms": wall * 1e3, "gpu_busy_ms": busy / 1e3, "kernels": len(events),
            "by_kind_ms": {k: round(v[0], 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][0])},
            "by_kind_calls": {k: v[1] for k, v in by_kind.items()},
            "top_kernels": [(round(sum(ds), 2), len(ds), kind(n), n[:140])
                            for n, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]]}


def run_variant(model_dir: str, variant: str, a, device) -> dict:
    import torch._inductor.config as inductor
    v = parse(variant)
    torch._dynamo.reset()
    gc.collect()
    before = 0
    if device.type == "cuda":
        from torch._inductor import cudagraph_trees
        cudagraph_trees.reset_cudagraph_trees()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()   # what earlier variants left: not this one's
    with inductor.patch(max_autotune_gemm=v["autotune"], coordinate_descent_tuning=v["cdt"]):
        t0 = time.perf_counter()
        learner = learner_for(model_dir, v, device)
        warm = []
        for i in range(a.warmup):   # compile
            bench_workload.sync()
            t = time.perf_counter()
            one_update(learner, i)
            bench_workload.sync()
            warm.append(time.perf_counter() - t)
            print(f"  {variant}: warm-up update {i} {warm[-1]:.3f} s", flush=True)
        times, stats = [], {}
        for i in range(a.updates):
            bench_workload.sync()
            t = time.perf_counter()
            stats = one_update(learner, a.warmup + i)
            bench_workload.sync()
            times.append(time.perf_counter() - t)
        out = {"variant": variant, "settings": v, "warmup_s": warm, "updates_s": times,
               "median_s": statistics.median(times), "loss": stats.get("loss"), "grad_norm": stats.get("grad_norm"),
               **bench_workload.cuda_info()}
        if device.type == "cuda":   # this variant's own: model, optimizer state, activations, graph pools
            out["peak_alloc_gib"] = (torch.cuda.max_memory_allocated() - before) / 2**30
        print(f"  {variant}: updates {' '.join(f'{t:.3f}' for t in times)} s, median {out['median_s']:.3f} s "
              f"({time.perf_counter() - t0:.0f} s with compile)", flush=True)
        if a.profile:
            out.update(profile_update(learner, a.warmup + a.updates))
    del learner
    return out


def table(rows: list[dict]) -> str:
    kinds = sorted({k for r in rows for k in r.get("by_kind_ms", {})},
                   key=lambda k: -max(r.get("by_kind_ms", {}).get(k, 0) for r in rows))
    head = ["variant", "median update", "updates", "peak alloc"] + (["kernels busy"] if kinds else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], f"{r['median_s']:.3f} s", " ".join(f"{t:.3f}" for t in r["updates_s"]),
                 f"{r.get('peak_alloc_gib', 0):.1f} GiB"]
        if kinds:
            cells.append(f"{r.get('gpu_busy_ms', 0):.1f} ms of {r.get('profiled_wall_ms', 0):.1f}, "
                         f"{r.get('kernels', 0)} kernels")
        lines.append("| " + " | ".join(cells) + " |")
    if kinds:
        lines += ["", "| kernels by kind, ms (calls) | " + " | ".join(r["variant"] for r in rows) + " |",
                  "|" + "---|" * (len(rows) + 1)]
        for k in kinds:
            lines.append(f"| {k} | " + " | ".join(f"{r['by_kind_ms'].get(k, 0):.1f} ({r['by_kind_calls'].get(k, 0)})"
                                                   if "by_kind_ms" in r else "-" for r in rows) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="ckpt,ckpt:fused,ckpt:keep0.7")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates first (compile)")
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--small", action="store_true", help="toy shapes (CPU smoke run)")
    a = p.parse_args(argv)
    for variant in a.variants.split(","):
        parse(variant)   # bad flags: one line, before any work
    if a.small:
        W.update(SHAPES["small"])
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp, torch.bfloat16 if device.type == "cuda" else torch.float32)
        for variant in a.variants.split(","):
            try:
                rows.append(run_variant(tmp, variant, a, device))
            except Exception:   # one variant's failure (a compile error, out of memory) leaves the others' figures
                traceback.print_exc()
                rows.append({"variant": variant, "error": traceback.format_exc(limit=3)})
            with open(os.path.join(a.out, "update_bench.jsonl"), "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    done = [r for r in rows if "error" not in r]
    text = f"W1 update alone, {bench_workload.cuda_info().get('device')}, torch {torch.__version__}\n\n" + table(done)
    with open(os.path.join(a.out, "update_bench.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
