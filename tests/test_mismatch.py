"""The mismatch lab's sources and repairs (docs/mismatch.md), each checked for doing what it says and nothing else:
top-k sampling (tokens and the processed log-probs), the engine's dtype copy and lagged weights (training rollouts
only; evaluation samples with the policy), the trainer temperature (the trainer's log-probs move, the sampling
does not), masked importance sampling (exactly the out-of-band tokens lose their loss), and the one-line errors."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import config
import config_checks
import engines.exact as exact
import registry
from algos.common import clipped_policy_loss, tis_weights
from buffer import Experience
from engines.base import SamplingParams, sample_tokens, top_k_filter
from engines.builtin import BuiltinEngine
from models import completion_logprobs


def test_top_k_samples_only_the_k_largest_and_reports_the_renormalised_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 12, generator=g)                                     # (B, V)
    allowed = logits.topk(3, dim=-1).indices                                      # (B, 3)
    processed, raw = SamplingParams(top_k=3, logprobs_mode="processed"), SamplingParams(top_k=3)
    for _ in range(20):
        tok, logp = sample_tokens(logits, processed, g)
        assert (allowed == tok[:, None]).any(-1).all()                          # never outside the top 3
        truncated = torch.log_softmax(top_k_filter(logits, 3), -1).gather(-1, tok[:, None]).squeeze(-1)
        full = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
        assert torch.allclose(logp, truncated) and (logp > full).all()           # renormalised over the 3 kept
    # raw mode: the same draws (same generator state), log-probs of the whole distribution
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    (t1, _), (t2, lr) = sample_tokens(logits, processed, a), sample_tokens(logits, raw, b)
    assert torch.equal(t1, t2) and torch.allclose(lr, torch.log_softmax(logits, -1).gather(-1, t2[:, None]).squeeze(-1))


@pytest.fixture(scope="module")
def policy(random_model_dir):
    return AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)


def rollout(engine, seed=0, train=True):
    params = SamplingParams(max_new_tokens=4, rollout=train)
    return engine.generate([[2, 3, 4], [5, 6]], 4, params, torch.Generator().manual_seed(seed))


def trainer_logprobs(model, r):
    C = r.completion_mask.shape[1]
    return completion_logprobs(model, r.input_ids, r.attention_mask, C)[0] * r.completion_mask


def test_engine_dtype_samples_training_rollouts_with_a_bf16_copy(policy):
    engine = BuiltinEngine(policy, eos_id=1, pad_id=0, sample_dtype="bfloat16")
    assert next(engine.rollout_model.parameters()).dtype == torch.bfloat16
    assert next(policy.parameters()).dtype == torch.float32                      # the trainer's stays fp32
    r = rollout(engine)
    gap = (r.logprobs - trainer_logprobs(policy, r)).abs().max().item()
    assert 1e-4 < gap < 0.5                                                      # bf16 numerics, not a bug
    ev = rollout(engine, train=False)                                            # evaluation: the policy itself
    assert torch.allclose(ev.logprobs, trainer_logprobs(policy, ev), atol=1e-5)
    same = BuiltinEngine(policy, eos_id=1, pad_id=0)                             # the default: no copy at all
    assert same.rollout_model is policy


def test_engine_lag_syncs_weights_k_steps_late(policy):
    import copy
    engine = BuiltinEngine(policy, eos_id=1, pad_id=0, lag=2)
    w = next(engine.rollout_model.parameters())
    versions = [copy.deepcopy(policy) for _ in range(3)]
    for i, m in enumerate(versions, start=1):                                    # weights of steps 1, 2, 3
        torch.nn.init.constant_(next(m.parameters()), float(i))
    engine.load_weights(versions[0].named_parameters())
    engine.load_weights(versions[1].named_parameters())
    assert torch.equal(w, next(policy.parameters()))                             # still the step-0 weights
    engine.load_weights(versions[2].named_parameters())
    assert (w == 1.0).all()                                                      # step 3 samples with step 1's
    assert not (next(policy.parameters()) == 1.0).all()                          # the policy was never touched


def test_train_temperature_moves_the_trainers_logprobs_not_the_sampling(policy):
    cfg = config.parse(["train_temperature=0.5"])
    assert config.trainer_temperature(cfg) == 0.5 and cfg.temperature == 1.0
    assert config.trainer_temperature(config.parse([])) == 1.0
    from update import Learner, micro_loss
    engine = BuiltinEngine(policy, eos_id=1, pad_id=0)
    r = rollout(engine)
    assert torch.equal(r.logprobs, rollout(engine).logprobs)                     # sampling: the same draws
    batch = Experience(input_ids=r.input_ids, attention_mask=r.attention_mask, completion_mask=r.completion_mask,
                       sample_logprobs=r.logprobs, rewards=torch.zeros(8), group_ids=r.group_ids,
                       versions=torch.zeros(8, dtype=torch.long), truncated=r.truncated,
                       advantages=torch.zeros_like(r.completion_mask))
    learner = Learner(policy, None, None, registry.get("algo", "grpo"), cfg, torch.device("cpu"))
    _, logp, _ = micro_loss(learner, batch)
    C = r.completion_mask.shape[1]
    at_half = completion_logprobs(policy, r.input_ids, r.attention_mask, C, 0.5)[0]
    assert torch.allclose(logp, at_half) and not torch.allclose(logp * r.completion_mask, r.logprobs, atol=1e-3)


def test_masked_importance_sampling_zeroes_exactly_the_out_of_band_tokens():
    # rho = pi_train / pi_sample per token: 3.0 and 0.4 leave [1/2, 2]; 1.5 and 0.6 stay (with their full weight)
    rho = torch.tensor([[3.0, 1.5], [0.6, 0.4]])
    sample = torch.log(torch.full((2, 2), 0.2))
    train, mask = sample + rho.log(), torch.ones(2, 2)
    w = tis_weights(train, sample, mask, "mask", 2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 1.5], [0.6, 0.0]]))
    assert torch.isfinite(tis_weights(sample + 100.0, sample, mask, "mask", 2.0)).all()   # exp(100) * 0 is no nan
    cfg = config.AlgoConfig(tis="mask", tis_cap=2.0)
    batch = Experience(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4),
                       completion_mask=mask, sample_logprobs=sample, rewards=torch.zeros(2),
                       group_ids=torch.zeros(2, dtype=torch.long), versions=torch.zeros(2, dtype=torch.long),
                       truncated=torch.zeros(2, dtype=torch.bool), advantages=torch.ones(2, 2))
    logp = train.clone().requires_grad_()
    loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(2, 2)}, batch, cfg)
    (g,) = torch.autograd.grad(loss, logp)
    # on-policy ratio 1: d/dlogp of -A * w * ratio, token-mean over 4 tokens
    assert torch.allclose(g, -torch.tensor([[0.0, 1.5], [0.6, 0.0]]) / 4)
    assert float(m["tis_masked_frac"]) == pytest.approx(0.5)


def test_tis_is_a_no_op_under_exact_logprobs(policy, monkeypatch):
    """exact_logprobs: every importance weight is exactly 1, so each repair gives the loss, metrics and gradient of
    tis=off, bit for bit (docs/mismatch.md: the exact row)."""
    monkeypatch.setattr(exact, "BLOCK", 8)
    r = BuiltinEngine(policy, eos_id=1, pad_id=0, exact=True).generate(
        [[2, 3, 4], [5, 6]], 4, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(0))
    mask = r.completion_mask
    batch = Experience(input_ids=r.input_ids, attention_mask=r.attention_mask, completion_mask=mask,
                       sample_logprobs=r.logprobs, rewards=torch.zeros(8), group_ids=torch.zeros(8, dtype=torch.long),
                       versions=torch.zeros(8, dtype=torch.long), truncated=torch.zeros(8, dtype=torch.bool),
                       advantages=torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)))
    out = {}
    for tis in ("off", "token", "seq", "mask"):
        policy.zero_grad()
        logp, ent = exact.completion_logprobs(policy, r.input_ids, r.attention_mask, mask.shape[1])
        loss, m = clipped_policy_loss({"logprobs": logp, "entropy": ent}, batch, config.AlgoConfig(tis=tis))
        loss.backward()
        out[tis] = loss.detach(), m, [p.grad.clone() for p in policy.parameters()]
        if tis != "off":
            assert float(m["tis_weight"]) == 1.0 and float(m.get("tis_masked_frac", 0.0)) == 0.0
    loss, m, grads = out["off"]
    assert mask.sum() > 10 and loss != 0 and any(g.abs().sum() > 0 for g in grads)
    for tis in ("token", "seq", "mask"):
        assert torch.equal(out[tis][0], loss) and all(torch.equal(a, b) for a, b in zip(out[tis][2], grads))
        assert all(torch.equal(torch.as_tensor(out[tis][1][k]), torch.as_tensor(v)) for k, v in m.items())
    policy.zero_grad()


@pytest.mark.parametrize("args, message", [
    (["top_k=-1"], "config key 'top_k' must be >= 0"),
    (["logprobs_mode=full"], "config key 'logprobs_mode' must be one of raw, processed"),
    (["engine_dtype=float16"], "config key 'engine_dtype' must be one of auto, float32, bfloat16"),
    (["engine_lag=-2"], "config key 'engine_lag' must be >= 0"),
    (["train_temperature=-1"], "config key 'train_temperature' must be >= 0"),
    (["algo.tis=mask", "algo.tis_cap=0.5"], "config key 'algo.tis_cap' must be >= 1"),
    (["algo.tis=clip"], "config key 'algo.tis' must be one of off, token, seq, mask"),
    (["engine=vllm", "top_k=4"], "top_k (the mismatch lab's options) need engine=builtin"),
    (["env.name=hilo", "engine_lag=1"], "engine_lag (the mismatch lab's options) need engine=builtin"),
])
def test_bad_mismatch_options_are_one_line_errors(args, message):
    with pytest.raises(config.UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        config_checks.validate(config.fill_defaults(config.parse(args)))
    assert "\n" not in str(e.value)


def test_the_lab_has_one_valid_command_per_experiment(capsys):
    from tools import mismatch_lab
    cmds = mismatch_lab.main(["--print", "--sources", "bf16,stale", "--repairs", "off,mask"]).splitlines()
    assert cmds == ["python train.py", "python train.py engine_dtype=bfloat16",
                    "python train.py engine_dtype=bfloat16 algo.tis=mask", "python train.py engine_lag=4",
                    "python train.py engine_lag=4 algo.tis=mask"]
    for source in mismatch_lab.SOURCES:   # every source is a one-line change that validates, with every repair
        for repair in mismatch_lab.REPAIRS:
            args = mismatch_lab.command(source, repair, []).split()[2:]
            cfg = config.fill_defaults(config.parse(args))
            config_checks.validate(cfg)
            exact.check_config(cfg)
            assert config_checks.mismatch_sources(cfg) or source in ("none", "exact")
