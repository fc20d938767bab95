"""Verifier for the synthetic arithmetic task (data.py): 1.0 for the exact sum, else 0.0.

    from registry import get
    get("reward", "arithmetic")(prompt="483+027=", completion="0150", answer="0150")  # -> 1.0

How the answer is read from a completion: everything from the first end-of-sequence marker on is
dropped (the tiny model's "<eos>", in case the caller decoded special tokens; normally the loop decodes
with skip_special_tokens=True and there is none), then surrounding whitespace is stripped. What is left
must equal the answer string exactly (data.py writes sums units digit first, fixed width: 483+027 ->
"0150"). For answer "0150": "0150", " 0150 ", "0150<eos>7" score 1.0; "015", "510", "0510", "01500",
"0 150", "" score 0.0. No partial credit: a dense per-digit reward would tell the policy where it
went wrong, which makes the task easier than a verifier that only checks the final answer (the
setting this codebase is for).
"""
from data import EOS_TEXT
from registry import register


def extract_answer(completion: str) -> str:
    return completion.split(EOS_TEXT, 1)[0].strip()


@register("reward", "arithmetic")
def arithmetic_reward(prompt: str, completion: str, answer: str, **_) -> float:
    return 1.0 if extract_answer(completion) == answer else 0.0
