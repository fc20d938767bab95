"""Task data: synthetic, verifiable prompts with a held-out split. The embedded default is `arithmetic`.

    from registry import get
    train, held_out = get("task", "arithmetic")(ArithmeticConfig())
    train[0]  # {"prompt": "483+027=", "answer": "0150"}

`arithmetic` is integer addition of two operands of up to `digits` digits, in a fixed-width format:
the prompt is "A+B=" with both operands zero-padded to `digits` digits, and the expected completion
is the sum written units digit first and zero-padded to `digits + 1` digits (483+27 = 510 is asked as
"483+027=" and answered "0150"), followed by the tokenizer's EOS. Units first is the order in which
one adds by hand: each answer digit needs only two operand digits and the carry from the digit just
written, whereas a most-significant-first answer needs the whole carry chain at its first token.
Measured here with the 2-layer tiny model of make_tiny_model.py: most-significant-first, supervised
training was still near chance after 1200 steps; units-first it learns addition within ~800-1000
steps (a 4-layer model learns either, at twice the cost per step; Lee et al. 2023, "Teaching
Arithmetic to Small Transformers", report the same effect of reversed answers). Fixed width keeps each operand digit at a fixed position and every answer the same length.
The tiny model uses a character tokenizer, so every character is one token.

Held-out split: a problem belongs to the held-out split when a stable hash (blake2b, not Python's
salted hash()) of its unordered operand pair falls in the first `heldout_percent` of 100 buckets.
The split therefore does not depend on the seed or on how many samples are drawn, "A+B" and "B+A"
always land in the same split, and every other user of the task (the RL train set, the SFT data of
make_tiny_model.py) draws from the train side only, so nothing held out is ever trained on.
"""
import hashlib
import random
from dataclasses import dataclass, field

from registry import register

# The tiny model's character vocabulary (make_tiny_model.py): every prompt and answer character is one
# token. The special tokens are spelled here so that the verifier can strip them from decoded text.
PAD_TEXT, EOS_TEXT = "<pad>", "<eos>"
CHARS = "0123456789+="


@dataclass
class ArithmeticConfig:
    digits: int = field(default=3, metadata={"help": "operands are uniform integers in [0, 10**digits)"})
    n_train: int = field(default=20000, metadata={"help": "distinct training problems (RL prompts)"})
    n_eval: int = field(default=500, metadata={"help": "distinct held-out problems for evaluation"})
    heldout_percent: int = field(default=10, metadata={"help": "percent of all problems reserved for held-out (stable hash)"})
    seed: int = field(default=0, metadata={"help": "seed for drawing the train and held-out samples"})


def is_heldout(a: int, b: int, heldout_percent: int) -> bool:
    """True when the problem {a, b} (order ignored) belongs to the held-out split."""
    lo, hi = min(a, b), max(a, b)
    h = int.from_bytes(hashlib.blake2b(f"{lo}+{hi}".encode(), digest_size=8).digest(), "little")
    return h % 100 < heldout_percent


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


def check_config(cfg: ArithmeticConfig):
    if not 1 <= cfg.digits <= 9:
        raise ValueError(f"arithmetic.digits must be in 1..9, got {cfg.digits}")
    if not 0 < cfg.heldout_percent < 100:
        raise ValueError(f"arithmetic.heldout_percent must be in 1..99, got {cfg.heldout_percent}")
    if cfg.n_train < 1 or cfg.n_eval < 1:
        raise ValueError(f"arithmetic.n_train and n_eval must be >= 1, got {cfg.n_train} and {cfg.n_eval}")


@register("task", "arithmetic")
def arithmetic_task(cfg: ArithmeticConfig) -> tuple[list[dict], list[dict]]:
    """(train, held_out) lists of {"prompt", "answer"}; the two never share a problem (in either order)."""
    check_config(cfg)
    # separate streams: the held-out set does not change when n_train changes, and vice versa
    train = sample_problems(cfg.n_train, cfg.digits, False, cfg.heldout_percent, random.Random(f"train-{cfg.seed}"))
    held = sample_problems(cfg.n_eval, cfg.digits, True, cfg.heldout_percent, random.Random(f"eval-{cfg.seed}"))
    return [make_sample(a, b, cfg.digits) for a, b in train], [make_sample(a, b, cfg.digits) for a, b in held]
