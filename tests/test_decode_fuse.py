"""The decode step's norm + GEMM kernel (kernels/decode_fuse.py: norm_linear) against float64 formulas.

Tiers as in test_decode_attention.py: the torch twin here, the Triton kernel interpreted on CPU in a subprocess
(float32 and float16: the interpreter has no bfloat16), the kernel on CUDA at W1's decode shape in bfloat16
(skipped without a GPU). The step itself takes the kernel in tests/test_fast_decode.py's interpreted test.
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.decode_fuse import norm_linear, norm_linear_reference  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402


def check(fn, device="cpu", M=5, K=40, N=24, dtype=torch.float32, tol=1e-4, **kw):
    """Each combination of residual, bias and glu: y equals the float64 norm (of x + res), GEMM (+ bias) and
    SiLU x up, relative to y's scale; the returned residual stream equals x + res rounded to dtype."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for res_on, glu in ((False, False), (True, False), (False, True), (True, True)):
        x, r = torch.randn(M, K, generator=g), torch.randn(M, K, generator=g)
        nw = torch.randn(K, generator=g) * 0.3 + 1
        w = torch.randn(2 * N if glu else N, K, generator=g) * K ** -0.5
        b = None if glu else torch.randn(N, generator=g)
        cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
        s = cast(x) + cast(r) if res_on else cast(x)                  # the stream as the kernel must round it
        sd = s.double().cpu()
        h = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * cast(nw).double().cpu()
        want = h @ cast(w).double().cpu().T + (0 if b is None else cast(b).double().cpu())
        if glu:
            gate, up = want.chunk(2, -1)
            want = torch.nn.functional.silu(gate) * up
        y, xo = fn(cast(x), cast(r) if res_on else None, cast(nw), 1e-6, cast(w), cast(b), glu, **kw)
        assert y.shape == (M, N) and y.dtype == dtype and xo.dtype == dtype
        err = ((y.double().cpu() - want).abs().max() / want.abs().max()).item()
        assert err <= tol, (res_on, glu, err)
        assert torch.equal(xo, s)


def test_reference():
    check(norm_linear_reference)
    check(norm_linear_reference, dtype=torch.bfloat16, tol=2e-2)


def test_kernel_interpreted():
    run_interpreted("""
import torch
from kernels.decode_fuse import norm_linear
from tests.test_decode_fuse import check
check(norm_linear, settings=(16, 16, 16, 4, 1))                            # K over 3 steps, a partial last one
check(norm_linear, M=20, N=40, settings=(16, 32, 32, 4, 1))                # rows and columns over 2 blocks
check(norm_linear, dtype=torch.float16, tol=5e-3, settings=(16, 16, 16, 4, 1))
print("ok")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_cuda():
    check(norm_linear, "cuda", M=128, K=896, N=1152, dtype=torch.bfloat16, tol=2e-2)   # W1's q/k/v (default settings)
    check(norm_linear, "cuda", M=128, K=896, N=4864, dtype=torch.bfloat16, tol=2e-2)   # and its gate/up
    check(norm_linear, "cuda", M=3, K=100, N=50, dtype=torch.bfloat16, tol=2e-2)       # partial blocks everywhere
    check(norm_linear, "cuda", M=128, K=896, N=1152, dtype=torch.float32, tol=1e-4)     # float32 dots (no TF32)
