"""On-policy distillation (Agarwal et al. 2024, GKD with student samples; Thinking Machines' "on-policy
distillation", 2025): the student samples, a teacher scores every sampled token by its own log-prob, and the
per-token reverse KL becomes the advantage.

    A_t  = task_coef * A_task  +  coef * (log pi_teacher(y_t) - log pi_student(y_t))       (B, C), no gradient
    loss = agg( max(-A * ratio, -A * clip(ratio, ...)) + kl_coef * KL(new || teacher) )    (ratio = 1 on-policy)

y_t is sampled from the student, so E[log pi_student - log pi_teacher] over its samples is KL(student || teacher)
at that position; minimising it with the policy gradient moves the student toward the teacher where the student
goes (mode-seeking), one dense signal per token instead of one reward per answer.
A_task is GRPO's group advantage of the task reward (algos/grpo.py), so `task_coef` = 0 is pure distillation and
> 0 mixes in the verifier.

Without a teacher (`algo.distill.teacher` empty, the default) there is no distillation term: A = task_coef * A_task,
GRPO's advantage on a GRPO loss, with a reference model only for kl_coef > 0, as GRPO.
Choices made here: the teacher's forward is the reference forward (train.py: extra_logprobs), so the batch's
ref_logprobs are the teacher's (`algo.distill.teacher` names its folder; it is offloaded, sharded or kept beside
the policy exactly like a reference model, and kl_coef > 0 then adds an estimator of KL(new || teacher) in the
loss as well). The student's log-prob in A is the trainer's own before the update (old_logprobs) when the loop
computed one, else the rollout engine's (sample_logprobs). The advantage of a token is its own log-ratio only
(discount 0: no sum over later tokens), as Thinking Machines' recipe does; not whitened. The teacher must share
the student's tokenizer (its vocabulary may be padded larger).
Full-distribution variant (`algo.distill.full=true`): the distillation term is the exact reverse KL over the whole
vocabulary at each completion token, differentiated directly, not an advantage:
    A_t  = task_coef * A_task
    loss = agg( max(-A * ratio, -A * clip(ratio, ...)) + kl_coef * KL ) + coef * agg( KL(pi_new || pi_teacher)_t )
with KL_t from both models' hidden states and heads (new["ref_kl"]: full_kl.py, kernels/fused_kl.py).
Metrics: distill_kl, the token mean of log pi_student - log pi_teacher (the k1 estimate of the reverse KL);
distill_kl_full (full=true), the token mean of the exact one.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from algos.common import Algorithm, aggregate, clipped_policy_loss, exact_kl_penalty, masked_mean
from algos.grpo import grpo_advantages
from config import opt, section
from registry import register


@section("algo.distill", "on-policy distillation (algo.name=distill; docs/distill.md)")
@dataclass
class DistillConfig:
    teacher: str = opt("", "teacher model folder, loaded in the reference model's place ('' = no teacher: GRPO)")
    coef: float = opt(1.0, "weight of the per-token advantage log p_teacher - log p_student")
    task_coef: float = opt(1.0, "weight of GRPO's group advantage of the task reward (0 = pure distillation)")
    full: bool = opt(False, "the distillation term is the exact KL(student || teacher) over the whole vocabulary at "
                            "each token, in the loss (full_kl.py), instead of the sampled log-ratio as an advantage")

    def check(self, cfg) -> list:
        return [("full", not self.full or bool(self.teacher), "false without a teacher (set algo.distill.teacher)"),
                ("full", not self.full or cfg.algo.name == "distill", "false unless algo.name=distill (the term is "
                 "its loss's; other algorithms take the exact KL as algo.kl_estimator=exact)")]


def student_logprobs(batch) -> Tensor:
    """(B, C): the trainer's log-probs before the update when there are some, else the sampling ones."""
    return batch.old_logprobs if batch.old_logprobs is not None else batch.sample_logprobs


def distill_token_advantages(batch) -> Tensor:
    """(B, C): log pi_teacher - log pi_student on each completion token, 0 elsewhere (the negated per-token
    reverse-KL sample)."""
    if batch.ref_logprobs is None:
        raise ValueError("algo.name=distill needs the teacher's log-probs: set algo.distill.teacher=<model folder>")
    return (batch.ref_logprobs.float() - student_logprobs(batch).float()) * batch.completion_mask


def distill_advantages(batch, cfg, sum_over=None) -> Tensor:
    adv = torch.zeros_like(batch.completion_mask)                                           # (B, C)
    if cfg.distill.teacher and not cfg.distill.full:   # full: the distillation term is in the loss (distill_loss)
        adv = cfg.distill.coef * distill_token_advantages(batch)
    if cfg.distill.task_coef:
        adv = adv + cfg.distill.task_coef * grpo_advantages(batch, cfg)
    return adv


def distill_loss(new: dict, batch, cfg) -> tuple[Tensor, dict]:
    loss, metrics = clipped_policy_loss(new, batch, cfg)
    if cfg.distill.teacher:   # without one, ref_logprobs (if any) are the reference model's, not a teacher's
        kl = student_logprobs(batch).float() - batch.ref_logprobs.float()                   # (B, C)
        metrics["distill_kl"] = masked_mean(kl, batch.completion_mask).detach()
    if full_distribution(cfg):   # the exact reverse KL at every token, differentiated directly
        full = new["ref_kl"]                                                                # (B, C)
        loss = loss + cfg.distill.coef * aggregate(full, batch.completion_mask, cfg.loss_agg, cfg.norm_len)
        metrics["distill_kl_full"] = masked_mean(full.detach(), batch.completion_mask)
    return loss, metrics


def full_distribution(cfg) -> bool:
    return bool(cfg.distill.teacher) and cfg.distill.full


register("algo", "distill")(Algorithm(advantages=distill_advantages, loss=distill_loss,
                                      needs_ref=lambda cfg: bool(cfg.distill.teacher) or cfg.kl_coef > 0,
                                      exact_kl=lambda cfg: full_distribution(cfg) or exact_kl_penalty(cfg)))
