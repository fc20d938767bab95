"""The update phase: mini-batches from the buffer, micro-batches inside each, one optimizer step per mini-batch.

    learner = Learner(policy, optimizer, schedule, algo, cfg, device, critic)
    stats = update(learner, buffer, generator, step, n_samples)   # -> {metric: mean over its optimizer steps}

Per mini-batch (one optimizer step):
  1. gradients accumulate over length-bucketed micro-batches (microbatch.py), each weighted so that their sum is
     the mini-batch's loss; under torchrun x `loss_scale`, this rank's share of the global batch, so that the
     gradient FSDP averages (or replicate's all-reduce) is the global batch's (distributed.py);
  2. the global gradient norm is clipped;
  3. a non-finite loss or gradient skips the step on every rank together (a rank that stepped alone would
     drift from the others); `max_bad_updates` of them in a row stop the run;
  4. the optimizer steps (PPO's critic too, with its own optimizer).
The first mini-batch also measures `logprob_mismatch`: |engine log-prob - trainer log-prob| on the fresh samples,
before any update has moved the policy, so any gap is numerics or a broken weight sync, never learning.
Metrics stay on the device until one transfer per optimizer step: an `.item()` per micro-batch would stall the
GPU until the host caught up.
"""
import math
from dataclasses import dataclass

import torch

import checkpoint
import distributed
from config import trainer_temperature
from microbatch import micro_batches, split_weight
from models import completion_logprobs, completion_loss


@dataclass
class Learner:
    """What the update phase changes: the policy (and PPO's critic), the optimizer and its schedule."""
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    algo: object                  # algos/common.py: Algorithm
    cfg: object                   # the whole Config
    device: torch.device
    critic: object = None         # critic.py: Critic, when algo.needs_critic
    version: int = 0              # optimizer updates applied so far, counted in RL steps (samples carry it)
    bad_updates: int = 0          # non-finite updates in a row

    @property
    def loss_agg(self) -> str:    # how the loss reduces over tokens: weights micro-batches and ranks
        return self.algo.loss_agg or self.cfg.algo.loss_agg

    @property
    def trained(self) -> list:    # every model the backward reaches
        return [self.policy] + ([self.critic.model] if self.critic is not None else [])


def fused_policy_loss(learner: Learner, micro):
    """algo.loss of the micro-batch through models.completion_loss: the kernel hands it rows at a time, and each
    piece's loss is weighted as micro-batching weights pieces, so the sum is the micro-batch's loss."""
    cfg, metrics = learner.cfg, {}

    def loss_fn(rows: slice, logp, entropy):
        piece = micro.select(rows)
        loss, m = learner.algo.loss({"logprobs": logp, "entropy": entropy}, piece, cfg.algo)
        w = split_weight(piece, micro, learner.loss_agg, cfg.algo.norm_len)
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + w * v
        return loss * w
    C = micro.completion_mask.shape[1]
    loss, logp, _ = completion_loss(learner.policy, micro.input_ids, micro.attention_mask, C, trainer_temperature(cfg),
                                    loss_fn, micro.images())
    return loss, logp, metrics


def micro_loss(learner: Learner, micro):
    """-> (loss, trainer log-probs (b, c), the algorithm's metrics) of one micro-batch."""
    cfg = learner.cfg
    if cfg.fused_loss:   # speed: the loss's gradient is taken in the kernel, rows at a time
        return fused_policy_loss(learner, micro)
    C = micro.completion_mask.shape[1]
    logp, entropy = completion_logprobs(learner.policy, micro.input_ids, micro.attention_mask, C,
                                        trainer_temperature(cfg), micro.images())
    new = {"logprobs": logp, "entropy": entropy}
    if learner.critic is not None:   # PPO: the value loss trains the critic in the same backward
        new["values"] = learner.critic.values(micro.input_ids, micro.attention_mask, micro.completion_mask, grad=True)
    loss, metrics = learner.algo.loss(new, micro, cfg.algo)
    return loss, logp, metrics


def add_mismatch(m: dict, micro, logp, version: int):
    """Sum and max of |trainer - engine log-prob| over the fresh (this version's) completion tokens, into m."""
    fresh = micro.completion_mask * (micro.versions == version).float()[:, None]      # (b, c)
    gap = (logp.detach().float() - micro.sample_logprobs).abs() * fresh              # (b, c)
    m["_mis_sum"], m["_mis_n"] = m.get("_mis_sum", 0.0) + gap.sum(), m.get("_mis_n", 0.0) + fresh.sum()
    top = gap.max() if gap.numel() else gap.new_zeros(())
    m["_mis_max"] = torch.maximum(m["_mis_max"], top) if "_mis_max" in m else top


def accumulate_gradients(learner: Learner, mb, measure_mismatch: bool) -> dict:
    """Forward + backward of every micro-batch of the mini-batch mb; -> its metrics as device tensors."""
    cfg, m = learner.cfg, {}
    scale = distributed.loss_scale(mb.completion_mask, learner.loss_agg)   # this rank's share of the global batch
    pieces = micro_batches(mb, cfg.micro_batch_size, learner.loss_agg, cfg.algo.norm_len)   # size 0 = one pass
    for micro, weight in distributed.accumulate(learner.trained, pieces, cfg.offload):   # one reduce-scatter
        micro = micro.to(learner.device)
        loss, logp, metrics = micro_loss(learner, micro)
        (loss * (weight * scale)).backward()
        if measure_mismatch:
            add_mismatch(m, micro, logp, learner.version)
        # x scale as for the loss, so that the plain mean over ranks (distributed.reduce_metrics) is the global one
        for k, v in {**metrics, "loss": loss.detach()}.items():
            m[k] = m.get(k, 0.0) + weight * scale * v
    return m


def optimizer_step(learner: Learner, m: dict, step: int) -> bool:
    """Average (replicate), clip, and step if loss and gradient are finite on every rank. m: host floats, gets
    grad_norm (and critic_grad_norm). -> whether the step was applied."""
    distributed.average_gradients(learner.policy)   # parallel=replicate: one all-reduce (FSDP: a no-op)
    if learner.critic is not None:
        distributed.average_gradients(learner.critic.model)
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.policy.parameters(), learner.cfg.grad_clip or float("inf"))
    m["grad_norm"] = distributed.grad_norm_value(grad_norm)
    finite = torch.tensor(float(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])), device=learner.device)
    if distributed.world() > 1:   # every rank must skip together or its shard drifts
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN, group=distributed.group())
    if not finite.item():
        learner.bad_updates += 1
        if distributed.rank() == 0:
            print(f"step {step}: non-finite loss or gradient, update skipped ({learner.bad_updates} in a row)",
                  flush=True)
        return False
    learner.optimizer.step()
    learner.schedule.step()
    if learner.critic is not None:   # its own optimizer
        m["critic_grad_norm"] = learner.critic.step()
    learner.bad_updates = 0
    checkpoint.crash_point("update", step)
    return True


def minibatch_size(cfg, n_samples: int) -> int:
    """Samples per optimizer step on this rank: algo.minibatch_size is global; 0 = this step's whole batch."""
    return cfg.algo.minibatch_size // distributed.world() or n_samples


def update(learner: Learner, buffer, generator: torch.Generator, step: int, n_samples: int) -> dict:
    """Every optimizer step of this RL step (n_samples: this rank's new samples); -> metrics (means over the
    optimizer steps), skipped_updates and logprob_mismatch/{mean,max} (over every rank's tokens)."""
    cfg = learner.cfg
    mb_size = minibatch_size(cfg, n_samples)
    stats: dict[str, list[float]] = {}
    mismatch, skipped, applied = None, 0, 0
    for mb in buffer.minibatches(mb_size, cfg.algo.epochs, generator, group_size=cfg.samples_per_prompt):
        learner.optimizer.zero_grad(set_to_none=True)
        if learner.critic is not None:
            learner.critic.optimizer.zero_grad(set_to_none=True)
        m = accumulate_gradients(learner, mb, measure_mismatch=mismatch is None)
        # every metric of this mini-batch to the host in one transfer (one sync per optimizer step)
        m = dict(zip(m, torch.stack([torch.as_tensor(v, dtype=torch.float32, device=learner.device).reshape(())
                                     for v in m.values()]).tolist()))
        if mismatch is None:
            mismatch = (m.pop("_mis_sum"), m.pop("_mis_n"), m.pop("_mis_max"))
        ok = optimizer_step(learner, m, step)
        for k, v in m.items():
            stats.setdefault(k, []).append(v)
        skipped, applied = skipped + (not ok), applied + ok
        if learner.bad_updates >= cfg.max_bad_updates:
            break
    buffer.end_step()
    learner.optimizer.zero_grad(set_to_none=True)   # memory: the gradients are not needed while the engine samples
    learner.version += applied > 0                  # a new policy exists only if some update went through
    mis_sum, mis_n, mis_max = mismatch or (0.0, 0.0, 0.0)
    mis_sum, mis_n = distributed.all_sum([mis_sum, mis_n])   # the gap's mean over every rank's tokens
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, "skipped_updates": skipped,
            "logprob_mismatch/mean": mis_sum / max(mis_n, 1.0), "logprob_mismatch/max": mis_max}
