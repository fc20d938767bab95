"""Ladder rung 1, `add4`: 4-digit addition (one more carry position than the default task's 3 digits).

    python train.py task=add4 model=assets/ladder-add4
    get("task", "add4")(None)[1][0]      # {"prompt": "0809+8809=", "answer": "81690"}   (9618, units first)

The format is tasks/arithmetic.py's with digits=4 (operands zero-padded, the sum units digit first and 5 wide),
as is its held-out split (a stable hash of the unordered operand pair) and its verifier, reward `arithmetic`
(exact match of the answer string). What makes it a harder rung for the 2-layer tiny model: 8 operand digits to
attend to instead of 6, a longer carry chain, and a warm start that has seen few 4-digit sums
(tools/make_ladder.py). The rung has no settings section: its sizes are fixed below, so every run of the
ladder sees the same train and held-out problems.
"""
import random

from registry import register
from tasks.arithmetic import make_sample, sample_problems

DIGITS, N_TRAIN, N_EVAL, HELDOUT_PERCENT = 4, 20000, 500, 10


def add4_samples(n: int, heldout: bool, seed: int = 0) -> list[dict]:
    """n distinct problems from one side of the split (seeded stream per side), as {"prompt", "answer"}."""
    rng = random.Random(f"add4-{'eval' if heldout else 'train'}-{seed}")
    return [make_sample(a, b, DIGITS) for a, b in sample_problems(n, DIGITS, heldout, HELDOUT_PERCENT, rng)]


@register("task", "add4")
def add4_task(_section=None) -> tuple[list[dict], list[dict]]:
    """(train, held_out); the rung takes no settings (the section is None: config.py has none for it)."""
    return add4_samples(N_TRAIN, False), add4_samples(N_EVAL, True)
