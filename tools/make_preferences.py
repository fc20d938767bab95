"""Build the shipped preference file for offline DPO on the embedded arithmetic task (tasks/arithmetic.py).

    python tools/make_preferences.py                       # writes assets/arithmetic_prefs.jsonl (1000 pairs, ~50 KB)
    python tools/make_preferences.py --n 200 --out /tmp/prefs.jsonl

Each line is {"prompt", "chosen", "rejected"}: prompt and chosen are a training problem of the task and its
answer, exactly as tasks/arithmetic.py writes them (so the file follows the task's format); rejected is the same answer
with one digit made one smaller (mod 10), which is what forgetting a single carry into that digit does: a
plausible wrong answer that differs from the right one in one place. Problems come from the task's train
split only, so held-out evaluation stays clean. Rerun this script whenever tasks/arithmetic.py's format changes
(tests/test_offline_and_ablate.py checks that the shipped file matches what this script writes).
"""
import argparse
import json
import os
import sys
import random

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root: tools/ import the project
from tasks.arithmetic import ArithmeticConfig  # noqa: E402
from tasks.arithmetic import arithmetic_task  # noqa: E402


def forget_one_carry(answer: str, rng: random.Random) -> str:
    i = rng.randrange(len(answer))
    return answer[:i] + str((int(answer[i]) - 1) % 10) + answer[i + 1:]


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    train, _ = arithmetic_task(ArithmeticConfig(n_train=n, n_eval=1, seed=seed))
    rng = random.Random(f"prefs-{seed}")
    return [{"prompt": s["prompt"], "chosen": s["answer"], "rejected": forget_one_carry(s["answer"], rng)} for s in train]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1000, help="number of pairs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="assets/arithmetic_prefs.jsonl")
    args = p.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in make_pairs(args.n, args.seed))
    print(f"wrote {args.n} pairs to {args.out}")


if __name__ == "__main__":
    main()
