"""The update phase: mini-batches from the buffer, micro-batches inside each, one optimizer step per mini-batch.

    learner = Learner(policy, optimizer, schedule, algo, cfg, device, critic)
    stats = update(learner, buffer, generator, step, n_samples)   # -> {metric: mean over its optimizer steps}

A new metric of the update goes into `update`'s stats (both modes' rows take them whole: train.metrics_row); a
plain number is averaged over ranks, distributed.Sum / Max / Min / Ratio declare another reduction.

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
Under exact_logprobs, while the weights are unmoved, the loss reads the engine's log-probs (`reuses_sampled`) and the
mismatch is measured on `exact_check` sequences of the first micro-batch only (`check_exact`).
Metrics stay on the device until one transfer per optimizer step: an `.item()` per micro-batch would stall the
GPU until the host caught up. For the same reason the micro-batches go up through pinned memory (to_device), and
a fused optimizer steps before that transfer, skipping itself on the device when 3. says so (optimizer_step).
pack=true (docs/packing.md): each micro-batch's real tokens run through the policy as one sequence, positions
restarting per sample (microbatch.pack; packed_completion below), with the same losses and gradients.
"""
import contextlib
import inspect
import math
from dataclasses import dataclass, fields, replace

import torch

import checkpoint
import distributed
import engines.exact as exact
import engines.moe as moe
import full_kl
from config import trainer_temperature
from kernels import linear_logprob_loss_kernel, linear_logprobs, token_logprobs
from microbatch import Packed, micro_batches, pack, packed_micro_batches, split_weight
from models import completion_logprobs, completion_loss, plain_head


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
    reference: object = None      # the reference (or teacher), when the loss takes the exact KL to it (full_kl.py)
    version: int = 0              # optimizer updates applied so far, counted in RL steps (samples carry it)
    bad_updates: int = 0          # non-finite updates in a row

    @property
    def loss_agg(self) -> str:    # how the loss reduces over tokens: weights micro-batches and ranks
        return self.algo.loss_agg or self.cfg.algo.loss_agg

    @property
    def trained(self) -> list:    # every model the backward reaches
        return [self.policy] + ([self.critic.model] if self.critic is not None else [])


def fused_policy_loss(learner: Learner, micro, packed: Packed | None = None):
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
    if packed is not None:
        loss, logp, _ = packed_completion(learner.policy, micro, packed, trainer_temperature(cfg), loss_fn)
        return loss, logp, metrics
    C = micro.completion_mask.shape[1]
    loss, logp, _ = completion_loss(learner.policy, micro.input_ids, micro.attention_mask, C, trainer_temperature(cfg),
                                    loss_fn, micro.images())
    return loss, logp, metrics


class ExactValues(torch.autograd.Function):
    """The exact forward's values with the ordinary forward's gradient: what the loss reads is bit for bit what the
    engine sampled with (exact_logprobs), what the backward differentiates is the forward the default path runs.
    (logp + (exact - logp).detach() would not give exact's bits back in floating point.)"""

    @staticmethod
    def forward(ctx, logp: torch.Tensor, exact_logp: torch.Tensor) -> torch.Tensor:   # (b, C) x 2 -> (b, C)
        return exact_logp.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def reuses_sampled(learner: Learner, micro, unmoved: bool) -> bool:
    """exact_logprobs: whether micro's loss may read the engine's sampled log-probs in place of the exact pass.
    While the policy's weights are those that sampled every row, the two are the same bits (tests/test_exact.py),
    so the pass would only recompute them. unmoved: no optimizer step yet in this batch. An on-policy buffer only:
    then every row is of this version on every rank, so all ranks decide alike (FSDP's gathers in the exact pass
    stay paired). micro on the host: no device sync."""
    cfg = learner.cfg
    return (cfg.exact_logprobs and unmoved and not cfg.replay.enabled
            and bool((micro.versions == learner.version).all()))


def check_exact(learner: Learner, micro):
    """exact_logprobs, while the loss reads the engine's log-probs: the exact pass, values only, on micro's first
    `exact_check` sequences, what logprob_mismatch measures (the loss's reused rows would give 0 by construction).
    A bounded sample, so the check's cost does not grow with the micro-batch. -> (those rows, their exact
    log-probs (k, C)), for add_mismatch."""
    checked = micro.select(slice(0, learner.cfg.exact_check))
    with torch.no_grad():   # the GPU path gives values only (kernels/exact_gemm.py)
        logp, _ = exact.completion_logprobs(learner.policy, checked.input_ids, checked.attention_mask,
                                            checked.completion_mask.shape[1], trainer_temperature(learner.cfg))
    return checked, logp


def micro_loss(learner: Learner, micro, packed: Packed | None = None, sampled: bool = False):
    """-> (loss, trainer log-probs (b, c), the algorithm's metrics) of one micro-batch (packed: its padding-free
    layout, when pack=true). sampled: the loss reads micro.sample_logprobs as the exact forward's values
    (exact_logprobs, `reuses_sampled`)."""
    cfg = learner.cfg
    if cfg.fused_loss and not cfg.exact_logprobs:   # speed: the loss's gradient is taken in the kernel, rows at a time
        return fused_policy_loss(learner, micro, packed)
    C, ref_kl = micro.completion_mask.shape[1], None
    if cfg.exact_logprobs and sampled:   # the exact pass's bits, already computed by the engine that sampled them
        exact_logp = micro.sample_logprobs.float()                                    # (b, C)
    elif cfg.exact_logprobs:   # values: the engine's own forward, bit for bit (engines/exact.py); gradient: below
        with torch.no_grad():   # memory: run first, so its transients are gone before the autograd graph below exists
            exact_logp, _ = exact.completion_logprobs(learner.policy, micro.input_ids, micro.attention_mask, C,
                                                      trainer_temperature(cfg))
    if learner.algo.exact_kl(cfg.algo) and packed is not None:   # KL(new || reference) too, packed (full_kl.py)
        kl = full_kl.head_and_kl(learner.policy, learner.reference, micro, trainer_temperature(cfg),
                                 kl_weights(learner, micro))
        logp, entropy, ref_kl = packed_completion(learner.policy, micro, packed, trainer_temperature(cfg), extra=kl)
    elif packed is not None:
        logp, entropy = packed_completion(learner.policy, micro, packed, trainer_temperature(cfg))
    elif learner.algo.exact_kl(cfg.algo):   # KL(new || reference) over the whole vocabulary too (full_kl.py)
        logp, entropy, ref_kl = full_kl.completion_logprobs_and_kl(learner.policy, learner.reference, micro, C,
                                                                   trainer_temperature(cfg), kl_weights(learner, micro))
    else:
        logp, entropy = completion_logprobs(learner.policy, micro.input_ids, micro.attention_mask, C,
                                            trainer_temperature(cfg), micro.images())
    if cfg.exact_logprobs:
        logp = ExactValues.apply(logp, exact_logp)
    new = {"logprobs": logp, "entropy": entropy}
    if ref_kl is not None:
        new["ref_kl"] = ref_kl
    if learner.critic is not None:   # PPO: the value loss trains the critic in the same backward
        new["values"] = learner.critic.values(micro.input_ids, micro.attention_mask, micro.completion_mask, grad=True)
    loss, metrics = learner.algo.loss(new, micro, cfg.algo)
    return loss, logp, metrics


def kl_weights(learner: Learner, micro):
    """-> probe(logp, entropy) -> (b, C): d loss / d KL_t, how the algorithm's loss of this micro-batch weighs each
    token's full-vocabulary KL, read by differentiating that loss once at KL = 0 (cheap: per-token arithmetic, the
    inputs detached). The losses that take new["ref_kl"] are linear in it (kl_coef * KL_t, distill's coef * KL_t,
    through a linear aggregation), so full_kl can take the KL's gradient with these weights in the KL's own forward
    (fused_kl_loss); its backward checks the linearity."""
    cfg = learner.cfg

    def probe(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        kl = torch.zeros_like(logp, requires_grad=True)                                 # (b, C)
        new = {"logprobs": logp, "entropy": entropy, "ref_kl": kl}
        if learner.critic is not None:   # the value loss does not read the KL: any values serve
            new["values"] = torch.zeros_like(logp)
        with torch.enable_grad():
            loss, _ = learner.algo.loss(new, micro, cfg.algo)
            g, = torch.autograd.grad(loss, kl, allow_unused=True)
        return torch.zeros_like(logp) if g is None else g
    return probe


def packed_completion(model, micro, packed: Packed, temperature: float, loss_fn=None, extra=None):
    """completion_logprobs (loss_fn None) or completion_loss of micro, from one forward over its packed tokens:
    no attention mask: the attention takes the samples' bounds (packed.cu_seqlens: VARLEN and flash-attn's varlen
    kernel) or reads them off the position restarts (a block-diagonal causal mask for sdpa / flex / eager), and
    the head runs on the kept tokens only (logits_to_keep = their predecessors). Tokens out of the loss
    (observations, padding) get log-prob 0.
    Run it inside packed_attention(model), backward included (gradient checkpointing recomputes in backward).
    -> (logp, entropy), each (b, C); with loss_fn (loss, logp, entropy) as models.completion_loss returns them.
    extra: fn(hidden (b, C, H) on the padded layout, 0 off keep; head weight; targets (b, C)) -> (logp, entropy,
    one more (b, C)), run in the head's place (a plain head, no loss_fn: full_kl.head_and_kl)."""
    keep, C = packed.keep, micro.completion_mask.shape[1]
    targets = torch.where(keep, micro.input_ids[:, -C:], -1)                       # (b, C); < 0: the kernels skip it
    # the samples' bounds as transformers' flash-attention keywords: its flash paths and VARLEN read them (no
    # bounds recomputed from the positions, no host sync), the others ignore them
    bounds = dict(cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens, max_length_q=packed.max_len,
                  max_length_k=packed.max_len)
    inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=packed.src,
                  use_cache=False, **bounds)
    if not plain_head(model):   # a head with a bias or scaling: logits of the M kept tokens, then log-probs
        lp, ent = token_logprobs(model(**inputs).logits[0], targets[keep], temperature)   # (M, V) -> (M,) x 2
        logp, entropy = (lp.new_zeros(keep.shape).index_put((keep,), x) for x in (lp, ent))   # (b, C) x 2
        if loss_fn is None:
            return logp, entropy
        return loss_fn(slice(0, len(keep)), logp, entropy), logp.detach(), entropy.detach()
    head, into_grad = model.get_output_embeddings(), not distributed.is_sharded(model)

    def kept_rows(hidden):   # (1, M, H) -> the log-prob kernels' outputs on the (b, C) layout, 0 off keep
        h = hidden.new_zeros(*keep.shape, hidden.shape[-1]).index_put((keep,), hidden[0])   # (b, C, H)
        if extra is not None:
            return extra(h, head.weight, targets)
        if loss_fn is None:
            return linear_logprobs(h, head.weight, targets, temperature, into_grad)
        return linear_logprob_loss_kernel(h, head.weight, targets, temperature, loss_fn, into_grad=into_grad)
    # as models._in_head: inside the model's forward (FSDP2 gathers the head there); clones for its hooks
    head.forward = lambda hidden: tuple(t.clone() for t in kept_rows(hidden))
    try:
        return tuple(model(**inputs).logits)
    finally:
        del head.forward


def flash_attention() -> str | None:
    """The flash-attn implementation transformers can use here, newest first; None without the package."""
    from transformers.utils import import_utils
    for name, check in (("flash_attention_4", "is_flash_attn_4_available"),
                        ("flash_attention_2", "is_flash_attn_2_available")):
        if getattr(import_utils, check, lambda: False)():
            return name
    return None


VARLEN = "packed_varlen"   # the packed forward's own attention, registered in transformers' AttentionInterface


def varlen_api(fn):
    """(fn, takes window_size, takes scale, takes enable_gqa): varlen_attn's keywords differ between torch versions
    (is_causal became window_size; scale and enable_gqa came later). Read once, at import: the attention that
    uses them is traced by a compiled layer."""
    names = inspect.signature(fn).parameters
    return fn, "window_size" in names, "scale" in names, "enable_gqa" in names


try:   # torch's varlen flash attention: CUDA, 16 bits
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    TORCH_VARLEN = varlen_api(_varlen_attn)
except ImportError:
    TORCH_VARLEN = None


def packed_attention_name(model) -> str:
    """The attention for a packed forward: flash-attn's varlen kernel where the package is installed (GPU, 16-bit
    weights), else VARLEN (torch's own flash varlen kernel on a GPU in 16 bits; per-sample sdpa on a CPU), else,
    on a GPU in float32 or with a torch that lacks torch.nn.attention.varlen, FlexAttention, whose block mask
    skips the blocks between samples. sdpa and eager would take the packed mask whole ((N, N) for N tokens:
    quadratic work)."""
    half = model.dtype in (torch.bfloat16, torch.float16)
    if model.device.type != "cuda":
        return VARLEN
    if half and (fa := flash_attention()):
        return fa
    return VARLEN if half and TORCH_VARLEN is not None else "flex_attention"


@contextlib.contextmanager
def packed_attention(model):
    """Within: packed_attention_name's implementation; the model's own again after (generation keeps its own).
    The critic, a model of its own, keeps its attention and the padded layout."""
    own, want = model.config._attn_implementation, packed_attention_name(model)
    if want == own:
        yield
        return
    if want == VARLEN:
        from transformers import AttentionInterface
        AttentionInterface.register(VARLEN, varlen_attention)   # no mask: transformers builds none for it
    model.set_attn_implementation(want)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention interface for VARLEN: causal attention within each packed sample, no mask.
    query (1, Hq, N, D), key / value (1, Hkv, N, D), cu_seq_lens_q (S + 1,) int32 sample bounds, max_length_q the
    longest sample -> ((1, N, Hq, D), None)."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(f"{VARLEN} attention runs one packed sequence with its cu_seq_lens_q "
                         "(update.packed_completion); use sdpa or eager elsewhere")
    if sliding_window or softcap or (dropout and module.training):
        raise ValueError(f"{VARLEN} attention has no sliding window, softcap or dropout: set pack=false for this "
                         "model")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))      # (N, H, D) each
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and TORCH_VARLEN is not None:
        out = flash_varlen(q, k, v, cu_seq_lens_q, max_length_q, scaling)
    else:   # CPU (and float32): sdpa per sample, so that no (N, N) mask exists
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scaling,
            enable_gqa=k.shape[1] != q.shape[1]).transpose(0, 1) for a, b in zip(bounds, bounds[1:])])
    return out[None], None                                                          # (1, N, Hq, D)


def flash_varlen(q, k, v, cu, max_len: int, scale):
    """torch's varlen flash attention, causal, across the keyword names of the torch versions that have it:
    q (N, Hq, D), k / v (N, Hkv, D) -> (N, Hq, D)."""
    fn, window, takes_scale, gqa = TORCH_VARLEN
    kw = {"window_size": (-1, 0)} if window else {"is_causal": True}
    if takes_scale:
        kw["scale"] = scale
    elif scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5):
        raise ValueError(f"this torch's varlen_attn has no scale argument and the model's is {scale}: set pack=false "
                         "or use flash-attn")
    if k.shape[1] != q.shape[1]:   # grouped-query attention: the kernel's own where it is exposed
        if gqa:
            kw["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)


def add_mismatch(m: dict, micro, logp, version: int):
    """Sum and max of |trainer - engine log-prob| over the fresh (this version's) completion tokens, into m."""
    fresh = micro.completion_mask * (micro.versions == version).float()[:, None]      # (b, c)
    gap = (logp.detach().float() - micro.sample_logprobs).abs() * fresh              # (b, c)
    m["_mis_sum"], m["_mis_n"] = m.get("_mis_sum", 0.0) + gap.sum(), m.get("_mis_n", 0.0) + fresh.sum()
    top = gap.max() if gap.numel() else gap.new_zeros(())
    m["_mis_max"] = torch.maximum(m["_mis_max"], top) if "_mis_max" in m else top


def to_device(x, device: torch.device):
    """x (an Experience or a Packed: a dataclass of tensors) with its CPU tensors on device. To a GPU through pinned
    memory with non_blocking copies: a copy from pageable memory first waits for every kernel queued before it
    (CUDA's rule for such copies), so each micro-batch would start on an idle GPU; these queue behind the work."""
    def move(t):
        if not torch.is_tensor(t) or t.device == device:
            return t
        if device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(device, non_blocking=True)   # the pinned copy lives until the copy is done
        return t.to(device)
    return replace(x, **{f.name: move(getattr(x, f.name)) for f in fields(x)})


def accumulate_gradients(learner: Learner, mb, measure_mismatch: bool) -> dict:
    """Forward + backward of every micro-batch of the mini-batch mb; -> its metrics as device tensors."""
    cfg, m = learner.cfg, {}
    scale = distributed.loss_scale(mb.completion_mask, learner.loss_agg)   # this rank's share of the global batch
    packs = cfg.pack and mb.pixel_values is None   # pictures take the padded path: packing does not place them yet
    split = packed_micro_batches if packs else micro_batches
    pieces = split(mb, cfg.micro_batch_size, learner.loss_agg, cfg.algo.norm_len)   # size 0 = one pass
    # the packed forward's attention for forward and backward alike: a recompute must see what the forward saw
    with packed_attention(learner.policy) if packs else contextlib.nullcontext():
        for i, (micro, weight) in enumerate(distributed.accumulate(learner.trained, pieces, cfg.offload)):
            # queued copies (to_device): the host goes on to launch this micro-batch while the GPU ends the last
            packed = to_device(pack(micro), learner.device) if packs else None   # index math on the host: no sync
            # exact_logprobs: before any optimizer step the loss may read the engine's bits (exact pass: a sample)
            sampled = reuses_sampled(learner, micro, measure_mismatch)
            micro = to_device(micro, learner.device)
            if sampled and i == 0:   # first: the check's transients are gone before the autograd graph exists
                add_mismatch(m, *check_exact(learner, micro), learner.version)
            moe.set_routes(learner.policy, micro.routes)   # moe.routing_replay: its backward's recompute too
            loss, logp, metrics = micro_loss(learner, micro, packed, sampled)
            (loss * (weight * scale)).backward()
            if measure_mismatch and not sampled:   # a reused row's gap is 0 by construction: not a measurement
                add_mismatch(m, micro, logp, learner.version)
            # x scale as for the loss, so that the plain mean over ranks (distributed.reduce_metrics) is the global one
            for k, v in {**metrics, "loss": loss.detach()}.items():
                m[k] = m.get(k, 0.0) + weight * scale * v
    moe.set_routes(learner.policy, None)   # the engine shares the policy's modules: it routes freely
    return m


def clip_gradients(learner: Learner) -> torch.Tensor:
    """Average (replicate) and clip the policy's gradients; -> their global norm before clipping, on the device
    (it reaches the host with the metrics, in their one transfer)."""
    distributed.average_gradients(learner.policy)   # parallel=replicate: one all-reduce (FSDP: a no-op)
    if learner.critic is not None:
        distributed.average_gradients(learner.critic.model)
    return distributed.clip_grad_norm(learner.policy.parameters(), learner.cfg.grad_clip)   # over every rank's shard


def optimizer_step(learner: Learner, m: dict, step: int) -> tuple[dict, bool]:
    """Clip, then step if loss and gradient are finite on every rank. m: the mini-batch's metrics as device
    tensors (accumulate_gradients). -> (m as host floats with grad_norm (and critic_grad_norm), whether the step was
    applied). A fused optimizer steps before anything reaches the host: it reads the finite flag on the device
    (found_inf, as a GradScaler sets it) and skips the whole update itself, moments and step count included, so
    the GPU runs backward, clip and step back to back and the host waits once, for the metrics, after them."""
    m["grad_norm"] = clip_gradients(learner)
    finite = (torch.isfinite(torch.as_tensor(m["loss"], device=learner.device))
              & torch.isfinite(m["grad_norm"])).float()                                      # () 1.0 or 0.0
    if distributed.world() > 1:   # every rank must skip together or its shard drifts
        torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN, group=distributed.group())
    early = on_device_skip(learner.optimizer)
    if early:
        learner.optimizer.found_inf = 1.0 - finite
        try:
            learner.optimizer.step()
        finally:
            del learner.optimizer.found_inf
    m = to_host({**m, "_finite": finite}, learner.device)
    if not m.pop("_finite"):
        learner.bad_updates += 1
        if distributed.rank() == 0:
            print(f"step {step}: non-finite loss or gradient, update skipped ({learner.bad_updates} in a row)",
                  flush=True)
        return m, False
    if not early:
        learner.optimizer.step()
    learner.schedule.step()
    if learner.critic is not None:   # its own optimizer
        m["critic_grad_norm"] = learner.critic.step()
    learner.bad_updates = 0
    checkpoint.crash_point("update", step)
    return m, True


def on_device_skip(optimizer) -> bool:
    """Does the optimizer skip a step by itself, reading a flag on the device? Fused Adam / AdamW do (found_inf).
    A streamed one (offload.stream) steps chunk by chunk, and FSDP2's sharded parameters are DTensors that the
    flag, a plain tensor, would have to meet inside the fused op: both keep the host's choice."""
    from torch.distributed.tensor import DTensor
    return (bool(optimizer.defaults.get("fused")) and not hasattr(optimizer, "offload_device")
            and not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]))


def to_host(m: dict, device: torch.device) -> dict:
    """Every metric (device tensors or numbers) to the host in one transfer: one sync per optimizer step."""
    return dict(zip(m, torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                                    for v in m.values()]).tolist()))


def minibatch_size(cfg, n_samples: int) -> int:
    """Samples per optimizer step on this rank: algo.minibatch_size is global; 0 = this step's whole batch."""
    return cfg.algo.minibatch_size // distributed.world() or n_samples


def update(learner: Learner, buffer, generator: torch.Generator, step: int, n_samples: int) -> dict:
    """Every optimizer step of this RL step (n_samples: this rank's new samples); -> metrics (means over the
    optimizer steps), skipped_updates and logprob_mismatch/{mean,max} (declared to reduce over every rank's tokens
    of the trainer's current version; absent when there are none, as under mode=async with stale samples:
    docs/async.md)."""
    cfg = learner.cfg
    mb_size = minibatch_size(cfg, n_samples)
    stats: dict[str, list[float]] = {}
    mismatch, skipped, applied = None, 0, 0
    for mb in buffer.minibatches(mb_size, cfg.algo.epochs, generator, group_size=cfg.samples_per_prompt):
        if distributed.all_sum([float(mb.completion_mask.sum())])[0] == 0:
            continue   # no loss token on any rank (DAPO found no group with signal): AdamW would still move the weights
        learner.optimizer.zero_grad(set_to_none=True)
        if learner.critic is not None:
            learner.critic.optimizer.zero_grad(set_to_none=True)
        m = accumulate_gradients(learner, mb, measure_mismatch=mismatch is None)
        m, ok = optimizer_step(learner, m, step)   # m: host floats from here
        if mismatch is None:
            mismatch = (m.pop("_mis_sum"), m.pop("_mis_n"), m.pop("_mis_max"))
        for k, v in m.items():
            stats.setdefault(k, []).append(v)
        skipped, applied = skipped + (not ok), applied + ok
        if learner.bad_updates >= cfg.max_bad_updates:
            break
    buffer.end_step()
    learner.optimizer.zero_grad(set_to_none=True)   # memory: the gradients are not needed while the engine samples
    learner.version += applied > 0                  # a new policy exists only if some update went through
    out = {**{k: sum(v) / len(v) for k, v in stats.items()}, "skipped_updates": skipped}
    mis_sum, mis_n, mis_max = mismatch or (0.0, 0.0, 0.0)
    if mis_n > 0:   # no token of this version (stale samples under mode=async, nothing trained): not measured, absent
        # over ranks: the gap's mean over every rank's tokens (a rank with none has no say), the largest gap
        out.update({"logprob_mismatch/mean": distributed.Ratio(mis_sum, mis_n),
                    "logprob_mismatch/max": distributed.Max(mis_max)})
    return out
