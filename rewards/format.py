"""Format reward: partial credit for the `<think>...</think><answer>...</answer>` layout.

    format_reward(prompt, "<think>2+2=4</think> <answer>4</answer>")    # -> 1.0
    format_reward(prompt, "<answer>4</answer>")                          # -> 0.5
    # config: rewards=math:1.0,format:0.2

Five checks, 0.2 each (so a model is rewarded for each step towards the layout, not only for all of it):
  1. exactly one non-empty <think>...</think> block
  2. exactly one non-empty <answer>...</answer> block
  3. the think block comes before the answer block
  4. nothing but whitespace before the first block
  5. nothing but whitespace after </answer>
Tags are matched literally and case-sensitively, as the chat templates that ask for them write them.
"""
import re

from registry import register

THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_checks(completion: str) -> dict[str, bool]:
    think, answer = list(THINK.finditer(completion)), list(ANSWER.finditer(completion))
    one_think = len(think) == 1 and completion.count("<think>") == 1 and bool(think[0].group(1).strip())
    one_answer = len(answer) == 1 and completion.count("<answer>") == 1 and bool(answer[0].group(1).strip())
    first = min(think[:1] + answer[:1], key=lambda m: m.start(), default=None)
    return {
        "think_block": one_think,
        "answer_block": one_answer,
        "think_before_answer": one_think and one_answer and think[0].end() <= answer[0].start(),
        "nothing_before": first is not None and not completion[:first.start()].strip(),
        "nothing_after": bool(answer) and not completion[answer[-1].end():].strip(),
    }


@register("reward", "format")
def format_reward(prompt: str, completion: str, **fields) -> float:
    checks = format_checks(completion)
    return sum(checks.values()) / len(checks)
