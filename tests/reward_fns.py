"""Reward functions for tests/test_rewards_pool.py. They live in their own module, which imports no torch,
so that the pool's worker processes (which import a reward's module by name) start in well under a second."""
import os
import time


def length(prompt, completion, **fields):
    return float(len(completion))


def matches(prompt, completion, answer="", **fields):
    return float(completion.strip() == answer)


def flaky(prompt, completion, **fields):
    if completion == "boom":
        raise RuntimeError("cannot score this")
    if completion == "nan":
        return float("nan")
    if completion == "hang":
        time.sleep(60)
    if completion == "die":
        os._exit(3)
    return 1.0


def slow(prompt, completion, **fields):
    time.sleep(float(completion))
    return 1.0


def batched_len(prompts, completions, fields, scale=1.0):
    return [scale * len(c) for c in completions]


batched_len.batched = True


def length_penalty(prompt, completion, completion_tokens, max_new_tokens, buffer=4, **fields):
    """0 up to buffer tokens before the limit, then down linearly to -1 at it (DAPO's soft overlong penalty)."""
    return -min(1.0, max(0, completion_tokens - (max_new_tokens - buffer)) / buffer)


def field_count(prompt, completion, **fields):
    return float(len(fields))


def batched_share(prompts, completions, fields, completion_tokens, max_new_tokens):
    return [n / max_new_tokens for n in completion_tokens]


batched_share.batched = True
