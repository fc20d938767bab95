"""Environments for tests/test_multiturn.py. Their own module, without torch, so the environment workers (which
import an environment's module by name) start fast. `echo` plays nicely; the others break the contract."""
import os
import time

from registry import register


@register("env", "echo")
class Echo:
    """Answers every turn with `obs` for `turns` turns, reward 0.5 per turn, success at the end."""

    def __init__(self, turns: int = 3, obs: str = "<>="):
        self.turns, self.obs, self.n = turns, obs, 0

    def reset(self, fields):
        return fields["prompt"]

    def step(self, action):
        self.n += 1
        done = self.n >= self.turns
        return (None if done else self.obs), 0.5, done, {"success": done}


@register("env", "hostile")
class Hostile:
    """What step() does depends on the row's `mode`: raise, hang, huge, wrong_type, die, bad_reward, or fine."""

    def __init__(self):
        self.mode = "fine"

    def reset(self, fields):
        self.mode = fields["mode"]
        if self.mode == "reset_raises":
            raise RuntimeError("cannot reset")
        return fields["prompt"]

    def step(self, action):
        if self.mode == "raise":
            raise ValueError("the environment is broken")
        if self.mode == "hang":
            time.sleep(600)
        if self.mode == "huge":
            return "9" * 10_000_000, 0.0, False, {}
        if self.mode == "wrong_type":
            return ["not", "a", "tuple"]
        if self.mode == "bad_reward":
            return "1", float("nan"), False, {}
        if self.mode == "die":
            os._exit(7)
        return None, 1.0, True, {"success": True}
