"""A reward value that carries the failures behind it, for rewards/pool.py to count and log; per-step scores.

    from rewards.score import Score
    return Score(0.5, [("timeout", "case 1: wall time limit 5s exceeded")])   # anywhere a float goes

It imports nothing of the project, so a reward module can return it without importing the pool.
"""
import math

CATEGORIES = ("timeout", "memory", "output_limit", "signal", "setup", "error", "wrong_answer")


class Score(float):
    """Everywhere else it is the float; the pool reads `.failures`: [(category from CATEGORIES, reason)]."""

    def __new__(cls, value, failures=()):
        self = super().__new__(cls, value)
        self.failures = [(str(c), str(r)) for c, r in failures]
        return self

    def __reduce__(self):
        return Score, (float(self), self.failures)


def read_value(out) -> tuple[float, list[float] | None, str | None]:
    """A reward's return -> (value, its step scores or None, the error or None): a number, or a list (tuple) of
    step scores whose value is their sum. Raises on what is neither (the caller records it)."""
    steps = [float(x) for x in out] if isinstance(out, (list, tuple)) else None
    value = math.fsum(steps) if steps is not None else float(out)
    bad = [v for v in (steps or [value]) if not math.isfinite(v)]
    return value, steps, f"non-finite value {bad[0]}" if bad else None


# ------------------------------------------------------------------------------------ per-step (process) rewards
# A reward may return a list of numbers instead of one: a score per step of the completion. The steps are the
# completion cut after each separator (STEP_SEPARATOR, a line, unless the row's `step_separator` field or the
# reward's `step_separator` attribute names another), the separator staying with the step it ends. A piece that
# is only whitespace (a blank line) joins the step before it, so "a\n\nb" is two steps; the text after the last
# separator is a step of its own, trailing separator or not. Rewards that score steps call `split_steps` to cut
# the completion as the pool counts it: a list of another length is a recorded failure (rewards/pool.py).

STEP_SEPARATOR = "\n"


def step_separator(fields: dict, fn=None) -> str:
    """The separator in force for a sample: the row's `step_separator` field, else the reward's attribute, else a line."""
    sep = fields.get("step_separator") or getattr(fn, "step_separator", None) or STEP_SEPARATOR
    if not isinstance(sep, str):
        raise ValueError(f"step_separator must be a non-empty string, got {sep!r}")
    return sep


def step_ends(text: str, sep: str = STEP_SEPARATOR) -> list[int]:
    """The character offset just past each step's end (exclusive); the last one is len(text). At least one step:
    an empty or blank completion is one step."""
    pieces = text.split(sep)
    ends, at = [], 0
    for k, piece in enumerate(pieces):
        at += len(piece) + (len(sep) if k < len(pieces) - 1 else 0)
        if ends and not ends[-1][1]:                # the steps so far are blank: this one takes them in
            ends[-1] = (at, bool(piece.strip()))
        elif piece.strip() or not ends:
            ends.append((at, bool(piece.strip())))
        else:                                       # a blank piece belongs to the step before it
            ends[-1] = (at, True)
    return [e for e, _ in ends]


def split_steps(text: str, sep: str = STEP_SEPARATOR) -> list[str]:
    """The completion's steps as text, as the pool counts them (their concatenation is the text)."""
    starts = [0] + step_ends(text, sep)[:-1]
    return [text[a:b] for a, b in zip(starts, step_ends(text, sep))]
