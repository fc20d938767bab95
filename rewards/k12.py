"""K-12 short-answer reward: normalised string match or numeric match within a tolerance.

    k12_reward(prompt, "<answer>Paris</answer>", answer="paris")            # -> 1.0
    k12_reward(prompt, "The answer is 3.14", answer="3.1416", rel_tol=1e-3)  # -> 1.0
    k12_reward(prompt, "photosynthesis", answer=["photosynthesis", "photo-synthesis"])
    # config: rewards=k12:1.0   (sample field "answer": one accepted answer or a list of them)

For short factual answers (a word, a name, a number with maybe a unit) where math-verify's symbolic
equivalence is the wrong tool. The prediction is the <answer> block if there is one, else what follows
the last "answer is"/"Answer:", else the last non-empty line. Both sides are normalised: lower case,
accents and punctuation removed, articles (a/an/the) dropped, whitespace collapsed. Numbers ("1,000",
"3/4", "25%", "-2.5e3", a trailing unit word) compare with rel_tol / abs_tol; "25%" also equals 0.25.
"""
import math
import re
import unicodedata
from fractions import Fraction

from registry import register

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
ANSWER_IS = re.compile(r"(?:answer is|answer:)\s*(.+)", re.IGNORECASE)
NUMBER = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?(?:/\d+)?)\s*(%?)\s*([a-z]*)$")


def extract_prediction(completion: str) -> str:
    tagged = ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1]
    said = ANSWER_IS.findall(completion)
    if said:
        return said[-1]
    lines = [line for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFKD", str(text)).encode("ascii", "ignore").decode().lower()
    text = re.sub(r"[^\w\s.%/+-]", " ", text).strip(" .")        # keep what numbers need
    words = [w for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


def to_numbers(text: str) -> list[float]:
    """'25%' -> [25.0, 0.25]; '3/4 cups' -> [0.75]; not a number -> []."""
    m = NUMBER.match(normalize(str(text).replace(",", "")))
    if not m:
        return []
    try:
        value = float(Fraction(m.group(1))) if "/" in m.group(1) else float(m.group(1))
    except (ValueError, ZeroDivisionError):
        return []
    return [value, value / 100] if m.group(2) else [value]


def matches(prediction: str, answer: str, rel_tol: float, abs_tol: float) -> bool:
    pred_nums, gold_nums = to_numbers(prediction), to_numbers(answer)
    if pred_nums and gold_nums:
        return any(math.isclose(p, g, rel_tol=rel_tol, abs_tol=abs_tol) for p in pred_nums for g in gold_nums)
    return normalize(prediction) == normalize(answer) != ""


@register("reward", "k12")
def k12_reward(prompt: str, completion: str, answer=None, rel_tol: float = 1e-4, abs_tol: float = 1e-9,
               **fields) -> float:
    if answer is None:
        raise ValueError("k12 reward: the sample has no 'answer' field")
    answers = answer if isinstance(answer, (list, tuple)) else [answer]
    prediction = extract_prediction(completion)
    return 1.0 if any(matches(prediction, str(a), rel_tol, abs_tol) for a in answers) else 0.0
