"""The decode-attention kernel (kernels/decode_attention.py): rotary, cache write and attention against float64.

Tiers as in test_kernels.py: the torch twin here, the Triton kernel interpreted on CPU in a subprocess,
the kernel on CUDA at W1's decode shape (skipped without a GPU).
"""
import functools
import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.decode_attention_ref import decode_attention_reference, head_norm  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402


def rope(x, cos, sin):
    """transformers' rotary embedding, written out: x (..., D), cos/sin (..., D)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def check_attention(fn, device="cpu", B=3, nh=6, nkv=2, S=150, D=40, last=97, dtype=torch.float32, tol=1e-5):
    """Random q/k/v of the new token, a cache already holding keys, a key mask with holes (left padding), a
    `last` slot inside the cache: the output equals float64 sdpa of the rotated query over the rotated new key
    at `last` and the keys [0, last) the mask allows; the cache gets the rotated key and the value at `last`
    and nothing else changes."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=g)
    k, v = torch.randn(B, nkv, S, D, generator=g), torch.randn(B, nkv, S, D, generator=g)
    cos, sin = torch.randn(S + 3, D, generator=g), torch.randn(S + 3, D, generator=g)   # any table: exact rotation
    pos = torch.randint(0, S + 3, (B,), generator=g)
    ok = torch.rand(B, S, generator=g) > 0.3
    ok[0, :] = False                                               # row 0 sees only its new token
    ok[1:, :5] = False                                             # left padding
    cast = lambda t: t.to(device=device, dtype=dtype)
    q_, k_, v_ = cast(qkv).double().cpu().split([nh * D, nkv * D, nkv * D], -1)    # as the kernel sees them
    c, s = cast(cos).double().cpu()[pos][:, None], cast(sin).double().cpu()[pos][:, None]   # (B, 1, D)
    q_new = cast(rope(q_.view(B, nh, D), c, s)).double().cpu()    # rounded to the cache's dtype, as the layer does
    k_want, v_want = cast(k).double().cpu(), cast(v).double().cpu()
    k_want[:, :, last] = cast(rope(k_.view(B, nkv, D), c, s)).double().cpu()
    v_want[:, :, last] = v_.view(B, nkv, D)
    visible = (ok | (torch.arange(S) == last)) & (torch.arange(S) <= last)
    want = F.scaled_dot_product_attention(q_new[:, :, None], k_want, v_want, attn_mask=visible[:, None, None],
                                          scale=0.3, enable_gqa=True).reshape(B, nh * D)
    k_big, v_big = cast(torch.cat([k, k], 2)), cast(torch.cat([v, v], 2))    # a strided view: slots beyond S
    okd = ok.to(device) if B % 2 else ok.to(device, torch.uint8)               # both mask dtypes
    got = fn(cast(qkv), cast(cos), cast(sin), pos.to(device), k_big[:, :, :S], v_big[:, :, :S], okd,
             torch.tensor([last], device=device), 0.3)
    assert got.shape == (B, nh * D) and got.dtype == dtype
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= tol, err
    torch.testing.assert_close(k_big[:, :, :S].double().cpu(), k_want, rtol=tol, atol=tol)   # rotated: an ulp apart
    assert torch.equal(v_big[:, :, :S].double().cpu(), v_want)
    assert torch.equal(k_big[:, :, S:], cast(k)) and torch.equal(v_big[:, :, S:], cast(v))   # beyond S: untouched


def check_norm(fn, device="cpu", B=3, nh=4, nkv=2, S=40, D=16, last=20, dtype=torch.float32, tol=1e-5):
    """With qk_norm, fn equals the reference run on q/k/v whose heads were normed beforehand by transformers'
    Qwen3RMSNorm formula (kernels.decode_attention_ref.head_norm), cache write included. Both outputs are rounded to
    dtype: in bf16 they may differ by an ulp of the larger values, hence a relative part of 2 bf16 ulps."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cast = lambda t: t.to(device=device, dtype=dtype)
    qkv = cast(torch.randn(B, (nh + 2 * nkv) * D, generator=g) * 3)
    qw, kw = cast(torch.rand(D, generator=g) + 0.5), cast(torch.rand(D, generator=g) + 0.5)
    k, v = cast(torch.randn(B, nkv, S, D, generator=g)), cast(torch.randn(B, nkv, S, D, generator=g))
    cos, sin = cast(torch.randn(S, D, generator=g)), cast(torch.randn(S, D, generator=g))
    pos, ok = torch.randint(0, S, (B,), generator=g).to(device), (torch.rand(B, S, generator=g) > 0.3).to(device)
    q_, k_, v_ = qkv.split([nh * D, nkv * D, nkv * D], -1)
    normed = torch.cat([head_norm(q_.view(B, nh, D), qw, 1e-6).view(B, -1),
                        head_norm(k_.view(B, nkv, D), kw, 1e-6).view(B, -1), v_], -1)
    k2, v2 = k.clone(), v.clone()
    want = decode_attention_reference(normed, cos, sin, pos, k2, v2, ok, torch.tensor([last], device=device), 0.3)
    got = fn(qkv, cos, sin, pos, k, v, ok, torch.tensor([last], device=device), 0.3, qk_norm=(qw, kw, 1e-6))
    rtol = 2 ** -7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=tol)
    torch.testing.assert_close(k.double(), k2.double(), rtol=tol, atol=tol)
    assert torch.equal(v, v2)


def check_last_past_cache(fn, B=2, nh=4, nkv=2, S=40, D=16, tol=1e-5, device="cpu", **kw):
    """A `last` >= S (a device tensor the host never reads) writes nothing and attends over the S slots key_ok
    allows and the new token: as `last` = S on a cache one slot longer whose extra slot is free. The cache, and
    memory just past it (a strided view), stay as they were."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=g)
    k, v = torch.randn(B, nkv, S + 8, D, generator=g), torch.randn(B, nkv, S + 8, D, generator=g)
    cos, sin = torch.randn(S + 8, D, generator=g), torch.randn(S + 8, D, generator=g)
    pos, ok = torch.randint(0, S, (B,), generator=g), torch.rand(B, S + 1, generator=g) > 0.3
    qkv, k, v, cos, sin, pos, ok = (t.to(device) for t in (qkv, k, v, cos, sin, pos, ok))
    want = fn(qkv, cos, sin, pos, k[:, :, :S + 1].clone(), v[:, :, :S + 1].clone(), ok,
              torch.tensor([S], device=device), 0.3, **kw)
    for last in (S, S + 3):
        kb, vb = k.clone(), v.clone()
        got = fn(qkv, cos, sin, pos, kb[:, :, :S], vb[:, :, :S], ok[:, :S].contiguous(),
                 torch.tensor([last], device=device), 0.3, **kw)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.equal(kb, k) and torch.equal(vb, v)


def check_share(fn, device="cpu", B=5, nh=6, nkv=2, S=70, D=16, last=50, shared=23, dtype=torch.float32,
                tol=1e-5, group=None, exact=True, **kw):
    """share=(src, shared): row b's slots below `shared` are read from row src[b]. Rows that differ there give
    the result of the unshared call on a cache whose rows hold src's slots (so the kernel reads src, not its own
    row); on that cache, the shared call equals the unshared one bit for bit (the same values read; exact=False:
    within tol, where the shared slots are read in tiles of another shape); the new token's key and value go to
    each row's own slot `last` only. group: rows in groups of that many reading the group's first (GRPO's
    samples), else a hand-picked map."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cast = lambda t: t.to(device=device, dtype=dtype)
    qkv = cast(torch.randn(B, (nh + 2 * nkv) * D, generator=g))
    k, v = cast(torch.randn(B, nkv, S, D, generator=g)), cast(torch.randn(B, nkv, S, D, generator=g))
    cos, sin = cast(torch.randn(S, D, generator=g)), cast(torch.randn(S, D, generator=g))
    pos, ok = torch.randint(0, S, (B,), generator=g).to(device), (torch.rand(B, S, generator=g) > 0.3).to(device)
    src = torch.tensor([0, 0, 2, 2, 0, 2, 6][:B]) if group is None else torch.arange(B) // group * group
    src = src.to(device)                                                  # default: rows 1, 4 read 0; 3, 5 read 2
    at = torch.tensor([last], device=device)
    k_src, v_src = k.clone(), v.clone()                                   # the caches as the shared prefill leaves them
    k_src[:, :, :shared], v_src[:, :, :shared] = k[src, :, :shared], v[src, :, :shared]
    share = (src, torch.tensor([shared], device=device))
    k1, v1, k2, v2, k3, v3 = k_src.clone(), v_src.clone(), k.clone(), v.clone(), k_src.clone(), v_src.clone()
    want = fn(qkv, cos, sin, pos, k1, v1, ok, at, 0.3, **kw)
    got = fn(qkv, cos, sin, pos, k2, v2, ok, at, 0.3, share=share, **kw)   # differing rows: src's slots are read
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    same = fn(qkv, cos, sin, pos, k3, v3, ok, at, 0.3, share=share, **kw)   # equal rows: exact
    assert torch.equal(same, want) if exact else torch.allclose(same, want, rtol=tol, atol=tol)
    assert torch.equal(k1, k3) and torch.equal(v1, v3)
    k_src[:, :, last], v_src[:, :, last] = k1[:, :, last], v1[:, :, last]   # the only slot written, per own row
    k[:, :, last], v[:, :, last] = k1[:, :, last], v1[:, :, last]
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_reference_share_is_checked():
    """The twin does not follow share (by its contract the row's own slots are equal), but checks its shapes."""
    kv, cs, pos, last = torch.zeros(2, 2, 10, 8), torch.zeros(10, 8), torch.zeros(2, dtype=torch.long), torch.tensor([3])
    ok = torch.ones(2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="share"):
        decode_attention_reference(torch.zeros(2, (2 + 4) * 8), cs, cs, pos, kv, kv, ok, last, 1.0,
                                   share=(torch.zeros(3, dtype=torch.long), torch.tensor([2])))


def test_reference_last_past_cache():
    check_last_past_cache(decode_attention_reference)


def test_reference_matches_sdpa():
    check_attention(decode_attention_reference)


def test_reference_qk_norm():
    """The twin's fused norm is the norm module's ops, so it equals norming first exactly (tol 0)."""
    check_norm(decode_attention_reference, tol=0.0)
    with pytest.raises(ValueError, match="qk_norm"):
        check_norm(lambda *a, qk_norm: decode_attention_reference(*a, qk_norm=(qk_norm[0][:-1], *qk_norm[1:])))


def test_bad_shapes_are_named():
    kv, cs, pos, last = torch.zeros(2, 3, 10, 8), torch.zeros(10, 8), torch.zeros(2, dtype=torch.long), torch.tensor([3])
    ok = torch.ones(2, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="kv_heads"):
        decode_attention_reference(torch.zeros(2, (4 + 6) * 8), cs, cs, pos, kv, kv, ok, last, 1.0)
    with pytest.raises(ValueError, match="key_ok"):
        decode_attention_reference(torch.zeros(2, (6 + 6) * 8), cs, cs, pos, kv, kv, ok[:, :9], last, 1.0)
    with pytest.raises(ValueError, match="pos"):
        decode_attention_reference(torch.zeros(2, (6 + 6) * 8), cs, cs, pos.float(), kv, kv, ok, last, 1.0)


def check_layout(G: int, heads: int, rows: int, block: int):
    """The kernel's rows and tile columns (`_layout`, run by `_probe_layout`): a row owns exactly the columns of
    its own sequence and KV head, and a padded row owns none. The second is speed, not correctness: a padded row
    that owns columns gets real scores, and the compiler keeps their softmax work (docs/kernels.md)."""
    import triton
    RP, C = max(16, triton.next_power_of_2(rows * heads * G)), rows * heads * block
    out = torch.zeros(RP, C, dtype=torch.int8)
    _probe_layout[(1,)](out, G=G, HEADS=heads, ROWS=rows, RP=RP, BLOCK=block)
    r, c = torch.arange(RP)[:, None], torch.arange(C)[None, :]
    n = heads * G                                                  # rows a sequence
    want = (r < rows * n) & (r // n == c // (heads * block)) & (r % n // G == c // block % heads)
    assert torch.equal(out.bool(), want), (G, heads, rows, block, out)


_da = importlib.import_module("kernels.decode_attention")
if getattr(_da, "_layout", None) is not None:
    import triton
    import triton.language as tl

    from kernels.decode_attention import _layout  # noqa: E402

    @triton.jit
    def _probe_layout(out_ptr, G: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr, RP: tl.constexpr,
                      BLOCK: tl.constexpr):
        r, rr, hr, c, hc, bq, bc, own = _layout(0, G, HEADS, ROWS, RP, BLOCK)
        tl.store(out_ptr + r[:, None] * (ROWS * HEADS * BLOCK) + c[None, :], own.to(tl.int8))


def test_padded_rows_own_no_column_interpreted():
    run_interpreted("""
from tests.test_decode_attention import check_layout
check_layout(7, 1, 1, 64)     # W1's shape: 7 rows of 16
check_layout(2, 1, 4, 32)     # qwen3's default: 4 sequences of 2 rows, 8 of 16
check_layout(2, 2, 1, 16)     # qwen3's old setting: 2 KV heads of 2 rows, 4 of 16
check_layout(3, 2, 2, 16)     # 12 of 16
check_layout(1, 1, 1, 16)     # MHA: 1 of 16
check_layout(2, 2, 4, 16)     # 16 of 16: none padded
print("ok")
""")


def test_kernel_interpreted():
    run_interpreted("""
import functools
import importlib
import torch
from tests.test_decode_attention import check_attention
from kernels.decode_attention import decode_attention
check_attention(decode_attention)                                  # odd head_dim, GQA 3, several blocks
check_attention(decode_attention, B=2, nh=4, nkv=4, S=70, D=16, last=69)   # MHA, last = final slot
check_attention(decode_attention, B=2, nh=14, nkv=2, S=64, D=64, last=0)   # one slot
split = functools.partial(decode_attention, splits=4, block=16)    # flash-decoding: 4 chunks merged in-kernel
check_attention(split, B=2, nh=6, nkv=2, S=150, D=40, last=97)     # row 0: only split 0 sees a key
check_attention(split, B=2, nh=6, nkv=2, S=150, D=40, last=20)     # splits past the filled length
check_attention(split, B=1, nh=14, nkv=2, S=64, D=64, last=0)
from tests.test_decode_attention import check_norm
check_norm(decode_attention)                                       # qwen3's q/k norm in the prologue, GQA 2
check_norm(decode_attention, B=2, nh=3, nkv=3, S=40, D=24, last=39)   # D not a power of two: padded columns
check_attention(functools.partial(decode_attention, heads=2, block=16), B=2, nh=12, nkv=4, S=50, D=24,
                last=33)                                           # 2 KV heads a program, GQA 3: rows padded
check_norm(functools.partial(decode_attention, heads=4, block=16), B=2, nh=8, nkv=4, S=40, D=16, last=20)
check_attention(functools.partial(decode_attention, heads=2, splits=4, block=16), B=2, nh=8, nkv=4, S=70, D=16,
                last=40)                                           # and split
from tests.test_decode_attention import check_share
check_share(decode_attention)                                      # a prompt's rows read one row's slots
check_share(functools.partial(decode_attention, block=16), shared=40, last=40)   # every slot before last shared
check_share(functools.partial(decode_attention, heads=2, block=16), nh=8, nkv=4, shared=17)   # mid-block bound
check_share(functools.partial(decode_attention, splits=4, block=16), shared=30)   # split: chunks on both sides
rows = lambda n, **kw: functools.partial(decode_attention, rows=n, block=16, **kw)   # n sequences a program
check_attention(rows(2), B=4, nh=6, nkv=2, S=70, D=16, last=40)
check_attention(rows(4), B=6, nh=6, nkv=2, S=70, D=16, last=69)   # cut to 2: the largest that divides B
check_norm(rows(4, heads=2), B=4, nh=8, nkv=4, S=40, D=16, last=20)
check_attention(rows(2, splits=4), B=4, nh=6, nkv=2, S=70, D=16, last=40)
check_share(rows(1))                                               # one sequence: the shared tiles' shape, exact
check_share(rows(2), B=6, exact=False)                             # pairs with one src, and one with two
check_share(rows(2), B=8, group=4, shared=40, last=40, exact=False)   # src in another program's sequences
check_share(rows(4, heads=2), B=8, nh=8, nkv=4, group=4, shared=33, exact=False)   # mid-block bound
check_share(rows(4, splits=4), B=8, group=4, shared=30)            # split: no shared tiles, exact
check_share(rows(2), B=6, group=3, shared=60, last=45, exact=False)   # shared past last
check_share(rows(4), B=8, group=4, shared=0, last=45)              # nothing shared: exact
print("ok")
""")


def test_last_past_cache_interpreted():
    run_interpreted("""
import functools
from tests.test_decode_attention import check_last_past_cache
from kernels.decode_attention import decode_attention
check_last_past_cache(decode_attention)
check_last_past_cache(functools.partial(decode_attention, heads=2, block=16), nkv=4, nh=8, S=37)
check_last_past_cache(functools.partial(decode_attention, splits=4, block=16), S=70)
print("ok")
""")


def test_default_past_shared_memory_falls_back_interpreted():
    """A card whose shared memory is too small for the head_dim-128 default (cards of compute capability 8.6 and
    8.9): the op launches SMALL's setting instead and the result is right; an override that does not fit still
    fails with its UserError (kernels/decode_attention.py: _decode_attention_op)."""
    run_interpreted("""
import functools
import importlib
import pytest
import triton
from tests.test_decode_attention import check_attention
from config_tree import UserError
da = importlib.import_module("kernels.decode_attention")
kernel, launched = da._decode_attention, []
class SmallCard:   # the kernel, refusing tiles past 100 KB as such a card's launch does
    def __getitem__(self, grid):
        def go(*a, **kw):
            launched.append((kw["BLOCK"], kw["num_warps"], kw["num_stages"], kw["HEADS"], kw["ROWS"]))
            need = kw["num_stages"] * 2 * kw["ROWS"] * kw["HEADS"] * kw["BLOCK"] * kw["DP"] * 4
            if need > 100 << 10:
                raise triton.runtime.errors.OutOfResources(need, 100 << 10, "shared memory")
            return kernel[grid](*a, **kw)
        return go
da._decode_attention = SmallCard()
assert da.SETTINGS[128] == (32, 4, 2, 1, 4)
check_attention(da.decode_attention, B=4, nh=4, nkv=2, S=40, D=128, last=30)
assert launched == [(32, 4, 2, 1, 4), (16, 4, 3, 2, 1)], launched
check_attention(da.decode_attention, B=4, nh=4, nkv=2, S=40, D=128, last=30)
assert launched[2:] == [(16, 4, 3, 2, 1)], launched                # remembered: no second attempt
check_attention(functools.partial(da.decode_attention, heads=2, block=16), B=4, nh=4, nkv=2, S=40, D=128, last=30)
assert launched[3] == (16, 4, 2, 2, 1), launched                   # a caller's heads: one sequence a program
da.OVERRIDDEN.add(128)
with pytest.raises(UserError, match="FAST_DECODE_ATTN=128=32x4x2x1x4"):
    check_attention(da.decode_attention, B=4, nh=4, nkv=2, S=40, D=128, last=30)
print("ok")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_cuda():
    for last in (0, 63, 64, 200, 319):
        check_attention(decode_attention, "cuda", B=128, nh=14, nkv=2, S=320, D=64, last=last, dtype=torch.bfloat16,
                        tol=3e-2)
    check_attention(decode_attention, "cuda", B=5, nh=6, nkv=2, S=150, D=40, last=97)   # float32, odd sizes
    for last in (0, 200, 319):                                         # qwen3's decode shape
        check_attention(decode_attention, "cuda", B=128, nh=16, nkv=8, S=320, D=128, last=last, dtype=torch.bfloat16,
                        tol=3e-2)
    check_norm(decode_attention, "cuda", B=128, nh=16, nkv=8, S=320, D=128, last=200, dtype=torch.bfloat16, tol=3e-2)
    check_norm(decode_attention, "cuda", B=5, nh=6, nkv=2, S=150, D=40, last=97)   # float32, odd sizes
    for heads, last in ((2, 0), (4, 200), (8, 319)):                   # several KV heads a program
        check_attention(functools.partial(decode_attention, heads=heads, block=16), "cuda", B=128, nh=16, nkv=8,
                        S=320, D=128, last=last, dtype=torch.bfloat16, tol=3e-2)
    check_norm(functools.partial(decode_attention, heads=8, block=16), "cuda", B=128, nh=16, nkv=8, S=320, D=128,
               last=200, dtype=torch.bfloat16, tol=3e-2)
    check_attention(functools.partial(decode_attention, heads=2, block=64), "cuda", B=128, nh=14, nkv=2, S=320,
                    D=64, last=200, dtype=torch.bfloat16, tol=3e-2)
    for splits, last in ((4, 0), (4, 130), (8, 319), (16, 200)):
        check_attention(functools.partial(decode_attention, splits=splits, block=32), "cuda", B=128, nh=14, nkv=2,
                        S=320, D=64, last=last, dtype=torch.bfloat16, tol=3e-2)
    for last, shared in ((64, 64), (200, 64), (319, 1)):              # qwen3's shape, GRPO's groups of 8 rows
        check_share(functools.partial(decode_attention), "cuda", B=128, nh=16, nkv=8, S=320, D=128, last=last,
                    shared=shared, dtype=torch.bfloat16, tol=3e-2, group=8, exact=False)   # 4 sequences a program
        check_share(functools.partial(decode_attention, rows=1, heads=2, block=16, stages=3), "cuda", B=128, nh=16,
                    nkv=8, S=320, D=128, last=last, shared=shared, dtype=torch.bfloat16, tol=3e-2, group=8)
    check_share(functools.partial(decode_attention), "cuda", B=128, nh=16, nkv=8, S=320, D=128, last=200, shared=64,
                dtype=torch.bfloat16, tol=3e-2, group=6, exact=False)   # programs whose sequences read two srcs
    for n, heads, last in ((2, 2, 100), (8, 1, 319)):
        check_attention(functools.partial(decode_attention, rows=n, heads=heads), "cuda", B=128, nh=16, nkv=8,
                        S=320, D=128, last=last, dtype=torch.bfloat16, tol=3e-2)
    check_share(decode_attention, "cuda", B=128, nh=14, nkv=2, S=320, D=64, last=200, shared=64,
                dtype=torch.bfloat16, tol=3e-2, group=8)                 # W1's
    check_share(functools.partial(decode_attention, splits=4, block=32), "cuda", B=128, nh=14, nkv=2, S=320, D=64,
                last=130, shared=64, dtype=torch.bfloat16, tol=3e-2, group=8)
    check_last_past_cache(decode_attention, device="cuda")            # a last past the cache: nothing written
    check_last_past_cache(functools.partial(decode_attention, splits=4, block=16), S=70, device="cuda")


def test_oversized_override_names_the_setting(monkeypatch):
    """A FAST_DECODE_ATTN entry whose tiles do not fit the card: a one-line UserError naming it; a setting passed
    as arguments: a ValueError naming them (kernels/decode_attention.py: too_big)."""
    da = importlib.import_module("kernels.decode_attention")   # the package exports a function of that name
    from config_tree import UserError
    monkeypatch.setitem(da.SETTINGS, 128, (256, 4, 4, 8, 1))
    monkeypatch.setattr(da, "OVERRIDDEN", {128})
    oom = RuntimeError("out of resource: shared memory, Required: 600000, Hardware limit: 232448\nmore")
    err = da.too_big(128, (256, 4, 4, 8), oom)
    assert isinstance(err, UserError) and "FAST_DECODE_ATTN=128=256x4x4x8" in str(err) and "\n" not in str(err)
    assert "32x4x2x1x4" in str(err)                                    # the default it would fall back to
    assert isinstance(da.too_big(64, (512, 4, 4, 1), oom), ValueError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_oversized_override_cuda(monkeypatch):
    """On the card: an override past its shared memory fails at launch with the UserError, not Triton's error."""
    da = importlib.import_module("kernels.decode_attention")   # the package exports a function of that name
    from config_tree import UserError
    monkeypatch.setitem(da.SETTINGS, 128, (128, 4, 3, 8, 1))
    monkeypatch.setattr(da, "OVERRIDDEN", {128})
    with pytest.raises(UserError, match="FAST_DECODE_ATTN=128=128x4x3x8"):
        check_attention(decode_attention, "cuda", B=2, nh=16, nkv=8, S=64, D=128, last=10, dtype=torch.bfloat16,
                        tol=3e-2)
