"""kernels/moe_experts.py: the decode step's expert GEMMs (x's rows gathered, SiLU(gate) * up in the epilogue,
each expert's weights streamed once) and kernels/decode_route.py's routing kernel, against their torch twins and
against engines/moe.py's other routes.

Tiers as in test_decode_attention.py: the twins here, the Triton kernels interpreted on CPU in a subprocess
(float32: the interpreter's bf16 dot is wrong), the kernels on CUDA in bf16 at W10's qwen3_moe shape (skipped
without a GPU).
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.moe_experts import expert_down_reference, expert_gate_up_reference  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402


def pairs(N: int, E: int, k: int, device="cpu", skew: bool = False):
    """Random top-k routing of N tokens -> (token (M,), offs (E,) int32) in expert order, as engines/moe.py sorts.
    skew: most pairs on expert 1 (more than a kernel's row block), expert E-1 with none."""
    from kernels.decode_route import by_expert
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    flat = torch.rand(N, E, generator=g).topk(k, -1).indices.reshape(-1)
    if skew:
        flat = torch.where(torch.rand(flat.shape, generator=g) < 0.8, 1, flat % (E - 1))
    order, _, offs = by_expert(flat.to(device), E)
    return order // k, offs


def check(device="cpu", N=9, H=32, I=48, E=4, k=2, dtype=torch.float32, skew=False, cfg=None, tol=1e-5):
    """Both kernels against the twins (relative Frobenius error), every output row written."""
    from kernels.moe_experts import expert_down, expert_gate_up
    token, offs = pairs(N, E, k, device, skew)
    cast = lambda t: t.to(device=device, dtype=dtype)
    x, gu, dn = cast(torch.randn(N, H)), cast(torch.randn(E, 2 * I, H) / H ** 0.5), cast(torch.randn(E, H, I) / I ** 0.5)
    a, a_ref = expert_gate_up(x, token, offs, gu, cfg), expert_gate_up_reference(x, token, offs, gu)
    y, y_ref = expert_down(a_ref, offs, dn, cfg), expert_down_reference(a_ref, offs, dn)
    for got, want in ((a, a_ref), (y, y_ref)):
        assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= tol


def test_twins_are_each_pairs_expert_mlp():
    """The twins against a loop over pairs: gate/up of the pair's token through its expert, SiLU(g) * u, down."""
    token, offs = pairs(7, 3, 2)
    x, gu, dn = torch.randn(7, 8), torch.randn(3, 12, 8), torch.randn(3, 8, 6)
    a, y = expert_gate_up_reference(x, token, offs, gu), None
    y = expert_down_reference(a, offs, dn)
    for m in range(token.shape[0]):
        e = int((offs <= m).sum())
        h = gu[e] @ x[token[m]]
        want = torch.nn.functional.silu(h[:6]) * h[6:]
        torch.testing.assert_close(a[m], want)
        torch.testing.assert_close(y[m], dn[e] @ a[m])
    with pytest.raises(ValueError, match="offs"):
        expert_gate_up_reference(x, token, offs.long(), gu)


def test_kernels_interpreted():
    run_interpreted("""
import torch
from tests.test_moe_experts import check
check()                                              # 4 experts, 9 tokens, top-2
check(N=40, E=3, H=64, I=32, skew=True, cfg=(16, 16, 16, 4, 2))   # an expert past one row block, one with none
import kernels.moe_experts as me
me.SPLIT = False                                     # an expert's row blocks looped over by its programs
check(N=40, E=3, H=64, I=32, skew=True, cfg=(16, 16, 16, 4, 2))
me.SPLIT = True
from engines.moe import routed_experts
torch.manual_seed(0)
x, router = torch.randn(6, 32), torch.randn(4, 32)
gu, dn = torch.randn(4, 2 * 16, 32) / 6, torch.randn(4, 32, 16) / 4
args = (x, router, 2, True, gu, dn, torch.nn.functional.silu)
import engines.moe as moe
for decode, router in ((False, "kernel"), (True, "kernel"), (True, "gemm")):   # decode: the routing kernel too
    moe.ROUTER = router                                # the router's GEMM in the routing kernel, or before it
    torch.testing.assert_close(routed_experts(*args, grouped="triton", decode=decode),
                               routed_experts(*args, grouped=False), rtol=1e-5, atol=1e-5)
from tools.kernel_families import check_moe_route
check_moe_route("cpu", 7, 12, 3, False, torch.float32)
check_moe_route("cpu", 40, 32, 4, True, torch.float32, H=48)
print("ok")
""")


def test_route_warps_switch_refuses_what_triton_cannot_launch():
    """FAST_DECODE_ROUTE_WARPS (the routing program's warps, kernels/decode_route.py) is refused at import in one
    line where it is no power of two up to 32, not at the first launch inside a captured step."""
    import subprocess
    code = "import kernels.decode_route as d; print(d.WARPS)"
    for value, ok in (("8", True), ("3", False), ("64", False)):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, FAST_DECODE_ROUTE_WARPS=value))
        assert (out.returncode == 0) == ok, out.stderr
        assert (out.stdout.strip() == value) if ok else "power of two up to 32, got" in out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_cuda():
    """bf16 at W10's qwen3_moe decode shape (128 tokens, top-4 of 32, hidden 1024, expert MLP 768), a skewed
    routing, and float32 at odd sizes; then the engine's route against torch's grouped GEMM."""
    check("cuda", N=128, H=1024, I=768, E=32, k=4, dtype=torch.bfloat16, tol=1e-2)
    check("cuda", N=128, H=1024, I=768, E=32, k=4, dtype=torch.bfloat16, skew=True, tol=1e-2)
    import kernels.moe_experts as me
    try:   # the row blocks looped over (the comparison) and one per program give the same rows, bitwise
        x, w = torch.randn(128, 256, device="cuda").bfloat16(), torch.randn(8, 2 * 96, 256, device="cuda").bfloat16()
        token, offs = pairs(128, 8, 4, "cuda", skew=True)
        me.SPLIT = False
        loop = me.expert_gate_up(x, token, offs, w)
        me.SPLIT = True
        assert torch.equal(loop, me.expert_gate_up(x, token, offs, w))
    finally:
        me.SPLIT = True
    import kernels.decode_route as dr
    before = dr.WARPS
    try:   # the routing program's warps (FAST_DECODE_ROUTE_WARPS): the same experts, order and weights, bitwise
        z = torch.randn(128, 32, device="cuda").bfloat16() + torch.randn(32, device="cuda").bfloat16()
        want = dr.route(z, 4, True, torch.bfloat16)   # 128 tokens: 8 warps by default
        dr.WARPS = 4
        assert all(torch.equal(u, v) for u, v in zip(want, dr.route(z, 4, True, torch.bfloat16)))
    finally:
        dr.WARPS = before
    check("cuda", N=9, H=40, I=24, E=5, k=2, tol=5e-3)                 # tf32 dots
    from engines.moe import grouped_ok, routed_experts
    if grouped_ok(torch.device("cuda"), torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(0)
        r = lambda *s, sc=1.0: torch.randn(*s, device="cuda", generator=g).mul(sc).to(torch.bfloat16)
        args = (r(128, 1024), r(32, 1024), 4, True, r(32, 1536, 1024, sc=1 / 32), r(32, 1024, 768, sc=1 / 28),
                torch.nn.functional.silu)
        b = routed_experts(*args, grouped=True).float()
        import engines.moe as moe
        before = moe.ROUTER
        try:
            for decode, moe.ROUTER in ((False, before), (True, "kernel"), (True, "gemm")):
                a = routed_experts(*args, grouped="triton", decode=decode).float()
                assert ((a - b).norm() / b.norm()).item() <= 1e-2
        finally:
            moe.ROUTER = before
    from tools.kernel_families import check_moe_route
    check_moe_route("cuda", 128, 32, 4, True, torch.bfloat16)          # W10's decode routing
    check_moe_route("cuda", 128, 32, 4, True, torch.bfloat16, H=1024)  # with its router's GEMM
    check_moe_route("cuda", 512, 64, 8, False, torch.float32)          # the most tokens the kernel takes
