"""Throughput of the code reward through the reward pool: N calls, every one accounted for.

    python tools/code_reward_bench.py                     # 1,000 calls, 2 test cases each
    python tools/code_reward_bench.py --calls 200 --workers 4

The batch mixes what a policy writes: correct programs (score 1), wrong answers (0.5: one of two cases
passes), crashes (0), function-style answers checked by asserts (1), and hostile programs (0): an infinite
loop, a fork bomb and a memory bomb, each stopped by the sandbox's limits, and an object whose __eq__
always holds, which the assert cases' outside comparison refuses (tests/hostile_programs.py has the rest). "Lost" counts calls whose score differs from the one their program
must get, plus calls the pool recorded as failures (timeouts, dead workers); a sound run loses none.
"""
import argparse
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.code import code_reward  # noqa: E402
from rewards.pool import RewardPool  # noqa: E402
from rewards.sandbox import capabilities  # noqa: E402

TESTS = {"tests": [{"input": "3 4\n", "output": "7"}, {"input": "10 5\n", "output": "15"}]}
ASSERTS = {"asserts": ["assert add(3, 4) == 7", "assert add(10, 5) == 15"]}
PROGRAMS = {   # kind: (program, expected score, share of the batch[, the sample's cases])
    "correct": ("a, b = map(int, input().split())\nprint(a + b)", 1.0, 0.60),
    "asserts": ("def add(a, b):\n    return a + b", 1.0, 0.10, ASSERTS),
    "eq_trick": ("class Y:\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return Y()", 0.0, 0.01, ASSERTS),
    "wrong": ("a, b = map(int, input().split())\nprint(a + b if a < 5 else a - b)", 0.5, 0.15),
    "crash": ("a, b = map(int, input().split())\nprint(a / 0)", 0.0, 0.09),
    "loop": ("while True:\n    pass", 0.0, 0.02),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", 0.0, 0.015),
    "memory_bomb": ("a = []\nwhile True:\n    a.append(bytearray(2**26))", 0.0, 0.015),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--wall-s", type=float, default=1.0, help="sandbox wall-time limit per test case")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="pool deadline per call")
    args = ap.parse_args()

    kinds = []
    for kind, (_, _, share, *_) in PROGRAMS.items():
        kinds += [kind] * round(share * args.calls)
    kinds = (kinds + ["correct"] * args.calls)[:args.calls]
    print(f"sandbox: {capabilities()}")
    with RewardPool([(code_reward, 1.0, {"wall_s": args.wall_s})], workers=args.workers, timeout_s=args.timeout_s) as pool:
        pool.wait_ready()
        t0 = time.perf_counter()
        handle = pool.submit([""] * len(kinds), [PROGRAMS[k][0] for k in kinds],
                             [(PROGRAMS[k][3:] or (TESTS,))[0] for k in kinds])
        rewards, info = handle.result()
        took = time.perf_counter() - t0
    wrong = [i for i, k in enumerate(kinds) if abs(rewards[i].item() - PROGRAMS[k][1]) > 1e-9]
    lost = len(wrong) + info["failures"]["code_reward"]
    print(f"calls: {len(kinds)} ({dict(Counter(kinds))}), 2 test cases each, workers: {args.workers}")
    print(f"wall: {took:.1f} s, {len(kinds) / took:.1f} calls/s, {len(kinds) * 2 / took:.1f} sandboxed runs/s "
          f"(hostile calls cost about one wall_s={args.wall_s:g} each)")
    print(f"results: {len(rewards)}, lost: {lost} (wrong score: {len(wrong)}, pool failures: "
          f"{info['failures']['code_reward']}), worker restarts: {pool.restarts}")
    print(f"failed samples by category: {info['failure_counts']['code_reward']}")
    for r in [f"{f['sample']}: {f['reason']}" for f in info["failed"] if f["category"] in ("timeout", "setup")][:5]:
        print("  ", r)
    sys.exit(1 if lost or len(rewards) != len(kinds) else 0)


if __name__ == "__main__":
    main()
