"""Step-time planner: from one GPU's measured phase times, predict the step time of synchronous colocated and
asynchronous disaggregated placements on 1-64 GPUs (docs/async.md has the model and a table).

    python tools/plan.py                                   # W1's 1-GPU H100 split (docs/benchmarks.md)
    python tools/plan.py --rollout 0.426 --update 0.361 --logprobs 0.025 --sync 0.01 --gpus 1,2,4,8
    python tools/plan.py --from-run runs/x                 # medians of a 1-GPU run's metrics.jsonl (steps >= 2)
    python tools/plan.py --gpus 4 --scale 4                # a global batch 4x the measured one (weak scaling)

The model, per step of a global batch s times the measured one (s = 1: the same batch; --scale):
  rollout on n GPUs  R(n) = R * (F + (1 - F) s / n)  a decode step reads every weight whatever its batch: the part F
                                                     of the rollout does not shrink with more GPUs (docs/speed.md)
  training on n GPUs U(n) = (U + L) s / n + A * (n > 1)   update and log-probs split; A: one gradient all-reduce
  sync colocated (N):  T = R(N) + U(N) + W * (N > 1)    every GPU generates, then trains, in turn
  async, K of N generate: T = max(R(K), U(N - K)) + W   the two overlap; W: the weight broadcast; best K shown
F defaults to 0.75, fitted to the 2-GPU colocated measurement (0.588 s against 0.81 s on one GPU, docs/speed.md);
A and W default to 0.02 s and 0.01 s. With max_staleness >= 1 the overlap is exact in steady state; with 0 the
async placement is sequential: T = R(K) + U(N - K) + W (printed as "async, staleness 0").
"""
import argparse
import json
import os
import statistics


def rollout_time(R: float, F: float, n: int, s: float = 1.0) -> float:
    return R * (F + (1 - F) * s / n)


def train_time(U: float, L: float, A: float, n: int, s: float = 1.0) -> float:
    return (U + L) * s / n + (A if n > 1 else 0.0)


def placement(R, U, L, W, A, F, N, K=0, s=1.0, staleness=1) -> float:
    """-> the predicted step time (s) of one placement on N GPUs at s times the measured batch: K = 0 colocated
    (every GPU generates, then trains), else K rollout GPUs + N - K trainer GPUs (mode=async)."""
    if K == 0:
        return rollout_time(R, F, N, s) + train_time(U, L, A, N, s) + (W if N > 1 else 0.0)
    r, t = rollout_time(R, F, K, s), train_time(U, L, A, N - K, s)
    return (max(r, t) if staleness > 0 else r + t) + W


def plan(R, U, L, W, A, F, N, s=1.0) -> dict:
    """-> predicted step times (s) on N GPUs: sync colocated, and async with the best split (and that split)."""
    sync = placement(R, U, L, W, A, F, N, 0, s)
    if N == 1:
        return {"sync": sync, "async": None, "async0": None, "K": None}
    best = min(range(1, N), key=lambda K: placement(R, U, L, W, A, F, N, K, s))
    return {"sync": sync, "async": placement(R, U, L, W, A, F, N, best, s),
            "async0": placement(R, U, L, W, A, F, N, best, s, staleness=0), "K": best}


def from_run(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if r["step"] >= 2]   # step 0: the evaluation; step 1: warm-up
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)   # noqa: E731
    return {"rollout": med("time/rollout"), "update": med("time/update"), "logprobs": med("time/logprobs"),
            "sync": med("time/sync")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollout", type=float, default=0.426, help="1-GPU rollout time of one step's batch (s)")
    p.add_argument("--update", type=float, default=0.361, help="1-GPU update time (s)")
    p.add_argument("--logprobs", type=float, default=0.025, help="1-GPU old/reference log-prob time (s)")
    p.add_argument("--sync", type=float, default=0.01, help="weight transfer to the rollout GPUs (s)")
    p.add_argument("--allreduce", type=float, default=0.02, help="one gradient all-reduce among trainers (s)")
    p.add_argument("--fixed", type=float, default=0.75, help="part of the rollout that more GPUs do not shrink")
    p.add_argument("--gpus", default="1,2,4,8,16,32,64", help="comma list of GPU counts")
    p.add_argument("--scale", type=float, default=1.0, help="global batch on N GPUs / the measured 1-GPU batch")
    p.add_argument("--from-run", help="take rollout/update/logprobs/sync from a 1-GPU run's metrics.jsonl")
    a = p.parse_args()
    t = from_run(a.from_run) if a.from_run else {"rollout": a.rollout, "update": a.update, "logprobs": a.logprobs,
                                                 "sync": a.sync}
    one = plan(t["rollout"], t["update"], t["logprobs"], t["sync"], a.allreduce, a.fixed, 1)["sync"]
    print(f"1 GPU: rollout {t['rollout']:.3f} s, update {t['update']:.3f} s, log-probs {t['logprobs']:.3f} s; "
          f"fixed rollout part {a.fixed}, all-reduce {a.allreduce} s, weight sync {t['sync']} s"
          + (f"; above 1 GPU the global batch is {a.scale}x (speed-ups in samples/s)" if a.scale != 1 else "") + "\n")
    print("| GPUs | sync colocated | async (rollout + train GPUs) | async, staleness 0 | async speed-up vs 1 GPU |")
    print("|---|---|---|---|---|")
    for N in map(int, a.gpus.split(",")):
        s = a.scale if N > 1 else 1.0
        r = plan(t["rollout"], t["update"], t["logprobs"], t["sync"], a.allreduce, a.fixed, N, s)
        if r["async"] is None:
            print(f"| {N} | {r['sync']:.3f} s | - | - | 1.00x |")
            continue
        print(f"| {N} | {r['sync']:.3f} s ({s * one / r['sync']:.2f}x) | {r['async']:.3f} s ({r['K']} + "
              f"{N - r['K']}) | {r['async0']:.3f} s | {s * one / r['async']:.2f}x |")


if __name__ == "__main__":
    main()
