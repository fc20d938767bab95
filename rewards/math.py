"""Math reward: 1.0 when the completion's final answer equals the reference answer, else 0.0.

    math_reward(prompt, "... so the total is \\boxed{\\frac{1}{2}}", answer="0.5")   # -> 1.0
    # config: rewards=math:1.0   (the sample field "answer" holds the reference)

Extraction and equivalence are math-verify's (boxed answers, fractions, LaTeX, sets, intervals,
symbolic expressions compared with sympy), not a hand-written matcher. Two additions:
  * a completion with an <answer>...</answer> block is judged on that block only;
  * a GSM8K-style reference ("reasoning ... #### 72") is cut to what follows "####".
math-verify enforces its own time limits with signal.alarm, which only works in a main thread; off the
main thread they are switched off, and the caller must bound the time (the reward pool's worker
processes do: a call past its deadline has its worker killed).
"""
import logging
import re
import threading

from registry import register

logging.getLogger("math_verify").setLevel(logging.ERROR)   # it warns on every call with timeouts off
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TIMEOUT_S = 5


def _timeout():
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse(text: str, parsing_timeout):
    # imported on first use: a run without the math reward (a GPU box without math-verify) still starts
    from math_verify import parse as mv_parse
    return mv_parse(text, parsing_timeout=parsing_timeout)


def verify(gold, pred, timeout_seconds):
    from math_verify import verify as mv_verify
    return mv_verify(gold, pred, timeout_seconds=timeout_seconds)


def parse_reference(answer: str):
    answer = str(answer).split("####")[-1].strip()
    gold = parse(answer, parsing_timeout=_timeout())
    if not gold:                        # bare LaTeX such as "\frac{1}{2}" parses once it is math mode
        gold = parse(f"${answer}$", parsing_timeout=_timeout())
    if not gold:
        raise ValueError(f"math reward: cannot parse the reference answer {answer!r:.80}")
    return gold


def is_equivalent(completion: str, answer: str) -> bool:
    tagged = ANSWER_TAG.findall(completion)
    text = tagged[-1] if tagged else completion
    pred = parse(text, parsing_timeout=_timeout())
    return bool(pred) and verify(parse_reference(answer), pred, timeout_seconds=_timeout())


@register("reward", "math")
def math_reward(prompt: str, completion: str, answer=None, **fields) -> float:
    if answer is None:
        raise ValueError("math reward: the sample has no 'answer' field")
    return 1.0 if is_equivalent(completion, answer) else 0.0
