"""The decode-attention kernel (kernels/decode_attention.py) against sdpa in float64.

Tiers as in test_kernels.py: the torch twin here, the Triton kernel interpreted on CPU in a subprocess,
the kernel on CUDA at W1's decode shape (skipped without a GPU).
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402


def check_attention(fn, device="cpu", B=3, nh=6, nkv=2, S=150, D=40, last=97, dtype=torch.float32, tol=1e-5):
    """Random q/k/v, a key mask with holes (left padding) and a `last` slot inside the cache: the output equals
    float64 sdpa over keys [0, last] that the mask allows; a sequence that sees no key gives 0."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h, T in ((nh, 1), (nkv, S), (nkv, S)))
    ok = torch.rand(B, S, generator=g) > 0.3
    ok[0, :] = False                                               # row 0 sees nothing: output 0, not nan
    ok[1:, last] = True
    ok[1:, :5] = False                                             # left padding
    visible = ok & (torch.arange(S) <= last)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible[:, None, None],
                                          scale=0.3, enable_gqa=True).squeeze(2)     # (B, nh, D)
    want[0] = 0
    cast = lambda t: t.to(device=device, dtype=dtype)
    k_big, v_big = cast(torch.cat([k, k], 2)), cast(torch.cat([v, v], 2))    # a strided view: slots beyond S
    ok = ok.to(device) if B % 2 else ok.to(device, torch.uint8)                # both mask dtypes
    got = fn(cast(q), k_big[:, :, :S], v_big[:, :, :S], ok, torch.tensor([last], device=device), 0.3)
    assert got.shape == (B, nh, D) and got.dtype == dtype
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= tol, err


def test_reference_matches_sdpa():
    check_attention(decode_attention_reference)


def test_bad_shapes_are_named():
    q, kv = torch.zeros(2, 4, 1, 8), torch.zeros(2, 3, 10, 8)
    with pytest.raises(ValueError, match="kv_heads"):
        decode_attention_reference(q, kv, kv, torch.ones(2, 10, dtype=torch.bool), torch.tensor([3]), 1.0)
    with pytest.raises(ValueError, match="key_ok"):
        decode_attention_reference(q, kv[:, :2], kv[:, :2], torch.ones(2, 9, dtype=torch.bool), torch.tensor([3]), 1.0)


def test_kernel_interpreted():
    run_interpreted("""
import torch
from tests.test_decode_attention import check_attention
from kernels.decode_attention import decode_attention
check_attention(decode_attention)                                  # odd head_dim, GQA 3, several blocks
check_attention(decode_attention, B=2, nh=4, nkv=4, S=70, D=16, last=69)   # MHA, last = final slot
check_attention(decode_attention, B=2, nh=14, nkv=2, S=64, D=64, last=0)   # one slot
print("ok")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_cuda():
    for last in (0, 63, 64, 200, 319):
        check_attention(decode_attention, "cuda", B=128, nh=14, nkv=2, S=320, D=64, last=last, dtype=torch.bfloat16,
                        tol=3e-2)
    check_attention(decode_attention, "cuda", B=5, nh=6, nkv=2, S=150, D=40, last=97)   # float32, odd sizes
