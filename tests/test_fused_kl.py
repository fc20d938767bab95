"""Fused full-vocabulary KL (kernels/fused_kl.py): the chunked loop against the eager formula and torch's kl_div,
gradients included; the Triton kernels under the CPU interpreter."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.fused_kl import fused_kl, fused_kl_reference  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402

# 37 tokens in blocks of 10 rows and V = 300 in blocks of 128 columns: ragged blocks both ways
N, V, HS, HT = 37, 300, 16, 24
SMALL = dict(chunk_bytes=1, rows_per_block=10)


def inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hs = (torch.randn(N, HS, generator=gen) * 0.5).to(dtype).requires_grad_()
    ws = torch.randn(V, HS, generator=gen).to(dtype).requires_grad_()
    ht, wt = (torch.randn(N, HT, generator=gen) * 0.5).to(dtype), torch.randn(V, HT, generator=gen).to(dtype)
    return hs, ws, ht, wt, torch.rand(N, generator=gen, dtype=dtype)


def test_eager_formula_is_torch_kl_div():
    hs, ws, ht, wt, _ = inputs()
    ls, lt = torch.log_softmax(hs @ ws.T / 0.7, -1), torch.log_softmax(ht @ wt.T / 0.7, -1)
    rev = F.kl_div(lt, ls, log_target=True, reduction="none").sum(-1)      # KL(p_s || p_t)
    fwd = F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1)      # KL(p_t || p_s)
    assert torch.allclose(fused_kl_reference(hs, ws, ht, wt, 0.7, True).double(), rev, atol=1e-5)
    assert torch.allclose(fused_kl_reference(hs, ws, ht, wt, 0.7, False).double(), fwd, atol=1e-5)
    assert not torch.allclose(rev, fwd, atol=1e-2)                          # the two directions differ here


@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_loop_matches_eager_with_gradients(reverse, temperature):
    hs, ws, ht, wt, g = inputs()
    kl = fused_kl(hs, ws, ht, wt, temperature, reverse, use_triton=False, **SMALL)
    ref = fused_kl_reference(hs, ws, ht, wt, temperature, reverse)
    assert kl.dtype == torch.float32 and kl.shape == (N,)
    assert torch.allclose(kl.double(), ref.double(), rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad((kl * g).sum(), [hs, ws])
    want = torch.autograd.grad((ref * g).sum(), [hs, ws])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()


def test_same_distribution_has_zero_kl_and_zero_gradient():
    hs, ws, _, _, g = inputs()
    kl = fused_kl(hs, ws, hs.detach() * 2, ws.detach() / 2, 1.0, True, use_triton=False, **SMALL)
    assert kl.abs().max() < 1e-5
    assert all(x.abs().max() < 1e-5 for x in torch.autograd.grad((kl * g).sum(), [hs, ws]))


def test_teacher_gets_no_gradient():
    hs, ws, ht, wt, _ = inputs()
    ht.requires_grad_()
    fused_kl(hs, ws, ht, wt, use_triton=False).sum().backward()
    assert ht.grad is None and hs.grad is not None and ws.grad is not None


@pytest.mark.parametrize("change, match", [
    (lambda t: (t[0][:, :3], *t[1:]), "student hidden"),
    (lambda t: (*t[:2], t[2][:5], t[3]), "share tokens"),
    (lambda t: (*t[:3], t[3][:7]), "share tokens"),
    (lambda t: (t[0].float(), *t[1:]), "dtype"),
])
def test_bad_shapes_are_refused(change, match):
    hs, ws, ht, wt, _ = inputs()
    with pytest.raises(ValueError, match=match):
        fused_kl(*change((hs, ws, ht, wt)), use_triton=False)
    with pytest.raises(ValueError, match="temperature"):
        fused_kl(hs, ws, ht, wt, temperature=0.0, use_triton=False)


def test_triton_kernels_interpreted_match_eager():
    run_interpreted("""
import torch
from kernels.fused_kl import LOSS_LAUNCH
from kernels.fused_kl import fused_kl, fused_kl_loss, fused_kl_reference
gen = torch.Generator().manual_seed(1)
N, V, HS, HT = 19, 300, 16, 8
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
    hs = (torch.randn(N, HS, generator=gen) * 0.5).to(dtype).requires_grad_()
    ws = torch.randn(V, HS, generator=gen).to(dtype).requires_grad_()
    ht, wt = (torch.randn(N, HT, generator=gen) * 0.5).to(dtype), torch.randn(V, HT, generator=gen).to(dtype)
    g = torch.rand(N, generator=gen)
    for reverse in (True, False):
        kl = fused_kl(hs, ws, ht, wt, 0.8, reverse, chunk_bytes=1, rows_per_block=8)   # Triton: TRITON_INTERPRET=1
        f32 = [x.detach().float().requires_grad_(i < 2) for i, x in enumerate((hs, ws, ht, wt))]
        ref = fused_kl_reference(*f32, 0.8, reverse)
        assert torch.allclose(kl, ref, rtol=tol, atol=tol), (dtype, reverse, (kl - ref).abs().max())
        got = torch.autograd.grad((kl * g).sum(), [hs, ws])
        want = torch.autograd.grad((ref * g).sum(), f32[:2])
        for a, b in zip(got, want):
            assert torch.allclose(a.float(), b, rtol=tol, atol=tol), (dtype, reverse, (a.float() - b).abs().max())
        # 8-row chunks, one program per row; (float32, reverse) also one chunk of all rows in 3 programs per row
        # (columns [0, 128), [128, 256), [256, 300))
        for split, block, rows in ((1, 4096, 8), (3, 128, N)) if dtype == torch.float32 and reverse else ((1, 4096, 8),):
            LOSS_LAUNCH.update(SPLIT=split, BLOCK=block)
            loss, kl = fused_kl_loss(hs, ws, ht, wt, g, 0.8, reverse, chunk_bytes=2 * 4 * V * rows)
            assert torch.allclose(kl, ref.detach(), rtol=tol, atol=tol), (dtype, reverse, split, (kl - ref).abs().max())
            for a, b in zip(torch.autograd.grad(loss, [hs, ws]), want):
                assert torch.allclose(a.float(), b, rtol=tol, atol=tol), (dtype, reverse, split, (a.float() - b).abs().max())
print("ok")
""")


def test_bench_w9_tiny_runs(tmp_path):
    import json
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "w9.json"
    r = subprocess.run([sys.executable, "tools/bench_w9.py", "--tiny", "--rep", "1", "--out", str(out)], cwd=root,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [x["shape"] for x in results] == ["32x512", "48x700"]
    assert all(x["ours"]["error"]["kl"] < 1e-5 and x["ours"]["fwd_bwd_ms"] > 0 for x in results)
    assert "| 32x512 |" in r.stdout


@pytest.mark.parametrize("reverse", [True, False])
def test_loss_with_gradient_in_the_forward_matches_eager(reverse):
    from kernels.fused_kl import fused_kl_loss
    hs, ws, ht, wt, g = inputs()
    loss, kl = fused_kl_loss(hs, ws, ht, wt, g, 0.7, reverse, use_triton=False, chunk_bytes=2 * 8 * V * 10)  # 10 rows
    ref = fused_kl_reference(hs, ws, ht, wt, 0.7, reverse)
    assert torch.allclose(kl.double(), ref.double(), rtol=1e-5, atol=1e-5) and not kl.requires_grad
    assert loss.item() == pytest.approx((ref * g).sum().item(), rel=1e-5)
    got = torch.autograd.grad(3.0 * loss, [hs, ws])                           # the upstream scale reaches both
    want = torch.autograd.grad(3.0 * (ref * g).sum(), [hs, ws])
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
    with torch.no_grad():                                                     # no gradient work under no_grad
        assert fused_kl_loss(hs, ws, ht, wt, g, 0.7, reverse, use_triton=False)[0].item() == pytest.approx(loss.item())


def test_loss_hands_its_gradient_buffers_over_once():
    """The backward gives autograd the buffers computed in the forward (scaled in place, no copy of d weight), so a
    leaf's .grad is that buffer; a second backward through the same graph is refused with a clear error."""
    from kernels.fused_kl import fused_kl_loss
    hs, ws, ht, wt, g = inputs()
    loss, _ = fused_kl_loss(hs, ws, ht, wt, g, use_triton=False, chunk_bytes=2 * 8 * V * 10)
    stored = loss.grad_fn.grads[1].data_ptr()                                  # no reference kept: autograd may take it
    (2.0 * loss).backward(retain_graph=True)
    assert ws.grad.data_ptr() == stored
    want = torch.autograd.grad(2.0 * (fused_kl_reference(hs, ws, ht, wt) * g).sum(), [ws])[0]
    assert torch.allclose(ws.grad, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


def test_loss_rows_keep_the_budget():
    from kernels.fused_kl import loss_rows
    for N, V, budget in ((32768, 151936, 448 << 20), (32768, 128256, 448 << 20), (37, 300, 2 * 8 * 300 * 10)):
        n = loss_rows(N, V, 2, budget)
        assert 1 <= n <= N and 2 * 2 * V * n <= budget
        assert n % 128 == 0 or n < 256
    assert loss_rows(5, 300, 2, 1) == 1 and loss_rows(5, 300, 2, 1 << 30) == 5


def test_fused_logits_kernel_interpreted_matches_float64():
    """tools/w9_floor.py's _logits_kl_kernel (both products with the statistics in their epilogue: the route W9's
    floor times against cuBLAS) inside fused_kl_loss, on ragged tiles: 19 rows in 16-row tiles, V = 300 in
    128-column tiles, K = 16 and 40 against 16-deep steps; float16, since triton 3.9's interpreter gets bfloat16
    tl.dot wrong (the GPU does not)."""
    run_interpreted("""
import sys
import torch
sys.path.insert(0, "tools")
from w9_floor import fused_logits_in_loss
from kernels.fused_kl import fused_kl_loss, fused_kl_reference
gen = torch.Generator().manual_seed(2)
N, V, HS, HT = 19, 300, 16, 40
hs = (torch.randn(N, HS, generator=gen) * 0.5).half().requires_grad_()
ws = torch.randn(V, HS, generator=gen).half().requires_grad_()
ht, wt = (torch.randn(N, HT, generator=gen) * 0.3).half(), torch.randn(V, HT, generator=gen).half()
g = torch.rand(N, generator=gen, dtype=torch.float64)
f64 = [x.detach().double().requires_grad_(i < 2) for i, x in enumerate((hs, ws, ht, wt))]
for reverse, load_t in ((True, False), (False, True)):    # both products in the kernel; the teacher's read
    ref = fused_kl_reference(*f64, 0.8, reverse)
    want = torch.autograd.grad((ref * g).sum(), f64[:2])
    with fused_logits_in_loss((16, 128, 16, 1, 2, 2), load_t):     # (BM, BN, BK, warps, stages, GROUP)
        loss, kl = fused_kl_loss(hs, ws, ht, wt, g.float(), 0.8, reverse, chunk_bytes=2 * 2 * V * N)
    # float16 logits: errors relative to the KL's and the gradients' own scale
    assert (kl.double() - ref).abs().max() < 5e-3 * ref.abs().max(), (reverse, load_t, (kl.double() - ref).abs().max())
    for a, b in zip(torch.autograd.grad(loss, [hs, ws]), want):
        assert (a.double() - b).abs().max() < 5e-3 * b.abs().max(), (reverse, load_t, (a.double() - b).abs().max())
print("ok")
""")
