"""Math reward on real answers: equivalent forms score 1, different answers 0."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.math import math_reward  # noqa: E402

EQUIVALENT = [
    ("72", "Natalia sold 48 + 24 = 72 clips. The answer is \\boxed{72}."),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "So she sold $72$ clips altogether."),  # GSM8K reference
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "The probability is \\boxed{0.5}"),
    ("1,000", "\\boxed{1000}"),
    ("$\\sqrt{2}/2$", "$\\frac{1}{\\sqrt{2}}$"),
    ("$x^2+2x+1$", "Expanding, we get $\\boxed{(x+1)^2}$"),
    ("$\\{1,2\\}$", "$\\boxed{\\{2,1\\}}$"),
    ("3", "<think>1+2</think><answer>3</answer>"),
]
DIFFERENT = [
    ("72", "\\boxed{71}"),
    ("72", "I think 72 or maybe 73"),            # the final answer counts, not any mention
    ("0.5", "\\boxed{\\frac{1}{3}}"),
    ("$x^2+2x+1$", "$\\boxed{(x-1)^2}$"),
    ("3", "<think>the answer is 3</think><answer>4</answer>"),
    ("5", "I don't know."),
]


@pytest.mark.parametrize("answer,completion", EQUIVALENT)
def test_equivalent_answers_score_one(answer, completion):
    assert math_reward("q", completion, answer=answer) == 1.0


@pytest.mark.parametrize("answer,completion", DIFFERENT)
def test_different_answers_score_zero(answer, completion):
    assert math_reward("q", completion, answer=answer) == 0.0


def test_off_main_thread_it_still_works():
    # math-verify's own timeouts use signal.alarm; the reward switches them off in threads
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(math_reward, "q", "\\boxed{\\frac{2}{4}}", answer="0.5").result() == 1.0


def test_missing_answer_is_named():
    with pytest.raises(ValueError, match="no 'answer' field"):
        math_reward("q", "\\boxed{1}")
