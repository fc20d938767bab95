"""Vision reward: the answer to a question about a picture (counting, a value read from a chart, multiple choice).

    vision_reward(prompt, "3", answer="3")                                      # -> 1.0  (a count)
    vision_reward(prompt, "the answer is 12.5", answer="12.5")                  # -> 1.0  (a value, K-12 tolerance)
    vision_reward(prompt, "(B) the square", answer="b", choices="ab")           # -> 1.0  (multiple choice)
    vision_reward(prompt, "x = \\frac{1}{2}", answer="1/2")                     # -> 1.0  (an expression: math-verify)
    # config: rewards=vision   (sample fields: "answer", and "choices" when the question is multiple choice)

The picture itself plays no part: the reward judges the text answer against the row's reference. How it reads:
  * multiple choice: the row names its option letters in `choices` (e.g. "abcd"), or the reference is one letter
    (then the options are a-e, or up to the reference's letter);
    the prediction is the first option letter that stands alone ("b", "(b)", "b)", "b." or "answer: b"), case
    ignored. Two different letters standing alone score 0: hedging is not an answer.
  * a number or a word: rewards/k12.py's prediction and match (normalised text, numbers within rel_tol);
  * else an expression: rewards/math.py's math-verify equivalence.
"""
import re

from registry import register
from rewards.k12 import extract_prediction, matches, to_numbers
from rewards.math import is_equivalent


def choice_letters(answer: str, choices) -> str:
    if choices:
        return "".join(choices).lower()
    if len(answer) == 1 and answer.isalpha():   # options a..e at least, so that "a or b" is not read as "a"
        return "abcdefghijklmnopqrstuvwxyz"[:max(5, ord(answer.lower()) - ord("a") + 1)]
    return ""


def chosen(completion: str, letters: str) -> str | None:
    """The option letter the completion picks, or None (no letter, or two different ones standing alone)."""
    found = {m.lower() for m in re.findall(rf"(?<![a-z])([{letters}])(?![a-z])", completion.lower())}
    return found.pop() if len(found) == 1 else None


@register("reward", "vision")
def vision_reward(prompt: str, completion: str, answer=None, choices=None, rel_tol: float = 1e-4, **fields) -> float:
    if answer is None:
        raise ValueError("vision reward: the sample has no 'answer' field")
    answer = str(answer).strip()
    letters = choice_letters(answer, choices)
    if letters:
        return 1.0 if chosen(extract_prediction(completion) or completion, letters) == answer.lower() else 0.0
    prediction = extract_prediction(completion)
    if to_numbers(answer) or re.fullmatch(r"[\w\s-]+", answer):
        return 1.0 if matches(prediction, answer, rel_tol, 1e-9) else 0.0
    return 1.0 if is_equivalent(completion, answer) else 0.0
