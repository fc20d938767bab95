"""Learned reward model: a tiny random sequence-classification model saved to a folder and loaded back."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards import reward_model as rm  # noqa: E402
from tests.conftest import make_word_classifier  # noqa: E402


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    words = "<pad> <eos> <unk> what is two plus two four five the answer".split()
    return make_word_classifier(tmp_path_factory.mktemp("rm"), words, num_labels=1, hidden=32, layers=2)


def test_scores_match_the_model_and_do_not_depend_on_batching(rm_dir):
    path, model, tok = rm_dir
    prompts = ["what is two plus two", "what is two", "what", "two plus two plus two plus two"]
    completions = [" four", " the answer is five", " two", ""]
    batched = rm.reward_model(prompts, completions, path=path, batch_size=4, device="cpu")
    single = rm.reward_model(prompts, completions, path=path, batch_size=1, device="cpu")
    assert len(batched) == 4 and len(set(batched)) == 4
    assert batched == pytest.approx(single, abs=1e-5)          # padding must not change a score
    with torch.no_grad():
        direct = model(**tok([prompts[1] + completions[1]], return_tensors="pt")).logits[0, 0].item()
    assert batched[1] == pytest.approx(direct, abs=1e-5)


def test_chat_template_is_used_when_present(rm_dir):
    path, _, _ = rm_dir
    model, tok = rm.load(path, "cpu")
    assert not getattr(tok, "chat_template", None) and rm.render(tok, "what", " two") == "what two"
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} <eos> {% endfor %}"
    try:
        assert rm.render(tok, "what", "two") == "what <eos> two <eos> "
    finally:
        tok.chat_template = None


def test_through_the_pool_as_a_batched_reward(rm_dir):
    from rewards.pool import RewardPool
    path, _, _ = rm_dir
    with RewardPool([(rm.reward_model, 2.0, {"path": path, "device": "cpu"})], workers=1, timeout_s=60) as pool:
        rewards, info = pool.submit(["what is two", "what"], [" four", " five"]).result()
    expected = rm.reward_model(["what is two", "what"], [" four", " five"], path=path, device="cpu")
    assert rewards.tolist() == pytest.approx([2 * e for e in expected], abs=1e-5)
    assert info["reasons"] == []


def test_missing_path_is_named():
    with pytest.raises(ValueError, match="set args"):
        rm.reward_model(["a"], ["b"])
