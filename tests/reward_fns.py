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
