"""The full-vocabulary KL in the loss (full_kl.py): full-distribution distillation (algo.distill.full=true) and the
exact KL penalty (algo.kl_estimator=exact) against hand computations with whole (B, C, V) softmaxes in float32, the
reference's hidden states (Experience.ref_hidden) through select / cat / micro-batches, short train.py runs, and the
settings refused before any work."""
import contextlib
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import full_kl  # noqa: E402
import registry  # noqa: E402
import update  # noqa: E402
from buffer import Experience  # noqa: E402
from config import UserError  # noqa: E402
from microbatch import micro_batches, pack, packed_micro_batches  # noqa: E402
from tests.conftest import make_random_model, step_rows  # noqa: E402

P, C, TEMPERATURE = 3, 4, 0.7


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random student and a sharper random teacher of the same tokenizer (V = 14), float32."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("full-kl")
    student = AutoModelForCausalLM.from_pretrained(make_random_model(str(root / "s"), seed=0))
    teacher = AutoModelForCausalLM.from_pretrained(make_random_model(str(root / "t"), seed=1))
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(4.0)                     # peaked: KL far from 0
    return student, teacher.eval().requires_grad_(False)


def make_batch() -> Experience:
    """4 rows, 2 groups: row 0's prompt is left-padded, rows 2 and 3 end after 2 of the 4 completion tokens (so a
    micro-batch of them is trimmed to 2 columns)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 14, (4, P + C), generator=g)
    attn = torch.ones(4, P + C, dtype=torch.long)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])        # (B, C)
    attn[0, 0], ids[0, 0] = 0, 0
    attn[:, P:] = mask.long()
    ids[:, P:][mask == 0] = 0
    return Experience(input_ids=ids, attention_mask=attn, completion_mask=mask,
                      sample_logprobs=-torch.rand(4, C, generator=g) * mask, rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]),
                      group_ids=torch.tensor([0, 0, 1, 1]), versions=torch.zeros(4, dtype=torch.long),
                      truncated=torch.zeros(4, dtype=torch.bool))


def hand_logprobs(model, b: Experience) -> torch.Tensor:
    """(B, C, V) log-softmax of the logits at temperature, from the model's whole forward (no kernel)."""
    pos = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits[:, P - 1:-1]
    return torch.log_softmax(logits.float() / TEMPERATURE, -1)


def run_cfg(algo: str, **algo_kw) -> config.Config:
    cfg = config.Config()
    cfg.temperature = TEMPERATURE
    cfg.algo.name = algo
    for k, v in algo_kw.items():
        if k.startswith("distill_"):
            setattr(cfg.algo.distill, k[8:], v)
        else:
            setattr(cfg.algo, k, v)
    return config.fill_defaults(cfg)


def with_reference(b: Experience, reference) -> Experience:
    b.ref_logprobs, b.ref_hidden = full_kl.logprobs_and_hidden(reference, b.input_ids, b.attention_mask, C,
                                                               TEMPERATURE)
    return b


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def loss_and_grads(learner, b, micro_size=0, packed=False):
    """The update's loss of b, as update.accumulate_gradients weights micro-batches (packed: pack=true's pieces and
    layout), and the policy's gradient."""
    learner.policy.zero_grad()
    total, metrics = 0.0, {}
    split = packed_micro_batches if packed else micro_batches
    for micro, weight in split(b, micro_size, learner.loss_agg):
        with update.packed_attention(learner.policy) if packed else contextlib.nullcontext():
            loss, _, m = update.micro_loss(learner, micro, pack(micro) if packed else None)
            (loss * weight).backward()
        total += weight * loss.item()
        metrics = {k: metrics.get(k, 0.0) + weight * float(v) for k, v in m.items()}
    return total, metrics, grads(learner.policy)


def test_full_distillation_loss_and_gradient_match_whole_softmaxes(models):
    """loss = agg(-A_task * ratio + coef * sum_v p_s (log p_s - log p_t)) with seq-mean-token-mean, by hand."""
    student, teacher = models
    cfg = run_cfg("distill", distill_teacher="/t", distill_full=True, distill_coef=0.5, distill_task_coef=2.0,
                  loss_agg="seq-mean-token-mean")
    algo = registry.get("algo", "distill")
    b = with_reference(make_batch(), teacher)
    b.advantages = algo.advantages(b, cfg.algo)
    from algos.grpo import grpo_advantages
    assert torch.equal(b.advantages, 2.0 * grpo_advantages(b, cfg.algo))    # no log-ratio in the advantage
    learner = update.Learner(student, None, None, algo, cfg, torch.device("cpu"), reference=teacher)
    loss, metrics, grad = loss_and_grads(learner, b)

    student.zero_grad()
    ls, lt = hand_logprobs(student, b), hand_logprobs(teacher, b)                             # (B, C, V) each
    kl = (ls.exp() * (ls - lt)).sum(-1)                                                        # (B, C)
    logp = ls.gather(-1, b.input_ids[:, P:, None])[..., 0]                                     # (B, C)
    per_token = -b.advantages * torch.exp(logp - logp.detach()) + 0.5 * kl
    m = b.completion_mask
    hand = ((per_token * m).sum(-1) / m.sum(-1)).mean()                                        # seq-mean-token-mean
    hand.backward()
    assert kl.min() > 0.05                                                                     # a real KL
    assert loss == pytest.approx(hand.item(), abs=1e-5)
    assert (grad - grads(student)).abs().max() < 1e-5 and grad.abs().max() > 1e-3
    assert metrics["distill_kl_full"] == pytest.approx(((kl * m).sum() / m.sum()).item(), abs=1e-5)
    assert torch.allclose(b.ref_logprobs, lt.gather(-1, b.input_ids[:, P:, None])[..., 0], atol=1e-5)

    # micro-batches of 2 rows (rows 2 and 3 trimmed to 2 columns, ref_hidden with them): the same loss and gradient
    loss2, _, grad2 = loss_and_grads(learner, b, micro_size=2)
    assert loss2 == pytest.approx(loss, abs=1e-6) and (grad2 - grad).abs().max() < 1e-6
    # pack=true: the same, from the padding-free layout
    loss3, _, grad3 = loss_and_grads(learner, b, micro_size=2, packed=True)
    assert loss3 == pytest.approx(loss, abs=1e-5) and (grad3 - grad).abs().max() < 1e-5


@pytest.mark.parametrize("algo_name", ["grpo", "gspo"])
def test_exact_kl_penalty_is_sum_p_log_p_over_q(models, algo_name):
    """kl_estimator=exact: the KL term is KL(new || ref) = sum_v p log(p / q) per token, whole vocabulary."""
    student, reference = models
    cfg = run_cfg(algo_name, kl_coef=0.3, kl_estimator="exact")
    algo = registry.get("algo", algo_name)
    b = with_reference(make_batch(), reference)
    b.advantages = algo.advantages(b, cfg.algo)
    learner = update.Learner(student, None, None, algo, cfg, torch.device("cpu"), reference=reference)
    loss, metrics, grad = loss_and_grads(learner, b)
    student.zero_grad()
    p, q = hand_logprobs(student, b), hand_logprobs(reference, b)                              # log p, log q
    kl = (p.exp() * (p - q)).sum(-1)                                                           # (B, C)
    m = b.completion_mask
    assert metrics["kl"] == pytest.approx(((kl * m).sum() / m.sum()).item(), abs=1e-5) and metrics["kl"] > 0.05
    if algo_name == "grpo":   # token-mean of -A * ratio + kl_coef * KL
        logp = p.gather(-1, b.input_ids[:, P:, None])[..., 0]
        hand = ((-b.advantages * torch.exp(logp - logp.detach()) + 0.3 * kl) * m).sum() / m.sum()
        hand.backward()
        assert loss == pytest.approx(hand.item(), abs=1e-5)
        assert (grad - grads(student)).abs().max() < 1e-5


def test_a_loss_not_linear_in_the_kl_is_refused_not_given_a_wrong_gradient(models):
    """full_kl takes the KL's gradient in its forward with the weights update.kl_weights reads off the loss at KL = 0;
    a loss that squares the KL has other weights at the real KL, and its backward says so instead of going on."""
    import dataclasses

    from algos.common import masked_mean
    student, reference = models
    cfg = run_cfg("grpo", kl_coef=0.3, kl_estimator="exact")
    grpo = registry.get("algo", "grpo")

    def squared(new, batch, cfg):
        loss, metrics = grpo.loss({**new, "ref_kl": torch.zeros_like(new["ref_kl"])}, batch, cfg)
        return loss + masked_mean(new["ref_kl"] ** 2, batch.completion_mask), metrics
    b = with_reference(make_batch(), reference)
    b.advantages = grpo.advantages(b, cfg.algo)
    linear = update.Learner(student, None, None, grpo, cfg, torch.device("cpu"), reference=reference)
    loss_and_grads(linear, b)                                                    # the linear loss goes through
    odd = update.Learner(student, None, None, dataclasses.replace(grpo, loss=squared), cfg, torch.device("cpu"),
                         reference=reference)
    with pytest.raises(RuntimeError, match="linear in the KL"):
        loss_and_grads(odd, b)


def test_with_lora_the_reference_is_the_base_with_adapters_off(tmp_path):
    """lora.r > 0: the reference is lora.AdaptersOff(policy) (the same head); with adapters moved away from 0 the
    exact KL is the adapted policy's against the plain base model's, by hand."""
    import copy

    import lora
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(make_random_model(str(tmp_path / "m"), seed=2))
    plain = copy.deepcopy(base).eval()
    cfg = run_cfg("grpo", kl_coef=1.0, kl_estimator="exact")
    cfg.lora.r = 4
    policy = lora.wrap(base, cfg.lora, "m")
    with torch.no_grad():   # move the adapters: B starts at 0, which would make the KL 0 whatever the reference
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    reference, algo = lora.AdaptersOff(policy), registry.get("algo", "grpo")
    b = with_reference(make_batch(), reference)
    b.advantages = torch.zeros_like(b.completion_mask)
    learner = update.Learner(policy, None, None, algo, cfg, torch.device("cpu"), reference=reference)
    _, metrics, _ = loss_and_grads(learner, b)
    with torch.no_grad():
        p, q = hand_logprobs(policy, b), hand_logprobs(plain, b)
    kl, m = (p.exp() * (p - q)).sum(-1), b.completion_mask
    assert metrics["kl"] == pytest.approx(((kl * m).sum() / m.sum()).item(), abs=1e-5) and metrics["kl"] > 1e-3


def test_a_teacher_with_a_padded_vocabulary_is_cut_to_the_students(models, tmp_path):
    """A reference with 2 vocabulary rows past the policy's 14 (the same first 14 tokens): its distribution is taken
    over the policy's tokens, renormalised there."""
    from transformers import AutoModelForCausalLM
    student = models[0]
    wide = AutoModelForCausalLM.from_pretrained(make_random_model(str(tmp_path / "w"), seed=3,
                                                                  vocab_chars="0123456789+=ab")).eval()
    full_kl.check_models(student, wide)
    cfg, algo = run_cfg("grpo", kl_coef=1.0, kl_estimator="exact"), registry.get("algo", "grpo")
    b = with_reference(make_batch(), wide)
    b.advantages = torch.zeros_like(b.completion_mask)
    _, metrics, _ = loss_and_grads(update.Learner(student, None, None, algo, cfg, torch.device("cpu"),
                                                  reference=wide), b)
    with torch.no_grad():
        p = hand_logprobs(student, b)                                                          # (B, C, 14)
        pos = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = wide(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits[:, P - 1:-1]
        q = torch.log_softmax(logits[..., :14].float() / TEMPERATURE, -1)                      # cut, renormalised
    kl, m = (p.exp() * (p - q)).sum(-1), b.completion_mask
    assert metrics["kl"] == pytest.approx(((kl * m).sum() / m.sum()).item(), abs=1e-5)


def test_ref_hidden_travels_through_select_cat_and_micro_batches(models):
    b = with_reference(make_batch(), models[1])
    assert b.ref_hidden.shape == (4, C, 64) and b.ref_hidden.dtype == torch.float32
    rows = torch.tensor([3, 0])
    assert torch.equal(b.select(rows).ref_hidden, b.ref_hidden[rows])
    both = Experience.cat([b.select(torch.tensor([0, 1])), b.select(torch.tensor([2, 3]))])
    assert torch.equal(both.ref_hidden, b.ref_hidden)
    pieces = list(micro_batches(b, 2, "token-mean"))
    assert [p.ref_hidden.shape[1] for p, _ in pieces] == [4, 2]                                # trimmed as the mask
    for piece, _ in pieces:
        assert piece.ref_hidden.shape[:2] == piece.completion_mask.shape
    short = pieces[1][0]                                                                       # rows 2 and 3
    assert torch.equal(short.ref_hidden, b.ref_hidden[2:, :2])


def test_kl_estimate_refuses_exact_outside_the_loss():
    from algos.common import kl_estimate, kl_in_loss
    with pytest.raises(ValueError, match="whole-vocabulary"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "exact")
    with pytest.raises(ValueError, match="ref_kl"):
        kl_in_loss(torch.zeros(1, 2), make_batch(), run_cfg("grpo", kl_coef=0.1, kl_estimator="exact").algo, {})


@pytest.mark.parametrize("argv, message", [
    (["algo.name=distill", "algo.distill.teacher=/t", "algo.distill.full=true", "fused_loss=true"], "fused_loss=true"),
    (["algo.name=distill", "algo.distill.teacher=/t", "algo.distill.full=true", "offload=true"], "offload=true"),
    (["algo.kl_coef=0.1", "algo.kl_estimator=exact", "replay.enabled=true"], "replay.enabled=true"),
    (["algo.name=dapo", "algo.kl_coef=0.1", "algo.kl_estimator=exact"], "more than one rollout round"),
    (["algo.kl_estimator=exact"], "set algo.kl_coef > 0"),
    (["algo.kl_coef=0.1", "algo.kl_estimator=exact", "algo.kl_in_reward=true"], "algo.kl_in_reward=false"),
    (["algo.name=distill", "algo.distill.full=true"], "algo.distill.full"),
    (["algo.name=grpo", "algo.distill.teacher=/t", "algo.distill.full=true"], "unless algo.name=distill"),
    (["algo.name=online_dpo", "algo.kl_coef=0.1", "algo.kl_estimator=exact"], "takes no KL term"),
])
def test_settings_it_cannot_take_are_refused_before_any_work(argv, message, tmp_path):
    from run_setup import prepare
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        prepare(argv + [f"out_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_offload_async_and_odd_models_are_refused(models, tmp_path):
    cfg = run_cfg("distill", distill_teacher="/t", distill_full=True)
    algo = registry.get("algo", "distill")
    cfg.offload = True
    with pytest.raises(UserError, match="offload=true"):
        full_kl.check_config(cfg, algo)
    cfg.offload, cfg.mode = False, "async"
    with pytest.raises(UserError, match="mode=async"):
        full_kl.check_config(cfg, algo)
    cfg.mode = "sync"
    full_kl.check_config(cfg, algo)
    from transformers import AutoModelForCausalLM
    small = AutoModelForCausalLM.from_pretrained(make_random_model(str(tmp_path / "small"), vocab_chars="0123"))
    with pytest.raises(UserError, match="fewer than the policy's 14"):
        full_kl.check_models(models[0], small)
    full_kl.check_models(small, models[0])                                                    # a larger teacher: cut
    small.config.final_logit_softcapping = 30.0
    with pytest.raises(UserError, match="plain linear layer"):
        full_kl.check_models(small, small)


def test_train_runs_log_the_full_kl_terms(random_model_dir, tmp_path):
    """train.py, two steps each: full-distribution distillation in one process and on 2 ranks under torchrun (FSDP2:
    the teacher's sharded head gathered for each micro-batch's loss) gives the same metrics (near-greedy sampling,
    top_p, makes the samples world-size independent); the exact KL penalty with LoRA runs, 0 at the first update
    (the adapters start at B = 0: the policy is its reference, the base)."""
    import subprocess

    from transformers import AutoModelForCausalLM
    from tests.conftest import ROOT, train_here, train_here_beside
    teacher = make_random_model(str(tmp_path / "teacher"), seed=1)
    sharp = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        sharp.get_output_embeddings().weight.mul_(4.0)
    sharp.save_pretrained(teacher)
    common = ["steps=2", "eval_every=2", "eval_size=4", "prompts_per_step=4", "samples_per_prompt=2", "progress=false",
              f"model={random_model_dir}"]
    args = common + ["algo.name=distill", f"algo.distill.teacher={teacher}", "algo.distill.full=true", "top_p=1e-6",
                     "lr=1e-2", "micro_batch_size=2", "dtype=float32"]
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "train.py", *args, f"out_dir={tmp_path / 'two'}"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    train_here_beside([two], [args + ["threads=1", f"out_dir={tmp_path / 'one'}"]])
    out, _ = two.communicate(timeout=600)
    assert two.returncode == 0, out[-3000:]
    one, fsdp = step_rows(tmp_path / "one"), step_rows(tmp_path / "two")
    for a, b in zip(one, fsdp, strict=True):
        for key in ("loss", "grad_norm", "distill_kl_full"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert len(one) == 2 and one[0]["distill_kl_full"] > 0.1 and one[0]["grad_norm"] > 0.1, one
    train_here(common + ["threads=1", "algo.kl_coef=0.5", "algo.kl_estimator=exact", "lora.r=4",
                         f"out_dir={tmp_path / 'lora'}"])
    kl = [r["kl"] for r in step_rows(tmp_path / "lora")]
    assert len(kl) == 2 and abs(kl[0]) < 1e-6, kl


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels of fused_kl)")
def test_on_cuda_the_kernels_give_the_cpu_loss_and_gradient(models):
    """The same full-distribution loss on the GPU (Triton's fused_kl, float32) as on the CPU (its torch twins), and a
    finite one in bf16."""
    import copy
    cfg = run_cfg("distill", distill_teacher="/t", distill_full=True, distill_coef=0.5, distill_task_coef=2.0)
    algo = registry.get("algo", "distill")
    out = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        student, teacher = (copy.deepcopy(m).to(device, dtype) for m in models)
        b = with_reference(make_batch().to(device), teacher).to(device)
        b.advantages = algo.advantages(b, cfg.algo)
        learner = update.Learner(student, None, None, algo, cfg, torch.device(device), reference=teacher)
        loss, metrics, grad = loss_and_grads(learner, b)
        out[device, dtype] = loss, metrics["distill_kl_full"], grad.float().cpu()
    (l0, k0, g0), (l1, k1, g1), (l2, k2, g2) = out.values()
    assert l1 == pytest.approx(l0, abs=1e-4) and k1 == pytest.approx(k0, abs=1e-4)
    assert (g1 - g0).abs().max() < 1e-3 * g0.abs().max()
    assert all(map(math.isfinite, (l2, k2))) and torch.isfinite(g2).all() and k2 == pytest.approx(k0, rel=0.2)
