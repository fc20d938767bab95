"""Per-token log-probs and entropies from logits, in one pass over the vocabulary.

    logits (N, V), targets (N,)  ->  logp (N,) = log softmax(logits / T)[target],  entropy (N,)

    from kernels.logprob import logprob_entropy, logprob_entropy_reference
    logp, ent = logprob_entropy(logits, targets, temperature, use_triton=True)   # fused, with backward

A target < 0 (e.g. -100) marks a padded token: its logp and entropy are 0 and it gets no gradient.
Layers, as in modded-nanogpt: Triton kernels (`_stats_kernel`, `_grad_kernel`) -> launchers
(`chunk_stats`, `chunk_grad`, which take a `use_triton` flag and have a torch twin each) ->
`autograd.Function` -> `logprob_entropy`. The launchers work on a block of vocabulary columns
starting at `col0` and keep a running (max, sum, shifted-sum) state per row, so
kernels/linear_logprob.py reuses them on logits chunks it never holds whole.

Math, with z = logits / T, p = softmax(z), lse = logsumexp(z):
    logp = z_y - lse        entropy = lse - E_p[z]
    d logp / dz = onehot(y) - p        d entropy / dz = -p * (z - E_p[z])
so the backward needs only lse and E_p[z] per row (saved by the forward) and re-reads the logits once.

`logprob_entropy_reference` is the plain PyTorch ground truth: it materialises the (N, V) softmax in
float32 (the memory wall the kernels avoid); the loop uses it on CPU.
"""
import torch
from torch import Tensor

try:  # triton is optional: without it (or off CUDA without TRITON_INTERPRET=1) the torch twins run
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_TRITON = False

# Vocabulary columns per kernel step, and warps per program: enough to read a logits tile near the card's memory
# bandwidth; larger steps were no faster (measured: docs/kernels.md, "Log-prob passes"). SPLIT: programs per row
# (each takes a contiguous column range), so that a chunk of ~1k rows fills the card in whole waves (to be measured
# at W2's H=896 chunk: docs/kernels.md, "W2 at H=896"). chunk_stats's running state always uses one per row.
LAUNCH = dict(BLOCK=4096, num_warps=8, SPLIT=1)


def _launch(n_cols: int, split: int = 1) -> tuple[int, int, dict]:
    """(columns per program, programs per row, kernel settings) for rows of n_cols columns."""
    block = min(LAUNCH["BLOCK"], triton.next_power_of_2(triton.cdiv(n_cols, split)))
    per = triton.cdiv(triton.cdiv(n_cols, split), block) * block   # a multiple of BLOCK: aligned, unmasked steps
    return per, triton.cdiv(n_cols, per), dict(BLOCK=block, num_warps=max(1, min(LAUNCH["num_warps"], block // 512)))


def logprob_entropy_reference(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    valid = targets >= 0                                          # (N,)
    logits = logits.float() / temperature                         # (N, V)
    logp_all = torch.log_softmax(logits, dim=-1)                  # (N, V)
    logp = logp_all.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (N,)
    p = logp_all.exp()
    entropy = -torch.where(p > 0, p * logp_all, 0).sum(-1)        # (N,) 0*log0 = 0 for masked vocab
    return torch.where(valid, logp, 0), torch.where(valid, entropy, 0)


if HAS_TRITON:
    @triton.jit
    def _stats_kernel(x_ptr, stride_x, tgt_ptr, m_ptr, s_ptr, t_ptr, zy_ptr, n_cols, col0, inv_t, per,
                      FRESH: tl.constexpr, BLOCK: tl.constexpr):
        # program (row, j) folds columns [j * per, (j + 1) * per) of its row into state slot row * S + j (S = grid
        # dim 1); state: m = running max of z, s = sum exp(z - m), t = sum exp(z - m) * (z - m), zy = target's z.
        # FRESH: start from the empty state instead of loading one (the buffers may then be uninitialised)
        row = tl.program_id(0).to(tl.int64)
        slot = row * tl.num_programs(1) + tl.program_id(1)
        x_row = x_ptr + row * stride_x
        c0 = tl.program_id(1) * per
        c1 = tl.minimum(c0 + per, n_cols)
        if FRESH:
            m = tl.full([], -float("inf"), tl.float32)
            s = tl.full([], 0.0, tl.float32)
            t = tl.full([], 0.0, tl.float32)
        else:
            m = tl.load(m_ptr + slot)
            s = tl.load(s_ptr + slot)
            t = tl.load(t_ptr + slot)
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(x_row + cols, mask=cols < c1, other=-float("inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(z, 0))
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # an all -inf prefix must not give nan
            alpha = tl.exp(m - shift)
            e = tl.exp(z - shift)
            dm = tl.where(alpha > 0, m - shift, 0.0)               # finite even when m is still -inf
            t = alpha * (t + dm * s) + tl.sum(e * tl.where(e > 0, z - shift, 0.0), 0)
            s = alpha * s + tl.sum(e, 0)
            m = m_new
        tl.store(m_ptr + slot, m)
        tl.store(s_ptr + slot, s)
        tl.store(t_ptr + slot, t)
        tgt = tl.load(tgt_ptr + row)
        here = (tgt >= col0 + c0) & (tgt < col0 + c1)
        zy = tl.load(x_row + tl.where(here, tgt - col0, 0)).to(tl.float32) * inv_t
        if FRESH:
            tl.store(zy_ptr + slot, tl.where(here, zy, 0.0))
        else:
            tl.store(zy_ptr + slot, tl.where(here, zy, tl.load(zy_ptr + slot)))

    @triton.jit
    def _finish_kernel(part_ptr, tgt_ptr, out_ptr, n, S, BLOCK_S: tl.constexpr):
        # part (4, n, S): each row's S partial states (m, s, t, zy) from _stats_kernel -> out (4, n): logp, entropy,
        # lse, E[z], as finish_stats computes them from one merged state
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK_S)
        ok = k < S
        at = part_ptr + row * S + k
        pm = tl.load(at, mask=ok, other=-float("inf"))
        ps = tl.load(at + n * S, mask=ok, other=0.0)
        pt = tl.load(at + 2 * n * S, mask=ok, other=0.0)
        zy = tl.sum(tl.load(at + 3 * n * S, mask=ok, other=0.0), 0)  # only the target's slot is not 0
        m = tl.max(pm, 0)
        shift = tl.where(m == -float("inf"), 0.0, m)
        alpha = tl.exp(pm - shift)                                 # (BLOCK_S,) rebase each part onto the row max
        s = tl.sum(alpha * ps, 0)
        t = tl.sum(alpha * (pt + tl.where(alpha > 0, pm - shift, 0.0) * ps), 0)
        valid = tl.load(tgt_ptr + row) >= 0
        lse = m + tl.log(s)
        tl.store(out_ptr + row, tl.where(valid, zy - lse, 0.0))
        tl.store(out_ptr + n + row, tl.where(valid, tl.log(s) - t / s, 0.0))
        tl.store(out_ptr + 2 * n + row, lse)
        tl.store(out_ptr + 3 * n + row, m + t / s)

    @triton.jit
    def _grad_kernel(x_ptr, stride_x, g_ptr, stride_g, tgt_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr,
                     n_cols, col0, inv_t, per, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        # d loss / d logits = (g_logp * (onehot - p) - g_ent * p * (z - E[z])) / T; g may alias x.
        # Program (row, j) writes columns [j * per, (j + 1) * per) of its row.
        row = tl.program_id(0).to(tl.int64)
        c0 = tl.program_id(1) * per
        c1 = tl.minimum(c0 + per, n_cols)
        tgt = tl.load(tgt_ptr + row)
        valid = tgt >= 0
        lse = tl.load(lse_ptr + row)
        glp = tl.where(valid, tl.load(glp_ptr + row), 0.0)
        if HAS_ENT:
            gent = tl.where(valid, tl.load(gent_ptr + row), 0.0)
            ez = tl.load(ez_ptr + row)
        local_t = tgt - col0
        for start in range(c0, c1, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < c1
            z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
            p = tl.exp(z - lse)
            g = glp * (tl.where(cols == local_t, 1.0, 0.0) - p)
            if HAS_ENT:
                g -= gent * p * tl.where(p > 0, z - ez, 0.0)      # masked vocab (z = -inf) has p = 0
            tl.store(g_ptr + row * stride_g + cols, (g * inv_t).to(g_ptr.dtype.element_ty), mask=mask)


def new_state(n: int, device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty running state for n rows: (max, sum, shifted sum, target logit), all float32 (n,)."""
    m = torch.full((n,), -float("inf"), dtype=torch.float32, device=device)
    return m, torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)


def chunk_stats(x: Tensor, targets: Tensor, state, col0: int, inv_t: float, use_triton: bool):
    """Fold logits columns [col0, col0 + x.shape[1]) of each row into the running state (in place)."""
    m, s, t, zy = state
    if use_triton:
        per, _, kw = _launch(x.shape[1])                           # one program per row: the state is per row
        _stats_kernel[(x.shape[0], 1)](x, x.stride(0), targets, m, s, t, zy, x.shape[1], col0, inv_t, per,
                                       FRESH=False, **kw)
        return
    z = x.float() * inv_t                                          # (n, v)
    m_new = torch.maximum(m, z.max(-1).values)                     # (n,)
    shift = torch.where(m_new == -float("inf"), 0.0, m_new)        # (n,)
    alpha = torch.exp(m - shift)                                   # (n,)
    e = torch.exp(z - shift[:, None])                              # (n, v)
    dm = torch.where(alpha > 0, m - shift, 0.0)                    # finite even when m is still -inf
    t.copy_(alpha * (t + dm * s) + (e * torch.where(e > 0, z - shift[:, None], 0.0)).sum(-1))
    s.copy_(alpha * s + e.sum(-1))
    m.copy_(m_new)
    here = (targets >= col0) & (targets < col0 + x.shape[1])       # (n,)
    idx = (targets - col0).clamp(0, x.shape[1] - 1)
    zy.copy_(torch.where(here, z.gather(1, idx[:, None]).squeeze(1), zy))


def finish_stats(state, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Running state -> (logp, entropy, lse, E[z]), each (n,) float32; padded tokens get logp = entropy = 0."""
    m, s, t, zy = state
    lse = m + torch.log(s)
    ez = m + t / s
    valid = targets >= 0
    logp = torch.where(valid, zy - lse, 0.0)
    entropy = torch.where(valid, torch.log(s) - t / s, 0.0)   # lse - E[z] without the large m cancelling
    return logp, entropy, lse, ez


def row_stats(x: Tensor, targets: Tensor, inv_t: float, use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Whole rows of logits x (n, V) -> (logp, entropy, lse, E[z]), each (n,) float32, as chunk_stats from a fresh
    state + finish_stats give them, in two launches (LAUNCH["SPLIT"] programs per row, then a merge per row)
    instead of ~15 small ones: at W2's 26 chunks those small kernels are ~1 ms of the step (to be measured)."""
    if not use_triton:
        state = new_state(x.shape[0], x.device)
        chunk_stats(x, targets, state, 0, inv_t, False)
        return finish_stats(state, targets)
    n = x.shape[0]
    per, split, kw = _launch(x.shape[1], LAUNCH["SPLIT"])
    part = torch.empty(4, n, split, dtype=torch.float32, device=x.device)     # m, s, t, zy per (row, split)
    _stats_kernel[(n, split)](x, x.stride(0), targets, part[0], part[1], part[2], part[3], x.shape[1], 0, inv_t,
                              per, FRESH=True, **kw)
    out = torch.empty(4, n, dtype=torch.float32, device=x.device)             # logp, entropy, lse, E[z]
    _finish_kernel[(n,)](part, targets, out, n, split, BLOCK_S=triton.next_power_of_2(split))
    return out[0], out[1], out[2], out[3]


def chunk_grad(x: Tensor, out: Tensor, targets: Tensor, lse: Tensor, ez: Tensor, g_logp: Tensor,
               g_ent, col0: int, inv_t: float, use_triton: bool):
    """d loss / d logits for columns [col0, col0 + x.shape[1]) into out (may be x itself)."""
    if use_triton:
        has_ent = g_ent is not None
        per, split, kw = _launch(x.shape[1], LAUNCH["SPLIT"])
        _grad_kernel[(x.shape[0], split)](x, x.stride(0), out, out.stride(0), targets, lse, ez, g_logp,
                                          g_ent if has_ent else g_logp, x.shape[1], col0, inv_t, per,
                                          HAS_ENT=has_ent, **kw)
        return
    valid = targets >= 0
    z = x.float() * inv_t                                          # (n, v)
    p = torch.exp(z - lse[:, None])                                # (n, v)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == (targets - col0)[:, None]
    g = torch.where(valid, g_logp, 0.0)[:, None] * (onehot.float() - p)
    if g_ent is not None:
        g -= torch.where(valid, g_ent, 0.0)[:, None] * p * torch.where(p > 0, z - ez[:, None], 0.0)
    out.copy_(g * inv_t)


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, use_triton):
        state = new_state(logits.shape[0], logits.device)
        ctx.set_materialize_grads(False)                           # an unused output's gradient stays None
        chunk_stats(logits, targets, state, 0, 1.0 / temperature, use_triton)
        logp, entropy, lse, ez = finish_stats(state, targets)
        ctx.save_for_backward(logits, targets, lse, ez)
        ctx.temperature, ctx.use_triton = temperature, use_triton
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ez = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        grad = torch.empty_like(logits)                            # (N, V)
        chunk_grad(logits, grad, targets, lse, ez, g_logp, g_ent, 0, 1.0 / ctx.temperature, ctx.use_triton)
        return grad, None, None, None


def into_grad_of(weight: Tensor, into_grad: bool) -> Tensor | None:
    """The Parameter whose .grad a backward may fill directly (into_grad, see kernels/linear_logprob.py), or None."""
    return weight if into_grad and weight.is_leaf and weight.requires_grad else None


def hand_to_grad(param: Tensor, grad: Tensor) -> None:
    """param.grad += grad (or = grad when it has none); a no-op when grad already is param.grad. Returns None:
    what the backward then hands autograd for that weight."""
    if param.grad is None:
        param.grad = grad
    elif grad is not param.grad:
        param.grad.add_(grad)


def check_linear_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, min_dim: int = 1):
    """hidden (..., H) with at least min_dim dims, weight (V, H) of the same dtype, targets shaped like hidden
    without H: one-line errors naming what does not match."""
    if hidden.dim() < min_dim or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., H) and weight (V, H) do not match: {tuple(hidden.shape)} vs {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one of them")
    if not hidden.is_floating_point() or 0 in weight.shape:
        raise ValueError(f"hidden and weight must be float with V, H >= 1, got {hidden.dtype} weight "
                         f"{tuple(weight.shape)}")
    if len({hidden.device, weight.device, targets.device}) > 1:
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device}, "
                         f"{targets.device}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)} without H")


def check_inputs(targets: Tensor, vocab: int, temperature: float, n_rows: int, also: Tensor | None = None) -> list:
    """One-line errors for targets the kernels cannot take. also: an int tensor (k,) the caller needs on the host,
    read back in the same sync as the targets' range check (one sync per call, not two); -> its values."""
    if targets.shape != (n_rows,):
        raise ValueError(f"targets have shape {tuple(targets.shape)}, expected ({n_rows},)")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32 or int64, got {targets.dtype}")
    if not 0 < temperature < float("inf"):   # inf would scale the kernels' masked -inf columns to nan
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if vocab < 1:
        raise ValueError(f"the vocabulary must have at least one column, got {vocab}")
    if not targets.numel():
        return [] if also is None else also.reshape(-1).tolist()
    parts = [targets.max().view(1).long()] + ([] if also is None else [also.reshape(-1).long()])
    hi, *rest = torch.cat(parts).tolist()                 # one host sync; a bad id would read out of bounds
    if hi >= vocab:
        raise ValueError(f"target id {hi} is out of range for a vocabulary of {vocab}")
    return rest


def logprob_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                    use_triton: bool = True) -> tuple[Tensor, Tensor]:
    """Fused version of logprob_entropy_reference; logits (N, V) any float dtype, targets (N,)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point() or logits.device != targets.device:
        raise ValueError(f"logits must be float and on targets' device, got {logits.dtype} on {logits.device}, "
                         f"targets on {targets.device}")
    check_inputs(targets, logits.shape[1], temperature, logits.shape[0])
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _LogprobEntropy.apply(logits, targets.contiguous(), float(temperature), use_triton and HAS_TRITON)
