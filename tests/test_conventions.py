"""Where this project meets verl's and TRL's numbers (docs/conventions.md): each test pins one finding of the
comparison, with hand-derived values, and fails on the code before its fix."""
import math

import pytest
import torch

import config
import config_checks
import registry
from algos.common import clipped_policy_loss
from algos.dapo import dapo_advantages
from conftest import step_rows
from test_algos import algo_cfg, batch_of   # norm_len=4 there: only seq-mean-token-sum-norm reads it, unused here


def test_kl_in_reward_takes_the_trainers_logprobs_in_a_run(random_model_dir, tmp_path):
    """One update per batch (where the loss needs no old log-probs), the KL in the reward and an engine in
    bfloat16 (its log-probs differ from the trainer's): the loop computes the trainer's log-probs for the KL,
    or kl_in_reward raises."""
    import train
    train.main([f"model={random_model_dir}", "algo.name=rloo", "steps=1", "eval_every=1", "eval_size=4",
                "prompts_per_step=2", "samples_per_prompt=2", "max_new_tokens=4", f"out_dir={tmp_path}",
                "progress=false", "algo.kl_coef=0.1", "algo.kl_in_reward=true", "engine_dtype=bfloat16"])
    assert step_rows(tmp_path)[0]["kl"] >= 0


def test_reinforce_pp_baseline_with_kl_in_reward_matches_verl():
    """The issue's case: rewards [1, 0] in one group, KL 1.0 (k1) on sample 0's first token, coefficient 0.5.
    Returns: R = (1 - 0.5, 0) = (0.5, 0), minus the group mean 0.25: (0.25, -0.25), on every token; whitened
    over the 4 tokens (mean 0, biased std 0.25): +-1. verl whitens with the unbiased std (sqrt(1/12)), which
    gives +-0.866 = +-1 * sqrt(3/4). Before the fix (the score's mean only, KL per token, reward-to-go):
    [[0.302, 1.508], [-0.905, -0.905]]."""
    batch = batch_of([1.0, 0.0], [[1, 1], [1, 1]], [0, 0], ref_logprobs=torch.tensor([[-2.0, -1.0], [-1.0, -1.0]]),
                     old_logprobs=torch.full((2, 2), -1.0))
    cfg = algo_cfg(kl_coef=0.5, kl_in_reward=True, kl_estimator="k1")
    adv = registry.get("algo", "reinforce_pp_baseline").advantages(batch, cfg)
    assert torch.allclose(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), atol=1e-6)
    verl = torch.tensor([[0.866, 0.866], [-0.866, -0.866]])
    assert torch.allclose(adv * math.sqrt(3 / 4), verl, atol=1e-3)      # the whitening convention apart, verl's


def test_dapo_dropped_groups_carry_zero_advantage():
    """Group 0's answers are all right (no signal: keep drops it) but of lengths 5 and 9 at L = 9: the overlong
    penalty alone made its shaped rewards (1, 0) and gave it advantages +-0.707 (up to 2.04 in bigger groups),
    although the code called such groups zero-advantage. Group 1 has signal and keeps its advantages."""
    lengths = [5, 9, 5, 5]
    batch = batch_of([1.0, 1.0, 1.0, 0.0], [[1] * n + [0] * (9 - n) for n in lengths], [0, 0, 1, 1])
    cfg = algo_cfg(max_new_tokens=9)
    adv = dapo_advantages(batch, cfg)[:, 0]
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2:].tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-5)
    cfg.dapo.dynamic_sampling = False                                # no dropping: the penalty's spread is signal
    assert dapo_advantages(batch, cfg)[0, 0] == pytest.approx(1 / math.sqrt(2), abs=1e-5)


@registry.register("reward", "test_always_one")
def always_one(prompt, completion, **_):
    return 1.0


def test_dapo_trains_nothing_when_no_group_has_signal(random_model_dir, tmp_path):
    """Every group's rewards are equal in every round: verl trains none of it; so must the loop (no optimizer
    step: AdamW would move the weights even on a zero gradient, and overlong-shaped rows would train)."""
    import train
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    train.main([f"model={random_model_dir}", "algo.name=dapo", "algo.dapo.max_rounds=2", "steps=2", "eval_every=2",
                "eval_size=4", "prompts_per_step=2", "samples_per_prompt=2", "max_new_tokens=4", "lr=1e-2",
                "rewards=test_always_one", f"out_dir={tmp_path}", "progress=false"])
    rows = step_rows(tmp_path)
    assert len(rows) == 2 and all(r["kept_frac"] == 0 and r["dynamic_sampling/rounds"] == 2 for r in rows)
    assert all("loss" not in r and "logprob_mismatch/max" not in r for r in rows)     # nothing trained, measured
    start = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert all(torch.equal(final[k], start[k]) for k in final)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """ratio 4 on every token, clip 0.2, dual_clip c = 3. A = -1: max(-A r, -A clip(r)) = max(4, 1.2) = 4, capped
    at -A c = 3, no gradient (the cap is a constant). A = +1: max(-4, -1.2) = -1.2, untouched by the dual clip.
    A = -1 at ratio 2: max(2, 1.2) = 2 < 3, its gradient -A r = 2 stays. Off (0): 4, with gradient 4."""
    adv, ratio = torch.tensor([[-1.0, 1.0, -1.0]]), torch.tensor([[4.0, 4.0, 2.0]])
    batch = batch_of([1.0], [[1, 1, 1]], [0], old_logprobs=torch.zeros(1, 3))
    batch.advantages = adv
    for c, expected_loss, expected_grad, frac in [(3.0, (3 - 1.2 + 2) / 3, [0.0, 0.0, 2 / 3], 1 / 3),
                                                  (0.0, (4 - 1.2 + 2) / 3, [4 / 3, 0.0, 2 / 3], None)]:
        logp = ratio.log().requires_grad_()
        loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(1, 3)}, batch, algo_cfg(dual_clip=c))
        (g,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(expected_loss) and g[0].tolist() == pytest.approx(expected_grad)
        assert (float(m["clip_frac_dual"]) == pytest.approx(frac)) if frac else "clip_frac_dual" not in m
    with pytest.raises(config.UserError, match="algo.dual_clip"):
        config_checks.validate(config.parse(["algo.dual_clip=0.5"]))
