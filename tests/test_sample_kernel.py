"""The Gumbel-max sampling kernel (kernels/sample.py): exact log-probs and the right distribution.

Tiers as in test_kernels.py: the torch twin here, the Triton kernel interpreted on CPU in a subprocess,
the kernel on CUDA at full vocabulary (skipped without a GPU).
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.sample import cdf_sample, gumbel_sample, gumbel_sample_reference  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402


def check_sampler(fn, device="cpu", V=7, rows=6000, dtype=torch.float32, steps=(0, 1), same_rows=None):
    """One call over `rows` copies of the same logits per step in `steps`: the token frequencies must match
    softmax(z / T) within 5 standard errors (plus one count), and each logp must equal log_softmax at the sampled
    token. Then the same seed and step must draw the same tokens, another step others (over `same_rows` rows)."""
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(V, generator=gen) * 2).to(device=device, dtype=dtype)
    if V > 16:   # a few live tokens, spread over the kernel's 2048-column blocks (edges included)
        live = torch.tensor(sorted({1, 2047, 2048, V // 2, V - 1}))
        keep = torch.full((V,), -float("inf"), device=device, dtype=dtype)
        keep[live] = z[live]
        z = keep
    z[3] = -float("inf")                                           # a banned token is never sampled
    inv_t = torch.tensor([1 / 0.8], device=device)
    logits = z.expand(rows, V)
    for step in steps:                                             # the step changes the noise stream
        tok, logp = fn(logits, inv_t, torch.tensor([42], device=device), torch.tensor([step], device=device))
        assert tok.shape == (rows,) and tok.dtype == torch.long and logp.dtype == torch.float32
        ref = torch.log_softmax(z.float() * inv_t, -1)
        assert torch.allclose(logp, ref[tok], atol=1e-5)
        p = ref.exp().cpu().double()
        freq = torch.bincount(tok.cpu(), minlength=V).double() / rows
        se = (p * (1 - p) / rows).sqrt()
        assert ((freq - p).abs() <= 5 * se + 1.5 / rows).all(), (freq, p)   # + a count of slack: rare tokens
        assert freq[3] == 0
    logits = z.expand(same_rows or rows, V)
    a = fn(logits, inv_t, torch.tensor([42], device=device), torch.tensor([5], device=device))[0]
    b = fn(logits, inv_t, torch.tensor([42], device=device), torch.tensor([5], device=device))[0]
    c = fn(logits, inv_t, torch.tensor([42], device=device), torch.tensor([6], device=device))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)              # same seed and step: same draw


def test_torch_twin():
    check_sampler(gumbel_sample_reference)


def test_kernel_interpreted_on_cpu():
    # three programs per row (a partial buffer of 4, one slot masked) of 3, 3 and 2 blocks of 512, the last block
    # holding the one column past 3584; the third program's first block is all -inf before its live token (the
    # online logsumexp's edge case). The interpreter runs every program in numpy, so time grows with
    # rows x calls x blocks per row: one distribution check on 64 rows and the same-draw check on 8, over 8
    # blocks of a row where 128-column blocks made 20.
    run_interpreted("import functools, tests.test_sample_kernel as t, kernels.sample as s; "
                    "t.check_sampler(functools.partial(s.gumbel_sample, split=3, block=512), rows=64, V=3585, "
                    "steps=(0,), same_rows=8); "
                    "print('ok')")


def test_cdf_kernel_interpreted_on_cpu():
    # the inverse-CDF sampler: several parts and several pick steps per part (a tenth of the Gumbel test's time)
    run_interpreted("import functools, tests.test_sample_kernel as t, kernels.sample as s; "
                    "t.check_sampler(functools.partial(s.cdf_sample, split=3, block=128, pick_block=256), rows=64, "
                    "V=2500, steps=(0,), same_rows=8); "
                    "print('ok')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_full_vocab():
    for fn in (gumbel_sample, cdf_sample):
        check_sampler(fn, "cuda", V=151936, rows=2000, dtype=torch.bfloat16)
        check_sampler(fn, "cuda", V=11, rows=20000)
