"""Per-step reward functions for tests/test_step_rewards.py, in a module without torch so that the reward pool's
workers (which import a reward's module by name) start fast."""
from rewards.score import split_steps, step_separator


def ok_steps(prompt, completion, **fields):
    """1 for each step that holds 'ok', else 0: a list as long as the pool counts steps."""
    return [float("ok" in s) for s in split_steps(completion, step_separator(fields, ok_steps))]


def one_too_many(prompt, completion, **fields):
    return [1.0] * (len(split_steps(completion, step_separator(fields))) + 1)


def short_plus_steps(prompt, completion, **fields):
    """Steps cut at '+' (the reward's declared separator): 1 for a step of at most 2 characters."""
    return [float(len(s) <= 2) for s in split_steps(completion, step_separator(fields, short_plus_steps))]


short_plus_steps.step_separator = "+"


def batched_steps(prompts, completions, fields, **kw):
    """A batched reward: one list of step scores per sample; 'bad' gets a list of the wrong length."""
    return [[0.5] * (len(split_steps(c)) + (c == "bad")) for c in completions]


batched_steps.batched = True
