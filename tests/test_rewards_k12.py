"""K-12 short-answer reward: normalised strings and numbers within tolerance."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.k12 import extract_prediction, k12_reward  # noqa: E402


@pytest.mark.parametrize("completion,answer,score", [
    ("<answer>Paris</answer>", "paris", 1.0),
    ("The Mitochondria.", "mitochondria", 1.0),
    ("I believe the answer is: Élan!", "elan", 1.0),
    ("Answer: 25%", "0.25", 1.0),
    ("1,000 cm", "1000", 1.0),
    ("3/4", "0.75", 1.0),
    ("-2.5e3", "-2500", 1.0),
    ("The answer is 3.14", "3.1416", 0.0),                # outside the default 1e-4 tolerance
    ("The answer is London", "paris", 0.0),
    ("photo synthesis", "photosynthesis", 0.0),
    ("12", "120", 0.0),
    ("", "", 0.0),                                        # nothing never matches nothing
])
def test_matching(completion, answer, score):
    assert k12_reward("q", completion, answer=answer) == score


def test_tolerance_and_several_accepted_answers():
    assert k12_reward("q", "The answer is 3.14", answer="3.1416", rel_tol=1e-3) == 1.0
    assert k12_reward("q", "photo-synthesis", answer=["photosynthesis", "photo-synthesis"]) == 1.0


def test_prediction_extraction():
    assert extract_prediction("work\nwork\nThe answer is 7 apples") == "7 apples"
    assert extract_prediction("line one\n\n  last line \n") == "  last line "
    with pytest.raises(ValueError, match="no 'answer' field"):
        k12_reward("q", "7")
