"""qwen3_moe's decode experts at W10's shape, timed in CUDA graphs, and one profiled W10 qwen3_moe rollout (GPU).

    python tools/moe_kernel_bench.py --out OUT                      # everything below
    python tools/moe_kernel_bench.py --out OUT --parts kernels      # kernels, block | profile | rollouts

- kernels: kernels/moe_experts.py's two launches (expert_gate_up, expert_down) against expert_mlp (the same tiles
  in one launch) at each setting of --mlp, 128 tokens x top-4 of 32 experts, hidden 1024, expert MLP 768, one
  graph over 8 layers' weights (151 MB each, so every layer's weights come from memory); the card's copy rate.
- block: the whole routed block as the decode step compiles it (router GEMM, routing kernel, experts, weighted
  sum), with each experts' route (engines/moe.py: EXPERTS).
- profile: W10's qwen3_moe (tools/bench_w10.py's MODELS), one rollout under torch.profiler: its CUDA kernels by
  total time (OUT/profile.txt), plus the rollout's split (FAST_DECODE_TIMES).
- rollouts: the same model, one engine per experts' route, their rollouts interleaved for --rounds rounds.
Writes OUT/moe_bench.json and prints a table. The graph timing is tools/decode_kernel_bench.py's `graph_us`.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # tools/
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch

from decode_kernel_bench import copy_row, graph_us


def kernel_rows(reps: int, mlp_cfgs: list[tuple], layers: int = 8) -> tuple[list[str], dict]:
    from kernels.decode_route import by_expert
    from kernels.moe_experts import SETTINGS, expert_down, expert_gate_up, expert_mlp
    N, H, I, E, k = 128, 1024, 768, 32, 4
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gus = [torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5 for _ in range(layers)]
    dns = [torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5 for _ in range(layers)]
    x = torch.randn(N, H, device=dev, dtype=dt, generator=g)
    flat = torch.rand(N, E, device=dev, generator=g).topk(k, -1).indices.reshape(-1)
    order, _, offs = by_expert(flat, E)
    token = order // k
    gb = (gus[0].numel() + dns[0].numel()) * 2 / 1e9
    two = lambda i: expert_down(expert_gate_up(x, token, offs, gus[i]), offs, dns[i])
    want = two(0)
    us = graph_us(lambda: [two(i) for i in range(layers)], 1, reps) / layers
    found = {"two_launches_us": us, "mlp": []}
    rows = [f"| experts | two launches {SETTINGS['gate_up']} + {SETTINGS['down']} | {us:.2f} | "
            f"{gb / us * 1e3:.2f} TB/s |"]
    for cfg in mlp_cfgs:
        try:
            got = expert_mlp(x, token, offs, gus[0], dns[0], cfg)
            same = torch.equal(got, want)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            us = graph_us(lambda: [expert_mlp(x, token, offs, gus[i], dns[i], cfg) for i in range(layers)], 1,
                          reps) / layers
            again = torch.equal(expert_mlp(x, token, offs, gus[0], dns[0], cfg), want)   # after the replays
        except Exception as e:
            rows.append(f"| experts | expert_mlp {cfg} | failed | {type(e).__name__}: {str(e)[:120]} |")
            continue
        found["mlp"].append({"cfg": cfg, "us": us, "equal": same and again, "rel_err": err})
        rows.append(f"| experts | expert_mlp {cfg} | {us:.2f} | {gb / us * 1e3:.2f} TB/s; equal to two launches: "
                    f"{same and again} (rel. err {err:.1e}) |")
    return rows, found


def block_rows(reps: int, layers: int = 8) -> tuple[list[str], dict]:
    import engines.moe as moe
    N, H, I, E, k = 128, 1024, 768, 32, 4
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s, sc=1.0: torch.randn(*s, device="cuda", generator=g).mul(sc).to(torch.bfloat16)
    x = r(N, H)
    ws = [(r(E, H, sc=H ** -0.5), r(E, 2 * I, H, sc=H ** -0.5), r(E, H, I, sc=I ** -0.5)) for _ in range(layers)]
    rows, found, want, before = [], {}, None, moe.EXPERTS
    for route in ("triton", "mlp"):
        moe.EXPERTS = route                                                # read when the block is traced
        block = torch.compile(lambda w, gu, dn: moe.routed_experts(x, w, k, True, gu, dn, torch.nn.functional.silu,
                                                                   "triton", decode=True), fullgraph=True,
                              dynamic=False)
        got = block(*ws[0])
        want = got if want is None else want
        us = graph_us(lambda: [block(*w) for w in ws], 1, reps) / layers
        found[route] = us
        rows.append(f"| routed block, compiled | EXPERTS={route} | {us:.2f} | equal to the first: "
                    f"{torch.equal(got, want)} |")
    moe.EXPERTS = before
    return rows, found


def rollouts(out: str, rounds: int, do_profile: bool, routes: list[str]) -> tuple[list[str], dict]:
    import bench_w10
    import engines.moe as moe
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    model_type, fields, _ = bench_w10.MODELS["qwen3_moe"]
    model = bench_w10.build(model_type, fields, False, torch.device("cuda"), torch.bfloat16)
    V, work = model.config.vocab_size, bench_w10.WORK
    prompts = torch.randint(1, 1000, (work["prompts"], work["prompt_len"]),
                            generator=torch.Generator().manual_seed(0)).tolist()
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=work["new"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    engines, rows, found, before = {}, [], {}, moe.EXPERTS
    for route in routes:
        moe.EXPERTS = route
        engines[route] = BuiltinEngine(model, eos_id=V, pad_id=0, fast=True)
        t0 = time.perf_counter()
        engines[route].generate(prompts, work["samples"], sampling, gen)
        torch.cuda.synchronize()
        found[f"{route}_first_s"] = time.perf_counter() - t0
        if do_profile and route == routes[0]:
            os.environ["FAST_DECODE_TIMES"] = "1"                            # the split, to stderr
            engines[route].generate(prompts, work["samples"], sampling, gen)
            os.environ.pop("FAST_DECODE_TIMES")
            found["profile"] = bench_w10.profile(lambda: engines[route].generate(prompts, work["samples"], sampling,
                                                                                 gen), os.path.join(out, "profile.txt"))
    times = {route: [] for route in routes}
    for i in range(rounds):
        for route in routes:
            moe.EXPERTS = route                                             # the compiled step's guard
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engines[route].generate(prompts, work["samples"], sampling, gen)
            torch.cuda.synchronize()
            times[route].append(time.perf_counter() - t0)
        print(f"round {i + 1}: " + ", ".join(f"{r} {times[r][-1]:.4f} s" for r in routes), flush=True)
    moe.EXPERTS = before
    for route in routes:
        t = times[route]
        found[route] = t
        rows.append(f"| W10 qwen3_moe rollout | EXPERTS={route} | {statistics.median(t):.4f} s ({min(t):.4f}-"
                    f"{max(t):.4f}) | {rounds} interleaved rounds |")
    return rows, found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for moe_bench.json and profile.txt")
    p.add_argument("--parts", default="kernels,block,profile,rollouts")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing (median)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rollout rounds")
    p.add_argument("--mlp", default="32x128x64x8x3x96x128", help="expert_mlp settings to time, comma-separated "
                   "(BM x BN x BK x warps x stages x CN of gate/up x CN of down)")
    a = p.parse_args()
    parts = a.parts.split(",")
    bad = [x for x in parts if x not in ("kernels", "block", "profile", "rollouts")]
    if bad or not torch.cuda.is_available():
        sys.exit(f"moe_kernel_bench: needs a GPU and parts among kernels, block, profile, rollouts; got {bad}")
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
        save(*kernel_rows(a.reps, [tuple(int(v) for v in c.split("x")) for c in a.mlp.split(",")]), "kernels")
    if "block" in parts:
        save(*block_rows(a.reps), "block")
    if "profile" in parts or "rollouts" in parts:
        save(*rollouts(a.out, a.rounds if "rollouts" in parts else 0, "profile" in parts,
                       ["triton", "mlp"] if "rollouts" in parts else ["triton"]), "rollouts")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
