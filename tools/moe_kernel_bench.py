"""qwen3_moe's decode experts and routing at W10's shape, timed in CUDA graphs, each candidate against today's
default in the same graphs; W10 rollouts with the candidates on, interleaved with today's; a profiled rollout (GPU).

    python tools/moe_kernel_bench.py --out OUT                                # kernels, then rollouts
    python tools/moe_kernel_bench.py --out OUT --parts kernels                # kernels | rollouts | profile
    python tools/moe_kernel_bench.py --out OUT --parts rollouts --schemes default,route_warps4 --budget 60

- kernels: at 128 tokens x top-4 of 32 experts (hidden 1024, expert MLP 768), routed as `routing` says (uniform,
  uneven, grouped), in one CUDA graph over 8 layers' weights (151 MB of experts each, so every layer's weights
  come from memory): kernels/moe_experts.py's two kernels (`EXPERTS`: today's settings, 64-row tiles),
  kernels/decode_route.py's routing (`ROUTES`: its program's warps, the router's GEMM before it or inside), and
  the whole routed block (engines/moe.py's routed_experts, eager) per `SCHEMES`; the card's copy rate.
- rollouts: W10's qwen3_moe (tools/bench_w10.py's MODELS and `setup`), one engine per scheme of --schemes (each
  traced and captured with its switches set), then qwen2 (the yardstick) if --budget seconds are not yet spent;
  --rounds rounds each time one rollout of every engine in turn (the switches set again before each call).
- profile: one more rollout of the first scheme with FAST_DECODE_TIMES (its split, to stderr) and under
  torch.profiler (its CUDA kernels by total time, OUT/profile.txt).
Writes OUT/moe_bench.json after each part and prints a table. The graph timing is tools/decode_kernel_bench.py's
`graph_us`.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # tools/
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch
from torch import Tensor

import engines.moe as moe
import kernels.decode_route as dr
import kernels.moe_experts as me
from decode_kernel_bench import MOE_SHAPE, copy_row, graph_us, moe_weights

DEV = "cuda"   # the kernels part's device (a CPU check of this file under TRITON_INTERPRET=1 sets "cpu")

# scheme -> the module switches it sets ((module, name, value)); "default" is today's code
SCHEMES = {"default": [],
           "route_warps4": [(dr, "WARPS", 4)],                               # the routing program in 4 warps (the
           "route_warps8": [(dr, "WARPS", 8)]}                               # default at 128 tokens is 8)
# the experts' variants timed in the graph: (name, switches, gate_up's cfg, down's cfg); None: SETTINGS'
EXPERTS = [("split (today)", [], None, None),
           ("split, BM 64", [], (64, 128, 64, 8, 3, 96), (64, 128, 64, 8, 3))]   # (the loop, SPLIT False: measured
# in docs/architectures.md, not a candidate: left out to keep the device call short)
# the routing's variants: (name, switches, router GEMM inside the kernel)
ROUTES = [("one program (today: 8 warps at 128 tokens), cuBLAS GEMM before", [], False),
          ("one program, 4 warps, GEMM before", [(dr, "WARPS", 4)], False),
          ("one program, 16 warps, GEMM before", [(dr, "WARPS", 16)], False),
          ("one program, GEMM inside", [], True)]


class switched:
    """Sets (module, name, value) switches for a with-block and restores them after."""

    def __init__(self, switches: list):
        self.switches = switches

    def __enter__(self):
        self.before = [(m, n, getattr(m, n)) for m, n, _ in self.switches]
        for m, n, v in self.switches:
            setattr(m, n, v)

    def __exit__(self, *exc):
        for m, n, v in self.before:
            setattr(m, n, v)


def routing(kind: str, N: int, E: int, k: int, g) -> Tensor:
    """(N k,) each pair's expert: "uniform" (each token its own random top-k: 8 to 24 pairs per expert at W10's
    shape); "uneven" (some experts preferred by every token, as W10's random qwen3_moe routes: its busiest expert
    took 26 to 56 pairs of 512 per MoE layer and decode step in a CPU run of its shape, docs/architectures.md); or
    "grouped" (GRPO's groups of 8 samples of one prompt take the same k experts)."""
    if kind == "grouped":
        per_group = torch.rand(N // 8, E, device=DEV, generator=g).topk(k, -1).indices    # (N / 8, k)
        return per_group.repeat_interleave(8, 0).reshape(-1)
    z = torch.randn(N, E, device=DEV, generator=g)
    if kind == "uneven":
        z = z + 0.35 * torch.randn(E, device=DEV, generator=g)       # a bias per expert: busiest ~31-59
    return z.topk(k, -1).indices.reshape(-1)


def hidden(kind: str, N: int, H: int, g, dtype) -> Tensor:
    """(N, H) hidden states that random routers (std H^-1/2 per weight) route as `routing`'s kinds: each token
    its own; a direction shared by every token (a bias of ~0.35 per expert's logit); groups of 8 equal tokens."""
    if kind == "grouped":
        return torch.randn(N // 8, H, device=DEV, generator=g).repeat_interleave(8, 0).to(dtype)
    x = torch.randn(N, H, device=DEV, generator=g)
    if kind == "uneven":
        x = x + 0.35 * torch.randn(H, device=DEV, generator=g)
    return x.to(dtype)


def kernel_rows(reps: int, layers: int = 8) -> tuple[list[str], dict]:
    """Per routing: the experts' variants, the routing's variants (on hidden states routed that way) and the whole
    routed block per scheme, each in one CUDA graph over `layers` layers, us per layer; outputs against today's."""
    from kernels.decode_route import by_expert
    N, H, I, E, k = MOE_SHAPE
    g = torch.Generator(device=DEV).manual_seed(0)
    gus, dns, x, gb = moe_weights(layers, g)
    routers = [torch.randn(E, H, device=DEV, dtype=x.dtype, generator=g) * H ** -0.5 for _ in range(layers)]
    rows, found = [], {}
    for kind in ("uniform", "uneven", "grouped"):
        flat = routing(kind, N, E, k, g)
        order, _, offs = by_expert(flat, E)
        token = order // k
        counts = torch.bincount(flat, minlength=E)
        tag = f"{kind} routing (pairs per expert {counts.min().item()}-{counts.max().item()})"
        want = None
        for name, sw, cg, cd in EXPERTS:
            two = lambda i: me.expert_down(me.expert_gate_up(x, token, offs, gus[i], cg), offs, dns[i], cd)
            with switched(sw):                                               # read at each call (and capture)
                got = two(0)
                us = graph_us(lambda: [two(i) for i in range(layers)], 1, reps) / layers
            want = got if want is None else want
            found[f"experts {kind}, {name}"] = us
            same = "bitwise" if torch.equal(got, want) else \
                f"rel. diff {((got.float() - want.float()).norm() / want.float().norm()).item():.1e}"
            rows.append(f"| experts, {tag} | {name} | {us:.2f} | {gb / us * 1e3:.2f} TB/s; against today's: {same} |")
        hs = hidden(kind, N, H, g, x.dtype)                                         # (N, H) routed `kind`ly too
        picks = torch.bincount(dr.route(torch.nn.functional.linear(hs, routers[0]), k, True, x.dtype)[1].flatten(),
                               minlength=E)
        tag = f"{kind} (pairs per expert {picks.min().item()}-{picks.max().item()} in layer 0)"
        want = None
        for name, sw, inside in ROUTES:
            fn = (lambda i: dr.route_linear(hs, routers[i], k, True)) if inside else \
                (lambda i: dr.route(torch.nn.functional.linear(hs, routers[i]), k, True, x.dtype))
            with switched(sw):
                got = fn(0)
                us = graph_us(lambda: [fn(i) for i in range(layers)], 1, reps) / layers
            want = got if want is None else want
            exact = all(torch.equal(u, v) for u, v in zip(got[1:], want[1:]))
            found[f"route {kind}, {name}"] = us
            rows.append(f"| routing (+ router GEMM), {tag} | {name} | {us:.2f} | experts, order, places and "
                        f"offsets equal to today's: {exact}; weights bitwise: {torch.equal(got[0], want[0])} |")
        want = None
        for scheme in SCHEMES:
            block = lambda i: moe.routed_experts(hs, routers[i], k, True, gus[i], dns[i], torch.nn.functional.silu,
                                                 grouped="triton", decode=True)
            with switched(SCHEMES[scheme]):
                got = block(0)
                us = graph_us(lambda: [block(i) for i in range(layers)], 1, reps) / layers
            want = got if want is None else want
            found[f"block {kind}, {scheme}"] = us
            rows.append(f"| routed block (eager: router GEMM, routing, experts, weighted sum), {tag} | {scheme} | "
                        f"{us:.2f} | against today's: rel. diff "
                        f"{((got.float() - want.float()).norm() / want.float().norm()).item():.1e} |")
        print("\n".join(rows[-len(EXPERTS) - len(ROUTES) - len(SCHEMES):]), flush=True)
    return rows, found


def rollouts(schemes: list[str], rounds: int, budget: float, tiny: bool = False) -> tuple[list[str], dict, dict]:
    """W10's qwen3_moe, one engine per scheme (set while its step is traced and captured), qwen2 if the budget
    allows, interleaved rounds (bench_w10's rows: x qwen2 per active parameter per round). tiny: bench_w10's toy
    shapes in float32 (a CPU check of this code)."""
    import bench_w10
    start = time.perf_counter()
    a = argparse.Namespace(tiny=tiny)
    dev, states = torch.device(DEV), []
    work, dtype = (bench_w10.WORK_TINY, torch.float32) if tiny else (bench_w10.WORK, torch.bfloat16)
    for name in schemes + ["qwen2"]:
        if time.perf_counter() - start > budget:
            print(f"rollouts: {name} skipped, {budget:.0f} s spent", flush=True)
            continue
        model = "qwen2" if name == "qwen2" else "qwen3_moe"
        try:
            with switched(SCHEMES.get(name, [])):
                st = bench_w10.setup(model, a, work, dev, dtype)
        except Exception as e:   # one scheme's failure is a line of the log, not the end of the others
            print(f"rollouts: {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        st["row"]["model"], st["switches"] = (name if model == "qwen2" else f"qwen3_moe {name}"), SCHEMES.get(name, [])
        states.append(st)
        print(f"rollouts: {name} set up, first rollout {st['row']['engine_first_s']:.2f} s, "
              f"{time.perf_counter() - start:.1f} s in", flush=True)
    for i in range(rounds):
        for st in states:
            with switched(st["switches"]):
                bench_w10.time_once(st)
        print(f"round {i + 1} (ended {time.strftime('%H:%M:%S')}): " + ", ".join(
            f"{st['row']['model']} {st['row']['engine_times'][-1]:.4f} s" for st in states), flush=True)
    rows = [st["row"] for st in states]
    bench_w10.round_ratios(rows)
    lines = [f"| W10 rollout, {rounds} interleaved rounds | {r['model']} | {r['engine_s']:.4f} s "
             f"({r['engine_min_s']:.4f}-{r['engine_max_s']:.4f}) | x qwen2 per active parameter "
             f"{r.get('x_qwen2', float('nan')):.3f}; rounds {[round(t, 4) for t in r['engine_times']]} |"
             for r in rows if r.get("engine_times")]
    return lines, {r["model"]: {k: v for k, v in r.items()} for r in rows}, states[0] if states else None


def profiled(out: str, st: dict) -> tuple[list[str], dict]:
    """One more rollout of the set-up engine `st` with FAST_DECODE_TIMES (its split, to stderr), one under
    torch.profiler (OUT/profile.txt)."""
    import bench_w10
    with switched(st["switches"]):
        os.environ["FAST_DECODE_TIMES"] = "1"
        try:
            st["fn"]()
        finally:
            os.environ.pop("FAST_DECODE_TIMES")
        path = bench_w10.profile(st["fn"], os.path.join(out, "profile.txt"))
    return [f"| W10 rollout | {st['row']['model']} profiled | | kernels: {path} |"], {"profile": path}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for moe_bench.json and profile.txt")
    p.add_argument("--parts", default="kernels,rollouts")
    p.add_argument("--reps", type=int, default=20, help="graph replays per timing (median)")
    p.add_argument("--schemes", default="default,route_warps4", help=f"rollouts' schemes, the first the baseline; of: "
                   f"{', '.join(SCHEMES)}, or several joined by + (their switches together)")
    p.add_argument("--rounds", type=int, default=3, help="rollouts: interleaved rounds")
    p.add_argument("--budget", type=float, default=120.0, help="rollouts: seconds of set-up after which the next "
                   "engine (qwen2 last) is skipped")
    a = p.parse_args()
    parts, schemes = a.parts.split(","), a.schemes.split(",")
    bad = [x for x in parts if x not in ("kernels", "rollouts", "profile")] + \
        [s for s in schemes if any(n not in SCHEMES for n in s.split("+"))]
    for s in schemes:   # "a+b": both schemes' switches
        SCHEMES[s] = [sw for n in s.split("+") for sw in SCHEMES[n]]
    if bad or not torch.cuda.is_available():
        sys.exit(f"moe_kernel_bench: needs a GPU, parts among kernels, rollouts, profile and schemes among "
                 f"{', '.join(SCHEMES)}; got {bad}")
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
    st = None
    if "rollouts" in parts or "profile" in parts:
        lines, f, st = rollouts(schemes, a.rounds if "rollouts" in parts else 0, a.budget)
        save(lines, f, "rollouts")
    if "profile" in parts and st is not None:
        save(*profiled(a.out, st), "profile")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
