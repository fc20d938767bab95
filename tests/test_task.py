"""Tests of the embedded default task: tasks/arithmetic.py (arithmetic), rewards/task.py and the shipped tiny model.

    .venv/bin/python -m pytest tests/test_task.py -q
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks.arithmetic import ArithmeticConfig  # noqa: E402
from tasks.arithmetic import arithmetic_task, is_heldout  # noqa: E402
from tools.make_tiny_model import carryless_answer  # noqa: E402
from registry import get  # noqa: E402
from tasks.arithmetic import arithmetic_reward, extract_answer  # noqa: E402

MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-model")


def operands(sample):
    a, b = sample["prompt"].removesuffix("=").split("+")
    return int(a), int(b)


def test_task_is_registered_and_deterministic():
    cfg = ArithmeticConfig(n_train=300, n_eval=50, seed=3)
    assert get("task", "arithmetic") is arithmetic_task
    assert arithmetic_task(cfg) == arithmetic_task(cfg)
    other_seed = arithmetic_task(ArithmeticConfig(n_train=300, n_eval=50, seed=4))
    assert other_seed[0] != arithmetic_task(cfg)[0]


def test_samples_are_correct_sums():
    train, held = arithmetic_task(ArithmeticConfig(n_train=200, n_eval=50))
    assert len(train) == 200 and len(held) == 50
    for s in train + held:
        a, b = operands(s)
        assert 0 <= a < 1000 and 0 <= b < 1000
        assert s["prompt"] == f"{a:03d}+{b:03d}=" and s["answer"] == f"{a + b:04d}"[::-1]   # units digit first


def test_heldout_disjoint_from_train_in_either_order():
    cfg = ArithmeticConfig(n_train=20000, n_eval=500)
    train, held = arithmetic_task(cfg)
    held_pairs = {frozenset(operands(s)) for s in held}
    train_pairs = {frozenset(operands(s)) for s in train}
    assert len(held_pairs & train_pairs) == 0
    assert len({s["prompt"] for s in train}) == len(train)          # distinct problems
    assert all(is_heldout(*operands(s), cfg.heldout_percent) for s in held)
    assert all(is_heldout(b, a, cfg.heldout_percent) for a, b in map(operands, held))


def test_eval_set_does_not_depend_on_n_train():
    _, held_small = arithmetic_task(ArithmeticConfig(n_train=10, n_eval=100))
    _, held_big = arithmetic_task(ArithmeticConfig(n_train=5000, n_eval=100))
    assert held_small == held_big


def test_heldout_fraction_is_about_right():
    pairs = [(a, b) for a in range(0, 1000, 7) for b in range(0, 1000, 11)]
    frac = sum(is_heldout(a, b, 10) for a, b in pairs) / len(pairs)
    assert 0.08 < frac < 0.12


@pytest.mark.parametrize("bad", ["arithmetic.digits=0", "arithmetic.heldout_percent=0", "arithmetic.n_eval=0"])
def test_bad_config_is_a_one_line_error(bad):
    import config
    import config_checks
    with pytest.raises(config.UserError) as e:
        config_checks.validate(config.parse([bad]))
    assert "\n" not in str(e.value) and bad.split("=")[0] in str(e.value)


def test_more_problems_than_exist_is_a_one_line_error():
    with pytest.raises(ValueError) as e:
        arithmetic_task(ArithmeticConfig(digits=1, n_train=1000))
    assert "\n" not in str(e.value)


def test_sample_format():
    from tasks.arithmetic import make_sample
    assert make_sample(483, 27, 3) == {"prompt": "483+027=", "answer": "0150"}
    assert make_sample(999, 999, 3) == {"prompt": "999+999=", "answer": "8991"}
    assert make_sample(5, 0, 2) == {"prompt": "05+00=", "answer": "500"}


@pytest.mark.parametrize("completion, score", [
    ("0150", 1.0), (" 0150 ", 1.0), ("0150\n", 1.0), ("0150<eos>", 1.0), ("0150<eos>77", 1.0),
    ("015", 0.0), ("510", 0.0), ("0510", 0.0), ("0 150", 0.0), ("01500", 0.0), ("", 0.0), ("<eos>0150", 0.0),
    ("0140", 0.0),
])
def test_reward_exact_match(completion, score):
    assert arithmetic_reward(prompt="483+027=", completion=completion, answer="0150") == score
    assert get("reward", "arithmetic")("483+027=", completion, answer="0150", extra_field=1) == score


def test_extract_answer():
    assert extract_answer("  42<eos><pad><pad>") == "42"


def test_carryless_answer():
    assert carryless_answer(58, 67, 3) == "5100"     # 8+7 -> 5, 5+6 -> 1, 0+0 -> 0, no carry out
    assert carryless_answer(999, 1, 3) == "0990"
    assert carryless_answer(123, 456, 3) == "9750"   # no carry: the true answer
    assert carryless_answer(123, 456, 3) == f"{123 + 456:04d}"[::-1]


def test_shipped_checkpoint_loads_and_round_trips():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 32         # vLLM CPU attention
    assert cfg.vocab_size == len(tok) and tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    size = sum(os.path.getsize(os.path.join(MODEL_DIR, f)) for f in os.listdir(MODEL_DIR))
    assert size < 20 * 2**20
    for text in ["483+027=0150", "000+000=0000", "999+999=8991"]:
        ids = tok.encode(text)
        assert len(ids) == len(text)                                   # one token per character
        assert tok.decode(ids) == text
    ids = tok.encode("012+003=5100") + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "012+003=5100"
    # a forward pass runs and gives a distribution over the vocabulary
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok.encode("012+003=")])).logits    # (1, 8, V)
    assert logits.shape == (1, 8, len(tok)) and torch.isfinite(logits).all()


def test_shipped_checkpoint_is_a_nontrivial_policy():
    """Greedy answers on a few held-out problems are well-formed numbers (SFT taught the format)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    _, held = arithmetic_task(ArithmeticConfig(n_eval=64))
    enc = tok([s["prompt"] for s in held], return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    answers = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    assert all(a.isdigit() for a in answers), answers
    correct = sum(a == s["answer"] for a, s in zip(answers, held))
    carryless = sum(a == carryless_answer(*operands(s), 3) for a, s in zip(answers, held))
    assert correct + carryless > 0.8 * len(held)                      # it adds, with or without carries
