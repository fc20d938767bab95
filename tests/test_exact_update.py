"""exact_logprobs in the update (update.py: reuses_sampled, check_exact, micro_loss): while the weights are those
that sampled the batch, the loss reads the engine's sampled log-probs instead of running the exact pass, with the
same loss and gradients; the exact pass checks `exact_check` sequences of the first micro-batch (logprob_mismatch
measures them, and only them), and every micro-batch after an optimizer step runs it on all its rows again.
Conftest's random 2-layer model on the CPU (torch path)."""
import pytest
import torch

import config
import engines.exact as exact
import registry
import update
from buffer import Experience, OnPolicyBuffer
from test_exact import generate


def setup(random_model_dir, *argv):
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    r = generate(model, n=2, max_new=8)                  # 5 prompts x 2 samples, the exact engine
    B = len(r.input_ids)
    batch = Experience(input_ids=r.input_ids, attention_mask=r.attention_mask, completion_mask=r.completion_mask,
                       sample_logprobs=r.logprobs, rewards=torch.zeros(B), group_ids=torch.arange(B) // 2,
                       versions=torch.zeros(B, dtype=torch.long), truncated=torch.zeros(B, dtype=torch.bool),
                       advantages=torch.randn(r.completion_mask.shape, generator=torch.Generator().manual_seed(1)))
    cfg = config.parse(["exact_logprobs=true", "samples_per_prompt=2", "temperature=0.9", *argv])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return update.Learner(model, opt, schedule, registry.get("algo", "grpo"), cfg, torch.device("cpu")), batch


def loss_and_grads(learner, micro, sampled: bool):
    learner.policy.zero_grad()
    loss, logp, _ = update.micro_loss(learner, micro, sampled=sampled)
    loss.backward()
    return loss.detach(), logp.detach(), [p.grad.clone() for p in learner.policy.parameters()]


def test_reading_the_sampled_logprobs_gives_the_exact_pass_loss_and_gradients(random_model_dir, monkeypatch):
    monkeypatch.setattr(exact, "BLOCK", 8)
    learner, batch = setup(random_model_dir)
    full = loss_and_grads(learner, batch, sampled=False)
    monkeypatch.setattr(exact, "completion_logprobs", None)   # the reusing path must not run the exact pass
    reused = loss_and_grads(learner, batch, sampled=True)
    m = batch.completion_mask.bool()      # off the loss's tokens the values may differ (the pass predicts padding)
    assert torch.equal(full[0], reused[0]) and torch.equal(full[1][m], reused[1][m])
    assert all(torch.equal(a, b) for a, b in zip(full[2], reused[2]))
    assert learner.policy.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_a_sample_of_the_first_micro_batch_and_every_row_after_an_optimizer_step_run_the_exact_pass(
        random_model_dir, monkeypatch):
    monkeypatch.setattr(exact, "BLOCK", 8)
    # 10 samples: mini-batches of 6 and 4 (two optimizer steps), micro-batches of 2: 3 + 2
    learner, batch = setup(random_model_dir, "micro_batch_size=2", "algo.minibatch_size=6", "exact_check=1")
    passes, own = [], exact.completion_logprobs
    monkeypatch.setattr(exact, "completion_logprobs", lambda model, ids, *a: passes.append(len(ids)) or
                        own(model, ids, *a))
    # the engine's values moved on the loss tokens, by 0.1 x (row + 1): the measured gap names the row it was
    # measured on, so a row not checked (or a reused one, gap 0 by construction) counted in the metric would
    # make its mean differ from its max
    shift = 0.1 * torch.arange(1, len(batch) + 1)[:, None]                                        # (B, 1)
    batch.sample_logprobs = batch.sample_logprobs + shift * batch.completion_mask
    buf = OnPolicyBuffer()
    buf.add(batch)
    out = update.update(learner, buf, torch.Generator().manual_seed(0), step=1, n_samples=len(batch))
    assert passes == [1, 2, 2]           # one sequence of the first micro-batch, then every row of the second's
    assert out["skipped_updates"] == 0
    mean, top = out["logprob_mismatch/mean"], out["logprob_mismatch/max"].value
    row = round(top / 0.1) - 1           # the checked row: its shift is the gap on every one of its tokens
    assert top == pytest.approx(0.1 * (row + 1), abs=1e-5) and mean.num / mean.den == pytest.approx(top, abs=1e-5)
    assert mean.den == batch.completion_mask[row].sum()   # exactly that row's tokens
    # the same with the batch of another version: no row is reused (the policy that sampled it is gone)
    passes.clear()
    learner.version = 1
    buf.add(batch)
    update.update(learner, buf, torch.Generator().manual_seed(0), step=2, n_samples=len(batch))
    assert passes == [2] * 5


def test_the_checked_update_gives_the_full_exact_pass_loss_gradients_and_zero_mismatch(random_model_dir,
                                                                                       monkeypatch):
    monkeypatch.setattr(exact, "BLOCK", 8)
    learner, batch = setup(random_model_dir, "micro_batch_size=4", "exact_check=3")
    reuse = update.reuses_sampled

    def run(reuses):   # one mini-batch's forward and backward, before any optimizer step
        monkeypatch.setattr(update, "reuses_sampled", reuses)
        learner.policy.zero_grad(set_to_none=True)
        m = update.accumulate_gradients(learner, batch, measure_mismatch=True)
        return m, [p.grad.clone() for p in learner.policy.parameters()]
    full, full_grads = run(lambda *a: False)         # the exact pass on every row, each one measured
    checked, grads = run(reuse)
    assert torch.equal(full["loss"], checked["loss"]) and all(torch.equal(a, b) for a, b in zip(full_grads, grads))
    assert full["_mis_max"] == 0.0 and checked["_mis_max"] == 0.0      # exact: the engine's bits, checked
    longest = batch.completion_mask.sum(-1).sort(descending=True, stable=True).values   # micro 0: the longest rows
    assert checked["_mis_n"] == longest[:3].sum() and full["_mis_n"] == batch.completion_mask.sum()


def test_exact_check_below_one_or_without_the_option_is_refused_before_any_work():
    import config_checks
    cfg = config.parse(["exact_logprobs=true", "exact_check=0"])
    with pytest.raises(config.UserError, match="'exact_check' must be >= 1; got 0"):
        config_checks.validate(cfg)
    with pytest.raises(config.UserError, match="exact_check=4 applies to exact_logprobs=true only"):
        exact.check_config(config.parse(["exact_check=4"]))
    exact.check_config(config.parse(["exact_logprobs=true", "exact_check=4"]))


def test_reuse_needs_the_option_an_unmoved_policy_this_version_and_an_on_policy_buffer(random_model_dir):
    learner, batch = setup(random_model_dir)
    assert update.reuses_sampled(learner, batch, unmoved=True)
    assert not update.reuses_sampled(learner, batch, unmoved=False)
    learner.version = 3
    assert not update.reuses_sampled(learner, batch, unmoved=True)
    learner.version = 0
    learner.cfg.replay.enabled = True
    assert not update.reuses_sampled(learner, batch, unmoved=True)
    learner.cfg.replay.enabled, learner.cfg.exact_logprobs = False, False
    assert not update.reuses_sampled(learner, batch, unmoved=True)
