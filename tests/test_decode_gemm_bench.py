"""tools/decode_gemm_bench.py's split-K Triton GEMM, interpreted on the CPU: each partial sum is its own run of K
steps (the runs of an uneven split included), their sum is the product, and every variant of the tool's table
matches the cuBLAS route's math at its tiny shapes."""
import os
import sys

import pytest

from tests.interpret import ROOT, run_interpreted


def test_splitk_partials_interpreted_match_torch():
    # float16: triton 3.9's interpreter gets bfloat16 tl.dot wrong (tests/test_fused_kl.py)
    run_interpreted("""
import sys
import torch
sys.path.insert(0, "tools")
from decode_gemm_bench import check_tiny, splitk_partials
gen = torch.Generator().manual_seed(3)
M, N, K = 19, 40, 96                                   # rows and columns ragged against 16 x 16 tiles
x = torch.randn(M, K, generator=gen).half()
w = (torch.randn(N, K, generator=gen) * K ** -0.5).half()
want = x.double() @ w.double().T
for BK, split in ((16, 1), (16, 4), (16, 6), (32, 2), (16, 5)):   # 6 steps in 5 runs: 1, 1, 1, 1, 2 steps
    p = splitk_partials(x, w, (16, 16, BK, split, 4, 2))
    assert p.shape == (split, M, N) and p.dtype == torch.float32, p.shape
    steps = K // BK
    for s in range(split):   # the kernel's runs: steps [s * steps // split, (s + 1) * steps // split)
        lo, hi = s * steps // split * BK, (s + 1) * steps // split * BK
        ref = x[:, lo:hi].double() @ w[:, lo:hi].double().T
        assert (p[s].double() - ref).abs().max() < 1e-3, (BK, split, s, (p[s].double() - ref).abs().max())
    assert (p.double().sum(0) - want).abs().max() < 2e-3, (BK, split)
for bad in ((16, 16, 64, 1, 4, 2), (16, 16, 16, 7, 4, 2)):   # K not a multiple of BK; more runs than steps
    try:
        splitk_partials(x, w, bad)
        raise AssertionError(f"{bad} was taken")
    except ValueError as e:
        assert "multiple of BK" in str(e)
assert check_tiny() == 0
print("ok")
""")


def test_without_the_interpreter_tiny_asks_for_it(monkeypatch):
    # --tiny on the CPU without TRITON_INTERPRET=1 would fail deep inside triton's launcher: one line instead
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))
    import decode_gemm_bench
    monkeypatch.setattr(sys, "argv", ["decode_gemm_bench.py", "--tiny"])
    with pytest.raises(SystemExit, match="set TRITON_INTERPRET=1"):
        decode_gemm_bench.main()
