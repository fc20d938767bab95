"""Ladder rung 3, `sum3`: a two-step sum of three 3-digit numbers.

    python train.py task=sum3 model=assets/ladder-sum3
    get("task", "sum3")(None)[0][0]  # {"prompt": "483+027+915=", "answer": "5241"}   (1425, units first)

Two additions in one answer: each answer digit needs three operand digits and a carry that can be 0, 1 or 2, so
the model has to carry a larger intermediate state than in `arithmetic` or `add4`. The answer is written units
digit first and zero-padded to 4 digits (the largest sum, 2997, has 4).

Held-out split: a stable hash (blake2b) of the sorted operand triple, so every order of the same three numbers
lands in the same split. Verifier: reward `arithmetic` (exact match of the answer string).
"""
import hashlib
import random

from registry import register

DIGITS, N_TRAIN, N_EVAL, HELDOUT_PERCENT = 3, 20000, 500, 10


def is_heldout3(nums: tuple[int, int, int]) -> bool:
    key = "+".join(str(x) for x in sorted(nums)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 100 < HELDOUT_PERCENT


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
