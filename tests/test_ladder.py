"""Tests of the task ladder: tasks/add4.py, mul2.py, sum3.py (generators, splits, verifier) and its shipped
warm starts (assets/ladder-<rung>/, tools/make_ladder.py). Seconds in all.

    .venv/bin/python -m pytest tests/test_ladder.py -q
"""
import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tasks  # noqa: E402,F401  (registers the rungs)
from config import Config  # noqa: E402
from config_checks import validate  # noqa: E402
from registry import get  # noqa: E402
from tasks.add4 import add4_samples  # noqa: E402
from tasks.arithmetic import arithmetic_reward, is_heldout  # noqa: E402
from tasks.mul2 import make_mul_sample, mul2_samples  # noqa: E402
from tasks.sum3 import is_heldout3, make_sum3_sample, sum3_samples  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNGS = ("add4", "mul2", "sum3")   # sum3: the task only (no warm start shipped)


@functools.cache
def rung_rows(rung: str) -> tuple[list[dict], list[dict]]:
    """(train, held_out) of a rung, built once per test session (20,000 rows take ~0.5 s)."""
    return get("task", rung)(None)


def operands(prompt: str, op: str) -> list[int]:
    return [int(x) for x in prompt.removesuffix("=").split(op)]


def test_examples_in_the_docstrings():
    assert make_mul_sample(47, 38) == {"prompt": "47*38=", "answer": "6871"}
    assert make_mul_sample(3, 5) == {"prompt": "03*05=", "answer": "5100"}
    assert make_sum3_sample((483, 27, 915)) == {"prompt": "483+027+915=", "answer": "5241"}
    assert add4_samples(1, True)[0] == {"prompt": "0809+8809=", "answer": "81690"}


@pytest.mark.parametrize("rows, op, width, value", [
    (add4_samples(300, False) + add4_samples(100, True), "+", 5, sum),
    (mul2_samples(300, False) + mul2_samples(100, True), "*", 4, lambda x: x[0] * x[1]),
    (sum3_samples(300, False) + sum3_samples(100, True), "+", 4, sum)])
def test_answers_are_right_units_first_and_fixed_width(rows, op, width, value):
    for r in rows:
        nums = operands(r["prompt"], op)
        assert r["answer"] == f"{value(nums):0{width}d}"[::-1] and len(r["answer"]) == width
    assert len({r["prompt"] for r in rows}) == len(rows)          # distinct problems


def test_splits_are_disjoint_and_by_unordered_operands():
    for a, b in (operands(r["prompt"], "+") for r in add4_samples(200, True)):
        assert is_heldout(a, b, 10) and is_heldout(b, a, 10)
    for a, b in (operands(r["prompt"], "*") for r in mul2_samples(200, False)):
        assert not is_heldout(a, b, 10)
    for nums in (tuple(operands(r["prompt"], "+")) for r in sum3_samples(200, True)):
        assert is_heldout3(nums) and is_heldout3(nums[::-1])
    for rung in RUNGS:
        train, held = rung_rows(rung)
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert get("task", "mul2")(None) == rung_rows("mul2")         # deterministic (the smallest rung)


def test_verifier_scores_the_rungs_answers():
    for rung in RUNGS:
        row = rung_rows(rung)[1][0]
        assert arithmetic_reward(row["prompt"], row["answer"] + "<eos>3", row["answer"]) == 1.0
        wrong = row["answer"][:-1] + str((int(row["answer"][-1]) + 1) % 10)
        assert arithmetic_reward(row["prompt"], wrong, row["answer"]) == 0.0
        assert arithmetic_reward(row["prompt"], row["answer"][::-1] + "0", row["answer"]) == 0.0


def test_unknown_rung_is_one_line_listing_the_tasks():
    with pytest.raises(KeyError) as e:   # registry.RegistryError: train.py prints it as one line
        validate(Config(task="add5"))
    assert "add5" in str(e.value) and all(r in str(e.value) for r in RUNGS) and "\n" not in str(e.value)


@pytest.mark.parametrize("rung", ("add4", "mul2"))
def test_shipped_warm_start_tokenizes_the_rung(rung):
    from transformers import AutoTokenizer
    path = os.path.join(ROOT, "assets", f"ladder-{rung}")
    tok = AutoTokenizer.from_pretrained(path)
    row = rung_rows(rung)[1][0]
    ids = tok.encode(row["prompt"] + row["answer"])
    assert len(ids) == len(row["prompt"] + row["answer"]) and tok.unk_token_id not in ids
    assert tok.decode(ids) == row["prompt"] + row["answer"]
