"""Format reward: partial credit, one fifth per check."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.format import format_checks, format_reward  # noqa: E402


@pytest.mark.parametrize("completion,score", [
    ("<think>2+2=4</think>\n<answer>4</answer>", 1.0),
    ("  <think>a</think><answer>4</answer>\n", 1.0),
    ("<answer>4</answer>", 0.6),                               # answer block, nothing before/after
    ("<think>a</think><answer>4</answer> trailing", 0.8),
    ("Sure! <think>a</think><answer>4</answer>", 0.8),
    ("<answer>4</answer><think>a</think>", 0.6),                 # wrong order, text after the answer
    ("<think></think><answer>4</answer>", 0.6),                  # an empty think block earns nothing
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.6),
    ("<think>a</think><answer>4", 0.4),                          # unclosed answer: no answer, no order
    ("The answer is 4.", 0.0),
])
def test_partial_credit(completion, score):
    assert format_reward("q", completion) == pytest.approx(score)


def test_checks_are_named():
    checks = format_checks("<answer>4</answer><think>a</think>")
    assert checks == {"think_block": True, "answer_block": True, "think_before_answer": False,
                      "nothing_before": True, "nothing_after": False}
