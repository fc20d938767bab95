"""Generative judge: a tiny causal LM built as a bigram table, so its replies and YES probability are known by hand.

The judge model: embeddings are one-hot (hidden size = vocabulary), every attention and MLP output projection is
zero, so the residual stream at a position is its own token's one-hot; the final RMSNorm scales it by sqrt(H) and
lm_head = TABLE / sqrt(H), so the logits after token i are TABLE[:, i] whatever came before. The template ends with
the completion, hence the completion's last word picks the reply.
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards import judge as jd  # noqa: E402

# an even count of words: the hidden size is the vocabulary's, split over two heads
WORDS = "<pad> <eos> <unk> YES NO maybe banana 8 12 what is two plus four five six seven nine ten ref".split()
ID = {w: i for i, w in enumerate(WORDS)}
V = len(WORDS)
# next word after each completion word: its reply (a verdict, a number, or nothing usable)
REPLY = {"four": "YES", "five": "NO", "six": "banana", "seven": "8", "nine": "12"}
TEMPLATE = "{prompt} ref {reference} {completion}"
YES_LOGITS = {"four": (2.0, 0.5), "five": (-1.0, 3.0)}      # (YES, NO) logits after the word; the rest are 0


def table() -> torch.Tensor:
    t = torch.zeros(V, V)                                    # (next, current) logits
    t[ID["<eos>"], :] = 5.0                                  # everything else ends the reply
    for word, reply in REPLY.items():
        t[ID["<eos>"], ID[word]] = 0.0
        t[ID[reply], ID[word]] = 10.0
    for word, (y, n) in YES_LOGITS.items():
        t[ID["YES"], ID[word]], t[ID["NO"], ID[word]] = y, n
        if REPLY[word] not in ("YES", "NO"):
            t[ID[REPLY[word]], ID[word]] = 0.0
    return t


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=V, hidden_size=V, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=V // 2, rms_norm_eps=1e-12, pad_token_id=0, eos_token_id=1,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(V))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(table() / math.sqrt(V))
    path = tmp_path_factory.mktemp("judge")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run(judge_dir, completions, **kw):
    args = dict(path=judge_dir, template=TEMPLATE, device="cpu", dtype="float32", reply_tokens=4)
    return jd.judge(["what is two plus two"] * len(completions), completions,
                    [{"answer": "four"}] * len(completions), **{**args, **kw})


def failures(scores):
    return [s.failures for s in scores]


def test_yes_prob_matches_a_hand_softmax(judge_dir):
    y, n = YES_LOGITS["four"]
    rest = V - 2                                             # the other logits after "four" are 0 (EOS included)
    raw = math.exp(y) / (math.exp(y) + math.exp(n) + rest)
    assert run(judge_dir, ["four"], no="")[0] == pytest.approx(raw, abs=1e-5)
    scores = run(judge_dir, ["four", "five"])                # renormalised over YES and NO
    assert scores == pytest.approx([1 / (1 + math.exp(n - y)), 1 / (1 + math.exp(3.0 - -1.0))], abs=1e-5)
    assert failures(scores) == [[], []]


def test_yes_prob_min_mass_fails_a_judge_that_answers_neither(judge_dir):
    scores = run(judge_dir, ["four", "six"], min_mass=0.2)   # "four": 0.33 on YES + NO; "six": ~1e-4
    assert failures(scores)[0] == [] and scores[0] > 0.5
    assert float(scores[1]) == 0.0 and failures(scores)[1][0][0] == "error" and "min_mass" in failures(scores)[1][0][1]


def test_verdicts_and_a_bad_reply_is_a_recorded_failure(judge_dir):
    scores = run(judge_dir, ["four", "five", "six"], mode="verdict", verdicts="YES:1;NO:0.25")
    assert [float(s) for s in scores] == [1.0, 0.25, 0.0]
    assert failures(scores)[:2] == [[], []]
    (category, reason), = failures(scores)[2]
    assert category == "error" and "banana" in reason


def test_numbers_with_and_without_a_range(judge_dir):
    assert [float(s) for s in run(judge_dir, ["seven", "nine"], mode="number")] == [8.0, 12.0]
    scores = run(judge_dir, ["seven", "nine", "four"], mode="number", lo=0, hi=10)
    assert float(scores[0]) == pytest.approx(0.8) and failures(scores)[0] == []
    assert "outside" in failures(scores)[1][0][1]            # 12 is not a score out of 10
    assert "no number" in failures(scores)[2][0][1]          # "YES"


def test_identical_pairs_are_judged_once(judge_dir, monkeypatch):
    seen = []
    real = jd.judge_unique
    monkeypatch.setattr(jd, "judge_unique", lambda texts, *a: seen.append(list(texts)) or real(texts, *a))
    scores = run(judge_dir, ["four", "five", "four", "four", "five"], mode="verdict")
    assert [float(s) for s in scores] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert len(seen) == 1 and len(seen[0]) == 2
    other_ref = jd.judge(["q", "q"], ["four", "four"], [{"answer": "a"}, {"answer": "b"}], path=judge_dir,
                         template=TEMPLATE, device="cpu", mode="verdict")
    assert len(seen[-1]) == 2 and [float(s) for s in other_ref] == [1.0, 1.0]   # another reference: another rubric


def test_through_the_pool_mixed_with_a_rule_reward(judge_dir):
    from rewards.pool import RewardPool
    from tests.reward_fns import matches
    args = {"path": judge_dir, "template": TEMPLATE, "device": "cpu", "mode": "verdict", "reply_tokens": 4}
    with RewardPool([(matches, 1.0), ("judge", 0.5, args)], workers=1, timeout_s=120) as pool:
        rewards, info = pool.submit(["what is two"] * 2, ["four", "six"], [{"answer": "four"}] * 2).result()
    assert rewards.tolist() == pytest.approx([1.5, 0.0])     # matches: 1, 0; judge: YES, banana
    assert info["failure_counts"]["judge"]["error"] == 1 and info["failed"][0]["sample"] == 1
    assert info["metrics"]["reward_fail/judge/error"] == 1.0


@pytest.mark.parametrize("kw, match", [(dict(mode="vote"), "mode must be one of"),
                                       (dict(template="{answer}"), "answer"),
                                       (dict(mode="number", lo=1), "lo < hi"), (dict(yes="YES NO"), "2 tokens"),
                                       (dict(mode="verdict", verdicts="x"), "verdicts"), (dict(path=""), "set args")])
def test_bad_options_are_named(judge_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        run(judge_dir, ["four"], **kw)


def test_the_rollouts_length_limit_never_reaches_the_judges_reply_length():
    """A reward naming max_new_tokens gets the rollout's (rewards/pool.py SAMPLING_ARGS): the judge's own reply
    length has another name, so a run's max_new_tokens=8 cannot cut its replies."""
    from rewards.judge import judge
    from rewards.pool import _asks
    assert _asks(judge, {}) == ()
