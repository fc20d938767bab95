"""Gradient accumulation over micro-batches, bucketed by length and trimmed of padding.

train.py splits each optimizer mini-batch with `micro_batches(mb, cfg.micro_batch_size, cfg.algo.loss_agg)` and
calls backward on `weight * loss` of each piece, so the summed gradient equals the whole mini-batch's:

    for micro, weight in micro_batches(mb, 32, "token-mean"):
        loss, metrics = algo.loss(new_logprobs(micro), micro, cfg.algo)
        (weight * loss).backward()

Why: activation memory grows with the tokens in one forward (a 0.5B model keeps ~60 KB per token per layer
for backward), so a bounded micro-batch bounds peak memory whatever the rollout batch size. Rows are sorted by
completion length before splitting (bucketing), and each piece drops the columns that are padding in all of its
rows (the prompt's left padding and the completion's right padding), so short samples do not pay for long ones.

The weights make the accumulation exact for the loss aggregations of algos/common.py:
    token-mean               weight = tokens in the piece / tokens in the mini-batch
    seq-mean-*               weight = rows in the piece / rows in the mini-batch
    seq-mean-token-sum-norm  also x (piece's width / mini-batch's width) when it divides by the width, i.e.
                             when no constant normaliser is set (norm_len=0; the loop sets algo.norm_len)
size 0 means no split: the mini-batch itself with weight 1, untouched.

pack=true (docs/packing.md) splits differently and lays each piece out without padding:
    packed_micro_batches   as many pieces as micro_batches makes, rows dealt longest first to the piece with the
                           fewest real tokens so far, so that the pieces cost about the same (the same weights)
    pack                   a piece's real tokens as one (1, N) sequence whose positions restart at 0 per sample,
                           with the samples' bounds (cu_seqlens) for a varlen attention; update.packed_completion
                           runs the policy over it
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from buffer import IMAGE_FIELDS, Experience


def trim(batch: Experience) -> Experience:
    """Drop leading prompt columns and trailing completion columns that are padding in every row."""
    P, C = batch.prompt_len, batch.completion_mask.shape[1]
    first = int(batch.attention_mask[:, :P].any(0).long().argmax()) if P else 0   # first column any row uses
    used = batch.completion_mask.any(0)                                            # (C,) completion columns in use
    # the last used column, not the count: a multi-turn episode's observation columns (mask 0) sit between turns
    c = int((torch.arange(C, device=used.device) * used).argmax()) + 1 if bool(used.any()) else 1
    out = {}
    for name, t in vars(batch).items():
        if name == "routes" and t is not None:                                     # (B, T, L, k): as input_ids
            out[name] = t[:, first:P + c]
        elif name == "ref_hidden" and t is not None:                               # (B, C, Ht): per token
            out[name] = t[:, :c]
        elif t is None or not torch.is_tensor(t) or t.dim() != 2 or name in (*IMAGE_FIELDS, "image_index"):   # pictures
            out[name] = t
        elif t.shape[1] == P + C:                                                  # (B, T): input_ids, attention
            out[name] = t[:, first:P + c]
        elif t.shape[1] == C:                                                      # (B, C): per-token fields
            out[name] = t[:, :c]
        else:
            raise ValueError(f"Experience field {name!r} is (B, {t.shape[1]}): neither (B, T) nor (B, C)")
    return Experience(**out)


def micro_batches(batch: Experience, size: int, loss_agg: str, norm_len: int = 0):
    """Yield (piece, weight) pairs covering the rows of batch; see the module docstring."""
    if size <= 0 or size >= len(batch):
        yield batch, 1.0
        return
    check_agg(loss_agg)
    lengths = batch.completion_mask.sum(-1)                                        # (B,)
    order = torch.argsort(lengths, descending=True, stable=True)                   # bucket by length
    for start in range(0, len(batch), size):
        rows = order[start:start + size]
        piece = trim(batch.select(rows))
        yield piece, float(split_weight(piece, batch, loss_agg, norm_len))


def check_agg(loss_agg: str):
    if loss_agg not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        raise ValueError(f"micro-batching does not know how to weight loss_agg {loss_agg!r}")


def split_weight(piece: Experience, whole: Experience, loss_agg: str, norm_len: int = 0):
    """The weight of a piece's loss in the whole's, for the aggregations above (a tensor for token-mean: no sync)."""
    if loss_agg == "token-mean":
        return piece.completion_mask.sum() / whole.completion_mask.sum().clamp(min=1)
    weight = len(piece) / len(whole)
    if loss_agg == "seq-mean-token-sum-norm" and not norm_len:      # it divides by the (trimmed) width
        weight *= piece.completion_mask.shape[1] / whole.completion_mask.shape[1]
    return weight


# ------------------------------------------------------------------------------------------ packed layout
def packed_micro_batches(batch: Experience, size: int, loss_agg: str, norm_len: int = 0):
    """Yield (piece, weight) pairs for pack=true: ceil(B / size) pieces of balanced real-token counts (greedy,
    longest row first into the lightest piece). Padding costs a packed forward nothing, so rows of any lengths
    can share a piece; balancing keeps the peak memory (the heaviest piece) near the mean."""
    if size <= 0 or size >= len(batch):
        yield batch, 1.0
        return
    check_agg(loss_agg)
    n = -(-len(batch) // size)
    tokens = batch.attention_mask.sum(-1).tolist()                                 # (B,) real tokens per row
    rows, load = [[] for _ in range(n)], [0] * n
    for r in sorted(range(len(batch)), key=lambda r: -tokens[r]):                  # stable: ties keep row order
        i = min(range(n), key=load.__getitem__)
        rows[i].append(r)
        load[i] += tokens[r]
    for r in rows:
        piece = trim(batch.select(torch.tensor(sorted(r), device=batch.input_ids.device)))
        yield piece, float(split_weight(piece, batch, loss_agg, norm_len))


@dataclass
class Packed:
    """A piece's real tokens as one sequence (what update.packed_completion feeds the policy)."""
    input_ids: Tensor      # (1, N) every real token (prompt, completion, observations), row after row
    position_ids: Tensor   # (1, N) 0, 1, ... within each row (rotary; mask-based attentions read the restarts)
    keep: Tensor           # (B, C) bool: the completion tokens in the loss (completion_mask 1)
    src: Tensor            # (M,) index into N of the token that predicts each kept one, in keep's row-major order
    cu_seqlens: Tensor     # (B + 1,) int32 where each row starts in N, then N: the varlen attention's sample bounds
    max_len: int           # the longest row's real tokens (a host int: the varlen kernel's tile count, no sync)

    def to(self, device) -> "Packed":
        return Packed(*(t.to(device, non_blocking=True) if torch.is_tensor(t) else t for t in vars(self).values()))


def pack(batch: Experience) -> Packed:
    """The padding-free layout of batch. Real tokens are attention_mask 1; a row's real tokens keep their order, so
    the positions (the count of real tokens before each) are those of the padded layout (models.position_ids)."""
    P = batch.prompt_len
    if P < 1:
        raise ValueError("pack needs a prompt column: the first completion token is predicted by the one before it")
    real = batch.attention_mask.bool()                                             # (B, T)
    where = torch.full(real.shape, -1, dtype=torch.long, device=real.device)       # (B, T) packed index, -1 = padding
    where[real] = torch.arange(int(real.sum()), device=real.device)
    keep = batch.completion_mask.bool()                                            # (B, C)
    src = where[:, P - 1:-1][keep]                                                 # (M,) each kept token's predecessor
    if bool((src < 0).any()):
        raise ValueError("a completion token in the loss follows a padding column (attention_mask 0): no real "
                         "token predicts it")
    pos = real.long().cumsum(-1) - 1                                               # (B, T)
    lengths = real.sum(-1)                                                         # (B,)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)      # (B + 1,)
    return Packed(batch.input_ids[real][None], pos[real][None], keep, src, cu, int(lengths.max()))
