"""Distributed training under torchrun: setup, rank helpers, metric reduction, FSDP2 sharding, weight sync.

    torchrun --nproc_per_node=2 train.py ...                          # one node: CPU (gloo) or GPUs (NCCL)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py ...

train.py calls these few functions; with plain `python train.py` (or world size 1) they are no-ops.
SPMD: every rank runs the same loop. What world size > 1 means:
- Prompts: every rank draws the same step's prompt list (same seed) and takes `share(list)` = items
  rank::world, so a prompt's whole group stays on one rank. GRPO's per-group advantages stay local; an
  algorithm that normalises over the whole batch takes its statistics with `all_sum` (REINFORCE++'s
  whitening: algos/common.masked_whiten), or it would normalise per rank.
- Training, `parallel=fsdp` (the default): the policy is loaded in float32 (master weights) and sharded with
  FSDP2 `fully_shard`, one unit per decoder layer plus the root (embeddings, norm, tied lm_head); on GPU it
  computes in the config dtype (bf16) with gradients reduced in float32. The reference model is sharded the
  same way, in the config dtype; PPO's critic as the policy is (critic.py). FSDP averages gradients over ranks,
  so `loss_scale` turns each rank's local loss into its part of the loss over the global batch: the update
  equals a one-process update on the same global batch (as for replicate's average, below). Over micro-batches
  the gradients accumulate locally and are reduce-scattered once, after the last (`accumulate`).
  The log-prob kernel runs in the lm_head's place inside the root's forward (models.completion_logprobs), so
  no (B, C, V) logits exist under FSDP either; the root unit (embeddings, tied head: 0.27 GB in bf16 at 0.5B)
  stays gathered from forward to backward, FSDP2's default for the root; the decoder layers reshard.
- Rollout: each rank's engine holds its own full copy of the weights in the config dtype. After each
  optimizer step `sync_weights` all-gathers the shards one FSDP unit (one decoder layer) at a time and the
  engine copies them in place. Memory trade-off: + one full copy in bf16 per rank (1 GB for a 0.5B model)
  that the engine needs anyway, + one unit's full weights while syncing; never a second full copy. The
  other way, unsharding the FSDP policy around generation, saves that copy but runs every decode step
  through FSDP's hooks and ties the engine to the FSDP module (no vLLM, no CUDA graphs).
- `parallel=replicate`: every rank trains the whole model exactly as one process does (the config dtype,
  layers compiled, the head's gradient straight into .grad) on its share, then `average_gradients` all-reduces
  the gradients once per optimizer step and every rank takes the same step. The engine samples with the
  policy's own parameters, as in one process: no weight sync and no second copy. It costs the whole
  gradient and AdamW state on every rank (8 bytes per parameter in bf16: weights, gradient, two moments;
  4 GB at 0.5B), so it is for models that fit one GPU with room; it is faster where FSDP's per-layer gathers
  and hooks bound the update (measured: docs/speed.md, "Two GPUs"). Numerically it is the one-process run (bf16
  weights and AdamW); fsdp keeps float32 masters.
- `offload=true` keeps the shards, gradients and AdamW state in CPU memory (FSDP2 CPUOffloadPolicy); the
  optimizer step then runs on the CPU. It works at any world size under torchrun (also --nproc_per_node=1).
- Metrics are reduced over ranks (`reduce_metrics`), each as it declares (Sum, Max, Min, Mean, Ratio); rank 0
  alone writes logs, plots and checkpoints.
  Checkpoints: `full_state` gathers model and optimizer state dicts keyed by parameter name (the same for
  any world size) and `load_full_state` puts them back, so a run can resume at another world size.
"""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def init(offload: bool = False) -> tuple[int, int]:
    """Join the process group when launched by torchrun; return (rank, world size). (0, 1) without torchrun.
    With offload the gradient norm is reduced over CPU shards, so GPUs get gloo for CPU tensors beside NCCL."""
    if "RANK" in os.environ and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))   # before NCCL picks a device
        gpu_backend = "cuda:nccl,cpu:gloo" if offload else "nccl"
        dist.init_process_group(gpu_backend if torch.cuda.is_available() else "gloo")
    return rank(), world()


# The ranks that train together. mode=async (async_rl.py) sets it to the trainer ranks, so that every helper
# below (shares, sums, metrics, loss scales, checkpoints) sees only them; None = every rank (the default group).
_group = None


def use_group(group):
    global _group
    _group = group


def group():
    return _group


def rank() -> int:
    return dist.get_rank(_group) if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size(_group) if dist.is_initialized() else 1


def print0(*a, **kw):
    """print on rank 0 only (every rank runs the same loop)."""
    if rank() == 0:
        print(*a, **kw, flush=True)


def share(items: list) -> list:
    """This rank's part of a list that every rank holds: items rank::world (whole prompts, never split)."""
    return items[rank()::world()]


def _device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else torch.device("cpu")


def all_sum(values: list[float]) -> list[float]:
    """Sum each number over ranks (float64; one collective for the whole list)."""
    if world() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device())
    dist.all_reduce(t, group=_group)
    return t.tolist()


# How a metric reduces over ranks, declared where it is made: row[key] = Sum(x), Max(x), Min(x), Mean(x) or
# Ratio(numerator, denominator) (each summed over ranks, then divided: the right mean of a quantity whose count
# differs by rank, e.g. the length of the correct answers). A plain number is a Mean, except for these names of
# metrics made outside the row's code (rewards/pool.py's failure counts, engines/multiturn.py's token and failure
# counts): SUMMED prefixes are summed, time/* and */max take the largest.
@dataclass(frozen=True)
class Mean:
    value: float


@dataclass(frozen=True)
class Sum:
    value: float


@dataclass(frozen=True)
class Max:
    value: float


@dataclass(frozen=True)
class Min:
    value: float


@dataclass(frozen=True)
class Ratio:
    num: float
    den: float


SUMMED = ("tokens_per_s", "reward_fail", "env_fail", "tokens/in_loss", "tokens/out_of_loss")


def declared(key: str, value):
    """value as its declared reduction (a plain number: by its name, as above)."""
    if isinstance(value, (Mean, Sum, Max, Min, Ratio)) or not isinstance(value, (int, float)):
        return value
    if key.startswith(SUMMED):
        return Sum(value)
    return Max(value) if key.startswith("time/") or key.endswith("/max") else Mean(value)


def combine(values: list):
    """Every rank's declared value of one key (ranks where it was not measured left out) -> one number, or None
    where nothing was measured (a Ratio whose denominators sum to 0: the key is left out)."""
    kind = type(values[0])
    if any(type(v) is not kind for v in values):
        raise TypeError(f"a metric declared differently on different ranks: {values}")
    if kind is Ratio:
        den = sum(v.den for v in values)
        return sum(v.num for v in values) / den if den else None
    if len(values) == 1:   # one process: the number as it was made
        return values[0].value
    nums = [v.value for v in values]
    return {Mean: lambda: sum(nums) / len(nums), Sum: lambda: sum(nums), Max: lambda: max(nums),
            Min: lambda: min(nums)}[kind]()


def reduce_metrics(row: dict) -> dict:
    """One step's metrics over all ranks (the trainer group under mode=async), each by its declared reduction
    (above); -> plain numbers. Ranks that did not measure a key are left out of it. A plain mean is right for
    per-sample averages because shares are equal in size (reward, accuracy, completion_len); the loss and the
    algorithm's metrics (entropy, clip_frac, kl) come scaled by `loss_scale`, as the loss is, so their mean over
    ranks is the global batch's wherever the metric's unit is the loss's (token means under token-mean,
    per-sequence means under the seq-* modes). A count that differs by rank needs Sum or Ratio."""
    row = {k: v if k == "step" else declared(k, v) for k, v in row.items()}
    rows = [row]
    if world() > 1:
        rows = [None] * world()
        dist.all_gather_object(rows, row, group=_group)   # keys can differ across ranks (reward_fail/* when they happen)
    out = {}
    for key in dict.fromkeys(k for r in rows for k in r):     # every key once, in order of appearance
        vals = [r[key] for r in rows if key in r]
        if not isinstance(vals[0], (Mean, Sum, Max, Min, Ratio)):   # step, and anything not a number
            out[key] = vals[0]
        elif (value := combine(vals)) is not None:
            out[key] = value
    return out


def shard(model, device: torch.device, compute_dtype: torch.dtype, offload: bool = False):
    """FSDP2: one unit per decoder layer (transformers' `_no_split_modules` names the class) and the root.
    Parameters keep their dtype (float32 masters for the policy); compute runs in `compute_dtype`."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {}
    if compute_dtype != next(model.parameters()).dtype:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if _group is not None:   # mode=async: shard over the trainer ranks only (use_group), not every rank
        from torch.distributed.device_mesh import DeviceMesh
        kw["mesh"] = DeviceMesh.from_group(_group, device.type)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    elif device.type == "cuda":   # offload: the float32 masters never go to the GPU whole, only shard by shard
        model.to(device)
    layers = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, **kw)
    visual = getattr(getattr(model, "model", None), "visual", None)   # a vision-language model's encoder (vision.py)
    if visual is not None:   # its own unit over its blocks' units: patch embedding and merger gather with it, not root
        fully_shard(visual, **kw)
    fully_shard(model, **kw)   # the root unit: what is left (embeddings, final norm, the tied lm_head)
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def accumulate(models: list, pieces, offload: bool = False):
    """Yield the micro-batches of one mini-batch (`microbatch.micro_batches`) with FSDP2's gradient reduce-scatter
    switched off for all but the last, for each of `models` that is sharded (the policy; PPO's critic): the
    earlier backwards add into local unsharded gradients, and the last backward reduce-scatters their sum once
    (no_sync in FSDP1 terms). Same gradient; one reduce-scatter per optimizer step instead of one per
    micro-batch, and no ranks waiting on each other in between. Costs one unsharded float32 gradient per rank
    while accumulating, so offload=true (memory first) keeps a reduce-scatter per micro-batch. The flag is set
    before each piece is handed out, so the caller's backward sees it."""
    pieces = list(pieces)             # to know which one is last; the pieces are CPU views of the mini-batch
    for i, piece in enumerate(pieces):
        for model in models:
            if is_sharded(model) and not offload:
                model.set_requires_gradient_sync(i == len(pieces) - 1)
        yield piece


def average_gradients(model):
    """parallel=replicate (every rank holds the whole model): replace each gradient by its mean over ranks,
    so every rank takes the same optimizer step and the weights stay identical without a sync. All gradients
    travel in one flat buffer: one collective per optimizer step (DDP's buckets in one), after the last
    micro-batch, so the accumulation before it needs no communication. Missing gradients count as zeros, so
    every rank sends the same layout. No-op in one process and for FSDP-sharded models (FSDP reduces its own)."""
    if world() == 1 or is_sharded(model):
        return
    params = list(model.parameters())                 # tied weights appear once
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # (total parameters,) in the gradients' dtype, as DDP's
    dist.all_reduce(flat, group=_group)               # sum (gloo has no average)
    flat /= world()
    for p, g, part in zip(params, grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
        p.grad = g


def loss_scale(completion_mask: torch.Tensor, loss_agg: str) -> float:
    """Factor for this rank's loss so that the mean over ranks (FSDP's gradient average) equals the loss
    of the global batch. token-mean divides by the global token count, the seq-* modes by the global number
    of sequences: factor = world * local_count / global_count (1.0 when the counts are equal)."""
    if world() == 1:
        return 1.0
    local = completion_mask.sum().item() if loss_agg == "token-mean" else completion_mask.shape[0]
    (total,) = all_sum([local])
    return world() * local / max(total, 1.0)


def global_norm(norm) -> torch.Tensor:
    """A norm from clip_grad_norm_ or get_total_norm as a plain tensor on the device: for sharded gradients it is a
    DTensor whose full value (over every rank's shard) is the global norm. No host sync."""
    from torch.distributed.tensor import DTensor
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the parameters' gradients to a global norm of max_norm (0 = no clipping); -> their global norm before
    clipping, on the device (global_norm): it can travel to the host with other metrics, in one transfer."""
    return global_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm or float("inf")))


def grad_norm_value(norm) -> float:
    """global_norm on the host (one sync)."""
    return global_norm(norm).item()


def sync_weights(model):
    """(name, full tensor) pairs for `engine.load_weights`. Unsharded models: their own parameters.
    Sharded ones: all-gather one FSDP unit at a time (in the compute dtype, so bf16 travels), yield its
    parameters, free them again: at most one unit's full weights exist beside the engine's copy."""
    if not is_sharded(model):
        yield from model.named_parameters()
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            module.unshard()              # this unit's parameters become plain full tensors until reshard()
            for name, p in module.named_parameters(prefix=prefix):
                if not isinstance(p, DTensor):    # units below this one stay sharded: they get their own turn
                    yield name, p
            module.reshard()
    if torch.cuda.is_available():
        torch.cuda.synchronize()      # so that time/sync measures the gathers and copies, not their launch


def full_state(model, optimizer=None) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state dicts on rank 0, in CPU memory, keyed by parameter name:
    the same layout at any world size, so a checkpoint written at one size resumes at another. Every rank
    must call it (it gathers); ranks other than 0 get empty dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    if not dist.is_initialized():   # plain python: nothing to gather
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        return (get_model_state_dict(model),
                get_optimizer_state_dict(model, optimizer) if optimizer is not None else {})
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model, options=options), {}
    return get_state_dict(model, optimizer, options=options)


def load_full_state(model, optimizer, model_state: dict, optim_state: dict | None):
    """Inverse of `full_state`: rank 0 passes the full dicts (other ranks may pass empty ones); each rank
    keeps its shard. Works for sharded and plain models, so world sizes may differ between save and load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    if optimizer is None or optim_state is None:
        set_model_state_dict(model, model_state, options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=options)


def fail(message: str, code: int = 2):
    """End this process for bad input with one line on stderr and exit code `code`. Before the process group exists
    every rank has run the same checks on the same command line, so rank 0 alone prints (RANK is torchrun's);
    after that a fault may be one rank's own, so each rank that meets one prints it."""
    import sys
    if int(os.environ.get("RANK", "0")) == 0 or dist.is_initialized():
        print(message, file=sys.stderr, flush=True)
    # torchrun reports any non-zero exit with its own ChildFailedError traceback and summary, whatever the rank
    # does (an error file only adds lines to it): the line above is the first thing on stderr
    sys.exit(code)
