"""linear_logprob_loss (gradient computed in the forward) against float64 autograd of the same loss.

    .venv/bin/python -m pytest tests/test_kernel_loss.py -q

Tiers as in tests/test_kernels.py: the torch twins in this process; the Triton kernels under
TRITON_INTERPRET=1 on CPU in a subprocess; CUDA at full vocabularies (skipped without a GPU).
Every check draws fresh random inputs and compares loss, logp, entropy, hidden.grad and weight.grad by
relative L2 error: <= 1e-4 for float32 inputs, <= 1e-2 for bf16. The losses use logp and entropy
nonlinearly (PPO's clipped ratio, GSPO's per-sequence ratio, squared entropies), rows of different
lengths, a fully padded row, temperature != 1 and several chunks.
"""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.logprob_loss import linear_logprob_loss, plan_chunks  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402
from kernels import logprob  # noqa: E402
from kernels.logprob import logprob_entropy_reference  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
CLIP = (0.8, 1.2)


def rel(a, b):
    assert torch.isfinite(a).all(), "non-finite values in the fused result"
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def away_from_clip(log_r):
    """Push log-ratios at least 0.05 away from log(clip bounds): bf16 rounding must not flip a clip branch."""
    for edge in map(math.log, CLIP):
        near = (log_r - edge).abs() < 0.05
        log_r = torch.where(near, edge + 0.1 * torch.sign(log_r - edge + 1e-9), log_r)
    return log_r


def make_loss(kind, ref_logp, targets):
    """loss_fn(rows, logp (b, C), entropy (b, C)) -> scalar, with its constants drawn from the float64
    reference's log-probs (so ratios land on both sides of the clip range)."""
    B, C = targets.shape
    mask = (targets >= 0).float()                                 # (B, C)
    n_tok = mask.sum().clamp(min=1)                               # batch-wide normaliser, known in advance
    adv = torch.randn(B, 1) * mask                                # (B, C) one advantage per sequence
    # logp < 0 < entropy: these signs keep each row's terms from cancelling, so the loss's relative error means
    # something; the gradients get both signs from the PPO / GSPO advantages
    a, b = -(torch.rand(B, C) + 0.5), torch.rand(B, C) + 0.5
    if kind == "linear":                                          # tools/bench.py's loss
        return lambda rows, lp, en: (lp * a[rows] + en * b[rows]).sum()
    if kind == "logp_only":                                       # no entropy gradient: the kernel's other branch
        return lambda rows, lp, en: (lp * a[rows]).sum()
    if kind == "ppo":                                             # token-level clip, k3 KL, squared entropy
        old = (ref_logp.float() - away_from_clip(torch.randn(B, C) * 0.3)) * mask
        ref = ref_logp.float() + torch.randn(B, C) * 0.2

        def ppo(rows, lp, en):
            m = mask[rows]
            r = torch.exp(lp - old[rows])
            per_tok = torch.maximum(-adv[rows] * r, -adv[rows] * r.clamp(*CLIP))
            kl = torch.exp(ref[rows] - lp) - (ref[rows] - lp) - 1
            return ((per_tok + 0.05 * kl - 0.01 * en + 0.05 * en ** 2) * m).sum() / n_tok
        return ppo
    if kind == "gspo":                                            # whole-sequence ratio: needs whole rows per chunk
        d = away_from_clip(torch.randn(B, 1) * 0.3)                # per-row mean log-ratio, off the clip edges
        jitter = torch.randn(B, C) * 0.3 * mask
        jitter = (jitter - (jitter.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))) * mask
        old = (ref_logp.float() - d - jitter) * mask
        adv_seq = adv[:, :1]                                      # (B, 1)

        def gspo(rows, lp, en):
            m = mask[rows]
            n = m.sum(1, keepdim=True).clamp(min=1)
            s = torch.exp(((lp - old[rows]) * m).sum(1, keepdim=True) / n)   # (b, 1)
            per_seq = torch.maximum(-adv_seq[rows] * s, -adv_seq[rows] * s.clamp(*CLIP))
            return per_seq.sum() / B + 0.1 * (((en * m).sum(1, keepdim=True) / n) ** 2).sum() / B
        return gspo
    raise ValueError(kind)


def make_targets(B, C, V, device="cpu"):
    t = torch.randint(0, V, (B, C))
    lengths = torch.randint(1, C + 1, (B,))
    t[torch.arange(C)[None, :] >= lengths[:, None]] = -1           # right padding, rows of different lengths
    if B > 2:
        t[1] = -1                                                 # a row with no token at all
    return t.to(device)


def check_loss(use_triton, kind="ppo", B=7, C=11, V=301, H=24, dtype=torch.float32, temperature=0.7,
               device="cpu", tied=False, pad=True, chunk_bytes=None, rows_per_chunk=None, into_grad=False):
    w = (torch.randn(V, H, device=device) / math.sqrt(H)).to(dtype).requires_grad_()
    t = make_targets(B, C, V, device) if pad else torch.randint(0, V, (B, C), device=device)
    if tied:  # the lm_head is the embedding: its gradient arrives by two paths
        ids = torch.randint(0, V, (B, C), device=device)
        h = torch.nn.functional.embedding(ids, w) * 2.0
    else:
        h = torch.randn(B, C, H, device=device).to(dtype).requires_grad_()
    w64 = w.detach().double().requires_grad_()
    h64 = torch.nn.functional.embedding(ids, w64) * 2.0 if tied else h.detach().double().requires_grad_()
    rl, re = logprob_entropy_reference((h64 @ w64.T).view(-1, V), t.view(-1), temperature)
    rl, re = rl.view(B, C), re.view(B, C)
    loss_fn = make_loss(kind, rl.detach().cpu(), t.cpu())
    on = lambda f: (lambda rows, lp, en: f(rows, lp.cpu(), en.cpu()))      # noqa: E731  constants live on the CPU
    ref = on(loss_fn)(slice(0, B), rl, re)
    ref.backward()
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    for _ in range(2 if into_grad else 1):   # into_grad: twice, as gradient accumulation does
        if tied:
            h = torch.nn.functional.embedding(ids, w) * 2.0
        loss, lp, en = linear_logprob_loss(h, w, t, temperature, on(loss_fn), rows_per_chunk, use_triton=use_triton,
                                           into_grad=into_grad, **kw)
        assert not lp.requires_grad and lp.shape == t.shape and lp.dtype == torch.float32
        loss.backward()
    if into_grad:
        w64.grad *= 2
        if not tied:
            h64.grad *= 2
    tol = TOL[dtype]
    # the loss against the sum of its rows' sizes: rows of different advantage signs may cancel in the total
    scale = sum(on(loss_fn)(slice(r, r + 1), rl[r:r + 1], re[r:r + 1]).abs() for r in range(B))
    errs = {"loss": (loss.double() - ref).abs().item() / scale.item(), "logp": rel(lp, rl), "entropy": rel(en, re), "d_weight": rel(w.grad, w64.grad)}
    if not tied:
        errs["d_hidden"] = rel(h.grad, h64.grad)
        assert (h.grad[t < 0] == 0).all(), "padded tokens got a gradient"
    assert max(errs.values()) < tol, (kind, dtype, errs)
    assert (lp[t < 0] == 0).all() and (en[t < 0] == 0).all()


def check_all(use_triton):
    """Every case; run with the torch twins here and with interpreted Triton below. Seeded (and the global
    generator given back): bf16's d weight sits near its 1e-2 band, and some draws crossed it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        _check_all(use_triton)


def _check_all(use_triton):
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("linear", "logp_only", "ppo", "gspo"):
            check_loss(use_triton, kind, dtype=dtype, rows_per_chunk=2)          # several chunks, odd B, C, V, H
        check_loss(use_triton, "ppo", dtype=dtype, tied=True, chunk_bytes=2 * 11 * 301 * 4)  # budget: ~2 rows
        check_loss(use_triton, "gspo", dtype=dtype, pad=False, chunk_bytes=1)    # one row per chunk, no padding
    check_loss(use_triton, "ppo", B=3, C=4, V=130, H=7, temperature=1.3)       # one chunk; float32 d weight
    check_loss(use_triton, "ppo", tied=True, rows_per_chunk=2, into_grad=True)  # the head's gradient into .grad
    check_loss(use_triton, "linear", dtype=torch.bfloat16, rows_per_chunk=2, into_grad=True)
    check_loss(use_triton, "linear", B=4, C=1, V=257, H=5, rows_per_chunk=3)   # a token per row
    old = dict(logprob.LAUNCH)
    logprob.LAUNCH.update(BLOCK=32, SPLIT=4)                      # several programs per row: partial states merged
    try:
        check_loss(use_triton, "ppo", dtype=torch.bfloat16, rows_per_chunk=2)
        check_loss(use_triton, "gspo", V=130, rows_per_chunk=3)   # 130 columns: a split with no full step
    finally:
        logprob.LAUNCH.update(old)


def test_torch_twins_match_reference():
    check_all(use_triton=False)


def test_triton_interpreted_on_cpu():
    run_interpreted("import tests.test_kernel_loss as t; t.check_all(use_triton=True); print('ok')")


def test_plan_chunks_hand_derived():
    assert plan_chunks([3, 3, 3, 3], 6) == [(0, 2), (2, 4)]
    assert plan_chunks([3, 0, 9, 2, 2], 6) == [(0, 2), (2, 3), (3, 5)]      # a row over the budget goes alone
    assert plan_chunks([5, 5, 5], 100, rows_per_chunk=2) == [(0, 2), (2, 3)]
    assert plan_chunks([], 4) == []


def test_scaled_backward_no_grad_and_skipped_rows():
    B, C, V, H = 4, 3, 11, 5
    h, w = torch.randn(B, C, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    t = torch.randint(0, V, (B, C))
    a = torch.randn(B, C)
    # rows 1 and 3 contribute a constant: no gradient work for them, but their value counts
    fn = lambda rows, lp, en: (lp * a[rows]).sum() if rows.start % 2 == 0 else torch.tensor(0.5)  # noqa: E731
    loss, lp, _ = linear_logprob_loss(h, w, t, 1.0, fn, rows_per_chunk=1, use_triton=False)
    (3 * loss).backward()                                          # the upstream scalar scales both gradients
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rl = logprob_entropy_reference((h64 @ w64.T).view(-1, V), t.view(-1))[0].view(B, C)
    ref = (rl[0::2] * a[0::2]).sum() + 1.0
    (3 * ref).backward()
    assert rel(loss, ref) < 1e-5 and rel(h.grad, h64.grad) < 1e-5 and rel(w.grad, w64.grad) < 1e-5
    assert (h.grad[1::2] == 0).all()
    with pytest.raises(RuntimeError, match="once"):               # the gradients were handed over already
        loss.backward()
    with torch.no_grad():                                          # values only, no gradient work
        loss2, lp2, _ = linear_logprob_loss(h, w, t, 1.0, fn, rows_per_chunk=1, use_triton=False)
    assert not loss2.requires_grad and torch.allclose(loss2, loss) and torch.allclose(lp2, lp)


def test_dispatch():
    import kernels
    from kernels import use_triton
    B, C, V, H = 2, 3, 11, 5
    h, w = torch.randn(B, C, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    t = torch.randint(0, V, (B, C))
    loss, lp, en = kernels.linear_logprob_loss_kernel(h, w, t, 1.0, lambda rows, lp, en: (lp + en).sum())
    rl, re = logprob_entropy_reference((h @ w.T).view(-1, V), t.view(-1))
    assert lp.shape == (B, C) and torch.allclose(loss, (rl + re).sum(), atol=1e-5)
    loss.backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape
    assert use_triton(h) == (os.environ.get("TRITON_INTERPRET") == "1")   # CPU tensors: the torch twins


def test_bad_inputs_name_the_problem():
    h, w, t = torch.randn(2, 3, 5), torch.randn(11, 5), torch.randint(0, 11, (2, 3))
    ok = lambda rows, lp, en: lp.sum()                             # noqa: E731
    with pytest.raises(ValueError, match="scalar"):
        linear_logprob_loss(h, w, t, 1.0, lambda rows, lp, en: lp, use_triton=False)
    with pytest.raises(ValueError, match="do not match"):
        linear_logprob_loss(h, w, t[:, :2], 1.0, ok, use_triton=False)
    with pytest.raises(ValueError, match="do not match"):
        linear_logprob_loss(h, torch.randn(11, 6), t, 1.0, ok, use_triton=False)
    with pytest.raises(ValueError, match="callable"):
        linear_logprob_loss(h, w, t, 1.0, None, use_triton=False)
    with pytest.raises(ValueError, match="rows_per_chunk"):
        linear_logprob_loss(h, w, t, 1.0, ok, rows_per_chunk=0, use_triton=False)
    with pytest.raises(ValueError, match="out of range"):
        linear_logprob_loss(h, w, t + 11, 1.0, ok, use_triton=False)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_loss(h, w, t, -1.0, ok, use_triton=False)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_gpu_full_vocab(dtype):
    # real vocabularies, odd C and H, several chunks (64 / 128 MB budgets), bf16 d weight over 8 chunks
    check_loss(True, "ppo", B=8, C=257, V=151936, H=896, dtype=dtype, device="cuda", chunk_bytes=64 << 20)
    check_loss(True, "gspo", B=8, C=129, V=128256, H=4096 + 8, dtype=dtype, device="cuda", chunk_bytes=128 << 20,
               tied=True)


def test_floor_tool_chunks_match_the_loss():
    """tools/w2_floor.py times the passes and traffic on the loss's own chunk: its arithmetic must agree with
    plan_chunks at both W2 shapes (1536 tokens x 22 chunks at both: the budget at H=896, the token cap at H=4096)."""
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import w2_floor
    from kernels.logprob_loss import CHUNK_BYTES, budget_tokens
    for V, want in ((151936, 1536), (128256, 1536)):
        rows = plan_chunks([256] * 128, budget_tokens(V, 2, CHUNK_BYTES))
        assert rows[0][1] * 256 == want == w2_floor.chunk_tokens(V, CHUNK_BYTES, 256, 32768)
    assert w2_floor.parse_settings("4096,8,1;2048,4,8") == [dict(BLOCK=4096, num_warps=8, SPLIT=1),
                                                           dict(BLOCK=2048, num_warps=4, SPLIT=8)]
