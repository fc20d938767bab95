"""Per-step (process) rewards: step boundaries, the pool's step lists and their failures, per-token placement
(rollout.py: step_tensors), credit assignment by hand for PPO (GAE), REINFORCE++ and GRPO's per-step group
normalisation, the process reward model (rewards/prm.py), and a 2-step training run with a process reward."""
import math
import os
import sys
from dataclasses import replace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import registry  # noqa: E402
from algos.ppo import PPOConfig  # noqa: E402
from buffer import Experience  # noqa: E402
from rewards.pool import RewardPool  # noqa: E402
from rewards.score import split_steps, step_ends, step_separator  # noqa: E402
from tests import step_reward_fns as fns  # noqa: E402
from tests.conftest import make_word_classifier, step_rows  # noqa: E402


# ------------------------------------------------------------------------------------------ step boundaries
@pytest.mark.parametrize("text, sep, steps", [
    ("a\nb\n", "\n", ["a\n", "b\n"]),                # lines, trailing newline
    ("a\nb", "\n", ["a\n", "b"]),                    # the last step without one
    ("a\n\nb\n\n", "\n", ["a\n\n", "b\n\n"]),        # blank lines join the step before them
    ("\n\na\nb", "\n", ["\n\na\n", "b"]),            # ... or, leading, the first step
    ("", "\n", [""]),                                # an empty completion is one step
    ("x = 1. Then y = 2.", "\n", ["x = 1. Then y = 2."]),
    ("s1 ## s2 ##", " ##", ["s1 ##", " s2 ##"]),     # a declared separator
    ("s1 ## s2", " ##", ["s1 ##", " s2"]),
])
def test_step_boundaries(text, sep, steps):
    assert split_steps(text, sep) == steps
    assert "".join(steps) == text and step_ends(text, sep)[-1] == len(text)


def test_the_row_then_the_reward_then_lines_name_the_separator():
    assert step_separator({}) == "\n"
    assert step_separator({}, fns.short_plus_steps) == "+"
    assert step_separator({"step_separator": "##"}, fns.short_plus_steps) == "##"
    with pytest.raises(ValueError, match="step_separator"):
        step_separator({"step_separator": 3})


# ---------------------------------------------------------------------------------------------- the pool
def test_the_pool_keeps_step_lists_and_sums_them():
    completions = ["ok\nno\nok", "no\nok\n", "ok"]
    fields = [{}, {}, {"step_separator": ";"}]
    with RewardPool([(fns.ok_steps, 2.0)], workers=1, timeout_s=60) as pool:
        rewards, info = pool.submit(["p"] * 3, completions, fields).result()
    assert rewards.tolist() == [4.0, 2.0, 2.0]                               # weight 2 times the summed steps
    assert info["per_reward"]["ok_steps"].tolist() == [2.0, 1.0, 1.0]        # accuracy reads this sum
    assert info["steps"]["ok_steps"] == [[(3, 1.0), (6, 0.0), (8, 1.0)], [(3, 0.0), (6, 1.0)], [(2, 1.0)]]
    assert info["failures"]["ok_steps"] == 0


def test_a_step_list_of_the_wrong_length_is_a_recorded_failure():
    with RewardPool([(fns.one_too_many, 1.0), (fns.ok_steps, 1.0)], workers=1, timeout_s=60) as pool:
        rewards, info = pool.submit(["p", "p"], ["ok\nok", "ok"]).result()
    assert info["per_reward"]["one_too_many"].tolist() == [0.0, 0.0]         # never cut to fit: 0 and a reason
    assert info["failures"]["one_too_many"] == 2
    assert "returned 3 step scores for a completion of 2 steps" in info["reasons"][0]
    assert info["steps"]["ok_steps"] == [[(3, 1.0), (5, 1.0)], [(2, 1.0)]] and "one_too_many" not in info["steps"]
    assert rewards.tolist() == [2.0, 1.0]


def test_batched_step_lists_fail_one_sample_at_a_time():
    with RewardPool([(fns.batched_steps, 1.0)], workers=1, timeout_s=60) as pool:
        rewards, info = pool.submit(["p", "p"], ["a\nb", "bad"]).result()
    assert rewards.tolist() == [1.0, 0.0] and info["failures"]["batched_steps"] == 1
    assert info["steps"]["batched_steps"] == [[(2, 0.5), (3, 0.5)], None]


# ------------------------------------------------------------------------------------- onto the tokens
class PieceTokenizer:
    """Multi-character tokens, one holding a separator inside it; id 0 is the special EOS."""
    pieces = ["<eos>", "ab", "\n", "c", "d\n", "e"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0))


def rollout_of(rows: list[list[int]], prompt_len: int = 2):
    from types import SimpleNamespace
    C = max(map(len, rows))
    comp = torch.tensor([r + [0] * (C - len(r)) for r in rows])                       # (B, C)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (C - len(r)) for r in rows])
    return SimpleNamespace(input_ids=torch.cat([torch.full((len(rows), prompt_len), 5), comp], 1),
                           completion_mask=mask, turn_rewards=None)


def test_step_scores_land_on_each_steps_last_token():
    from rollout import last_token, step_tensors
    tok = PieceTokenizer()
    # "ab\n" | "cd\n" | "e" then EOS: the second step ends inside the token "d\n"
    rows = [[1, 2, 3, 4, 5, 0], [3, 0]]
    text = tok.decode(rows[0])
    assert split_steps(text) == ["ab\n", "cd\n", "e"]
    assert [last_token(tok, rows[0], e) for e in step_ends(text)] == [1, 3, 4]
    info = {"per_reward": {"steps": torch.tensor([0.6, 0.0]), "rule": torch.tensor([1.0, 0.0])},
            "steps": {"steps": [[(3, 0.1), (6, 0.2), (7, 0.3)], None]}}
    out = step_tensors(info, {"steps": 2.0, "rule": 0.5}, tok, rollout_of(rows))
    # steps 1 and 2 on their last tokens; step 3 and the scalar reward on the completion's last token (EOS)
    assert torch.allclose(out["turn_rewards"][0], torch.tensor([0.0, 0.2, 0.0, 0.4, 0.0, 0.6 + 0.5]))
    assert out["step_mask"].tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert torch.allclose(out["turn_rewards"].sum(-1), torch.tensor([2.0 * 0.6 + 0.5, 0.0]))


# --------------------------------------------------------------------------- credit assignment by hand
def two_step_batch(**kw) -> Experience:
    """One completion of 4 tokens, two steps: 0.5 at token 1, 1.0 at token 3 (the scalar sum is 1.5)."""
    fields = dict(input_ids=torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.ones(1, 6, dtype=torch.long),
                  completion_mask=torch.ones(1, 4), sample_logprobs=torch.zeros(1, 4), rewards=torch.tensor([1.5]),
                  group_ids=torch.tensor([0]), versions=torch.zeros(1, dtype=torch.long),
                  truncated=torch.zeros(1, dtype=torch.bool), turn_rewards=torch.tensor([[0.0, 0.5, 0.0, 1.0]]),
                  step_mask=torch.tensor([[0.0, 1.0, 0.0, 1.0]]))
    return Experience(**{**fields, **kw})


def test_ppo_gae_over_two_steps_by_hand():
    algo = registry.get("algo", "ppo")
    cfg = config.AlgoConfig(name="ppo", ppo=PPOConfig(gamma=0.9, gae_lambda=0.8))
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    adv = algo.advantages(two_step_batch(values=values), cfg)
    # d_t = r_t + 0.9 V_{t+1} - V_t (V_4 = 0), A_t = d_t + 0.72 A_{t+1}
    d = [0.0 + 0.9 * 0.2 - 0.1, 0.5 + 0.9 * 0.3 - 0.2, 0.0 + 0.9 * 0.4 - 0.3, 1.0 - 0.4]
    a3 = d[3]
    a2 = d[2] + 0.72 * a3
    a1 = d[1] + 0.72 * a2
    a0 = d[0] + 0.72 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2, a3], abs=1e-6)
    assert adv[0, 1].item() == pytest.approx(0.92424, abs=1e-6)
    scalar = algo.advantages(two_step_batch(values=values, turn_rewards=None, step_mask=None), cfg)
    assert scalar[0, 1].item() == pytest.approx(0.07 + 0.72 * (0.06 + 0.72 * 1.1), abs=1e-6)   # all 1.5 at the end
    assert scalar[0, 3].item() == pytest.approx(1.1, abs=1e-6)


def test_reinforce_pp_returns_are_the_steps_to_go():
    from algos.reinforce_pp import reward_to_go
    from algos.common import token_rewards, masked_whiten
    cfg = config.AlgoConfig(name="reinforce_pp")
    b = two_step_batch()
    assert reward_to_go(token_rewards(b, cfg))[0].tolist() == [1.5, 1.5, 1.0, 1.0]
    adv = registry.get("algo", "reinforce_pp").advantages(b, cfg)
    # whitened over the batch's 4 tokens: mean 1.25, biased variance 0.0625
    assert adv[0].tolist() == pytest.approx([0.25 / math.sqrt(0.0625 + 1e-8)] * 2 + [-0.25 / math.sqrt(0.0625 + 1e-8)] * 2,
                                            abs=1e-5)
    assert torch.allclose(adv, masked_whiten(torch.tensor([[1.5, 1.5, 1.0, 1.0]]), b.completion_mask))


def group_batch() -> Experience:
    """One group of two samples, 3 completion tokens each. Sample 0: steps 1 (token 0) and 0 (token 2);
    sample 1: steps 0 (token 1) and 1 (token 2). Sums 1 and 1: GRPO's sum mode sees no signal."""
    return Experience(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
                      completion_mask=torch.ones(2, 3), sample_logprobs=torch.zeros(2, 3), rewards=torch.tensor([1.0, 1.0]),
                      group_ids=torch.tensor([0, 0]), versions=torch.zeros(2, dtype=torch.long),
                      truncated=torch.zeros(2, dtype=torch.bool),
                      turn_rewards=torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
                      step_mask=torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]))


def test_grpo_per_step_normalisation_by_hand():
    algo = registry.get("algo", "grpo")
    b = group_batch()
    assert algo.advantages(b, config.AlgoConfig()).abs().max() == 0          # sum: equal totals, no signal
    adv = algo.advantages(b, config.AlgoConfig(step_rewards="per_step"))
    # the group's step rewards (1, 0, 0, 1): mean 0.5, unbiased std sqrt(1/3); r~ = +-0.5 / (std + 1e-6)
    z = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # sample 0: steps +z (token 0), -z (token 2): A = (0, -z, -z); sample 1: -z (token 1), +z (token 2)
    assert adv.tolist() == [pytest.approx([0.0, -z, -z], abs=1e-6), pytest.approx([0.0, 0.0, z], abs=1e-6)]
    centred = registry.get("algo", "dr_grpo").advantages(b, config.AlgoConfig(step_rewards="per_step"))
    assert centred.tolist() == [pytest.approx([0.0, -0.5, -0.5]), pytest.approx([0.0, 0.0, 0.5])]


def test_per_step_with_one_step_per_sample_is_grpo():
    from algos.grpo import grpo_advantages
    b = group_batch()
    b.rewards, b.turn_rewards, b.step_mask = torch.tensor([0.3, 1.0]), None, None
    b.completion_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    per_step = grpo_advantages(b, config.AlgoConfig(step_rewards="per_step"))
    assert torch.allclose(per_step, grpo_advantages(b, config.AlgoConfig()), atol=1e-6)


def test_a_bad_step_mode_is_refused_by_name():
    import config_checks
    with pytest.raises(config.UserError, match="algo.step_rewards.*sum, per_step"):
        config_checks.validate(config.parse(["algo.step_rewards=mean"]))


# ----------------------------------------------------------------------------------- process reward model
@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    words = "<pad> <eos> <unk> two plus is four five".split()
    return make_word_classifier(tmp_path_factory.mktemp("prm"), words, num_labels=2, hidden=16, layers=1)


def test_prm_scores_each_prefix_and_goes_through_the_pool(prm_dir):
    from rewards.prm import prm
    path, model, tok = prm_dir
    completions = [" two plus two\n is four\n", " five"]
    scores = prm(["two plus", "two"], completions, path=path, device="cpu", label=1, batch_size=2)
    with torch.no_grad():
        hand = [model(**tok([t], return_tensors="pt")).logits.softmax(-1)[0, 1].item()
                for t in ["two plus two plus two\n", "two plus two plus two\n is four\n", "two five"]]
    assert [len(s) for s in scores] == [2, 1]
    assert scores[0] + scores[1] == pytest.approx(hand, abs=1e-5)
    with RewardPool([("prm", 1.0, {"path": path, "device": "cpu", "label": 1})], workers=1, timeout_s=60) as pool:
        rewards, info = pool.submit(["two plus", "two"], completions).result()
    assert rewards.tolist() == pytest.approx([sum(scores[0]), scores[1][0]], abs=1e-5)
    assert [s for _, s in info["steps"]["prm"][0]] == pytest.approx(scores[0], abs=1e-5)


# ------------------------------------------------------------------------------------------ a short run
@registry.register("reward", "test_short_plus_steps")
def _short_plus_steps(prompt, completion, **fields):
    return fns.short_plus_steps(prompt, completion, **fields)


_short_plus_steps.step_separator = "+"


def test_a_run_with_a_process_reward_trains_two_steps(random_model_dir, tmp_path, monkeypatch):
    """GRPO with per-step normalisation on a reward that scores each '+'-separated step: the steps reach the
    batch the algorithm sees (a step ends on each '+' before the last token), and the loss is finite."""
    import train
    from algos.grpo import grpo_advantages
    seen = []

    def capture(batch, cfg, sum_over=None):
        seen.append(batch)
        return grpo_advantages(batch, cfg, sum_over)

    grpo = registry.get("algo", "grpo")          # grpo, seeing each batch on its way (restored after the test)
    monkeypatch.setitem(registry._REGISTRY["algo"], "grpo", replace(grpo, advantages=capture))
    train.main([f"model={random_model_dir}", "steps=2", "eval_every=2", "eval_size=4", "prompts_per_step=4",
                "samples_per_prompt=4", "rewards=test_short_plus_steps", "algo.step_rewards=per_step",
                "max_new_tokens=8", "threads=1", "progress=false", f"out_dir={tmp_path}"])
    rows = step_rows(tmp_path)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert len(seen) == 2
    plus = 2 + "0123456789+=".index("+")                                    # the random model's char ids
    inner = 0
    for b in seen:
        mask, C = b.completion_mask, b.completion_mask.shape[1]
        last = mask.sum(-1).long() - 1                                         # (B,)
        assert torch.allclose(b.turn_rewards.sum(-1), b.rewards, atol=1e-5)
        assert torch.equal(b.step_mask[torch.arange(len(b)), last], torch.ones(len(b)))
        before = b.step_mask * (torch.arange(C) < last[:, None])                 # (B, C) steps ending early
        assert (b.input_ids[:, -C:][before > 0] == plus).all()
        inner += int(before.sum())
    assert inner > 0                                                           # some completion had several steps
