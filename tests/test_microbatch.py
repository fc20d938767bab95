"""Micro-batching (microbatch.py): accumulated gradients equal the whole mini-batch's, for every loss_agg."""
import pytest
import torch

import config
import config_checks
import kernels
from algos.grpo import clipped_policy_loss, grpo_advantages
from microbatch import micro_batches, trim
from models import completion_logprobs, load_model
from engines.builtin import BuiltinEngine
from engines.base import SamplingParams
from conftest import step_rows  # noqa: E402


@pytest.fixture(scope="module")
def rollout_batch(random_model_dir):
    from buffer import Experience
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "123+456=", "7=", "99+1="]]   # prompts of several lengths
    r = engine.generate(prompts, 3, SamplingParams(max_new_tokens=10), torch.Generator().manual_seed(2))
    assert r.truncated.any() and (~r.truncated).any()                   # completions of several lengths
    B = len(r.input_ids)
    batch = Experience(input_ids=r.input_ids, attention_mask=r.attention_mask, completion_mask=r.completion_mask,
                       sample_logprobs=r.logprobs, rewards=torch.arange(B).float() % 3, group_ids=r.group_ids,
                       versions=torch.zeros(B, dtype=torch.long), truncated=r.truncated)
    return model, batch


@pytest.mark.parametrize("loss_agg, norm_len", [("token-mean", 0), ("seq-mean-token-mean", 0),
                                                ("seq-mean-token-sum", 0), ("seq-mean-token-sum-norm", 0),
                                                ("seq-mean-token-sum-norm", 16)])
def test_accumulated_gradient_equals_full_batch(rollout_batch, loss_agg, norm_len):
    model, batch = rollout_batch
    cfg = config.AlgoConfig(loss_agg=loss_agg, norm_len=norm_len)
    batch.advantages = grpo_advantages(batch, cfg)
    grads = []
    for size in (0, 5):
        model.zero_grad()
        pieces = list(micro_batches(batch, size, loss_agg, norm_len))
        assert len(pieces) == (1 if size == 0 else 3)
        for piece, weight in pieces:
            logp, ent = completion_logprobs(model, piece.input_ids, piece.attention_mask,
                                            piece.completion_mask.shape[1])
            loss, _ = clipped_policy_loss({"logprobs": logp, "entropy": ent}, piece, cfg)
            (loss * weight).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7), (grads[0] - grads[1]).abs().max()


def test_trim_drops_only_all_padding_columns(rollout_batch):
    _, batch = rollout_batch
    short = batch.completion_mask.sum(-1).argsort()[:2]                 # the two shortest completions
    piece = trim(batch.select(short))
    assert piece.completion_mask.shape[1] == int(batch.completion_mask[short].sum(-1).max())
    assert piece.attention_mask[:, 0].any() and piece.completion_mask[:, -1].any()
    assert piece.attention_mask.sum() == batch.attention_mask[short].sum()   # no real token lost
    assert piece.input_ids.shape[1] - piece.completion_mask.shape[1] == piece.prompt_len


def test_train_runs_with_micro_batches_and_checkpointing(tmp_path, random_model_dir):
    from conftest import train_here
    out = tmp_path / "run"
    train_here([f"model={random_model_dir}", "steps=2", "eval_size=8", "prompts_per_step=4", f"out_dir={out}",
                "micro_batch_size=8", "grad_checkpointing=true", "progress=false"])   # 4 pieces of the 32
    rows = step_rows(out)
    assert len(rows) == 2 and all(row["logprob_mismatch/max"] < 1e-4 for row in rows)


def test_fused_head_path_equals_logits_path(rollout_batch):
    """completion_logprobs takes the hidden-state kernel for plain heads; same values and gradients as logits."""
    from models import plain_head, position_ids
    model, batch = rollout_batch
    assert plain_head(model)
    ids, mask, C = batch.input_ids, batch.attention_mask, batch.completion_mask.shape[1]
    adv = torch.randn(len(ids), 1, generator=torch.Generator().manual_seed(5))
    results = []
    for fused in (True, False):
        model.zero_grad()
        if fused:
            logp, ent = completion_logprobs(model, ids, mask, C, 0.8)
        else:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -C - 1:-1]
            logp, ent = kernels.token_logprobs(logits, ids[:, -C:], 0.8)
        (-(logp * adv * batch.completion_mask).sum() + 0.1 * ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("algo_name, overrides", [("grpo", {}), ("dr_grpo", {}), ("gspo", {}),
                                                  ("grpo", {"kl_coef": 0.1, "loss_agg": "seq-mean-token-mean"})])
def test_fused_policy_loss_equals_autograd(rollout_batch, monkeypatch, algo_name, overrides):
    """fused_loss=true (update.fused_policy_loss: the kernel hands the loss rows at a time, here one row per
    chunk) gives the loss, metrics and gradients of log-probs + autograd, for token- and sequence-level losses."""
    import models
    import registry
    import update
    model, batch = rollout_batch
    cfg = config.Config()
    cfg.algo.name = algo_name
    for k, v in overrides.items():
        setattr(cfg.algo, k, v)
    config.fill_defaults(cfg)
    config_checks.validate(cfg)
    algo = registry.get("algo", algo_name)
    loss_agg = algo.loss_agg or cfg.algo.loss_agg
    batch.advantages = algo.advantages(batch, cfg.algo)
    with torch.no_grad():   # old and reference log-probs from a moved copy, so ratios and the KL are not trivial
        batch.old_logprobs = completion_logprobs(model, batch.input_ids, batch.attention_mask,
                                                 batch.completion_mask.shape[1])[0] + 0.05
        batch.ref_logprobs = batch.old_logprobs - 0.1
    kernel = kernels.linear_logprob_loss_kernel
    monkeypatch.setattr(models, "linear_logprob_loss_kernel", lambda *a, **kw: kernel(*a, **{**kw, "rows_per_chunk": 1}))
    learner = update.Learner(model, None, None, algo, cfg, torch.device("cpu"))
    C = batch.completion_mask.shape[1]
    out = []
    for fused in (False, True):
        model.zero_grad()
        if fused:
            loss, _, m = update.fused_policy_loss(learner, batch)
        else:
            logp, ent = completion_logprobs(model, batch.input_ids, batch.attention_mask, C)
            loss, m = algo.loss({"logprobs": logp, "entropy": ent}, batch, cfg.algo)
        loss.backward()
        out.append((loss.item(), {k: float(v) for k, v in m.items()},
                    torch.cat([p.grad.flatten() for p in model.parameters()])))
    (l0, m0, g0), (l1, m1, g1) = out
    assert g0.abs().sum() > 0 and l1 == pytest.approx(l0, rel=1e-5, abs=1e-7)
    assert m1.keys() == m0.keys()
    if loss_agg == "token-mean":   # else a piece's token-mean metrics are weighted by rows, as micro-batches are
        assert all(m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7) for k in m0)
    assert torch.allclose(g1, g0, rtol=1e-4, atol=1e-7), (g1 - g0).abs().max()
