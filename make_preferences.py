"""Build the shipped preference file for offline DPO on the embedded arithmetic task (data.py).

    python make_preferences.py                       # writes assets/arithmetic_prefs.jsonl (1000 pairs, ~50 KB)
    python make_preferences.py --n 200 --out /tmp/prefs.jsonl

Each line is {"prompt": "58+67=", "chosen": "125", "rejected": "115"}: chosen is the correct sum, rejected
is a plausible wrong one: the sum with every carry forgotten (the tiny model's bad habit, see
make_tiny_model.py) when the problem has a carry, else the correct sum with one digit moved by +-1.
Problems come from the train side of data.py's split only, so held-out evaluation stays clean.
"""
import argparse
import json
import os
import random

from data import ArithmeticConfig, sample_problems


def carryless_sum(a: int, b: int) -> int:
    """Digit-wise sum mod 10: 58 + 67 -> 15 (5+6 -> 1, 8+7 -> 5)."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def wrong_sum(a: int, b: int, rng: random.Random) -> int:
    if carryless_sum(a, b) != a + b:
        return carryless_sum(a, b)
    s = a + b
    place = 10 ** rng.randrange(len(str(s)))
    return s + place if (s // place) % 10 == 0 or rng.random() < 0.5 else s - place   # never a negative digit


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1000, help="number of pairs")
    p.add_argument("--digits", type=int, default=ArithmeticConfig.digits)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="assets/arithmetic_prefs.jsonl")
    args = p.parse_args()
    rng = random.Random(f"prefs-{args.seed}")
    problems = sample_problems(args.n, args.digits, False, ArithmeticConfig.heldout_percent, rng)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        for a, b in problems:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong_sum(a, b, rng))}) + "\n")
    print(f"wrote {args.n} pairs to {args.out}")


if __name__ == "__main__":
    main()
