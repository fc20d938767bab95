"""The exact path's Triton kernels (kernels/exact_gemm.py, kernels/exact_attention.py): a row's bits do not depend
on how many rows the call has or where the row sits, a one-token decode step's attention over the cache equals
the same token's row in the full-sequence call, and the exact engine on the Triton path samples log-probs the
trainer gives back bit for bit. On a CPU under TRITON_INTERPRET=1 at tiny shapes (in a subprocess; there the
kernels' tl.dot is an explicit product and sum: kernels/exact_gemm.py EXPLICIT_DOT); on CUDA natively, with the
GEMM at W1's shapes too."""
import os
import subprocess
import sys

import pytest
import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# tile configurations (BM, BN, BK, warps, stages) of kernels/exact_gemm.py's TILES to check, besides the table's own
TILE_CHOICES = [(64, 64, 64, 4, 3), (32, 32, 128, 4, 3), (16, 32, 128, 4, 4), (64, 16, 64, 4, 4), (128, 64, 64, 4, 3),
                (128, 128, 64, 8, 3)]


def check_every_tile(device: str, shapes):
    """Each of TILE_CHOICES, forced on every weight class: exact_linear's rows keep their bits whatever M and place."""
    import kernels.exact_gemm as eg
    own = dict(eg.TILES)
    try:
        for tile in TILE_CHOICES:
            eg.TILES.update({c: tile for c in eg.TILES})
            check_gemm(device, shapes)
    finally:
        eg.TILES.update(own)


def check_gemm(device: str, shapes):
    """Rows of exact_linear: the same bits in any call (any M, any place), near F.linear's values."""
    import torch.nn.functional as F

    from kernels.exact_gemm import exact_linear
    g = torch.Generator().manual_seed(0)
    for M, K, N in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x, w, b = (torch.randn(*s, generator=g).to(device, dtype) for s in [(M, K), (N, K), (N,)])
            full = exact_linear(x, w, b)                                                  # (M, N)
            ref = F.linear(x.double(), w.double(), b.double())    # float64: no TF32, whatever a test left set
            ulp = 1e-5 if dtype == torch.float32 else 2 ** -7   # the interpreter's bfloat16 cast truncates: one ulp
            assert ((full.float() - ref).abs() <= ulp * ref.abs() + 1e-3).all(), (M, K, N, dtype)
            pick = torch.tensor([M - 1, 3, M // 2 + 13, 64, 0], device=device) % M
            for rows in (pick, pick[:1], torch.arange(M, device=device).flip(0)):
                assert torch.equal(exact_linear(x[rows], w, b), full[rows]), (M, K, N, dtype, rows)
    return x


def check_gemm_and_norm(device: str, shapes=((70, 80, 70),)):
    """Rows of exact_linear and exact_rmsnorm: the same bits in any call, near transformers' / F.linear's values."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from kernels.exact_gemm import exact_rmsnorm
    x = check_gemm(device, shapes)[:20]
    for mode, cls in enumerate([Qwen2RMSNorm, Olmo2RMSNorm, Gemma3RMSNorm]):
        m = cls(x.shape[1]).to(device, x.dtype)
        torch.nn.init.normal_(m.weight, 0, 0.5)
        eps = getattr(m, "variance_epsilon", None) or m.eps
        y = exact_rmsnorm(x, m.weight.detach(), eps, mode)
        with torch.no_grad():
            want = m(x).float()
        assert ((y.float() - want).abs() <= 2 * 2 ** -7 * want.abs() + 1e-5).all(), cls
        assert torch.equal(exact_rmsnorm(x[[19, 3, 0]], m.weight.detach(), eps, mode), y[[19, 3, 0]])


def check_attention(device: str):
    """exact_attention near softmax attention (float64); a decode call (one token per row, nothing past it in the cache)
    equals the full-sequence call's rows bit for bit."""
    from kernels.exact_attention import exact_attention
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, D, L = 3, 6, 2, 16, 48                   # 3 query heads per KV head; 3 key blocks of 16
    for dtype, window in ((torch.float32, None), (torch.bfloat16, 7)):
        kc, vc = (torch.randn(B, nkv, L, D, generator=g).to(device, dtype) for _ in range(2))
        lens = torch.tensor([35, 4, 8])
        rows = torch.repeat_interleave(torch.arange(B), lens).to(device)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()]).to(device)
        q = torch.randn(len(rows), nh, D, generator=g).to(device, dtype)
        full = exact_attention(q, rows, pos, kc, vc, window, 0.25, 16)                   # (N, nh, D)
        for n in (0, 5, len(rows) - 1):                  # against softmax attention in float32
            b, p = int(rows[n]), int(pos[n])
            t = torch.arange(L, device=device)
            ok = (t <= p) & ((p - t < window) if window else True)
            k, v = kc[b].double().repeat_interleave(nh // nkv, 0), vc[b].double().repeat_interleave(nh // nkv, 0)
            w = (q[n].double()[:, None] @ k.transpose(1, 2)).squeeze(1) * 0.25           # (nh, L) float64
            ref = (w.masked_fill(~ok, float("-inf")).softmax(-1)[:, None] @ v).squeeze(1)
            assert (full[n].double() - ref).abs().max() < (1e-4 if dtype == torch.float32 else 0.05)
        pick = torch.tensor([len(rows) - 1, 20, 37], device=device)   # the last token of row 2, one of rows 0 and 1
        stale = kc.clone(), vc.clone()
        for n in pick.tolist():                          # the decode step's cache: nothing written past the token
            stale[0][rows[n], :, pos[n] + 1:] = 0
            stale[1][rows[n], :, pos[n] + 1:] = 0
        assert torch.equal(exact_attention(q[pick], rows[pick], pos[pick], *stale, window, 0.25, 16), full[pick])


def check_fused(device: str):
    """The fused kernels keep a row's bits whatever the call: exact_linear_cat equals exact_linear on the
    concatenated weight; exact_rope_cache, exact_silu_mul and exact_row_logprobs give a row the same bits alone,
    reordered and in the full call, and are near their torch definitions; a sampled token's log-prob equals the
    target mode's for the same token (the engine's and the trainer's calls)."""
    from engines.exact import _rotate
    from kernels.exact_attention import exact_rope_cache
    from kernels.exact_gemm import exact_linear, exact_linear_cat, exact_silu_mul
    from kernels.exact_sample import exact_row_logprobs
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device)
    x, ws, bs = r(37, 24), [r(32, 24), r(16, 24), r(16, 24)], [r(32), r(16), r(16)]
    full = exact_linear_cat(x, ws, bs)                                                # (37, 64)
    assert torch.equal(full, exact_linear(x, torch.cat(ws), torch.cat(bs)))
    pick = torch.tensor([36, 2, 0, 17], device=device)
    assert torch.equal(exact_linear_cat(x[pick], ws, bs), full[pick])
    gu = r(37, 2 * 40).bfloat16()
    y = exact_silu_mul(gu)
    assert torch.equal(exact_silu_mul(gu[pick]), y[pick])
    want = torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]
    assert ((y.float() - want.float()).abs() <= 2 ** -6 * want.float().abs() + 1e-6).all()
    N, nh, nkv, D, B, L = 9, 4, 2, 8, 3, 16
    qkv, cos, sin = r(N, (nh + 2 * nkv) * D), r(L, D), r(L, D)
    q, k, v = (t.reshape(N, -1, D) for t in qkv.split([nh * D, nkv * D, nkv * D], -1))
    rows, pos = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2], device=device), torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3],
                                                                                       device=device)
    kc, vc = torch.zeros(B, nkv, L, D, device=device), torch.zeros(B, nkv, L, D, device=device)
    qo = exact_rope_cache(q, k, v, rows, pos, cos, sin, kc, vc)
    c, s = cos[pos][:, None], sin[pos][:, None]
    assert (qo - _rotate(q, c, s)).abs().max() < 1e-5
    assert (kc[rows, :, pos] - _rotate(k, c, s)).abs().max() < 1e-5 and torch.equal(vc[rows, :, pos], v)
    kc2, vc2, p = torch.zeros_like(kc), torch.zeros_like(vc), torch.tensor([8, 2, 0], device=device)
    assert torch.equal(exact_rope_cache(q[p], k[p], v[p], rows[p], pos[p], cos, sin, kc2, vc2), qo[p])
    assert torch.equal(kc2[rows[p], :, pos[p]], kc[rows[p], :, pos[p]])
    z = (r(6, 3000) * 3).bfloat16()                                                  # more than one block of BV
    inv_t = torch.tensor([1 / 0.7], device=device)
    seed, step = torch.tensor([5], device=device), torch.tensor([3], device=device)
    tok, lp, _ = exact_row_logprobs(z, inv_t, seed=seed, step=step)
    ref = torch.log_softmax(z.float() * inv_t, -1)
    assert (lp - ref.gather(-1, tok[:, None]).squeeze(-1)).abs().max() < 1e-4
    _, lp2, ent = exact_row_logprobs(z, inv_t, tgt=tok)
    assert torch.equal(lp2, lp)                                                       # the engine's = the trainer's
    assert (ent + (ref.exp() * ref).sum(-1)).abs().max() < 1e-3
    for rows_ in (pick[:3] % 6, torch.tensor([5], device=device)):
        assert torch.equal(exact_row_logprobs(z[rows_], inv_t, tgt=tok[rows_])[1], lp[rows_])
        assert torch.equal(exact_row_logprobs(z[rows_], inv_t, tgt=tok[rows_])[2], ent[rows_])


INTERPRETED = r"""
import sys
import torch
sys.path.insert(0, "tests")
import engines.exact as exact
from models import completion_logprobs, load_model
from test_exact import generate, trainer_logprobs
from test_exact_kernels import check_attention, check_every_tile, check_fused, check_gemm_and_norm
check_fused("cpu")
check_gemm_and_norm("cpu")
check_every_tile("cpu", ((70, 150, 40),))
check_attention("cpu")
model, _ = load_model(sys.argv[1], torch.device("cpu"), torch.float32)
assert exact.on_gpu(torch.zeros(1))                     # the interpreter takes the Triton path
r = generate(model, n=1, max_new=5)
m = r.completion_mask.bool()
got = trainer_logprobs(model, r, torch.randperm(len(m), generator=torch.Generator().manual_seed(1)))
assert m.sum() > 10 and torch.equal(got[m], r.logprobs[m])
ref = completion_logprobs(model, r.input_ids, r.attention_mask, m.shape[1], 0.9)[0].detach().float()
assert (ref[m] - r.logprobs[m]).abs().max() < 1e-3
print("ok")
"""


def test_kernels_and_the_engine_on_the_triton_path_interpreted(random_model_dir):
    """One subprocess (torch and transformers imported once): the GEMM, RMSNorm and attention checks, then the
    exact engine on the Triton path: its sampled log-probs equal the trainer's, batched otherwise, bit for bit."""
    triton = pytest.importorskip("triton")
    if tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9):
        pytest.skip("triton < 3.9's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses")
    out = subprocess.run([sys.executable, "-c", INTERPRETED, random_model_dir], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


@cuda
def test_gpu_gemm_rmsnorm_and_attention_are_invariant():
    check_gemm_and_norm("cuda", shapes=((100, 80, 70), (4100, 896, 4864), (3000, 4864, 896), (700, 896, 151936)))
    check_every_tile("cuda", shapes=((300, 896, 128), (200, 4864, 896)))
    check_attention("cuda")
    check_fused("cuda")
