"""Tier-1 tests of every advantage estimator and loss in algos/, with hand-derived numbers and gradients,
plus a one-step in-process run of every registered algorithm (tier 2)."""
import math

import pytest
import torch
import torch.nn.functional as F

import config
import config_checks
import registry
from algos.common import (K3_MAX, KL_LOG_RATIO_MAX, aggregate, clipped_policy_loss, kl_estimate, kl_in_reward,
                          masked_whiten, tis_weights, token_rewards)
from algos.dapo import dapo_advantages, keep_groups_with_signal, overlong_penalty
from algos.dpo import online_dpo_advantages, online_dpo_loss, pair_labels, preference_loss, sequence_scores
from algos.gspo import gspo_loss
from algos.grpo import grpo_advantages
from algos.ppo import gae, ppo_advantages, ppo_loss, value_loss
from algos.reinforce_pp import reinforce_pp_advantages, reward_to_go
from algos.rloo import leave_one_out_advantages, rloo_advantages
from buffer import Experience
from distributed import Sum
from conftest import step_rows  # noqa: E402


def batch_of(rewards, mask, group_ids, **extra) -> Experience:
    mask = torch.tensor(mask, dtype=torch.float)
    B, C = mask.shape
    return Experience(input_ids=torch.zeros(B, 2 + C, dtype=torch.long), attention_mask=torch.ones(B, 2 + C),
                      completion_mask=mask, sample_logprobs=torch.zeros(B, C),
                      rewards=torch.tensor(rewards, dtype=torch.float), group_ids=torch.tensor(group_ids),
                      versions=torch.zeros(B, dtype=torch.long), truncated=torch.zeros(B, dtype=torch.bool), **extra)


def algo_cfg(**kw) -> config.AlgoConfig:
    cfg = config.AlgoConfig(**kw)
    cfg.norm_len = cfg.norm_len or 4
    cfg.max_new_tokens = cfg.max_new_tokens or 4       # what config.fill_defaults copies from max_new_tokens
    return cfg


MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]


def reinforce_grad(batch, logits, agg="token-mean", norm_len=None):
    """The REINFORCE gradient -agg(A * logp) that every on-policy policy-gradient loss must reproduce."""
    logp = F.logsigmoid(logits)
    return torch.autograd.grad(aggregate(-batch.advantages * logp, batch.completion_mask, agg, norm_len), logits)[0]


def loss_grad(loss_fn, batch, cfg, logits):
    logp = F.logsigmoid(logits)                       # any differentiable per-token log-prob
    loss, metrics = loss_fn({"logprobs": logp, "entropy": torch.zeros_like(logp)}, batch, cfg)
    return torch.autograd.grad(loss, logits)[0], loss, metrics


# --- advantage estimators --------------------------------------------------------------------------
def test_gae_lambda1_gamma1_is_reward_to_go_minus_value():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    v = torch.tensor([[0.2, 0.5, 0.7], [0.4, 0.6, 0.0]])
    m = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    expected = torch.tensor([[0.8, 0.5, 0.3], [0.6, 0.4, 0.0]])       # returns 1 everywhere minus V
    assert torch.allclose(gae(r, v, m, 1.0, 1.0), expected, atol=1e-6)


def test_gae_hand_values():
    r, v, m = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 0.5, 0.7]]), torch.ones(1, 3)
    # lambda = 0: one-step TD errors r_t + V_{t+1} - V_t, with V after the end = 0
    assert torch.allclose(gae(r, v, m, 1.0, 0.0), torch.tensor([[0.3, 0.2, 0.3]]), atol=1e-6)
    # gamma 0.9, lambda 0.5: d = (0.25, 0.13, 0.3); A2 = 0.3, A1 = 0.13 + 0.45 * 0.3, A0 = 0.25 + 0.45 * A1
    assert torch.allclose(gae(r, v, m, 0.9, 0.5), torch.tensor([[0.36925, 0.265, 0.3]]), atol=1e-6)


def test_ppo_advantages_put_reward_on_last_token():
    batch = batch_of([1.0, 0.0], [[1, 1, 1], [1, 1, 0]], [0, 0], values=torch.zeros(2, 3))
    cfg = algo_cfg()
    cfg.ppo.gae_lambda = 1.0
    assert torch.allclose(ppo_advantages(batch, cfg), torch.tensor([[1.0, 1, 1], [0, 0, 0]]))


def test_rloo_leave_one_out_hand_values():
    adv = leave_one_out_advantages(torch.tensor([1.0, 0, 0, 0, 3, 1]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert torch.allclose(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 2.0, -2.0]))
    batch = batch_of([1.0, 0, 1, 0], MASK, [0, 0, 1, 1])
    assert torch.allclose(rloo_advantages(batch, algo_cfg()), torch.tensor([1.0, -1, 1, -1])[:, None] * batch.completion_mask)


def test_reinforce_pp_global_whitening_hand_values():
    batch = batch_of([1.0, 0.0], [[1, 1], [1, 0]], [0, 0])
    # returns on the 3 real tokens: 1, 1, 0 -> mean 2/3, std sqrt(2/9); (1/3)/sqrt(2/9) = 1/sqrt(2)
    s = 1 / math.sqrt(2)
    expected = torch.tensor([[s, s], [-2 * s, 0.0]])
    assert torch.allclose(reinforce_pp_advantages(batch, algo_cfg()), expected, atol=1e-5)
    # the baseline variant subtracts the group mean first (0.5, -0.5): a shift, which whitening removes here
    assert torch.allclose(reinforce_pp_advantages(batch, algo_cfg(), baseline=True), expected, atol=1e-5)
    batch2 = batch_of([1.0, 0.0, 5.0, 5.0], [[1], [1], [1], [1]], [0, 0, 1, 1])
    # without baseline group 1's high score dominates; with it group 1 is (0, 0) and group 0 is (0.5, -0.5)
    assert torch.allclose(reinforce_pp_advantages(batch2, algo_cfg(), baseline=True)[:, 0],
                          torch.tensor([0.5, -0.5, 0, 0]) / math.sqrt(0.125), atol=1e-5)


def test_kl_in_reward_is_per_token_and_goes_into_the_return():
    batch = batch_of([1.0], [[1, 1]], [0], ref_logprobs=torch.tensor([[-1.5, -2.0]]))
    batch.old_logprobs = torch.tensor([[-1.0, -1.0]])                    # the trainer's: k1 = log r = (0.5, 1.0)
    batch.sample_logprobs = torch.tensor([[-0.2, -3.0]])                 # the engine's (mismatched): not used
    cfg = algo_cfg(kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
    assert torch.allclose(kl_in_reward(batch, cfg), torch.tensor([[-0.05, -0.1]]))
    assert torch.allclose(token_rewards(batch, cfg), torch.tensor([[-0.05, 0.9]]))
    assert torch.allclose(reward_to_go(token_rewards(batch, cfg)), torch.tensor([[0.85, 0.9]]))
    cfg.kl_in_reward = False                                            # in the loss instead: reward untouched
    assert torch.allclose(token_rewards(batch, cfg), torch.tensor([[0.0, 1.0]]))
    batch.old_logprobs = None                                           # never the engine's as a stand-in
    with pytest.raises(ValueError, match="old_logprobs"):
        kl_in_reward(batch, algo_cfg(kl_coef=0.1, kl_in_reward=True))


def test_dapo_overlong_penalty_and_dynamic_sampling():
    assert torch.allclose(overlong_penalty(torch.tensor([5, 6, 7, 8]), 8, 2, 1.0), torch.tensor([0, 0, -0.5, -1]))
    assert torch.all(overlong_penalty(torch.tensor([8]), 8, 0, 1.0) == 0)
    batch = batch_of([1.0, 0, 1, 1], MASK, [0, 0, 1, 1])
    cfg = algo_cfg()
    assert keep_groups_with_signal(batch, cfg).tolist() == [True, True, False, False]
    cfg.dapo.dynamic_sampling = False
    assert keep_groups_with_signal(batch, cfg).all()


def reference_group_advantages(rewards: list[float], groups: list[int], scale: bool, eps: float = 1e-6):
    """GRPO's advantages in exact rational arithmetic, group by group: an implementation that shares nothing
    with algos/ (no torch, no float rounding until the last division)."""
    from fractions import Fraction
    members: dict[int, list] = {}
    for r, g in zip(rewards, groups):
        members.setdefault(g, []).append(Fraction(r))
    out = []
    for r, g in zip(rewards, groups):
        xs = members[g]
        mean = sum(xs) / len(xs)
        var = sum((x - mean) ** 2 for x in xs) / max(len(xs) - 1, 1)
        out.append(float(Fraction(r) - mean) / (math.sqrt(var) + eps) if scale else float(Fraction(r) - mean))
    return out


def test_equal_rewards_give_exactly_zero_advantage():
    # the documented mix rewards=math:1.0,format:0.2 as the reward pool sums it (float32): 1.2 is not dyadic,
    # and float32's mean of eight 1.2s is not 1.2; before the fix each of them got advantage +0.106
    parts = [[1, 1]] * 8 + [[0, 1]] * 8 + [[1, 1], [0, 1], [0, 0], [1, 1]] + [[1, 0]] * 4       # (B, 2)
    rewards = torch.tensor(parts, dtype=torch.float32) @ torch.tensor([1.0, 0.2])               # (B,)
    groups = [0] * 8 + [1] * 8 + [2] * 4 + [3] * 4
    B = len(groups)
    batch = batch_of(rewards.tolist(), [[1, 1, 1]] * B, groups)
    batch.rewards = rewards
    cfg = algo_cfg()
    equal = torch.tensor(groups) != 2
    for name, scale in [("grpo", True), ("gspo", True), ("dapo", True), ("dr_grpo", False), ("rloo", False)]:
        adv = registry.get("algo", name).advantages(batch, cfg)[:, 0]                          # (B,)
        assert torch.all(adv[equal] == 0), f"{name}: {adv[equal].tolist()}"
        ref = reference_group_advantages(rewards.tolist(), groups, scale)
        if name == "rloo":
            ref = [a * 4 / 3 for a in ref]          # leave-one-out: k / (k - 1) times the centred reward
        assert torch.allclose(adv, torch.tensor(ref), rtol=1e-6, atol=1e-6), name
    assert keep_groups_with_signal(batch, cfg).tolist() == (~equal).tolist()    # DAPO: no signal, not kept
    only_equal = batch.select(torch.nonzero(equal)[:, 0])
    only_equal.group_ids = torch.tensor([0] * 8 + [1] * 8 + [2] * 4)
    for name in ("reinforce_pp_baseline", "reinforce_pp"):      # whitening in float64: equal values give 0
        batch_all_one_group = only_equal if name.endswith("baseline") else only_equal.select(torch.arange(8))
        assert torch.all(registry.get("algo", name).advantages(batch_all_one_group, cfg) == 0), name


def test_dapo_overlong_penalty_uses_the_rollout_length_limit():
    # L is max_new_tokens (9), not algo.norm_len (Dr. GRPO's divisor), nor the batch's completion width; equal
    # rewards, so dynamic sampling is off (it would drop the group: test_dapo_dropped_groups_carry_zero_advantage)
    lengths = [5, 6, 7, 9]
    batch = batch_of([1.0] * 4, [[1] * n + [0] * (9 - n) for n in lengths], [0] * 4)
    for norm_len in (0, 6):
        cfg = algo_cfg(norm_len=norm_len, max_new_tokens=9)        # overlong_buffer 2: penalty from 8 tokens on
        cfg.dapo.dynamic_sampling = False
        assert torch.allclose(dapo_advantages(batch, cfg)[:, 0], torch.tensor([0.5, 0.5, 0.5, -1.5]), atol=1e-6)
    # no completion reached the limit: the batch is 7 wide, no one is penalised
    narrow = batch_of([1.0] * 4, [[1] * n + [0] * (7 - n) for n in [5, 6, 7, 7]], [0] * 4)
    assert torch.all(dapo_advantages(narrow, algo_cfg(max_new_tokens=9)) == 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dapo_advantages(batch, config.AlgoConfig())


def fake_rounds(monkeypatch, rewards_per_round: list[list[float]], algo: str, **cfg_kw):
    """train.draw over fake rounds (train.collect replaced): 3 prompts x 2 samples each, the given rewards."""
    import types
    import train
    calls = []

    def collect(run, step, times):
        r = rewards_per_round[len(calls)]
        calls.append(r)
        times["time/rollout"] = 1.0
        b = batch_of(r, [[1, 1, 0]] * len(r), [0, 0, 1, 1, 2, 2])
        return b, {"metrics": {"reward/x": sum(r) / len(r), "reward_fail/x": 1.0}}
    monkeypatch.setattr(train, "collect", collect)
    cfg = config.Config()
    cfg.algo.name, cfg.samples_per_prompt, cfg.prompts_per_step = algo, 2, 3
    for k, v in cfg_kw.items():
        setattr(cfg.algo.dapo, k, v)
    config.fill_defaults(cfg)
    run = types.SimpleNamespace(cfg=cfg, learner=types.SimpleNamespace(algo=registry.get("algo", algo)),
                                tok=types.SimpleNamespace(pad_token_id=0))
    times = {}
    return (*train.draw(run, 1, times), times, calls)


def test_dapo_dynamic_sampling_draws_until_the_batch_is_full_of_groups_with_signal(monkeypatch):
    # signal per group: round 1 [no, yes, no], round 2 [yes, no, no], round 3 [yes, yes, yes]
    rounds = [[1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 1]]
    batch, info, n_samples, metrics, times, calls = fake_rounds(monkeypatch, rounds, "dapo")
    assert metrics == {"dynamic_sampling/rounds": 3, "dynamic_sampling/groups_drawn": Sum(9),
                       "dynamic_sampling/groups_with_signal": Sum(5)}
    # round 3's last two groups with signal are surplus: 9 groups drawn, 7 in the batch, 3 of them kept
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    keep = registry.get("algo", "dapo").keep(batch, algo_cfg())
    assert keep.tolist() == [False, False, True, True, False, False, True, True] + [False] * 4 + [True, True]
    assert n_samples == 6 and times == {"time/rollout": 3.0}                    # the update's whole batch: one round
    assert info["metrics"] == {"reward/x": pytest.approx(sum(map(sum, rounds)) / 18), "reward_fail/x": 3.0}
    # full after round 2? no more rounds
    batch, _, _, metrics, _, calls = fake_rounds(monkeypatch, [rounds[1], rounds[2]], "dapo")
    assert len(calls) == 2 and metrics["dynamic_sampling/groups_with_signal"] == Sum(4) and len(batch) == 10
    # max_rounds=1 (and dynamic_sampling=false): one round, as every other algorithm
    for kw in ({"max_rounds": 1}, {"dynamic_sampling": False}):
        batch, _, n_samples, metrics, _, calls = fake_rounds(monkeypatch, rounds, "dapo", **kw)
        assert len(calls) == 1 and metrics == {} and len(batch) == n_samples == 6
    batch, _, _, metrics, _, calls = fake_rounds(monkeypatch, rounds, "grpo")
    assert len(calls) == 1 and metrics == {}


def test_kl_estimates_are_bounded():
    # ref - logp = 100 overflowed k3 to inf (exp(100) > float32's max), and the update was skipped
    logp = torch.tensor([0.0, -100.0, -1.0, -3.0], requires_grad=True)
    ref = torch.tensor([-100.0, 0.0, -1.5, -0.5])
    kl = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(kl).all() and kl.abs().max() <= K3_MAX
    assert torch.isfinite(torch.autograd.grad(kl.sum(), logp)[0]).all()
    # inside the bounds: the textbook formulas, unchanged
    lr = (logp - ref)[2:].detach().double()
    assert torch.allclose(kl_estimate(logp, ref, "k3")[2:].double(), torch.exp(-lr) - 1 + lr, atol=1e-6)
    assert kl_estimate(logp, ref, "k3")[1] == K3_MAX
    # k3's log-ratio clamp (+-20, verl's) is inside k3 only: k1 and k2 need no exp and stay exact, as in verl/TRL
    k3_at_20 = math.exp(-KL_LOG_RATIO_MAX) - 1 + KL_LOG_RATIO_MAX                # 19.0...: above K3_MAX anyway
    assert k3_at_20 > K3_MAX
    assert kl_estimate(logp, ref, "k1").tolist()[:2] == [100.0, -100.0]
    assert kl_estimate(logp, ref, "k2").tolist()[:2] == [5000.0, 5000.0]
    # and through the loss: finite, so the update is not skipped
    batch = batch_of([1.0, 0.0], [[1, 1], [1, 1]], [0, 0], ref_logprobs=torch.tensor([[-100.0, 0.0], [0.0, 0.0]]))
    batch.advantages = grpo_advantages(batch, algo_cfg())
    loss, m = loss_grad(clipped_policy_loss, batch, algo_cfg(kl_coef=0.1), torch.zeros(2, 2, requires_grad=True))[1:]
    assert math.isfinite(loss.item()) and math.isfinite(float(m["kl"]))


def test_clip_frac_cut_counts_the_tokens_whose_gradient_the_clip_removes():
    # (advantage, ratio) per token: above the range with A > 0 and below it with A < 0 are cut; the other two
    # outside the range keep their gradient (the max picks the unclipped term); one token is inside
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]])
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.0]])
    batch = batch_of([1.0], [[1] * 5], [0], old_logprobs=torch.zeros(1, 5))
    batch.advantages = adv
    logp = ratio.log().requires_grad_()
    loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(1, 5)}, batch, algo_cfg())
    (g,) = torch.autograd.grad(loss, logp)
    assert float(m["clip_frac"]) == pytest.approx(4 / 5) and float(m["clip_frac_cut"]) == pytest.approx(2 / 5)
    assert (g[0] == 0).tolist() == [True, False, True, False, False]       # the independent check: gradients


def test_whitening_convention_biased_variance():
    x, mask = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4)
    expected = (x - 2.5) / math.sqrt(1.25 + 1e-8)       # biased variance 1.25 (the unbiased one is 5/3)
    assert torch.allclose(masked_whiten(x, mask), expected, atol=1e-6)
    assert torch.all(masked_whiten(torch.full((1, 8), 1.2), torch.ones(1, 8)) == 0)


def test_online_dpo_pairs_best_vs_worst():
    labels = pair_labels(torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 1, 0.5]), torch.arange(3).repeat_interleave(4))
    assert labels.tolist() == [1, -1, 0, 0, 0, 0, 0, 0, -1, 0, 1, 0]   # group 1 has no signal: no pair


# --- losses and their gradients --------------------------------------------------------------------
@pytest.mark.parametrize("name, agg", [("grpo", "token-mean"), ("rloo", "token-mean"), ("reinforce_pp", "token-mean"),
                                       ("dapo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")])
def test_on_policy_gradient_equals_reinforce(name, agg):
    algo = registry.get("algo", name)
    batch, cfg = batch_of([1.0, 0, 1, 0], MASK, [0, 0, 1, 1]), algo_cfg()
    batch.advantages = algo.advantages(batch, cfg)
    logits = torch.randn(4, 3, requires_grad=True, generator=torch.Generator().manual_seed(0))
    g, _, m = loss_grad(algo.loss, batch, cfg, logits)
    assert torch.allclose(g, reinforce_grad(batch, logits, agg, cfg.norm_len), atol=1e-6)
    assert float(m["ratio"]) == pytest.approx(1.0) and float(m["clip_frac"]) == 0.0


def test_dr_grpo_divides_by_the_constant_not_the_length():
    batch, cfg = batch_of([1.0, 0, 1, 0], MASK, [0, 0, 1, 1]), algo_cfg(norm_len=10)
    batch.advantages = registry.get("algo", "dr_grpo").advantages(batch, cfg)     # (0.5, -0.5) per group
    logits = torch.zeros(4, 3, requires_grad=True)
    g, _, _ = loss_grad(registry.get("algo", "dr_grpo").loss, batch, cfg, logits)
    # d/dlogit of -A * logsigmoid(logit) at 0 is -A / 2; divided by norm_len 10 and by B = 4 sequences
    assert torch.allclose(g, -batch.advantages / 2 / 10 / 4, atol=1e-7)


def test_gspo_on_policy_is_seq_mean_token_mean_reinforce_and_clips_per_sequence():
    batch, cfg = batch_of([1.0, 0, 1, 0], MASK, [0, 0, 1, 1]), algo_cfg()
    batch.advantages = grpo_advantages(batch, cfg)
    logits = torch.randn(4, 3, requires_grad=True, generator=torch.Generator().manual_seed(1))
    g, _, _ = loss_grad(gspo_loss, batch, cfg, logits)
    assert torch.allclose(g, reinforce_grad(batch, logits, "seq-mean-token-mean"), atol=1e-6)
    # a sequence whose geometric-mean ratio left [1 - 3e-4, 1 + 4e-4] on the side its advantage pushes: no gradient
    batch.old_logprobs = F.logsigmoid(logits).detach() - 0.01 * (batch.advantages > 0)   # s = e^0.01 for A > 0
    g, _, m = loss_grad(gspo_loss, batch, cfg, logits)
    assert torch.all(g[batch.advantages[:, 0] > 0] == 0) and float(m["clip_frac"]) == 0.5
    assert float(m["clip_frac_cut"]) == 0.5                  # those sequences are cut; the others are inside


def test_clipping_stops_gradient_and_dapo_clips_higher():
    batch, cfg = batch_of([1.0, 0, 1, 0], MASK, [0, 0, 1, 1]), algo_cfg()
    batch.advantages = torch.ones(4, 3) * batch.completion_mask
    batch.old_logprobs = torch.zeros(4, 3)
    logp = torch.full((4, 3), math.log(1.25), requires_grad=True)           # ratio 1.25: above 1.2, below 1.28
    loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(4, 3)}, batch, cfg)
    assert torch.autograd.grad(loss, logp)[0].abs().sum() == 0 and loss.item() == pytest.approx(-1.2)
    loss, m = registry.get("algo", "dapo").loss({"logprobs": logp, "entropy": torch.zeros(4, 3)}, batch, cfg)
    assert m["clip_frac"] == 0 and loss.item() == pytest.approx(-1.25)      # clip-higher lets it through


def test_ppo_loss_policy_gradient_and_value_gradient():
    batch = batch_of([1.0, 0.0], [[1, 1], [1, 0]], [0, 0], values=torch.tensor([[0.5, 0.5], [0.2, 0.0]]))
    cfg = algo_cfg()
    cfg.ppo.whiten, cfg.ppo.value_clip, cfg.ppo.vf_coef, cfg.ppo.gae_lambda = False, 0.0, 1.0, 1.0
    batch.advantages = ppo_advantages(batch, cfg)                         # [[0.5, 0.5], [-0.2, 0]]
    logits = torch.randn(2, 2, requires_grad=True, generator=torch.Generator().manual_seed(2))
    values = torch.tensor([[0.5, 0.5], [0.2, 0.0]], requires_grad=True)
    logp = F.logsigmoid(logits)
    loss, m = ppo_loss({"logprobs": logp, "entropy": torch.zeros(2, 2), "values": values}, batch, cfg)
    g_logits, g_values = torch.autograd.grad(loss, [logits, values])
    assert torch.allclose(g_logits, reinforce_grad(batch, logits), atol=1e-6)
    # value loss 0.5 * token-mean (V - R)^2 with R = A + V_old = (1, 1, 0): dV = (V - R) / 3 tokens
    assert torch.allclose(g_values, torch.tensor([[-0.5, -0.5], [0.2, 0.0]]) / 3, atol=1e-6)
    assert float(m["value_loss"]) == pytest.approx(0.5 * (0.25 + 0.25 + 0.04) / 3)


def test_value_clipping_hand_values():
    R, old, mask = torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.ones(1, 1)
    v = torch.tensor([[1.0]], requires_grad=True)              # moved 1.0 > clip 0.2: clipped branch (V 0.2) wins
    loss = value_loss(v, old, R, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * 1.8 ** 2) and torch.autograd.grad(loss, v)[0].item() == 0
    v = torch.tensor([[0.1]], requires_grad=True)              # inside the clip: plain squared error
    loss = value_loss(v, old, R, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * 1.9 ** 2) and torch.autograd.grad(loss, v)[0].item() == pytest.approx(-1.9)


def test_ppo_whitening_uses_the_minibatch():
    batch = batch_of([1.0, 0.0], [[1, 1], [1, 0]], [0, 0], values=torch.zeros(2, 2))
    batch.advantages = torch.tensor([[3.0, 1.0], [2.0, 0.0]])
    w = masked_whiten(batch.advantages, batch.completion_mask)
    assert torch.allclose(w, torch.tensor([[1.2247, -1.2247], [0.0, 0.0]]), atol=1e-4)


def test_whitening_over_parts_equals_the_whole():
    """masked_whiten with sum_over (distributed.all_sum under torchrun): two halves whitened with sums over
    both give the whole batch's result, not each half's own."""
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(6, 5, generator=g), (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = masked_whiten(x, mask)
    (xa, ma), (xb, mb) = (x[:3], mask[:3]), (x[3:], mask[3:])
    mean = (x * mask).sum().item() / mask.sum().item()

    def sum_over(values):   # all_sum as the first half's rank sees it: its numbers plus the second half's
        if len(values) == 2:                                   # first pass: sum and count
            return [values[0] + (xb * mb).sum().item(), values[1] + mb.sum().item()]
        return [values[0] + ((xb - mean) ** 2 * mb).sum().item()]   # second pass: squared deviations
    assert torch.allclose(masked_whiten(xa, ma, sum_over=sum_over), whole[:3], atol=1e-6)
    assert not torch.allclose(masked_whiten(xa, ma), whole[:3], atol=1e-2)   # whitened alone: another result
    assert torch.allclose(masked_whiten(x, mask, sum_over=lambda v: v), whole, atol=1e-6)   # world size 1


def test_dpo_loss_hand_values_and_gradient():
    zero = torch.zeros(3, requires_grad=True)
    loss = preference_loss(zero, torch.zeros(3), "sigmoid", beta=0.1)
    assert torch.allclose(loss, torch.full((3,), math.log(2)))             # equal log-ratios: log 2
    (g,) = torch.autograd.grad(loss.sum(), zero)
    assert torch.allclose(g, torch.full((3,), -0.05))                      # -beta * sigmoid(0)
    assert preference_loss(torch.tensor([0.0]), torch.tensor([0.0]), "ipo", beta=0.5).item() == pytest.approx(1.0)
    assert preference_loss(torch.tensor([2.0]), torch.tensor([1.0]), "ipo", beta=0.5).item() == pytest.approx(0.0)
    assert preference_loss(torch.tensor([1.0]), torch.tensor([0.0]), "simpo", beta=2.0, simpo_gamma=0.5).item() \
        == pytest.approx(-math.log(1 / (1 + math.exp(-1.5))))
    logp, ref, mask = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -2.0]]), torch.tensor([[1.0, 1.0]])
    assert sequence_scores(logp, ref, mask, "sigmoid").item() == pytest.approx(0.0)
    assert sequence_scores(logp, None, mask, "simpo").item() == pytest.approx(-2.0)


@pytest.mark.parametrize("estimator", ["k3", "exact"])
def test_online_dpo_refuses_a_kl_coef_it_would_ignore(estimator):
    argv = ["algo.name=online_dpo", "algo.kl_coef=0.1", f"algo.kl_estimator={estimator}"]
    cfg = config.fill_defaults(config.parse(argv))
    with pytest.raises(config.UserError, match=r"takes no KL term.*algo.kl_coef=0\b") as e:
        config_checks.validate(cfg)
    assert "\n" not in str(e.value)
    config_checks.validate(config.fill_defaults(config.parse(["algo.name=online_dpo"])))   # kl_coef=0 is fine
    config_checks.validate(config.fill_defaults(config.parse(["algo.kl_coef=0.1"])))       # grpo takes it


def test_online_dpo_loss_on_a_grouped_batch():
    batch = batch_of([1.0, 0, 0.5, 1, 1], [[1, 1]] * 5, [0, 0, 0, 1, 1], ref_logprobs=torch.zeros(5, 2))
    cfg = algo_cfg()
    batch.advantages = online_dpo_advantages(batch, cfg)
    logp = torch.tensor([[-0.5, -0.5], [-1.0, -1.0], [-9.0, -9.0], [0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    loss, m = online_dpo_loss({"logprobs": logp, "entropy": torch.zeros(5, 2)}, batch, cfg)
    # one pair (rows 0 vs 1): h_w = -1, h_l = -2 -> -log sigmoid(0.1 * 1)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.1)))) and m["pairs"] == 1
    (g,) = torch.autograd.grad(loss, logp)
    s = 0.1 * (1 - 1 / (1 + math.exp(-0.1)))
    assert torch.allclose(g, torch.tensor([[-s, -s], [s, s], [0, 0], [0, 0], [0, 0]]), atol=1e-7)


def test_tis_weights_truncate_and_reweight_the_loss():
    train, sample, mask = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.5]])), torch.ones(1, 2)
    assert torch.allclose(tis_weights(train, sample, mask, "token", 1.5), torch.tensor([[1.5, 1.0]]))
    assert torch.allclose(tis_weights(train, sample, mask, "seq", 10.0), torch.tensor([[2.0, 2.0]]))
    assert torch.allclose(tis_weights(train, sample, mask, "seq", 1.5), torch.tensor([[1.5, 1.5]]))
    batch, cfg = batch_of([1.0, 0], [[1, 1], [1, 1]], [0, 0]), algo_cfg(tis="token", tis_cap=1.5)
    batch.advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    batch.sample_logprobs = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.5]]))
    logp = torch.log(torch.full((2, 2), 0.5)).requires_grad_()
    loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(2, 2)}, batch, cfg)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, torch.tensor([[-1.5, -1.0], [1.0, 1.0]]) / 4) and float(m["tis_weight"]) == pytest.approx(4.5 / 4)


def test_kl_sits_in_the_loss_or_the_reward_never_both():
    batch = batch_of([1.0, 0], [[1, 1], [1, 1]], [0, 0], ref_logprobs=torch.full((2, 2), -1.0))
    batch.advantages = torch.zeros(2, 2)
    logp = torch.full((2, 2), -0.5, requires_grad=True)
    new = {"logprobs": logp, "entropy": torch.zeros(2, 2)}
    loss, m = clipped_policy_loss(new, batch, algo_cfg(kl_coef=0.1, kl_estimator="k1"))
    assert loss.item() == pytest.approx(0.1 * 0.5) and float(m["kl"]) == pytest.approx(0.5)
    loss, m = clipped_policy_loss(new, batch, algo_cfg(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True))
    assert loss.item() == 0 and float(m["kl"]) == pytest.approx(0.5)             # logged, not optimised here


def test_bad_algo_choices_are_user_errors():
    for override in ["algo.loss_agg=sum", "algo.kl_estimator=k9", "algo.tis=both", "algo.dpo.loss=hinge"]:
        with pytest.raises(config.UserError, match=override.split("=")[0]):
            config_checks.validate(config.parse([override]))


# --- every registered algorithm runs end to end and learns a toy reward (in process, random model) ----------
@registry.register("reward", "test_short")
def short_reward(prompt, completion, **_):
    return float(len(completion) <= 2)        # ~40% of a random model's samples; a right-signed update drives it to 1


@pytest.mark.parametrize("name", registry.names("algo"))
def test_every_algorithm_runs_and_learns_a_toy_reward(name, random_model_dir, tmp_path):
    import json
    import train
    kl = [] if name == "online_dpo" else ["algo.kl_coef=0.01"]   # online_dpo's loss has no KL term and refuses one
    train.main([f"model={random_model_dir}", f"algo.name={name}", "steps=12", "eval_every=12", "eval_size=8",
                "prompts_per_step=8", "samples_per_prompt=4", "rewards=test_short", f"out_dir={tmp_path}", "lr=3e-3",
                "progress=false", "algo.minibatch_size=16", *kl])   # 2 updates per step, KL on
    rows = step_rows(tmp_path)
    assert len(rows) == 12 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows[:4]), rows
    # measured wherever an update ran (a DAPO step that found no group with signal trains and measures nothing)
    assert all(0 <= r["logprob_mismatch/mean"] <= r["logprob_mismatch/max"] < 1e-3 for r in rows if "loss" in r)
    first, last = [sum(r["reward"] for r in part) / 4 for part in (rows[:4], rows[-4:])]
    assert last > first + 0.25, (first, last)


def test_critic_values_have_no_dropout(random_model_dir):
    """transformers' token-classification head has a 0.1 dropout; in train mode it made every V(s) noisy."""
    from critic import Critic
    cfg = config.Config(model=random_model_dir)
    critic = Critic(cfg, torch.device("cpu"), torch.float32)
    torch.nn.init.normal_(critic.model.score.weight)              # a nonzero head, so dropout would show
    ids, mask = torch.randint(2, 14, (2, 6)), torch.ones(2, 6, dtype=torch.long)     # the 14-token vocabulary
    comp = torch.ones(2, 3)
    assert critic.model.training
    v1, v2 = (critic.values(ids, mask, comp) for _ in range(2))
    assert v1.abs().sum() > 0 and torch.equal(v1, v2)


def test_readme_algorithm_table_names_every_registered_algorithm():
    """README's table is written by hand (the advantage and loss in words): it must name each registered algorithm
    and nothing else, so a new variant fails here until it has its row."""
    import os
    import re
    import algos  # noqa: F401  (registers every algorithm)
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    table = readme.split("| `algo.name` |", 1)[1].split("\n\n", 1)[0]          # the header row to the blank line
    listed = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert listed == set(registry.names("algo")), f"README lists {sorted(listed)}"
