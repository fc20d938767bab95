"""On-policy distillation (algos/distill.py): the per-token advantage and the gradient against hand formulas, the
estimator's expectation against the exact reverse-KL gradient, and a short run toward a sharper teacher."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import registry  # noqa: E402
from algos import distill  # noqa: E402
from buffer import Experience  # noqa: E402
from tests.conftest import make_random_model, step_rows  # noqa: E402


def algo_cfg(**distill_kw) -> config.AlgoConfig:
    cfg = config.AlgoConfig(name="distill", distill=distill.DistillConfig(**{"teacher": "/t", **distill_kw}))
    cfg.norm_len = cfg.max_new_tokens = 3
    return cfg


def batch(**kw) -> Experience:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])                   # (B, C): row 0 ends after 2 tokens
    fields = dict(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
                  completion_mask=mask, sample_logprobs=torch.tensor([[-1.0, -0.5, 0.0], [-2.0, -0.1, -0.3]]),
                  ref_logprobs=torch.tensor([[-0.2, -1.5, -9.0], [-2.0, -0.4, -0.1]]),
                  rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
                  versions=torch.zeros(2, dtype=torch.long),
                  truncated=torch.zeros(2, dtype=torch.bool))
    return Experience(**{**fields, **kw})


def test_advantage_is_the_teacher_student_log_ratio_plus_the_task_term():
    algo = registry.get("algo", "distill")
    b = batch()
    pure = algo.advantages(b, algo_cfg(coef=0.5, task_coef=0.0))
    assert torch.allclose(pure, torch.tensor([[0.5 * 0.8, 0.5 * -1.0, 0.0], [0.0, 0.5 * -0.3, 0.5 * 0.2]]))
    mixed = algo.advantages(b, algo_cfg(coef=0.5, task_coef=2.0))
    # GRPO on rewards (1, 0): centred +-0.5, unbiased std sqrt(0.5): +-0.7071 on every completion token
    task = torch.tensor([[1.0], [-1.0]]) * 0.5 / (math.sqrt(0.5) + 1e-6) * b.completion_mask
    assert torch.allclose(mixed, pure + 2.0 * task, atol=1e-6)
    old = torch.tensor([[-0.7, -0.7, 0.0], [-1.0, -1.0, -1.0]])                # the trainer's own, when it has them
    with_old = algo.advantages(batch(old_logprobs=old), algo_cfg(coef=1.0, task_coef=0.0))
    assert torch.allclose(with_old, (b.ref_logprobs - old) * b.completion_mask)


def test_gradient_matches_the_hand_formula():
    algo = registry.get("algo", "distill")
    cfg = algo_cfg(coef=1.0, task_coef=0.0)
    b = batch()
    b.advantages = algo.advantages(b, cfg)
    logp = b.sample_logprobs.clone().requires_grad_()                         # on-policy: ratio 1
    loss, metrics = algo.loss({"logprobs": logp, "entropy": torch.zeros(2, 3)}, b, cfg)
    loss.backward()
    # token-mean over 5 completion tokens of -A_t * ratio: d loss / d logp_t = -(ref_t - student_t) / 5
    hand = -(b.ref_logprobs - b.sample_logprobs) * b.completion_mask / 5
    assert torch.allclose(logp.grad, hand, atol=1e-6)
    assert float(metrics["distill_kl"]) == pytest.approx((-0.8 + 1.0 + 0.0 + 0.3 - 0.2) / 5)


def test_the_estimator_is_the_reverse_kl_gradient_in_expectation():
    """Over one position with the student's exact distribution as sampling weights:
    E_{y ~ p_s}[grad log p_s(y) * A(y)] = -grad KL(p_s || p_t), with A(y) the distillation advantage."""
    theta = torch.tensor([0.3, -1.0, 0.8, 0.0], requires_grad=True)          # student logits over 4 tokens
    teacher = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0, 0.5]), -1)
    logp_s = torch.log_softmax(theta, -1)                                     # (4,) every token as a 1-token sample
    b = batch(completion_mask=torch.ones(4, 1), sample_logprobs=logp_s.detach()[:, None],
              ref_logprobs=teacher[:, None], rewards=torch.zeros(4), group_ids=torch.arange(4),
              input_ids=torch.zeros(4, 2, dtype=torch.long), attention_mask=torch.ones(4, 2, dtype=torch.long),
              versions=torch.zeros(4, dtype=torch.long), truncated=torch.zeros(4, dtype=torch.bool))
    adv = registry.get("algo", "distill").advantages(b, algo_cfg(coef=1.0, task_coef=0.0))[:, 0]   # (4,)
    (estimate,) = torch.autograd.grad((logp_s.exp().detach() * adv * logp_s).sum(), theta, retain_graph=True)
    kl = (logp_s.exp() * (logp_s - teacher)).sum()
    (exact,) = torch.autograd.grad(kl, theta)
    assert torch.allclose(estimate, -exact, atol=1e-6) and exact.abs().max() > 0.1


def test_missing_teacher_logprobs_are_named():
    with pytest.raises(ValueError, match="algo.distill.teacher"):
        distill.distill_token_advantages(batch(ref_logprobs=None))


def test_options_parse_and_reach_the_algorithm():
    cfg = config.parse(["algo.name=distill", "algo.distill.coef=0.25", "algo.distill.teacher=/t",
                        "algo.distill.task_coef=0"])
    assert (cfg.algo.distill.coef, cfg.algo.distill.teacher, cfg.algo.distill.task_coef) == (0.25, "/t", 0.0)


def test_a_short_run_moves_the_student_toward_a_sharper_teacher(random_model_dir, tmp_path):
    """Pure distillation from a random model into a sharper one of the same tokenizer: the teacher really is loaded
    (distill_kl far from 0 at the start) and the reverse KL on the student's own samples falls."""
    import train
    from transformers import AutoModelForCausalLM
    teacher = make_random_model(str(tmp_path / "teacher"), seed=1)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)                        # peaked next-token distributions
    model.save_pretrained(teacher)
    train.main([f"model={random_model_dir}", "algo.name=distill", f"algo.distill.teacher={teacher}",
                "algo.distill.task_coef=0", "steps=16", "eval_every=16", "eval_size=4", "prompts_per_step=8",
                "samples_per_prompt=2", "lr=3e-3", "threads=1", "progress=false", f"out_dir={tmp_path / 'run'}"])
    kl = [r["distill_kl"] for r in step_rows(tmp_path / "run")]
    assert len(kl) == 16 and kl[0] > 0.5, kl
    assert sum(kl[-3:]) / 3 < 0.7 * sum(kl[:3]) / 3, kl


def test_without_a_teacher_it_is_grpo_and_needs_no_reference():
    from algos.grpo import grpo_advantages
    algo = registry.get("algo", "distill")
    cfg = algo_cfg(teacher="", coef=1.0, task_coef=1.0)
    assert torch.equal(algo.advantages(batch(), cfg), grpo_advantages(batch(), cfg))
    assert algo.needs_ref(algo_cfg()) and not algo.needs_ref(cfg)


def test_gradient_matches_trls_on_policy_gkd(monkeypatch):
    """TRL's GKD loss (GKDTrainer.generalized_jsd_loss) at beta=1, which its code computes as
    kl_div(input=log p_teacher, target=log p_student) = sum_v p_s (log p_s - log p_t): the reverse KL, token mean over
    the labelled positions. On the same logits it must equal (value and gradient) kernels/fused_kl.py's torch twin
    (the full-distribution form), and its gradient must equal the expectation over the student's own tokens of
    algos/distill.py's sampled form (the advantage log p_t - log p_s in the clipped policy loss)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    gkd = pytest.importorskip("trl.experimental.gkd")
    from kernels.fused_kl import fused_kl
    B, T, H, V = 2, 4, 8, 11
    g = torch.Generator().manual_seed(0)
    h_s, h_t = torch.randn(B * T, H, generator=g), torch.randn(B * T, H, generator=g)
    w_s, w_t = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    real = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)            # (N,): sample 0 ends after 3 tokens
    labels = torch.where(real, 0, -100).view(B, T)                             # TRL ignores -100
    worst = {}
    for temperature in (1.0, 0.7):
        def trl_loss(hs, ws):
            return gkd.GKDTrainer.generalized_jsd_loss((hs @ ws.T).view(B, T, V), (h_t @ w_t.T).view(B, T, V),
                                                       labels=labels, beta=1.0, temperature=temperature)

        def fused_loss(hs, ws):
            return fused_kl(hs, ws, h_t, w_t, temperature=temperature, use_triton=False)[real].mean()

        def sampled_loss(hs, ws):   # every token of every position as a one-token sample, weighted by p_s
            logp = torch.log_softmax(hs @ ws.T / temperature, -1)                             # (N, V)
            teacher = torch.log_softmax(h_t @ w_t.T / temperature, -1)
            mask = real.float()[:, None].expand(-1, V).reshape(-1, 1)                           # (N * V, 1)
            b = batch(completion_mask=mask, sample_logprobs=logp.detach().reshape(-1, 1),
                      ref_logprobs=teacher.reshape(-1, 1), rewards=torch.zeros(B * T * V),
                      group_ids=torch.zeros(B * T * V, dtype=torch.long),
                      input_ids=torch.zeros(B * T * V, 2, dtype=torch.long),
                      attention_mask=torch.ones(B * T * V, 2, dtype=torch.long),
                      versions=torch.zeros(B * T * V, dtype=torch.long),
                      truncated=torch.zeros(B * T * V, dtype=torch.bool))
            cfg = algo_cfg(coef=1.0, task_coef=0.0)
            # the token mean over N * V rows, each weighted by p_s * V: the expectation per position
            b.advantages = distill.distill_advantages(b, cfg) * logp.exp().detach().reshape(-1, 1) * V
            loss, _ = distill.distill_loss({"logprobs": logp.reshape(-1, 1), "entropy": torch.zeros_like(mask)}, b, cfg)
            return loss

        results = {}
        for name, fn in [("trl", trl_loss), ("fused", fused_loss), ("sampled", sampled_loss)]:
            hs, ws = h_s.clone().requires_grad_(), w_s.clone().requires_grad_()
            loss = fn(hs, ws)
            results[name] = (loss.detach(), *torch.autograd.grad(loss, (hs, ws)))
        trl_value, *trl_grads = results["trl"]
        hand = torch.log_softmax(h_s @ w_s.T / temperature, -1), torch.log_softmax(h_t @ w_t.T / temperature, -1)
        reverse = (hand[0].exp() * (hand[0] - hand[1])).sum(-1)[real].mean()
        assert trl_value.item() == pytest.approx(reverse.item(), rel=1e-5) and trl_value > 0.1   # beta=1: reverse KL
        assert torch.allclose(results["fused"][0], trl_value, rtol=1e-5, atol=1e-6)
        for name in ("fused", "sampled"):
            for ours, theirs in zip(results[name][1:], trl_grads):
                assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6), (name, (ours - theirs).abs().max())
                worst[name] = max(worst.get(name, 0.0), (ours - theirs).abs().max().item())
        assert trl_grads[0].abs().max() > 1e-2
    print(f"max |gradient - TRL's|: {worst}")
