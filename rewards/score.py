"""A reward value that carries the failures behind it, for rewards/pool.py to count and log.

    from rewards.score import Score
    return Score(0.5, [("timeout", "case 1: wall time limit 5s exceeded")])   # anywhere a float goes

It imports nothing, so a reward module can return it without importing the pool.
"""

CATEGORIES = ("timeout", "memory", "output_limit", "signal", "setup", "error", "wrong_answer")


class Score(float):
    """Everywhere else it is the float; the pool reads `.failures`: [(category from CATEGORIES, reason)]."""

    def __new__(cls, value, failures=()):
        self = super().__new__(cls, value)
        self.failures = [(str(c), str(r)) for c, r in failures]
        return self

    def __reduce__(self):
        return Score, (float(self), self.failures)
