"""Ladder rung 2, `mul2`: 2-digit by 2-digit multiplication.

    python train.py task=mul2 model=assets/ladder-mul2
    make_mul_sample(47, 38)              # {"prompt": "47*38=", "answer": "6871"}   (47*38 = 1786, units first)

Operands are uniform in [0, 100), zero-padded to 2 digits; the product is written units digit first and
zero-padded to 4 digits, as tasks/arithmetic.py writes sums (each answer digit then depends on operand digits
and on carries already written). Unlike a sum, every product digit but the first needs several partial products
and a carry that can exceed 1, which is why it is the harder rung for the 2-layer tiny model. The '*' character
is not in the default tiny model's vocabulary: the ladder's models (tools/make_ladder.py) add it.

Held-out split: tasks/arithmetic.py's stable hash of the unordered operand pair (A*B and B*A land together);
10,000 ordered pairs exist, so the train side holds ~9,000 and the task draws 4,000 of them.
Verifier: reward `arithmetic` (exact match of the answer string, no partial credit).
"""
import random

from registry import register
from tasks.arithmetic import sample_problems

DIGITS, N_TRAIN, N_EVAL, HELDOUT_PERCENT = 2, 4000, 400, 10
MUL_CHAR = "*"


def make_mul_sample(a: int, b: int) -> dict:
    """47, 38 -> {"prompt": "47*38=", "answer": "6871"} (47*38 = 1786 written units first, 4 wide)."""
    return {"prompt": f"{a:02d}{MUL_CHAR}{b:02d}=", "answer": f"{a * b:04d}"[::-1]}


def mul2_samples(n: int, heldout: bool, seed: int = 0) -> list[dict]:
    rng = random.Random(f"mul2-{'eval' if heldout else 'train'}-{seed}")
    return [make_mul_sample(a, b) for a, b in sample_problems(n, DIGITS, heldout, HELDOUT_PERCENT, rng)]


@register("task", "mul2")
def mul2_task(_section=None) -> tuple[list[dict], list[dict]]:
    """(train, held_out); the rung takes no settings (the section is None: config.py has none for it)."""
    return mul2_samples(N_TRAIN, False), mul2_samples(N_EVAL, True)
