"""How the fast decoder (engines/fast_decode.py) reads the policy's weights: fused copies, in place, or packed.

A decode step at batch 128 is a chain of small GEMMs, each latency-bound: fewer, larger ones are faster. Each decoder
layer's seven projections fall into four groups that share an input (`groups`: q/k/v, gate/up, o, down), and
`project` applies one group as (ws, b, A, B, R). `refresh` re-reads those tuples before each rollout, into the same
buffers (captured graphs hold their addresses), along one of two routes (`WEIGHTS`, config decode_weights):

- "fused" (the default): q/k/v and gate/up are each one GEMM over weights concatenated once per rollout. LoRA
  (peft layers over plain Linears, lora.py): W + B A * alpha / r is merged into those buffers (and into buffers of
  its own for o_proj and down_proj), so a decode step costs what the plain model's does: 4 GEMMs per layer per
  token. The copies cost ~0.5 GB for a 0.5B model, 12 GiB at a 7B LoRA.
- "in_place", for models whose copies do not fit: no copy of any weight. The decoder, when built, re-packs each
  group of frozen projections into one buffer, rows [W_1; ...; W_n; the adapters' A] (`pack_layers`, `pack_group`:
  the base weights become views of it, layer by layer, so memory grows by one group's buffer at most); per rollout
  only A's rows and a block-diagonal B are refilled (`fill`). A group is then two GEMMs: [x W^T + b | x A^T], and
  an addmm adding (x A^T) B^T (`low_rank_add`): 8 per layer per token with LoRA on every projection (15 unpacked,
  FAST_DECODE_PACK=0). Groups that cannot be packed (trained weights, mixed dtypes or devices, DoRA) read each
  weight where it lives and add their adapters' product from separate A and B (`low_rank`).

FP8 (engine_dtype=fp8: the engine's training rollouts; engines/builtin.py): a third route, "fp8", the fused one
with every group whose weights hold at least FP8_MIN elements (and the head, `refresh`'s head) replaced by a
float8_e4m3 copy of its merged weights with one float32 scale per output channel, made at refresh
(kernels/fp8_quant.py: merge_quantise; on the CPU kernels/fp8.py: quantise_rows); the step applies it as one scaled FP8 GEMM with the activations quantised per token
(kernels/fp8.py: fp8_linear). The master weights are never touched. Only large weights (FP8_MIN): a decode GEMM
of a small weight is latency-bound, so its halved bytes save little, and its activation quantisation may be a
kernel of its own. "fp8_all" quantises every group and the head (small models: the mismatch lab,
docs/mismatch.md).

Measured: docs/lora.md ("decode_weights=in_place", "FP8"), tools/lora_decode_bench.py.
"""
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fp8 import FP8, fp8_linear, gemm_fits, quantise_rows
from kernels.fp8_quant import HAS_TRITON, merge_quantise
from lora import dense_weight

WEIGHTS = ("fused", "in_place", "fp8", "fp8_all")  # FastDecoder(weights=): how the step reads the weights (refresh)
# the fp8 routes: a group (or the head) goes to FP8 when its weights hold at least this many elements. 14 * 2**20
# (~14.7 M) takes a 7B's q/k/v (16.5 M), whose quantisation fuses into the norm before it, and leaves its o_proj
# (12.8 M), whose input comes out of the attention op, so its quantisation would be a kernel of its own costing
# about what the FP8 GEMM saves (docs/lora.md); on a GPU a weight whose dimensions are not multiples of 16 stays
# bf16 too (torch._scaled_mm's rule)
FP8_MIN = {"fp8": 14 * 2**20, "fp8_all": 0}
# how the fp8 routes' refresh makes a GPU's FP8 copies: "triton" (the default: kernels/fp8_quant.py merges each
# projection's adapters and quantises it in two kernels, ~5 bytes moved per weight element) or "torch"
# (lora.dense_weight, then kernels/fp8.py's quantise_rows: several eager passes over each weight per rollout). The
# two copies can differ by one e4m3 step on near-ties (docs/lora.md); the CPU always takes "torch"
FP8_REFRESH = os.environ.get("FAST_DECODE_FP8_REFRESH", "triton")
if FP8_REFRESH not in ("torch", "triton"):
    raise ValueError(f"FAST_DECODE_FP8_REFRESH={FP8_REFRESH!r}: use torch or triton")
# switches, set before building a decoder (tests, tools/lora_decode_bench.py) or from the environment: whether
# decode_weights=in_place re-packs each group's frozen weights with its adapters' A (pack_group; "0": the unpacked
# route, 15 GEMMs per layer per token with LoRA on every projection, for comparison), and how the packed group adds
# its low-rank product ("addmm" into the base output, or "mm" and an add the compiler may fuse). docs/lora.md
PACK = os.environ.get("FAST_DECODE_PACK", "1") == "1"
LOW_RANK = os.environ.get("FAST_DECODE_LOW_RANK", "addmm")


def bias_of(m):
    return getattr(getattr(m, "base_layer", m), "bias", None)


def base_weight(m) -> Tensor:
    """The frozen (or, without LoRA, trained) weight of a Linear or of a peft LoRA layer's base, where it lives."""
    return getattr(m, "base_layer", m).weight


def _cat(ts: list, out: Tensor | None) -> Tensor | None:
    """ts concatenated along dim 0, into out (the last rollout's buffer: same address) when there is one."""
    if ts[0] is None:
        return None
    return torch.cat(ts, out=out) if out is not None else torch.cat(ts)


def low_rank(ms: list, prev_a: Tensor | None, prev_b: Tensor | None,
             dtype: torch.dtype | None = None) -> tuple[Tensor | None, Tensor | None]:
    """The active LoRA adapters of layers ms (sharing one input) as one pair: A (R, in) stacks every adapter's
    A, B (sum of outs, R) is block-diagonal with each adapter's B * alpha / r in its layer's rows, so
    x A^T B^T is every adapter's update of the concatenated output in two GEMMs. (None, None) without adapters.
    In dtype (default: the base weights')."""
    blocks, row = [], 0                                     # (A, scaled B, first output row)
    for m in ms:
        if hasattr(m, "lora_A") and not (m.disable_adapters or m.merged):
            for name in (n for n in m.active_adapters if n in m.lora_A):
                if m.use_dora.get(name):
                    raise ValueError("weights='in_place' does not apply DoRA adapters: use weights='fused'")
                blocks.append((m.lora_A[name].weight, m.lora_B[name].weight * m.scaling[name], row))
        row += base_weight(m).shape[0]
    if not blocks:
        return None, None
    dtype = dtype or base_weight(ms[0]).dtype
    with torch.no_grad():
        a = torch.cat([A for A, _, _ in blocks]).to(dtype)                     # (R, in)
        b = torch.zeros(row, a.shape[0], dtype=dtype, device=a.device)         # (out, R)
        col = 0
        for A, B, first in blocks:
            b[first:first + B.shape[0], col:col + A.shape[0]] = B
            col += A.shape[0]
    return (prev_a.copy_(a), prev_b.copy_(b)) if prev_a is not None else (a, b)


def groups(layer) -> list[list]:
    """A decoder layer's projections in the four groups that share an input: q/k/v, gate/up, o, down. A family
    that fuses them already (phi3: qkv_proj, gate_up_proj) has one projection in the group; a layer of routed
    experts (engines/moe.py reads their weights in place) has none in the MLP's two."""
    a, mlp = layer.self_attn, layer.mlp
    qkv = [a.qkv_proj] if hasattr(a, "qkv_proj") else [a.q_proj, a.k_proj, a.v_proj]
    if hasattr(mlp, "experts"):
        return [qkv, [], [a.o_proj], []]
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return [qkv, gate_up, [a.o_proj], [mlp.down_proj]]


class Pack(NamedTuple):
    """One group's frozen weights and its adapters' A in one buffer (decode_weights=in_place, `pack_group`)."""
    w: Tensor             # (out + R, in): rows [W_1; ...; W_n; A-rows]; each base weight is a view of its rows
    b: Tensor | None      # (out + R,): the biases likewise (zeros where a projection has none, and for the A-rows)
    out: int              # sum of the group's output widths
    slots: list           # (LoRA layer, adapter name, its first output row, its first A-row, its rank)


def _laid_out(ts: list, rows: int) -> Tensor | None:
    """The (rows, ...) tensor over the storage whose first rows are ts, one after the other (a group packed
    before, e.g. by an earlier decoder), or None when ts are not laid out so (never packed, or moved since)."""
    storage, at = ts[0].untyped_storage(), 0
    for t in ts:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != at or not t.is_contiguous():
            return None
        at += t.numel()
    shape = (rows, *ts[0].shape[1:])
    if storage.nbytes() != ts[0][:1].numel() * rows * ts[0].element_size():
        return None
    return torch.empty(0, dtype=ts[0].dtype, device=ts[0].device).set_(storage, 0, shape)


def _pack_rows(ts: list, extra: int, like: Tensor) -> Tensor:
    """ts (each (n_i, ...), or None for a missing bias of n_i rows given as an int) copied into one new buffer of
    sum n_i + extra rows, zeros elsewhere; each tensor then becomes a view of its rows (its old storage is freed
    once nothing else holds it). The one new allocation: a group's weights, never a model's."""
    rows = [t if isinstance(t, int) else t.shape[0] for t in ts]
    buf = torch.zeros(sum(rows) + extra, *like.shape[1:], dtype=like.dtype, device=like.device)
    at = 0
    for t, n in zip(ts, rows):
        if not isinstance(t, int):
            buf[at:at + n].copy_(t)
            t.data = buf[at:at + n]
        at += n
    return buf


def pack_group(ms: list) -> Pack | None:
    """Re-pack the storage of a group of projections ms (sharing an input) so that one GEMM gives their outputs
    and x A^T of every adapter: [x W^T + b | x A^T] (project). None where packing does not apply, and the group
    keeps the unpacked route: a weight that trains (full fine-tuning: the optimizer, FSDP, offload and checkpoint
    loads may swap its storage), weights or biases of different dtypes or devices, an adapter that is DoRA, or a
    group with nothing to gain (one projection, no adapter)."""
    if not ms:
        return None
    ws = [base_weight(m) for m in ms]
    bs = [bias_of(m) for m in ms]
    present = [t for t in ws + bs if t is not None]
    slots, R, row = [], 0, 0
    for m, w in zip(ms, ws):
        for name in getattr(m, "lora_A", {}):
            if m.use_dora.get(name):
                return None
            r = m.lora_A[name].weight.shape[0]
            slots.append((m, name, row, R, r))
            R += r
        row += w.shape[0]
    if (any(t.requires_grad or type(t.data) is not torch.Tensor for t in present) or (len(ms) == 1 and not R)
            or len({(t.dtype, t.device) for t in present}) > 1 or len({w.shape[1] for w in ws}) > 1):
        return None
    with torch.no_grad():
        w = _laid_out(ws, row + R)
        w = _pack_rows(ws, R, ws[0]) if w is None else w                 # (out + R, in)
        have = [t for t in bs if t is not None]
        b = _laid_out(bs, row + R) if have and len(have) == len(bs) else None
        if have and b is None:                                           # (out + R,); a missing bias's rows are zeros
            b = _pack_rows([t if t is not None else v.shape[0] for t, v in zip(bs, ws)], R, have[0])
    return Pack(w, b, row, slots)


def fill(pack: Pack, prev: Tensor | None) -> Tensor | None:
    """Copy the adapters' current A into the pack's A-rows and return B (out, R): block-diagonal, each adapter's
    B * alpha / r at (its output rows, its A-rows); zero where an adapter is off (disabled, merged, inactive).
    prev: the last rollout's B, refilled in place (same storage: captured graphs stay valid). None if R = 0."""
    R = pack.w.shape[0] - pack.out
    if not R:
        return None
    with torch.no_grad():
        b = prev if prev is not None else pack.w.new_empty(pack.out, R)             # (out, R)
        b.zero_()
        for m, name, first, col, r in pack.slots:
            if m.disable_adapters or m.merged or name not in m.active_adapters:
                continue
            pack.w[pack.out + col:pack.out + col + r].copy_(m.lora_A[name].weight)   # (r, in)
            B = m.lora_B[name].weight                                                # (out_m, r)
            b[first:first + B.shape[0], col:col + r].copy_(B * m.scaling[name])
    return b


@torch.library.custom_op("rlhack::low_rank_add", mutates_args=("y",))
def low_rank_add(y: Tensor, B: Tensor) -> None:
    """y (..., out + R) = [x W^T + b | x A^T] -> its first out columns += (x A^T) B^T, B (out, R): one addmm in
    place. An op of its own so that torch.compile keeps it in place: a plain addmm_ on a slice of the GEMM's
    output compiles to an addmm into a new buffer, which cuBLAS precedes by a copy of the slice (seen in
    inductor's code on CPU)."""
    flat, R = y.view(-1, y.shape[-1]), B.shape[1]                            # (M, out + R)
    flat[:, :-R].addmm_(flat[:, -R:], B.t())


def project(x: Tensor, p: tuple) -> Tensor:
    """x (B, T, in) -> (B, T, out): the projections of one group (FastDecoder.refresh) applied to their shared
    input. p = (ws, b, A, B, R): one GEMM per weight in ws (outputs side by side) and the bias (or, ws an FP8
    weight and its scales, one scaled FP8 GEMM: the fp8 routes); then either
    R = 0 and the low-rank product x A^T B^T of separate A, B (if any), or R > 0: ws is one packed weight
    (pack_group) whose GEMM gave [x W^T + b | x A^T], and one addmm adds (x A^T) B^T into its first columns."""
    ws, b, A, B, R = p
    if ws[0].dtype == FP8:                      # the fp8 routes: ws = [w8 (out, in), scale (out,)] (fp8_group)
        return fp8_linear(x, ws[0], ws[1], b)
    y = F.linear(x, ws[0], b) if len(ws) == 1 else torch.cat([F.linear(x, w) for w in ws], dim=-1)
    if len(ws) > 1 and b is not None:
        y = y + b
    if R and LOW_RANK == "mm":   # the add left to the compiler, which may fuse it into the next pointwise kernel
        return y[..., :-R] + F.linear(y[..., -R:], B)
    if R:
        low_rank_add(y, B)
        return y[..., :-R]                                                   # (B, T, out): rows out + R apart
    return y if A is None else y + F.linear(F.linear(x, A), B)


def pack_layers(layers) -> list[list]:
    """Re-pack every layer's groups (pack_group), layer by layer: memory grows by one group's buffer at a time
    (the old storage is freed as each group moves), never by a copy of the model. Done when a decoder is built
    (FastDecoder(weights="in_place")), once per model, not at LoRA setup: only this decoder reads the layout, and
    runs that never build it keep peft's."""
    packs = []
    for layer in layers:
        packs.append([pack_group(ms) for ms in groups(layer)])
        # reserved memory too: a group's buffer is larger than any freed weight, so the caching allocator
        # would take new segments for every layer while keeping the old ones cached (most large weights had
        # segments of their own, which this hands back)
        if base_weight(layer.self_attn.o_proj).is_cuda:
            torch.cuda.empty_cache()
    return packs


@torch.no_grad()   # copies for the decoder, never part of a graph the trainer differentiates
def refresh(layers, fused: list[tuple], packs: list[list] | None, weights: str, head=None) -> list[tuple]:
    """Per layer, what each of its four GEMM groups (q/k/v, gate/up, o, down) applies, as (ws, b, A, B, R) for
    `project`, re-read before each rollout into the same buffers (captured graphs stay valid).
    weights="fused": q/k/v and gate/up concatenated into one weight each, LoRA adapters merged (lora.dense_weight),
    o_proj and down_proj read in place unless they carry an adapter: ~0.5 GB of copies for a 0.5B model,
    well under a millisecond on a GPU, 3 fewer kernels per layer per token (small decode GEMMs are
    latency-bound, so fewer, larger ones are faster).
    weights="in_place": no copy of any weight. A group packed at construction (pack_group: its base weights
    are views of one buffer whose last rows hold the adapters' A) gets its A-rows and block-diagonal B
    refilled (`fill`): two GEMMs per group. An unpacked group (pack_group says why) reads each weight where it
    lives and adds its adapters' low-rank product from separate A and B (`low_rank`, a few MB of copies).
    weights="fp8" / "fp8_all": the fused route, but a group with at least FP8_MIN[weights] elements of weight gets
    an FP8 copy of its merged weights and per-row scales (fp8_group), and the head (the model's lm_head, given as
    head) likewise, its tuple appended after the layers' (engines/decode_step.py applies it; read in place when it
    stays bf16).
    layers: the decoder's layers; fused: the last call's tuples, refilled in place ([] for none); packs: per layer,
    per group, its Pack or None (pack_layers; None: no packing), a group moved since (a .to()) packed again here."""
    new = []
    for i, layer in enumerate(layers):
        old = fused[i] if fused else (None,) * 4
        for j, ms in enumerate(groups(layer) if packs else []):   # moved since (a .to()): pack again
            pk = packs[i][j]
            if pk is not None and ms and _laid_out([base_weight(m) for m in ms], pk.w.shape[0]) is None:
                packs[i][j] = pack_group(ms)
        layer_packs = packs[i] if packs else (None,) * 4
        new.append(tuple(_group(ms, prev, pk, weights) for ms, prev, pk in zip(groups(layer), old, layer_packs)))
    if weights in FP8_MIN and head is not None:
        new.append(_group([head], fused[len(layers)] if len(fused) > len(layers) else None, None, weights))
    return new


def fp8_fits(ms: list, weights: str, device) -> bool:
    """Does the group ms (sharing an input) go to FP8 on this route: weights="fp8" or "fp8_all", at least
    FP8_MIN[weights] elements, and on a GPU dimensions that torch._scaled_mm takes?"""
    if weights not in FP8_MIN:
        return False
    ws = [base_weight(m) for m in ms]
    n, k = sum(w.shape[0] for w in ws), ws[0].shape[1]
    return n * k >= FP8_MIN[weights] and (torch.device(device).type != "cuda" or gemm_fits(n, k))


def fp8_group(ms: list, prev_w: list | None) -> list:
    """[w8 (out, in) e4m3, scale (out,) float32] of the group's merged weights (LoRA adapters merged, lora.dense_weight;
    outputs side by side), refilled into prev_w's buffers when given (captured graphs stay valid). Each projection
    is quantised straight into its rows: no concatenated bf16 copy of the group is made; on a GPU with
    FP8_REFRESH = "triton" (the default) by kernels/fp8_quant.py, which also merges its adapters (not DoRA: those
    take the torch route)."""
    ws = [base_weight(m) for m in ms]
    n, k = sum(w.shape[0] for w in ws), ws[0].shape[1]
    w8, scale = (prev_w if prev_w is not None and prev_w[0].dtype == FP8 else
                 (torch.empty(n, k, dtype=FP8, device=ws[0].device),
                  torch.empty(n, dtype=torch.float32, device=ws[0].device)))
    row = 0
    for m, w in zip(ms, ws):
        rows = (w8[row:row + w.shape[0]], scale[row:row + w.shape[0]])
        if FP8_REFRESH == "triton" and HAS_TRITON and w.is_cuda and not any(getattr(m, "use_dora", {}).values()):
            A, B, scaling = _adapter(m)                                      # (R, in), (out, R) float32
            merge_quantise(w, A, B, rows, scaling)
        else:
            quantise_rows(dense_weight(m), rows)
        row += w.shape[0]
    return [w8, scale]


def _adapter(m) -> tuple:
    """(A (R, in), B (out, R), scaling) of projection m's active adapters for kernels/fp8_quant.py: one adapter's
    own float32 factors and alpha / r, read in place (no copy per rollout); several stacked by `low_rank` (B scaled,
    scaling 1); (None, None, 1.0) without any."""
    active = ([] if not hasattr(m, "lora_A") or m.disable_adapters or m.merged else
              [n for n in m.active_adapters if n in m.lora_A])
    if len(active) == 1 and m.lora_A[active[0]].weight.dtype == torch.float32:
        name = active[0]
        return m.lora_A[name].weight, m.lora_B[name].weight, float(m.scaling[name])
    return (*low_rank([m], None, None, torch.float32), 1.0)


def merged(ms: list, out: Tensor | None = None) -> Tensor:
    """(out, in): the group's weights with their LoRA adapters merged (lora.dense_weight), outputs side by side;
    into out (the last rollout's buffer) when given. A lone projection without active adapters gives its own W."""
    ws = [dense_weight(m) for m in ms]                                      # new tensors, or W if adapters are off
    return _cat(ws, out) if out is not None or len(ws) > 1 else ws[0]


def _group(ms: list, prev: tuple | None, pack: Pack | None, weights: str) -> tuple:
    """(ws, b, A, B, R) of Linears (or peft LoRA layers) ms that read the same input; prev: the last call's
    buffers, refilled in place; pack: the group's packed storage, if any."""
    if not ms:                                                              # routed experts: no group
        return None
    prev = prev or (None,) * 5
    if pack is not None:
        return [pack.w], pack.b, None, fill(pack, prev[3]), pack.w.shape[0] - pack.out
    b = bias_of(ms[0]) if len(ms) == 1 else _cat([bias_of(m) for m in ms], prev[1])   # one: read in place
    if fp8_fits(ms, weights, base_weight(ms[0]).device):
        return fp8_group(ms, prev[0]), b, None, None, 0
    if weights == "in_place":
        return [base_weight(m) for m in ms], b, *low_rank(ms, prev[2], prev[3]), 0
    if len(ms) == 1 and type(ms[0]) is torch.nn.Linear:
        return [ms[0].weight], b, None, None, 0                             # read in place
    if prev[0] is not None and prev[0][0].dtype != FP8:
        return [merged(ms, prev[0][0])], b, None, None, 0
    w = merged(ms)
    return [w.clone() if w is base_weight(ms[0]) else w], b, None, None, 0  # ours, so later calls can refill it
