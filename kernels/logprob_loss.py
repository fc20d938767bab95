"""A loss straight from hidden states, its gradient computed in the forward: three matmuls of N*V*H, not four.

    from kernels.logprob_loss import linear_logprob_loss
    def loss_fn(rows, logp, entropy):           # rows: a slice of dim 0; logp, entropy (b, C) float32
        return -(logp * adv[rows]).sum() / n_tokens - 0.01 * (entropy * mask[rows]).sum() / n_tokens
    loss, logp, ent = linear_logprob_loss(hidden (B, C, H), weight (V, H), targets (B, C), temperature, loss_fn)
    loss.backward()                              # hidden.grad, weight.grad: computed above, only scaled here

When it applies: the loss is a sum over rows (dim 0: sequences; or tokens, for hidden (N, H)) of a function
of that row's log-probs and entropies alone, everything else in it (advantages, old / reference log-probs,
masks, normalisers such as the batch's token count) known before the call. GRPO, DAPO, GSPO, PPO-clip,
RLOO, REINFORCE++ and KL-in-the-loss all are. loss_fn's only differentiable inputs are logp and entropy:
a gradient into any other tensor it touches is dropped. A loss that mixes rows through the policy's own
log-probs (a batch mean of logp, say) is not a sum over rows: take linear_logprob_entropy and autograd.

How: rows are grouped into chunks whose (tokens x V) logits fit `chunk_bytes`, of at most MAX_CHUNK_TOKENS
tokens; padded tokens (target < 0) are left out of the matmuls and count for nothing. Per chunk:
  1. logits = h @ W.T                       cuBLAS, into one reused (n, V) buffer in the input dtype
  2. lse, E[z], logp, entropy per token     Triton pass over the buffer (kernels/logprob.py row_stats)
  3. loss_fn on (b, C) leaf tensors; torch.autograd.grad gives d loss / d logp and d loss / d entropy
  4. G = d loss / d logits                  Triton pass, in place over the logits (chunk_grad)
  5. d h = G @ W,  d W (+)= G.T @ h         cuBLAS
Backward only multiplies the stored gradients by the upstream scalar (a no-op for loss.backward()).
Against linear_logprob_entropy (recompute in backward) this drops one N*V*H matmul, and it needs the whole
vocabulary of a token at once, which is why chunks are whole rows x V and not tiles.

Memory above the inputs and the two gradients: one logits buffer (<= chunk_bytes, unless one row alone is
larger: then that row is the chunk) plus O(tokens) vectors. d W adds up over chunks: in a float32 copy
when V * H * 4 fits chunk_bytes too, else in the weight's dtype through cuBLAS addmm (float32 products,
rounded to bf16 once per chunk: the error that adds is below what bf16 logits already cost;
tools/kernel_bench.py measures it).

Speed: the three cuBLAS matmuls are most of the time, and the Triton passes between them are the rest.
Running the passes on a side stream beside a matmul hid nothing (presumably cuBLAS holds every SM), so they
run in order. Measured against torch.compile and Liger (W2, docs/benchmarks.md): docs/kernels.md.

loss_fn should not sync with the host (.item()): every sync stalls the chunk pipeline. logp and entropy
come back detached, shaped like targets, 0 on padded tokens (for metrics). `use_triton=False` runs the same
loop with the torch twins of the kernels (the CPU path); kernels/__init__.py picks one by the tensors' device.
"""
import torch
from torch import Tensor

from kernels.logprob import (HAS_TRITON, check_inputs, check_linear_inputs, chunk_grad, hand_to_grad, into_grad_of,
                             row_stats)

CHUNK_BYTES = 480 * 2**20  # one (tokens x V) logits buffer: W2 (docs/benchmarks.md) stays < 0.5 GiB extra
# Tokens per chunk at most, whatever the budget: fewer chunks mean fewer read-modify-writes of the (V, H) d W,
# which pays at H=896 up to 1,536 tokens; at H=4096 the budget would give 1,792 tokens, measured slower
# (docs/kernels.md, "W2 and W9 at H=896 in interleaved rounds").
MAX_CHUNK_TOKENS = 1536


def budget_tokens(V: int, itemsize: int, chunk_bytes: int) -> int:
    """Valid tokens a chunk may hold: its (tokens, V) logits buffer within chunk_bytes, at most MAX_CHUNK_TOKENS."""
    return max(1, min(MAX_CHUNK_TOKENS, chunk_bytes // (V * itemsize)))


def plan_chunks(counts: list[int], budget_tokens: int, rows_per_chunk: int | None = None) -> list[tuple[int, int]]:
    """Row ranges [r0, r1): whole rows, as many as keep a chunk's valid tokens within budget_tokens
    (counts[i] = valid tokens of row i); a row over the budget alone is a chunk by itself."""
    B = len(counts)
    if rows_per_chunk is not None:
        return [(r, min(r + rows_per_chunk, B)) for r in range(0, B, rows_per_chunk)]
    chunks, r0, held = [], 0, 0
    for r, c in enumerate(counts):
        if r > r0 and held + c > budget_tokens:
            chunks.append((r0, r))
            r0, held = r, 0
        held += c
    return chunks + [(r0, B)] if B else []


def chunked_loss(hidden, weight, targets, rows_shape, temperature, loss_fn, chunks, keep, use_triton,
                 need_h, need_w, acc_f32):
    """The loop (see top): (loss (), logp (N,), entropy (N,), d hidden (N, H) or None, d weight (V, H) or None).
    hidden (N, H), targets (N,) flat; rows_shape: targets' own shape (B, C, ...); keep (M,): the valid tokens,
    None when all are; chunks: (r0, r1, k0, k1) = rows [r0, r1) and their valid tokens keep[k0:k1]."""
    (N, H), V = hidden.shape, weight.shape[0]
    per_row = N // max(rows_shape[0], 1)
    inv_t = 1.0 / temperature
    pieces, parts = [], []                                         # per chunk: (logp, entropy) (b*C,) each; loss ()
    grad_h = (torch.empty_like(hidden) if keep is None else torch.zeros_like(hidden)) if need_h else None
    w_dtype = torch.float32 if acc_f32 else weight.dtype
    grad_w = torch.empty(V, H, dtype=w_dtype, device=weight.device) if need_w else None
    w_started = False                                              # the first product overwrites: no zero fill
    most = max((k1 - k0 for *_, k0, k1 in chunks), default=0)
    buf = hidden.new_empty(most * V)                               # logits, then G, one chunk at a time
    for r0, r1, k0, k1 in chunks:
        t0, t1, m = r0 * per_row, r1 * per_row, k1 - k0
        if keep is None:                                           # every token valid: views, no copies
            h, tgt, idx = hidden[t0:t1], targets[t0:t1], None
        else:
            idx = keep[k0:k1]                                      # (m,) valid tokens of these rows
            h, tgt = hidden.index_select(0, idx), targets.index_select(0, idx)   # (m, H), (m,)
        if m:
            logits = torch.mm(h, weight.T, out=buf[: m * V].view(m, V))        # (m, V)
            lp_m, en_m, lse, ez = row_stats(logits, tgt, inv_t, use_triton)   # (m,) each
        if idx is None and m:                                      # the statistics' own fresh buffers: no copy
            lp_c, en_c = lp_m, en_m                                # (b*C,) each
        else:                                                      # padded tokens get 0
            lp_c, en_c = (hidden.new_zeros(t1 - t0, dtype=torch.float32) for _ in range(2))
            if m:
                lp_c.index_copy_(0, idx - t0, lp_m)
                en_c.index_copy_(0, idx - t0, en_m)
        pieces.append((lp_c, en_c))
        track = m > 0 and (need_h or need_w)
        # the loss's leaves are the outputs' own chunks, so that no copy is made per chunk; with autograd on, an
        # in-place change to a leaf is an error, and without it the loss gets copies: it cannot corrupt the outputs
        lp, en = (x.detach().view(r1 - r0, *rows_shape[1:]) for x in (lp_c, en_c))               # (b, C)
        lp, en = (x.requires_grad_() if track else x.clone() for x in (lp, en))
        with torch.set_grad_enabled(track):                        # autograd.Function.forward runs without it
            part = loss_fn(slice(r0, r1), lp, en)
            if not isinstance(part, Tensor) or part.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(part, 'shape', type(part))}")
            wanted = track and part.requires_grad
            g_lp, g_en = torch.autograd.grad(part, (lp, en), allow_unused=True) if wanted else (None, None)
        parts.append(part.detach())
        if g_lp is None and g_en is None:                          # no gradient from these rows
            if need_h and idx is None:
                grad_h[t0:t1].zero_()                              # (allocated empty when nothing is padded)
            continue
        local = slice(None) if idx is None else idx - t0           # valid tokens within the chunk's rows
        g_lp = torch.zeros(m, device=hidden.device) if g_lp is None else g_lp.reshape(-1)[local].float().contiguous()
        g_en = None if g_en is None else g_en.reshape(-1)[local].float().contiguous()             # (m,)
        chunk_grad(logits, logits, tgt, lse, ez, g_lp, g_en, 0, inv_t, use_triton)   # logits -> G, in place
        if need_h:
            if idx is None:
                torch.mm(logits, weight, out=grad_h[t0:t1])        # (m, H)
            else:
                grad_h.index_copy_(0, idx, torch.mm(logits, weight))
        if need_w:
            if w_dtype == logits.dtype:                            # cuBLAS: float32 products, one rounding here
                if w_started:
                    grad_w.addmm_(logits.T, h)                     # (V, H)
                else:
                    torch.mm(logits.T, h, out=grad_w)
            elif w_started:
                grad_w.add_(torch.mm(logits.T, h))                 # float32 accumulator (it fit the budget, so
            else:                                                  # does this (V, H) product)
                grad_w.copy_(torch.mm(logits.T, h))
            w_started = True
    if need_w and not w_started:
        grad_w.zero_()
    if need_w and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    # one launch each for the whole call, not one per chunk (chunks cover the rows in order)
    total = torch.stack([p.float() for p in parts]).sum() if parts else torch.zeros((), device=hidden.device)
    logp, ent = (torch.cat([p[i] for p in pieces]) if pieces else hidden.new_zeros(0, dtype=torch.float32)
                 for i in range(2))
    return total, logp.view(rows_shape), ent.view(rows_shape), grad_h, grad_w


class _LinearLogprobLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows_shape, temperature, loss_fn, chunks, keep, use_triton, acc_f32,
                into_grad):
        ctx.set_materialize_grads(False)
        ctx.param = into_grad_of(weight, into_grad)
        total, logp, ent, grad_h, grad_w = chunked_loss(hidden, weight, targets, rows_shape, temperature, loss_fn,
                                                        chunks, keep, use_triton, *ctx.needs_input_grad[:2], acc_f32)
        ctx.grads = [grad_h, grad_w]
        ctx.mark_non_differentiable(logp, ent)
        return total, logp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_ent):
        if ctx.grads is None:
            raise RuntimeError("linear_logprob_loss hands its gradients over once; a second backward is not supported")
        grad_h, grad_w = ctx.grads
        ctx.grads = None      # drop our references: autograd can then keep the tensors as .grad without a copy
        rest = (None,) * 9                                         # targets ... into_grad
        if g_loss is None:
            return (None, None) + rest
        for g in (grad_h, grad_w):   # always: testing g_loss != 1 first would stall the host on the GPU
            if g is not None:
                g.mul_(g_loss.to(g.dtype))
        if grad_w is not None and ctx.param is not None:   # into_grad: .grad has it now, autograd gets None
            grad_w = hand_to_grad(ctx.param, grad_w)
        return (grad_h, grad_w) + rest


def linear_logprob_loss(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, loss_fn,
                        rows_per_chunk: int | None = None, use_triton: bool = True,
                        chunk_bytes: int = CHUNK_BYTES, into_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """hidden (B, ..., H), weight (V, H), targets (B, ...) -> (loss (), logp, entropy (B, ...) float32).
    loss_fn(rows: slice, logp (b, ...), entropy (b, ...)) -> scalar: rows' share of the loss (see top).
    into_grad: the backward adds weight's gradient into weight.grad itself, as in linear_logprob_entropy."""
    check_linear_inputs(hidden, weight, targets, min_dim=2)                        # rows: hidden is (B, ..., H)
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable (rows, logp, entropy) -> scalar, got {type(loss_fn).__name__}")
    if rows_per_chunk is not None and not (isinstance(rows_per_chunk, int) and rows_per_chunk > 0):
        raise ValueError(f"rows_per_chunk must be a positive int or None, got {rows_per_chunk!r}")
    rows_shape, V = tuple(targets.shape), weight.shape[0]
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]).contiguous(), targets.reshape(-1).contiguous()  # (N, H), (N,)
    if flat_t.numel() == 0:
        raise ValueError(f"linear_logprob_loss needs at least one token; targets have shape {rows_shape}")
    valid = targets.reshape(rows_shape[0], -1) >= 0                # (B, C)
    counts = check_inputs(flat_t, V, temperature, flat_h.shape[0], also=valid.sum(1))   # chunking needs the counts
    keep = None if sum(counts) == flat_t.numel() else valid.reshape(-1).nonzero().squeeze(1)   # (M,)
    budget = budget_tokens(V, flat_h.element_size(), chunk_bytes)
    chunks, k = [], 0
    for r0, r1 in plan_chunks(counts, budget, rows_per_chunk):
        n = sum(counts[r0:r1])
        chunks.append((r0, r1, k, k + n))
        k += n
    weight = weight.contiguous()
    # several chunks add into each weight row: in float32 when that copy fits the logits budget too
    acc_f32 = V * flat_h.shape[1] * 4 <= chunk_bytes and len(chunks) > 1
    args = (flat_t, rows_shape, float(temperature), loss_fn, chunks, keep, use_triton and HAS_TRITON)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, logp, ent = _LinearLogprobLoss.apply(flat_h, weight, *args, acc_f32, into_grad)
        return loss, logp, ent
    # values only (metrics, evaluation): no gradient matmuls, and loss_fn runs without autograd
    return chunked_loss(flat_h, weight, *args, False, False, False)[:3]
