"""The embedded default task, `arithmetic`: synthetic, verifiable prompts with a held-out split, and its verifier.

    from registry import get
    train, held_out = get("task", "arithmetic")(ArithmeticConfig())
    train[0]  # {"prompt": "483+027=", "answer": "0150"}

`arithmetic` is integer addition of two operands of up to `digits` digits, in a fixed-width format:
the prompt is "A+B=" with both operands zero-padded to `digits` digits, and the expected completion
is the sum written units digit first and zero-padded to `digits + 1` digits (483+27 = 510 is asked as
"483+027=" and answered "0150"), followed by the tokenizer's EOS. Units first is the order in which
one adds by hand: each answer digit needs only two operand digits and the carry from the digit just
written, whereas a most-significant-first answer needs the whole carry chain at its first token.
Measured here with the 2-layer tiny model of tools/make_tiny_model.py: most-significant-first, supervised
training was still near chance after 1200 steps; units-first it learns addition within ~800-1000
steps (a 4-layer model learns either, at twice the cost per step; Lee et al. 2023, "Teaching
Arithmetic to Small Transformers", report the same effect of reversed answers). Fixed width keeps each operand digit at a fixed position and every answer the same length.
The tiny model uses a character tokenizer, so every character is one token.

Held-out split: a problem belongs to the held-out split when a stable hash (blake2b, not Python's
salted hash()) of its unordered operand pair falls in the first `heldout_percent` of 100 buckets.
The split therefore does not depend on the seed or on how many samples are drawn, "A+B" and "B+A"
always land in the same split, and every other user of the task (the RL train set, the SFT data of
tools/make_tiny_model.py) draws from the train side only, so nothing held out is ever trained on.
"""
import hashlib
import random
from dataclasses import dataclass

from config import opt, section
from registry import register


@section("arithmetic", "settings of the embedded arithmetic task")
@dataclass
class ArithmeticConfig:
    digits: int = opt(3, "operands are uniform integers in [0, 10**digits)")
    n_train: int = opt(20000, "distinct training problems (RL prompts)")
    n_eval: int = opt(500, "distinct held-out problems for evaluation")
    heldout_percent: int = opt(10, "percent of all problems reserved for held-out (stable hash)")
    seed: int = opt(0, "seed for drawing the train and held-out samples")

    def check(self, cfg) -> list:
        if cfg.task != "arithmetic":
            return []
        return [("digits", 1 <= self.digits <= 9, "1..9"), ("heldout_percent", 0 < self.heldout_percent < 100, "1..99"),
                ("n_train", self.n_train >= 1, ">= 1"), ("n_eval", self.n_eval >= 1, ">= 1")]

# The tiny model's character vocabulary (tools/make_tiny_model.py): every prompt and answer character is one
# token. The special tokens are spelled here so that the verifier can strip them from decoded text.
PAD_TEXT, EOS_TEXT = "<pad>", "<eos>"
CHARS = "0123456789+="


def in_heldout(key: str, heldout_percent: int) -> bool:
    """True when key's bucket of 100 under a stable hash (blake2b, not Python's salted hash()) is below
    heldout_percent: the held-out split of every embedded task (arithmetic, sum3, shapes, hilo), each with its key."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % 100 < heldout_percent


def is_heldout(a: int, b: int, heldout_percent: int) -> bool:
    """True when the problem {a, b} (order ignored) belongs to the held-out split."""
    return in_heldout(f"{min(a, b)}+{max(a, b)}", heldout_percent)


def make_sample(a: int, b: int, digits: int) -> dict:
    """483, 27, 3 -> {"prompt": "483+027=", "answer": "0150"} (sum units digit first, digits + 1 wide)."""
    A, B, S = f"{a:0{digits}d}", f"{b:0{digits}d}", f"{a + b:0{digits + 1}d}"
    return {"prompt": f"{A}+{B}=", "answer": S[::-1]}


def sample_problems(n: int, digits: int, heldout: bool, heldout_percent: int, rng: random.Random) -> list[tuple[int, int]]:
    """n distinct (a, b) pairs from one side of the split, in draw order (deterministic given rng)."""
    total = 10 ** (2 * digits)                       # ordered pairs overall
    side = total * (heldout_percent if heldout else 100 - heldout_percent) // 100
    if n > side // 2:                                # rejection sampling of distinct pairs stays fast below ~half
        raise ValueError(f"asked for {n} distinct {'held-out' if heldout else 'train'} problems with digits={digits}; "
                         f"only about {side} exist (raise digits or lower n)")
    seen, out = set(), []
    while len(out) < n:
        a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
        if (a, b) not in seen and is_heldout(a, b, heldout_percent) == heldout:
            seen.add((a, b))
            out.append((a, b))
    return out


@register("task", "arithmetic")
def arithmetic_task(cfg: ArithmeticConfig) -> tuple[list[dict], list[dict]]:
    """(train, held_out) lists of {"prompt", "answer"}; the two never share a problem (in either order).
    config_checks.validate checks the section's ranges."""
    # separate streams: the held-out set does not change when n_train changes, and vice versa
    train = sample_problems(cfg.n_train, cfg.digits, False, cfg.heldout_percent, random.Random(f"train-{cfg.seed}"))
    held = sample_problems(cfg.n_eval, cfg.digits, True, cfg.heldout_percent, random.Random(f"eval-{cfg.seed}"))
    return [make_sample(a, b, cfg.digits) for a, b in train], [make_sample(a, b, cfg.digits) for a, b in held]


# --- the verifier: reward "arithmetic" ---
# How the answer is read from a completion: everything from the first end-of-sequence marker on is dropped (the
# tiny model's "<eos>", in case the caller decoded special tokens; the loop decodes with skip_special_tokens=True),
# then surrounding whitespace is stripped. What is left must equal the answer string exactly. For answer "0150":
# "0150", " 0150 ", "0150<eos>7" score 1.0; "015", "510", "0510", "01500", "0 150", "" score 0.0. No partial
# credit: a dense per-digit reward would tell the policy where it went wrong, which makes the task easier than a
# verifier that only checks the final answer (the setting this codebase is for).

def extract_answer(completion: str) -> str:
    return completion.split(EOS_TEXT, 1)[0].strip()


@register("reward", "arithmetic")
def arithmetic_reward(prompt: str, completion: str, answer: str, **_) -> float:
    """arithmetic_reward(prompt="483+027=", completion="0150", answer="0150") -> 1.0"""
    return 1.0 if extract_answer(completion) == answer else 0.0
