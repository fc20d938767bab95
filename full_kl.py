"""The exact per-token KL to the reference (or distillation teacher) over the whole vocabulary, in the loss.

    python train.py algo.name=distill algo.distill.teacher=/models/t algo.distill.full=true   # full distillation
    python train.py algo.kl_coef=0.05 algo.kl_estimator=exact                                # exact KL penalty

Where a sampled estimator (k1, k2, k3; algos/common.py: kl_estimate) reads the two models' log-probs of the sampled
token, this takes KL(pi_new || pi_ref)_t = sum_v pi_new(v) log(pi_new(v) / pi_ref(v)) at every completion position,
from both models' last hidden states and heads (kernels/fused_kl.py: fused_kl_loss, chunked: the (N, V) logits
never exist). Its two halves run at different times:
  * experience time (train.py: extra_logprobs): the reference's forward, the one that gives ref_logprobs, also
    keeps its last hidden states (B, C, Ht) in the batch (`Experience.ref_hidden`, CPU memory, the model's dtype);
  * update time (update.py: micro_loss): the policy's forward runs fused_kl_loss in its head's place
    (models._in_head), after the log-probs, with the reference's head weight brought to the device for that call;
    the KL (B, C), with its gradient, reaches the algorithm as new["ref_kl"]. The gradient is taken in that forward
    (four products instead of six), with each token's weight in the loss read off the algorithm's loss first
    (update.kl_weights): the loss must be linear in the KL, which backward checks.
The algorithm says when it wants this (algos/common.py: Algorithm.exact_kl); `check_config` refuses, before any
work, the settings where it cannot hold yet.
Choices: both heads must be plain linear layers (models.plain_head); a teacher whose vocabulary is padded past the
student's is cut to the student's rows (its distribution renormalised over the tokens the student can emit); one
with fewer rows is refused. The KL is taken at the trainer's temperature, as the log-probs are.
"""
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

import distributed
import registry
from config import UserError
from kernels import linear_logprobs
from kernels.fused_kl import fused_kl_loss
from models import _in_head, plain_head


def check_config(cfg, algo):
    """One-line refusals, before any work, of the settings the exact KL cannot take (train.py's prepare)."""
    a = cfg.algo
    if a.kl_estimator == "exact" and a.kl_coef <= 0:
        raise UserError("algo.kl_estimator=exact is the KL penalty's: set algo.kl_coef > 0, or leave the estimator "
                        "at k3 (k1, k2, k3, exact)")
    if a.kl_estimator == "exact" and a.kl_in_reward:
        raise UserError("algo.kl_estimator=exact takes the KL in the loss: set algo.kl_in_reward=false, or use k1, k2 "
                        "or k3 in the reward")
    if a.kl_estimator == "exact" and not algo.exact_kl(a):
        takes = [n for n in registry.names("algo") if registry.get("algo", n).exact_kl(a)]
        raise UserError(f"algo '{a.name}' takes no KL term in its loss: algo.kl_estimator=exact needs one that does "
                        f"({', '.join(takes)})")
    if not algo.exact_kl(a):
        return
    what = "algo.distill.full=true" if a.kl_estimator != "exact" else "algo.kl_estimator=exact"
    blocked = [k for k, on in [("fused_loss=true", cfg.fused_loss), ("offload=true", cfg.offload),
                               ("mode=async", cfg.mode == "async"), ("replay.enabled=true", cfg.replay.enabled),
                               ("more than one rollout round per step", algo.max_rounds(a) > 1),
                               ("memory_budget_gib", cfg.memory_budget_gib > 0)] if on]
    if blocked:
        raise UserError(f"{what} (the full-vocabulary KL) does not run with {', '.join(blocked)} yet: it runs in one "
                        "process or under torchrun (parallel=fsdp or replicate) with offload=false, fused_loss=false, "
                        "no replay, one rollout round per step (dapo: algo.dapo.dynamic_sampling=false), "
                        "memory_budget_gib=0")


def check_models(policy, reference):
    """After loading: both heads plain linear layers, the reference's vocabulary at least the policy's."""
    for name, m in (("the policy", policy), ("the reference (or teacher)", reference)):
        if not plain_head(m):
            raise UserError(f"the full-vocabulary KL needs {name}'s head to be a plain linear layer (no bias, logit "
                            "scaling or soft-capping): use a k1, k2 or k3 estimator (algo.distill.full=false)")
    vs, vt = vocab_size(policy), vocab_size(reference)
    if vt < vs:
        raise UserError(f"the reference (or teacher) has {vt} vocabulary rows, fewer than the policy's {vs}: the "
                        "full-vocabulary KL needs the policy's tokenizer in the teacher")


def logprobs_and_hidden(model, ids: Tensor, attn: Tensor, C: int, temperature: float,
                        images: dict | None = None) -> tuple[Tensor, Tensor]:
    """The reference's forward at experience time (no gradient): -> (log-probs (B, C) float32, last hidden states
    (B, C, Ht) in the model's dtype), both on the CPU."""
    targets = ids[:, -C:]
    logp, _, hidden = _in_head(model, ids, attn, C,
                               lambda h, w: (*linear_logprobs(h, w, targets, temperature), h), images)
    return logp.cpu(), hidden.cpu()


def head_weight(reference, V: int, device) -> Tensor:
    """The reference's head weight on the device, its first V rows (the policy's vocabulary), no gradient. Sharded
    (FSDP2), it is gathered here, for one micro-batch's loss: every rank runs as many micro-batches as the others, so
    the all-gathers pair up. With LoRA the reference is the policy seen with its adapters off (lora.AdaptersOff):
    the same head."""
    w = reference.get_output_embeddings().weight.detach()                                 # (Vt, Ht)
    if isinstance(w, DTensor):
        w = w.full_tensor()
    return w[:V].to(device, non_blocking=True)


def vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]   # a DTensor's shape is the whole tensor's


class _KLFromItsLoss(torch.autograd.Function):
    """The KL values (b, C), whose gradient fused_kl_loss already took in its forward as the gradient of
    sum_t g_t * KL_t. The loss downstream must weigh KL_t by g_t up to one factor (micro-batch weights, loss
    scaling): backward checks that the incoming gradient is c * g and hands c to that loss. A loss that uses the KL
    other than linearly with g's weights is refused there, rather than given a wrong gradient."""

    @staticmethod
    def forward(ctx, kl: Tensor, loss: Tensor, g: Tensor) -> Tensor:                     # (b, C), (), (b, C)
        ctx.save_for_backward(g)
        return kl.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        g, = ctx.saved_tensors
        c = (grad * g).sum() / (g * g).sum().clamp(min=1e-30)                              # least squares: grad ~ c * g
        if (grad - c * g).abs().max() > 1e-4 * grad.abs().max() + 1e-12:                  # one host sync per micro-batch
            raise RuntimeError("the loss weighs the full-vocabulary KL (new['ref_kl']) other than the weights "
                               "update.kl_weights read off it: full_kl needs a loss linear in the KL")
        return None, c, None


def head_and_kl(policy, reference, micro, temperature: float, probe):
    """-> fn(hidden (b, C, H), head weight (V, H), targets (b, C)) -> (log-probs, entropies, KL(policy || reference)),
    each (b, C) with its gradient, for a function that runs in the policy's head's place. probe(logp, entropy) ->
    (b, C): how the loss weighs each token's KL (update.kl_weights), known before the KL, so that fused_kl_loss
    takes the KL's gradient in its forward (four products of N x V x H, not fused_kl's six). The reference's head
    weight is fetched now, before the policy's forward: a sharded reference's gather is then not interleaved with
    the policy's own."""
    ref_h = micro.ref_hidden                                                               # (b, C, Ht)
    ref_w = head_weight(reference, vocab_size(policy), ref_h.device)                       # (V, Ht)
    into_grad = not distributed.is_sharded(policy)   # as models.completion_logprobs

    def run(hidden, weight, targets):                                                      # (b, C, H), (V, H)
        logp, entropy = linear_logprobs(hidden, weight, targets, temperature, into_grad)   # (b, C) x 2
        g = probe(logp.detach(), entropy.detach()).float()                                 # (b, C)
        flat_ref = ref_h.reshape(-1, ref_h.shape[-1]).to(weight.dtype)                    # (b * C, Ht)
        loss, kl = fused_kl_loss(hidden.reshape(-1, hidden.shape[-1]), weight, flat_ref, ref_w.to(weight.dtype),
                                 g.reshape(-1), temperature)                               # (), (b * C,)
        return logp, entropy, _KLFromItsLoss.apply(kl.view(g.shape), loss, g)
    return run


def completion_logprobs_and_kl(policy, reference, micro, C: int, temperature: float,
                               probe) -> tuple[Tensor, Tensor, Tensor]:
    """The policy's forward at update time: -> (log-probs, entropies, KL(policy || reference)), each (b, C), all with
    their gradients. The KL is computed where the head would run, so the hidden states are the head's own input."""
    targets = micro.input_ids[:, -C:]
    run = head_and_kl(policy, reference, micro, temperature, probe)
    return _in_head(policy, micro.input_ids, micro.attention_mask, C, lambda h, w: run(h, w, targets),
                    micro.images())
