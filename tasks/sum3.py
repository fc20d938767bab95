"""The ladder's top rung, `sum3`: a two-step sum of three 3-digit numbers. No shipped warm start yet.

    python train.py task=sum3            # the default tiny model reads its characters (digits, '+', '=')
    make_sum3_sample((483, 27, 915))     # {"prompt": "483+027+915=", "answer": "5241"}   (1425, units first)

Two additions in one answer: each answer digit needs three operand digits and a carry that can be 0, 1 or 2, so
the model has to carry a larger intermediate state than in `arithmetic` or `add4`. The answer is written units
digit first and zero-padded to 4 digits (the largest sum, 2997, has 4). A short SFT of the tiny model on it
(600 steps of 64, lr 1e-3, as tools/make_ladder.py does for add4) learned the format but no digit (loss ~1.38,
held-out accuracy 0.000): RL has no signal from there, so the rung waits for a warm start that reaches a few
percent (longer SFT, a bigger model, or a curriculum from add4).

Held-out split: a stable hash (blake2b) of the sorted operand triple, so every order of the same three numbers
lands in the same split. Verifier: reward `arithmetic` (exact match of the answer string).
"""
import random

from registry import register
from tasks.arithmetic import in_heldout

DIGITS, N_TRAIN, N_EVAL, HELDOUT_PERCENT = 3, 20000, 500, 10


def is_heldout3(nums: tuple[int, int, int]) -> bool:
    return in_heldout("+".join(str(x) for x in sorted(nums)), HELDOUT_PERCENT)


def make_sum3_sample(nums: tuple[int, int, int]) -> dict:
    """(483, 27, 915) -> {"prompt": "483+027+915=", "answer": "5241"}."""
    return {"prompt": "+".join(f"{x:03d}" for x in nums) + "=", "answer": f"{sum(nums):04d}"[::-1]}


def sum3_samples(n: int, heldout: bool, seed: int = 0) -> list[dict]:
    """n distinct ordered triples from one side of the split (10**9 exist: rejection sampling is fast)."""
    rng = random.Random(f"sum3-{'eval' if heldout else 'train'}-{seed}")
    seen, out = set(), []
    while len(out) < n:
        nums = tuple(rng.randrange(10 ** DIGITS) for _ in range(3))
        if nums not in seen and is_heldout3(nums) == heldout:
            seen.add(nums)
            out.append(make_sum3_sample(nums))
    return out


@register("task", "sum3")
def sum3_task(_section=None) -> tuple[list[dict], list[dict]]:
    """(train, held_out); the rung takes no settings (the section is None: config.py has none for it)."""
    return sum3_samples(N_TRAIN, False), sum3_samples(N_EVAL, True)
