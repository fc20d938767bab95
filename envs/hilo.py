"""The embedded multi-turn task, `hilo`: find a secret code from higher/lower feedback, one guess per turn.

    python train.py --config configs/multiturn.yaml      # task=hilo env.name=hilo model=assets/hilo-model

The secret is `digits` digits (default 3). Each assistant turn is a guess of as many digits; the environment
answers one character per digit: '=' right, '<' the secret's digit is lower, '>' it is higher. The episode
ends when the guess is right (reward 1, success), after `max_guesses` wrong guesses, or on a malformed guess
(reward 0). With the tiny model's character tokenizer a 4-guess episode reads (| marks the turns):

    prompt "?" | model "555<eos>" | observation "<><" | model "282<eos>" | observation ">>>" | model "394<eos>" | ...

One turn cannot solve it (1 code in 1000), four can: halving each digit's range finds any digit in 4 guesses.
The shipped warm start (tools/make_hilo_model.py) learned the format from a sloppy player that guesses each
digit uniformly inside the range the feedback leaves, which wins ~15% of episodes in 4 guesses (the model,
sampled, wins ~39%: its guesses are less spread than the player's); RL has to discover that guessing the middle
wins (configs/multiturn.yaml: 0.39 -> 0.93 held-out in 60 steps). `digit_reward` > 0 adds a per-turn reward for each newly found digit.

Held-out split: a code is held out when a stable hash of it falls in the first `heldout_percent` of 100
buckets (as tasks/arithmetic.py splits problems), so training never sees a held-out code.
"""
import random
from dataclasses import dataclass

from config import opt, section
from registry import register
from tasks.arithmetic import in_heldout


@section("hilo", "settings of the embedded multi-turn task (task=hilo, env.name=hilo)")
@dataclass
class HiloConfig:
    digits: int = opt(3, "length of the secret code (each digit 0-9)")
    n_eval: int = opt(100, "held-out secret codes for evaluation")
    heldout_percent: int = opt(10, "percent of all codes reserved for held-out (stable hash)")
    seed: int = opt(0, "seed for drawing the codes")

    def check(self, cfg) -> list:
        if cfg.task != "hilo":
            return []
        return [("digits", 1 <= self.digits <= 6, "1..6 (10**digits codes are listed)"),
                ("heldout_percent", 0 < self.heldout_percent < 100, "1..99"), ("n_eval", self.n_eval >= 1, ">= 1")]


def is_heldout(code: str, heldout_percent: int) -> bool:
    return in_heldout(code, heldout_percent)


def feedback(secret: str, guess: str) -> str:
    """secret '384', guess '555' -> '<><' (3 < 5, 8 > 5, 4 < 5)."""
    return "".join("=" if s == g else "<" if s < g else ">" for s, g in zip(secret, guess))


@register("env", "hilo")
class Hilo:
    def __init__(self, max_guesses: int = 4, digit_reward: float = 0.0):
        self.max_guesses, self.digit_reward = max_guesses, digit_reward
        self.secret, self.guesses, self.found = "", 0, set()

    def reset(self, fields: dict) -> str:
        self.secret, self.guesses, self.found = fields["secret"], 0, set()
        return fields["prompt"]

    def step(self, action: str):
        guess = action.strip()
        self.guesses += 1
        if len(guess) != len(self.secret) or not guess.isdigit():
            return None, 0.0, True, {"success": False, "invalid": True}
        if guess == self.secret:
            return None, 1.0 + self._newly_found(guess), True, {"success": True}
        shaped = self._newly_found(guess)
        if self.guesses >= self.max_guesses:
            return None, shaped, True, {"success": False}
        return feedback(self.secret, guess), shaped, False, {}

    @staticmethod
    def scripted_turn(fields: dict, history: list[str], rng: random.Random) -> str:
        """The warm start's sloppy player (tools/make_hilo_model.py): each digit uniform inside the range the feedback
        so far leaves for it, a consistent but aimless player (it wins ~15% of 4-guess episodes)."""
        lo, hi = [0] * len(fields["secret"]), [9] * len(fields["secret"])
        for guess, fb in zip(history[1::2], history[2::2]):   # history: prompt, guess, feedback, guess, ...
            for i, (f, g) in enumerate(zip(fb, guess)):
                d = int(g)
                lo[i], hi[i] = (d + 1, hi[i]) if f == ">" else (lo[i], d - 1) if f == "<" else (d, d)
        return "".join(str(rng.randint(a, b)) for a, b in zip(lo, hi))

    def _newly_found(self, guess: str) -> float:
        new = {i for i, (s, g) in enumerate(zip(self.secret, guess)) if s == g} - self.found
        self.found |= new
        return self.digit_reward * len(new)


@register("task", "hilo")
def hilo_task(cfg: HiloConfig) -> tuple[list[dict], list[dict]]:
    """(train, held_out) rows {"prompt": "?", "secret": "384"}; every code of each side, shuffled."""
    codes = [f"{i:0{cfg.digits}d}" for i in range(10 ** cfg.digits)]
    random.Random(f"hilo-{cfg.seed}").shuffle(codes)
    train = [c for c in codes if not is_heldout(c, cfg.heldout_percent)]
    held = [c for c in codes if is_heldout(c, cfg.heldout_percent)][:cfg.n_eval]
    return [{"prompt": "?", "secret": c} for c in train], [{"prompt": "?", "secret": c} for c in held]
