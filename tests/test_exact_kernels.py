"""The exact path's Triton kernels (kernels/exact_gemm.py, kernels/exact_attention.py) under TRITON_INTERPRET=1 on
a CPU at tiny shapes: a row's bits do not depend on how many rows the call has or where the row sits, a
one-token decode step's attention over the cache equals the same token's row in the full-sequence call, and the
whole exact engine on the Triton path samples log-probs the trainer gives back bit for bit. On CUDA the engine
test runs natively (bf16)."""
import pytest
import torch

from interpret import run_interpreted

GEMM_AND_NORM = r"""
import torch
import torch.nn.functional as F
from kernels.exact_gemm import exact_linear, exact_rmsnorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in [(100, 80), (70, 80), (70,)])   # K: a partial tile
    full = exact_linear(x, w, b)                                                              # (100, 70)
    ref = F.linear(x.float(), w.float(), b.float())
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7     # the interpreter's bfloat16 cast truncates: one ulp
    assert ((full.float() - ref).abs() <= ulp * ref.abs() + 1e-4).all()
    pick = torch.tensor([99, 3, 77, 64, 0])
    for rows in (pick, pick[:1], torch.arange(100).flip(0)):
        assert torch.equal(exact_linear(x[rows], w, b), full[rows]), (dtype, rows)
    for mode, cls in enumerate([Qwen2RMSNorm, Olmo2RMSNorm, Gemma3RMSNorm]):
        m = cls(80).to(dtype)
        torch.nn.init.normal_(m.weight, 0, 0.5)
        eps = getattr(m, "variance_epsilon", None) or m.eps
        y = exact_rmsnorm(x[:20], m.weight.detach(), eps, mode)
        with torch.no_grad():
            want = m(x[:20]).float()
            assert ((y.float() - want).abs() <= 2 * ulp * want.abs() + 1e-5).all(), (cls, dtype)
        assert torch.equal(exact_rmsnorm(x[[19, 3, 0]], m.weight.detach(), eps, mode), y[[19, 3, 0]])
print("ok")
"""

ATTENTION = r"""
import torch
from kernels.exact_attention import exact_attention
g = torch.Generator().manual_seed(0)
B, nh, nkv, D, L, S = 3, 6, 2, 16, 48, 40                 # 3 query heads per KV head; S positions used, 3 blocks
for dtype in (torch.float32, torch.bfloat16):
    for window in (None, 7):
        kc, vc = (torch.randn(B, nkv, L, D, generator=g).to(dtype) for _ in range(2))
        lens = torch.tensor([S, 17, 33])
        rows = torch.repeat_interleave(torch.arange(B), lens)
        pos = torch.cat([torch.arange(n) for n in lens.tolist()])
        q = torch.randn(len(rows), nh, D, generator=g).to(dtype)
        full = exact_attention(q, rows, pos, kc, vc, window, 0.25, 16)                       # (N, nh, D)
        # reference: softmax attention of each token over its visible slots, in float32
        for n in (0, 5, len(rows) - 1):
            b, p = int(rows[n]), int(pos[n])
            t = torch.arange(L)
            ok = (t <= p) & ((p - t < window) if window else True)
            k, v = kc[b].float().repeat_interleave(nh // nkv, 0), vc[b].float().repeat_interleave(nh // nkv, 0)
            w = (q[n].float()[:, None] @ k.transpose(1, 2)).squeeze(1) * 0.25                 # (nh, L)
            ref = (w.masked_fill(~ok, float("-inf")).softmax(-1)[:, None] @ v).squeeze(1)
            assert (full[n].float() - ref).abs().max() < (1e-4 if dtype == torch.float32 else 0.05)
        # decode: one token per row over a cache that holds nothing (zeros) past it, in a call of its own
        pick = torch.tensor([len(rows) - 1, 20, 41])        # one token of each row: rows 2, 0, 1
        stale = kc.clone(), vc.clone()
        for n in pick.tolist():
            b, p = int(rows[n]), int(pos[n])
            stale[0][b, :, p + 1:] = 0
            stale[1][b, :, p + 1:] = 0
        one = exact_attention(q[pick], rows[pick], pos[pick], *stale, window, 0.25, 16)
        assert torch.equal(one, full[pick]), (dtype, window)
        assert torch.equal(exact_attention(q[pick[:1]], rows[pick[:1]], pos[pick[:1]], kc, vc, window, 0.25, 16),
                           full[pick[:1]])
print("ok")
"""

ENGINE = r"""
import sys
import torch
sys.path.insert(0, "tests")
import engines.exact as exact
from models import load_model
from test_exact import generate, trainer_logprobs
model, _ = load_model(sys.argv[1], torch.device("cpu"), torch.float32)
x = torch.zeros(1)
assert exact.on_gpu(x)                                    # the interpreter takes the Triton path
r = generate(model, n=2, max_new=6)
m = r.completion_mask.bool()
got = trainer_logprobs(model, r, torch.randperm(len(m), generator=torch.Generator().manual_seed(1)))
assert m.sum() > 10 and torch.equal(got[m], r.logprobs[m])
from models import completion_logprobs
ref = completion_logprobs(model, r.input_ids, r.attention_mask, m.shape[1], 0.9)[0].detach().float()
assert (ref[m] - r.logprobs[m]).abs().max() < 1e-3
print("ok")
"""


def test_gemm_and_rmsnorm_rows_are_invariant_interpreted():
    run_interpreted(GEMM_AND_NORM)


def test_decode_step_attention_equals_the_full_sequence_interpreted():
    run_interpreted(ATTENTION)


def test_engine_on_the_triton_path_equals_the_trainer_interpreted(random_model_dir):
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", ENGINE, random_model_dir], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
