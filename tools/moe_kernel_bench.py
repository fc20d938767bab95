"""qwen3_moe's decode experts at W10's shape, timed in CUDA graphs, and a profiled W10 qwen3_moe rollout (GPU).

    python tools/moe_kernel_bench.py --out OUT                      # both parts
    python tools/moe_kernel_bench.py --out OUT --parts kernels      # kernels | profile

- kernels: kernels/moe_experts.py's two kernels at 128 tokens x top-4 of 32 experts (hidden 1024, expert MLP
  768), routed as `routing` says (uniform, uneven, grouped), an expert's row blocks looped over by its programs
  or one per program (SPLIT), one CUDA graph over 8 layers' weights (151 MB each, so every layer's weights come
  from memory); the card's copy rate.
- profile: W10's qwen3_moe (tools/bench_w10.py's MODELS): its rollout's split (FAST_DECODE_TIMES, to stderr), one
  rollout under torch.profiler (its CUDA kernels by total time, OUT/profile.txt), then --rounds rollouts of each
  row-block scheme, one engine each, interleaved.
Writes OUT/moe_bench.json and prints a table. The graph timing is tools/decode_kernel_bench.py's `graph_us`.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # tools/
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch
from torch import Tensor

import bench_workload   # tools/: W1's timing helpers
from decode_kernel_bench import MOE_SHAPE, copy_row, graph_us, moe_weights


def routing(kind: str, N: int, E: int, k: int, g) -> Tensor:
    """(N k,) each pair's expert: "uniform" (each token its own random top-k: 8 to 24 pairs per expert at W10's
    shape); "uneven" (some experts preferred by every token, as W10's random qwen3_moe routes: its busiest expert
    took 26 to 56 pairs of 512 per MoE layer and decode step in a CPU run of its shape, docs/architectures.md); or
    "grouped" (GRPO's groups of 8 samples of one prompt take the same k experts)."""
    if kind == "grouped":
        per_group = torch.rand(N // 8, E, device="cuda", generator=g).topk(k, -1).indices    # (N / 8, k)
        return per_group.repeat_interleave(8, 0).reshape(-1)
    z = torch.randn(N, E, device="cuda", generator=g)
    if kind == "uneven":
        z = z + 0.35 * torch.randn(E, device="cuda", generator=g)       # a bias per expert: busiest ~31-59
    return z.topk(k, -1).indices.reshape(-1)


def kernel_rows(reps: int, layers: int = 8) -> tuple[list[str], dict]:
    """Both expert kernels, one graph over `layers` layers' weights, at each routing, with an expert's row blocks
    looped over by its programs (split False) or one per program (split True: kernels/moe_experts.py's SPLIT)."""
    import kernels.moe_experts as me
    from kernels.decode_route import by_expert
    N, H, I, E, k = MOE_SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    gus, dns, x, gb = moe_weights(layers, g)
    rows, found, before = [], {}, me.SPLIT
    for kind in ("uniform", "uneven", "grouped"):
        flat = routing(kind, N, E, k, g)
        order, _, offs = by_expert(flat, E)
        token = order // k
        counts = torch.bincount(flat, minlength=E)
        two = lambda i: me.expert_down(me.expert_gate_up(x, token, offs, gus[i]), offs, dns[i])
        want = None
        for split in (False, True):
            me.SPLIT = split                                                 # read at each call
            got = two(0)
            want = got if want is None else want
            us = graph_us(lambda: [two(i) for i in range(layers)], 1, reps) / layers
            found[f"{kind}, split {split}"] = us
            rows.append(f"| experts, {kind} routing (pairs per expert {counts.min().item()}-{counts.max().item()}, "
                        f"{(counts > 0).sum().item()} experts used) | split {split} | {us:.2f} | "
                        f"{gb / us * 1e3:.2f} TB/s of all experts' bytes; equal to split False: "
                        f"{torch.equal(got, want)} |")
    me.SPLIT = before
    return rows, found


def profiled(out: str, rounds: int) -> tuple[list[str], dict]:
    """W10's qwen3_moe: a warm-up rollout (compile, capture), one with FAST_DECODE_TIMES (its split, to stderr),
    one under torch.profiler (OUT/profile.txt); with rounds, a second engine with the other row-block scheme
    (SPLIT) and the two engines' rollouts interleaved for that many rounds."""
    import bench_w10
    import kernels.moe_experts as me
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    model_type, fields, _ = bench_w10.MODELS["qwen3_moe"]
    model = bench_w10.build(model_type, fields, False, torch.device("cuda"), torch.bfloat16)
    V, work = model.config.vocab_size, bench_w10.WORK
    prompts = torch.randint(1, 1000, (work["prompts"], work["prompt_len"]),
                            generator=torch.Generator().manual_seed(0)).tolist()
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=work["new"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    before, rows, found = me.SPLIT, [], {}
    schemes = [before, not before] if rounds else [before]
    engines = {}
    for split in schemes:
        me.SPLIT = split                                                    # read when the step is traced
        engines[split] = BuiltinEngine(model, eos_id=V, pad_id=0, fast=True)
        found[f"split {split} first_s"] = bench_workload.timed(
            lambda: engines[split].generate(prompts, work["samples"], sampling, gen), 0)[0]
    me.SPLIT = before
    fn = lambda: engines[before].generate(prompts, work["samples"], sampling, gen)
    os.environ["FAST_DECODE_TIMES"] = "1"
    fn()
    os.environ.pop("FAST_DECODE_TIMES")
    found["profile"] = bench_w10.profile(fn, os.path.join(out, "profile.txt"))
    times = {split: [] for split in schemes}
    for i in range(rounds):
        for split in schemes:
            me.SPLIT = split                                                # the compiled step's guard
            times[split].append(bench_workload.timed(
                lambda: engines[split].generate(prompts, work["samples"], sampling, gen), 0)[0])
        print(f"round {i + 1}: " + ", ".join(f"split {sp} {times[sp][-1]:.4f} s" for sp in schemes), flush=True)
    me.SPLIT = before
    for split, t in times.items():
        if t:
            found[f"split {split}"] = t
            rows.append(f"| W10 qwen3_moe rollout | split {split} | {statistics.median(t):.4f} s ({min(t):.4f}-"
                        f"{max(t):.4f}) | {rounds} interleaved rounds |")
    return rows + [f"| W10 qwen3_moe rollout | profiled | | kernels: {found['profile']} |"], found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for moe_bench.json and profile.txt")
    p.add_argument("--parts", default="kernels,profile")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing (median)")
    p.add_argument("--rounds", type=int, default=3, help="with profile: rollouts of each row-block scheme, "
                   "interleaved (0: the profile only)")
    a = p.parse_args()
    parts = a.parts.split(",")
    bad = [x for x in parts if x not in ("kernels", "profile")]
    if bad or not torch.cuda.is_available():
        sys.exit(f"moe_kernel_bench: needs a GPU and parts among kernels, profile; got {bad}")
    os.makedirs(a.out, exist_ok=True)
    rows, found = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", "", "| what | variant | us | |",
                   "|---|---|---|---|"], {}

    def save(r: list[str], f: dict, key: str):
        rows.extend(r)
        found[key] = f
        print("\n".join(r), flush=True)
        with open(os.path.join(a.out, "moe_bench.json"), "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "found": found, "rows": rows}, fh, indent=1)

    if "kernels" in parts:
        save([copy_row(a.reps)], {}, "copy")
        save(*kernel_rows(a.reps), "kernels")
    if "profile" in parts:
        save(*profiled(a.out, a.rounds), "profile")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
