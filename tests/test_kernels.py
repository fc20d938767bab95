"""Fused log-prob / entropy kernels against a float64 reference, on fresh random inputs each run.

    .venv/bin/python -m pytest tests/test_kernels.py -q

Three tiers: the torch twins in this process; the Triton kernels under TRITON_INTERPRET=1 on CPU in a
subprocess (the variable must be set before triton is imported, and must not leak into other tests);
the Triton kernels on CUDA at full vocabulary sizes (skipped without a GPU).
Tolerance: relative L2 error <= 1e-4 for float32 inputs, <= 1e-2 for bf16 inputs (outputs and gradients).
"""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels import linear_logprob, logprob  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402
from kernels.linear_logprob import linear_logprob_entropy  # noqa: E402
from kernels.logprob import logprob_entropy, logprob_entropy_reference  # noqa: E402
import kernels  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def rel(a, b):
    assert torch.isfinite(a).all(), "non-finite values in the fused result"
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_targets(N, V, pad_every=5, gen=None):
    t = torch.randint(0, V, (N,), generator=gen)
    t[::pad_every] = -100                                          # padded / masked positions
    return t


def reference(h, w, t, temperature, g_lp, g_ent):
    """float64 eager: outputs and gradients w.r.t. h (or logits when w is None) and w."""
    h64 = h.detach().double().requires_grad_()
    w64 = None if w is None else w.detach().double().requires_grad_()
    logits = h64 if w is None else h64 @ w64.T
    lp, en = logprob_entropy_reference(logits, t, temperature)
    (lp * g_lp.double() + en * g_ent.double()).sum().backward()
    return lp, en, h64.grad, None if w is None else w64.grad


def check_logits(use_triton, N=37, V=300, dtype=torch.float32, temperature=0.7, device="cpu"):
    x = (torch.randn(N, V, device=device) * 3).to(dtype).requires_grad_()
    t = make_targets(N, V).to(device)
    g_lp, g_ent = torch.randn(N, device=device), torch.randn(N, device=device)
    lp, en = logprob_entropy(x, t, temperature, use_triton=use_triton)
    (lp * g_lp + en * g_ent).sum().backward()
    rl, re, rg, _ = reference(x, None, t, temperature, g_lp, g_ent)
    tol = TOL[dtype]
    assert rel(lp, rl) < tol and rel(en, re) < tol and rel(x.grad, rg) < tol, (rel(lp, rl), rel(en, re), rel(x.grad, rg))
    assert (lp[t < 0] == 0).all() and (x.grad[t < 0] == 0).all()


def check_linear(use_triton, N=45, V=301, H=24, dtype=torch.float32, temperature=0.7, device="cpu",
                 chunk_bytes=4096, tied=False, fuse_matmul=False, into_grad=False):
    w = (torch.randn(V, H, device=device) / math.sqrt(H)).to(dtype).requires_grad_()
    t = make_targets(N, V).to(device)
    if tied:  # the lm_head is the embedding: hidden states come out of it, so its gradient has two paths
        ids = torch.randint(0, V, (N,), device=device)
        h = torch.nn.functional.embedding(ids, w) * 2.0
    else:
        h = torch.randn(N, H, device=device).to(dtype).requires_grad_()
    g_lp, g_ent = torch.randn(N, device=device), torch.randn(N, device=device)
    # into_grad: twice, as gradient accumulation does: .grad first set by the kernel, then added into
    for _ in range(2 if into_grad else 1):
        if tied:
            h = torch.nn.functional.embedding(ids, w) * 2.0
        lp, en = linear_logprob_entropy(h, w, t, temperature, use_triton=use_triton, chunk_bytes=chunk_bytes,
                                        fuse_matmul=fuse_matmul, into_grad=into_grad)
        (lp * g_lp + en * g_ent).sum().backward()
    w64 = w.detach().double().requires_grad_()
    h64 = torch.nn.functional.embedding(ids, w64) * 2.0 if tied else h.detach().double().requires_grad_()
    rl, re = logprob_entropy_reference(h64 @ w64.T, t, temperature)
    ((rl * g_lp.double() + re * g_ent.double()).sum() * (2 if into_grad else 1)).backward()
    tol = TOL[dtype]
    errs = [rel(lp, rl), rel(en, re), rel(w.grad, w64.grad)] + ([] if tied else [rel(h.grad, h64.grad)])
    assert max(errs) < tol, errs
    assert (lp[t < 0] == 0).all() and (en[t < 0] == 0).all()


def check_all(use_triton):
    """Every case the kernels must get right; run with the torch twins here and interpreted Triton below."""
    old, launch = linear_logprob.TOKENS_PER_BLOCK, dict(logprob.LAUNCH)
    linear_logprob.TOKENS_PER_BLOCK = 16                           # several token blocks at tiny N
    try:
        for dtype in (torch.float32, torch.bfloat16):
            check_logits(use_triton, dtype=dtype)
            check_linear(use_triton, dtype=dtype)                  # odd N, V, H; token and vocab blocks
            check_linear(use_triton, dtype=dtype, tied=True)
            check_linear(use_triton, dtype=dtype, fuse_matmul=True)   # Triton matmuls, softmax in the epilogue
            check_linear(use_triton, dtype=dtype, tied=True, into_grad=True)   # the head's gradient into .grad
        check_linear(use_triton, dtype=torch.bfloat16, into_grad=True, chunk_bytes=1 << 20)  # float32 sum, then into .grad
        check_linear(use_triton, N=5, V=130, H=7, temperature=1.3, chunk_bytes=1 << 20)  # one tile
        logprob.LAUNCH.update(BLOCK=32, SPLIT=3)                  # the gradient pass with 3 programs per row
        check_linear(use_triton, dtype=torch.bfloat16)
        # masked vocabulary (-inf logits, as after top-k filtering): finite, zero probability there
        x = torch.randn(6, 50)
        x[:, 10:] = -float("inf")
        lp, en = logprob_entropy(x, torch.arange(6), 1.0, use_triton=use_triton)
        rl, re = logprob_entropy_reference(x, torch.arange(6), 1.0)
        assert rel(lp, rl) < 1e-5 and rel(en, re) < 1e-5
    finally:
        linear_logprob.TOKENS_PER_BLOCK = old
        logprob.LAUNCH.update(launch)


def test_torch_twins_match_reference():
    check_all(use_triton=False)


def test_triton_interpreted_on_cpu():
    run_interpreted("import tests.test_kernels as t; t.check_all(use_triton=True); print('ok')")


def test_hand_derived_values():
    V = 8
    lp, en = logprob_entropy_reference(torch.zeros(2, V), torch.tensor([3, 5]))
    assert torch.allclose(lp, torch.full((2,), -math.log(V))) and torch.allclose(en, torch.full((2,), math.log(V)))
    lp2, en2 = linear_logprob_entropy(torch.zeros(2, 4), torch.randn(V, 4), torch.tensor([3, 5]), use_triton=False)
    assert torch.allclose(lp2, lp) and torch.allclose(en2, en)


def test_padding_compaction_only_when_padded(monkeypatch):
    """linear_logprob_entropy learns the valid count in its range check's host read: without padding it makes no
    nonzero() (a second sync); with padding it compacts, and padded tokens get 0."""
    calls, nonzero = [], torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **k: calls.append(1) or nonzero(self, *a, **k))
    h, w = torch.randn(2, 3, 5), torch.randn(11, 5)
    t = torch.tensor([[0, 4, 10], [2, 3, 7]])
    lp, _ = linear_logprob_entropy(h, w, t, use_triton=False)
    assert calls == [] and torch.allclose(lp, logprob_entropy_reference((h @ w.T).view(6, 11), t.view(6))[0].view(2, 3))
    t[1, 1] = -100
    lp2, en2 = linear_logprob_entropy(h, w, t, use_triton=False)
    assert calls == [1] and lp2[1, 1] == 0 and en2[1, 1] == 0 and torch.allclose(lp2[0], lp[0])


def test_dispatch_and_shapes():
    x, t = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    lp, en = kernels.token_logprobs(x, t, 1.0)
    rl, re = logprob_entropy_reference(x.view(6, 11), t.view(6))
    assert lp.shape == (2, 3) and torch.allclose(lp.view(6), rl) and torch.allclose(en.view(6), re)
    h, w = torch.randn(2, 3, 5, requires_grad=True), torch.randn(11, 5, requires_grad=True)
    lp2, en2 = kernels.linear_logprobs(h, w, t, 1.0)
    assert lp2.shape == (2, 3) and torch.allclose(lp2, logprob_entropy_reference((h @ w.T).view(6, 11), t.view(6))[0].view(2, 3), atol=1e-5)
    lp2.sum().backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape
    from kernels import use_triton
    assert use_triton(x) == (os.environ.get("TRITON_INTERPRET") == "1")   # CPU tensors: the torch reference


def test_bad_inputs_name_the_problem():
    h, w = torch.randn(4, 5), torch.randn(11, 5)
    with pytest.raises(ValueError, match="out of range"):
        linear_logprob_entropy(h, w, torch.tensor([0, 1, 2, 11]), use_triton=False)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_entropy(h, w, torch.tensor([0, 1, 2, 3]), 0.0, use_triton=False)
    with pytest.raises(ValueError, match="do not match"):
        linear_logprob_entropy(h, torch.randn(11, 6), torch.tensor([0, 1, 2, 3]), use_triton=False)
    with pytest.raises(ValueError, match="cast"):
        linear_logprob_entropy(h, w.double(), torch.tensor([0, 1, 2, 3]), use_triton=False)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_gpu_full_vocab(dtype, monkeypatch):
    check_logits(True, N=1025, V=151936, dtype=dtype, device="cuda")
    # several token and vocabulary blocks at real vocabularies, odd N and H (the float64 reference
    # holds several (N, V) tensors, so N stays in the thousands)
    monkeypatch.setattr(linear_logprob, "TOKENS_PER_BLOCK", 1024)
    for fuse in (False, True):
        check_linear(True, N=3077, V=151936, H=896, dtype=dtype, device="cuda", chunk_bytes=64 << 20, fuse_matmul=fuse)
    check_linear(True, N=2001, V=128256, H=4096 + 8, dtype=dtype, device="cuda", chunk_bytes=128 << 20, tied=True)
