"""The decode attention's contract, checked, and its torch twin (kernels/decode_attention.py holds the kernel).

    check_inputs(qkv, cos, sin, pos, k, v, key_ok, last, qk_norm=None, share=None)
    # a ValueError naming the argument whose shape, dtype, layout or device breaks `decode_attention`'s contract,
    # before any launch; the kernel and the twin call it alike, so both refuse the same inputs
    o = decode_attention_reference(...)   # decode_attention's arguments, less its launch settings: the same result
    # in float32, the CPU path's attention and the tests' yardstick

`rotate` and `head_norm` are the rotary embedding and Qwen3's per-head RMSNorm as transformers computes them; the
engines' layer-by-layer path calls them too.
"""
import torch
from torch import Tensor


def check_inputs(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k: Tensor, v: Tensor, key_ok: Tensor,
                 last: Tensor, qk_norm: tuple | None = None, share: tuple | None = None):
    """A ValueError for the first argument that breaks the contract (the module's docstring); None when all keep it."""
    if k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"k, v must be (B, kv_heads, S, head_dim), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, nkv, S, D = k.shape
    nh = qkv.shape[-1] // D - 2 * nkv if qkv.dim() == 2 else 0
    if qkv.dim() != 2 or qkv.shape[0] != B or nh <= 0 or nh % nkv or qkv.shape[1] != (nh + 2 * nkv) * D or D % 2:
        raise ValueError(f"qkv must be (B, (heads + 2 kv_heads) * head_dim) with heads % kv_heads == 0 and an even "
                         f"head_dim; got qkv {tuple(qkv.shape)}, k {tuple(k.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D or cos.shape[0] < S:
        raise ValueError(f"cos, sin must be (>= S, head_dim) = (>= {S}, {D}), "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if pos.shape != (B,) or pos.dtype != torch.long:
        raise ValueError(f"pos must be a ({B},) int64 tensor, got {pos.dtype} {tuple(pos.shape)}")
    if key_ok.shape != (B, S) or key_ok.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"key_ok must be bool or uint8 (B, S) = ({B}, {S}), got {key_ok.dtype} {tuple(key_ok.shape)}")
    if last.shape != (1,) or last.dtype != torch.long:
        raise ValueError(f"last must be a (1,) int64 tensor, got {last.dtype} {tuple(last.shape)}")
    if any(t.stride(-1) != 1 for t in (qkv, cos, sin, k, v, key_ok)) or sin.stride(0) != cos.stride(0):
        raise ValueError("qkv, cos, sin, k, v and key_ok must be contiguous in their last dimension")
    if B == 0 or S == 0 or k.dtype != v.dtype or not k.is_floating_point():
        raise ValueError(f"k, v must be float caches of one dtype with B, S >= 1, got {k.dtype} {v.dtype} "
                         f"{tuple(k.shape)}")
    if len({t.device for t in (qkv, cos, sin, pos, k, v, key_ok, last)}) > 1:
        raise ValueError("qkv, cos, sin, pos, k, v, key_ok and last must be on one device")
    if qk_norm is not None:
        qw, kw, _ = qk_norm
        if any(w.shape != (D,) or w.dtype != qkv.dtype or w.device != qkv.device or w.stride(0) != 1 for w in (qw, kw)):
            raise ValueError(f"qk_norm's weights must be contiguous ({D},) tensors of qkv's dtype and device, got "
                             f"{tuple(qw.shape)} {qw.dtype}, {tuple(kw.shape)} {kw.dtype}")
    if share is not None:
        src, shared = share
        if src.shape != (B,) or shared.shape != (1,) or src.dtype != torch.long or shared.dtype != torch.long \
                or src.device != k.device or shared.device != k.device:
            raise ValueError(f"share must be (src ({B},) int64, shared (1,) int64) on the cache's device, got src "
                             f"{src.dtype} {tuple(src.shape)}, shared {shared.dtype} {tuple(shared.shape)}")


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding as transformers' Llama/Qwen2 apply it: x (..., D), cos and sin broadcastable to x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def head_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """transformers' Qwen3RMSNorm over the last dimension of x, op for op."""
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def decode_attention_reference(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k: Tensor, v: Tensor,
                               key_ok: Tensor, last: Tensor, scale: float, qk_norm: tuple | None = None,
                               share: tuple | None = None) -> Tensor:
    """The torch twin: the same contract, in float32 (the slots after `last` are masked, not skipped). share is
    checked and not followed: by its contract the row's own slots hold the same values, and gathering src's rows
    here would copy the cache each call (the CPU engine's path)."""
    check_inputs(qkv, cos, sin, pos, k, v, key_ok, last, qk_norm, share)
    B, nkv, S, D = k.shape
    nh = qkv.shape[1] // D - 2 * nkv
    if qk_norm is not None:
        qw, kw, eps = qk_norm
        q, kn, vn = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
        q, kn = head_norm(q.view(B, nh, D), qw, eps).view(B, -1), head_norm(kn.view(B, nkv, D), kw, eps).view(B, -1)
        qkv = torch.cat([q, kn, vn], dim=-1)
    q, kn, vn = qkv.float().split([nh * D, nkv * D, nkv * D], dim=-1)
    c, s_ = cos[pos].float()[:, None], sin[pos].float()[:, None]        # (B, 1, D)
    q = rotate(q.view(B, nh, D), c, s_).to(k.dtype)                    # (B, nh, D)
    k_new = rotate(kn.view(B, nkv, D), c, s_).to(k.dtype)[:, :, None]   # (B, nkv, 1, D)
    v_new = vn.view(B, nkv, 1, D).to(v.dtype)
    # the new token's key and value go to slot `last`; a `last` >= S writes nothing (as the kernel), here by
    # writing the last slot's own value back, with no host sync
    inside = last < S
    slot = last.clamp(max=S - 1).expand(B, nkv)[:, :, None, None].expand(B, nkv, 1, D)
    k.scatter_(2, slot, torch.where(inside, k_new, k.gather(2, slot)))
    v.scatter_(2, slot, torch.where(inside, v_new, v.gather(2, slot)))
    # attend over the slots before `last` that key_ok allows, and the new token itself
    # (the token's own score is a column of its own: no copy of the cache with the token appended)
    ok = key_ok.bool() & (torch.arange(S, device=k.device) < last)                  # (B, S)
    g = nh // nkv
    qg = q.float().reshape(B, nkv, g, D)
    sc = (qg @ k.float().transpose(-1, -2)) * scale                                 # (B, nkv, g, S)
    sc = sc.masked_fill(~ok[:, None, None], float("-inf"))
    own = (qg @ k_new.float().transpose(-1, -2)) * scale                            # (B, nkv, g, 1)
    p = torch.cat([sc, own], -1).softmax(-1)                                        # (B, nkv, g, S + 1)
    o = p[..., :S] @ v.float() + p[..., S:] * v_new.float()                         # (B, nkv, g, D)
    return o.reshape(B, nh * D).to(qkv.dtype)
