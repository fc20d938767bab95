"""tools/decode_kernel_bench.py's CPU parts (the timing itself needs CUDA): the shared-prompt layout it times."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

import decode_kernel_bench as bench  # noqa: E402


def test_shared_prompt_is_the_shared_prefills_layout():
    """Groups of n sequences hold their first sequence's prompt slots (K, V and key mask) and nothing else
    changes; the share it returns names those first sequences and the prompt's length."""
    g = torch.Generator().manual_seed(0)
    B, nkv, S, D, n, prompt = 8, 2, 12, 4, 4, 5
    k, v = torch.randn(B, nkv, S, D, generator=g), torch.randn(B, nkv, S, D, generator=g)
    ok = torch.rand(B, S, generator=g) > 0.3
    k0, v0, ok0 = k.clone(), v.clone(), ok.clone()
    src, shared = bench.shared_prompt([k, v], ok, n, prompt)
    assert src.tolist() == [0, 0, 0, 0, 4, 4, 4, 4] and shared.tolist() == [prompt]
    for b in range(B):
        first = b // n * n
        assert torch.equal(k[b, :, :prompt], k0[first, :, :prompt])
        assert torch.equal(v[b, :, :prompt], v0[first, :, :prompt])
        assert torch.equal(ok[b, :prompt], ok0[first, :prompt])
        assert torch.equal(k[b, :, prompt:], k0[b, :, prompt:]) and torch.equal(v[b, :, prompt:], v0[b, :, prompt:])
        assert torch.equal(ok[b, prompt:], ok0[b, prompt:])


def test_bad_numbers_fail_before_any_gpu_work():
    """--once (a profiler's single call), --fills and --share take non-negative slot counts: a bad one ends the
    run with a line naming all three, before the CUDA check."""
    import subprocess
    for bad in (["--once", "-3"], ["--fills", "64,-1"], ["--share", "8"]):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "decode_kernel_bench.py"), "--out",
                            os.devnull, *bad], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--once a slot count >= 0" in r.stderr, (bad, r.stderr)
