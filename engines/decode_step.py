"""The fast decoder's model step, written once for every family engines/families.py describes.

`Step._forward` runs the model by hand over its own modules (embedding weight, norms, projections through
engines/decode_weights.py's fused or packed groups, activations, rotary tables) with the static cache
engines/fast_decode.py allocates. Per layer, the spec (families.LayerSpec) says which norms sit where, whether
q and k are normed, which rotary table applies (the identity for layers without rotary), the sliding window,
and whether the MLP is routed experts (engines/moe.py).

On CUDA a decode step's layers whose norms and activation kernels/decode_fuse.py covers (`fusable`) take two
fused kernels for what sits between their GEMMs: the residual add and pre-attention norm in the q/k/v GEMM, the
residual add, pre-MLP norm and SiLU x up in the gate/up GEMM (the residual of the down projection is added by the
next layer's q/k/v kernel). Other layers, the prefill and the CPU keep the modules' route.
"""
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.decode_weights import project
from engines.moe import moe_block
from kernels import decode_attention_kernel, use_triton
from kernels.decode_attention import rotate
from kernels.decode_fuse import NORMS, norm_linear

# the fused norm + GEMM kernels of the decode step (kernels/decode_fuse.py); "0" keeps the modules' route
# (comparisons: tools/decode_kernel_bench.py); read at trace time, so set it before a decoder's first capture
FUSE = os.environ.get("FAST_DECODE_FUSE", "1") == "1"


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q (B, nh, T, D), k and v (B, nkv, S, D), mask (B, 1, T, S) bool -> (B, T, nh * D).
    The g = nh / nkv query heads of a group share one K/V head (GQA) without copying K/V."""
    B, nh, T, D = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    s = (q.reshape(B, nkv, g * T, D) @ k.transpose(-1, -2)) * scale            # (B, nkv, g*T, S)
    s = s.view(B, nkv, g, T, -1).masked_fill(~mask[:, :, None], float("-inf"))
    p = s.float().softmax(-1).to(q.dtype).view(B, nkv, g * T, -1)            # softmax in fp32, like HF's eager
    return (p @ v).view(B, nh, T, D).transpose(1, 2).reshape(B, T, nh * D)


def _norm(m, x: Tensor) -> Tensor:
    return x if m is None else m(x)


# per-head q/k norms whose formula the decode-attention kernel applies itself (kernels/decode_attention.py:
# head_norm), saving a kernel and a copy of q/k/v per layer; others (gemma3's 1 + w) run as their own modules
KERNEL_NORMS = ("Qwen3RMSNorm", "Qwen3MoeRMSNorm")


def _fusable_norm(a, spec, dtype) -> tuple | None:
    """(q weight, k weight, eps) when the kernel can apply this layer's q/k norm, else None."""
    if spec.qk_norm != "head" or type(a.q_norm).__name__ not in KERNEL_NORMS \
            or type(a.k_norm).__name__ not in KERNEL_NORMS:
        return None
    qw, kw = a.q_norm.weight, a.k_norm.weight
    if qw.dtype != dtype or kw.dtype != dtype or a.q_norm.variance_epsilon != a.k_norm.variance_epsilon:
        return None
    return qw, kw, a.q_norm.variance_epsilon


def _plain(p: tuple) -> bool:
    """A projection group applied as one GEMM of a single weight (+ bias): no adapters, packing or FP8."""
    ws, _, A, _, R = p
    return len(ws) == 1 and ws[0].dtype in (torch.bfloat16, torch.float16, torch.float32) and A is None and not R


def fusable(layer, spec, p_qkv: tuple, p_gu: tuple, x: Tensor) -> bool:
    """Can this layer's decode step take kernels/decode_fuse.py's kernels: pre-norms only (NORMS' formula, in
    x's dtype), a dense SiLU MLP, plain q/k/v and gate/up groups, and Triton for x (CUDA, or the interpreter)?"""
    if not FUSE or spec.moe or spec.norms[1] is not None or spec.norms[3] is not None or not use_triton(x):
        return False
    pre_a, pre_m = spec.norms[0], spec.norms[2]
    act = getattr(layer.mlp, "act_fn", None) or getattr(layer.mlp, "activation_fn", None)
    return (all(type(n).__name__ in NORMS and n.weight.dtype == x.dtype for n in (pre_a, pre_m))
            and type(act).__name__ in ("SiLU", "SiLUActivation") and _plain(p_qkv) and _plain(p_gu))


class Step:
    """Mixed into FastDecoder: needs self.model, self.arch, self.fused, self.attention, self.n_heads, self.n_kv,
    self.head_dim, self.splits and self.moe_grouped (engines/moe.py: grouped GEMMs or the dense form)."""

    def _forward(self, ids: Tensor, pos: Tensor, slots: Tensor, key_ok: Tensor, ks: list[Tensor], vs: list[Tensor],
                 cos: Tensor, sin: Tensor, kpos: Tensor | None = None, routes: list | None = None,
                 embeds: Tensor | None = None) -> Tensor:
        """ids, pos (B, T); writes these T tokens' K/V at cache slots (T,), or (B, T) per row, of ks, vs (per layer
        (B, nkv, S, D)); key_ok (B, 1, T, S) says which slots each query may see; cos, sin (R, S, D) rotary tables,
        a row per kind of layer (or (S, D): one); kpos (B, S): each slot's position, updated here (needed only
        for sliding windows); routes: per MoE layer a (B, S, k) buffer that gets each token's experts at its slot
        (routing replay); embeds (B, T, H): input embeddings in place of the ids' (a prefill with pictures).
        Returns the last token's logits (B, V)."""
        m, arch = self.model.model, self.arch
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        # the embedding by its weight, not its module: training hooks on it (transformers' gradient checkpointing
        # adds one that calls requires_grad_) would stop torch.compile here
        x = F.embedding(ids, m.embed_tokens.weight) if embeds is None else embeds   # (B, T, H)
        if arch.embed_scale and embeds is None:                              # gemma3: read live (a .to() moves it)
            x = x * m.embed_tokens.embed_scale.to(x.dtype)
        windowed = {}                                                        # window -> (B, 1, T, S) mask
        if any(s.window for s in arch.layers):
            if slots.dim() == 1:
                kpos.index_copy_(1, slots, pos)
            else:
                kpos.scatter_(1, slots, pos)
            for w in {s.window for s in arch.layers if s.window}:
                windowed[w] = key_ok & (kpos[:, None, None, :] > pos[:, None, :, None] - w)
        n_moe, down = 0, None   # down: a fused layer's MLP output (B, T, H), added to x by the next layer
        for i, (layer, spec) in enumerate(zip(m.layers, arch.layers)):
            ok = windowed.get(spec.window, key_ok)
            pre_a, post_a, pre_m, post_m = spec.norms
            p_qkv, p_gu, p_o, p_down = self.fused[i]
            if x.shape[1] == 1 and fusable(layer, spec, p_qkv, p_gu, x):   # a decode step: kernels/decode_fuse.py
                x, down = self._fused_layer(i, layer, spec, x, down, pos, slots, ok, ks, vs, cos, sin)
                continue
            if down is not None:
                x, down = x + down, None
            qkv = project(_norm(pre_a, x), p_qkv)                            # (B, T, (nh + 2 nkv) D)
            x = x + _norm(post_a, project(self._attention(qkv, pos, slots, ok, ks[i], vs[i], cos[spec.rope],
                                                          sin[spec.rope], layer.self_attn, spec), p_o))
            h = _norm(pre_m, x)
            if spec.moe:   # routes: routing replay's record (engines/moe.py), one (B, S, k) buffer per MoE layer
                y = moe_block(layer.mlp, h, self.moe_grouped, None if routes is None else routes[n_moe], slots)
                n_moe += 1
            else:
                gate, up = project(h, p_gu).chunk(2, dim=-1)                 # (B, T, I) each
                act = getattr(layer.mlp, "act_fn", None) or layer.mlp.activation_fn
                y = project(act(gate) * up, p_down)
            x = x + _norm(post_m, y)
        if down is not None:
            x = x + down
        h = m.norm(x[:, -1])                                  # (B, H); the fp8 routes' head follows the layers'
        logits = project(h, self.fused[-1]) if len(self.fused) > len(m.layers) else self.model.lm_head(h)  # (B, V)
        if arch.final_softcap:
            logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
        return logits

    def _fused_layer(self, i: int, layer, spec, x: Tensor, down: Tensor | None, pos: Tensor, slots: Tensor,
                     ok: Tensor, ks: list, vs: list, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """One decode layer in five kernels (kernels/decode_fuse.py: norm_linear): x (B, 1, H) the residual stream
        without down (B, 1, H), the last fused layer's MLP output (or None) -> (x + down + attention, this layer's
        MLP output). The modules' route computes the same up to rounding."""
        B, T, H = x.shape
        pre_a, _, pre_m, _ = spec.norms
        (w_qkv,), b_qkv, _, _, _ = self.fused[i][0]
        (w_gu,), _, _, _, _ = self.fused[i][1]
        qkv, x = norm_linear(x.view(B, H), None if down is None else down.view(B, H), pre_a.weight,
                             pre_a.variance_epsilon, w_qkv, b_qkv)           # (B, (nh + 2 nkv) D), (B, H)
        o = project(self._attention(qkv.view(B, T, -1), pos, slots, ok, ks[i], vs[i], cos[spec.rope],
                                    sin[spec.rope], layer.self_attn, spec), self.fused[i][2])   # (B, 1, H)
        act, x = norm_linear(x, o.view(B, H), pre_m.weight, pre_m.variance_epsilon, w_gu, None, glu=True)  # (B, I)
        return x.view(B, T, H), project(act.view(B, T, -1), self.fused[i][3])

    def _qk_norm(self, a, spec, qkv: Tensor) -> Tensor:
        """The family's norm of q and k before rotary (families.LayerSpec.qk_norm); qkv unchanged without one."""
        if spec.qk_norm is None:
            return qkv
        B, T, _ = qkv.shape
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
        if spec.qk_norm == "head":
            q, k = a.q_norm(q.view(B, T, nh, D)).view(B, T, -1), a.k_norm(k.view(B, T, nkv, D)).view(B, T, -1)
        else:
            q, k = a.q_norm(q), a.k_norm(k)
        return torch.cat([q, k, v], dim=-1)

    def _attention(self, qkv: Tensor, pos: Tensor, slots: Tensor, key_ok: Tensor, k_cache: Tensor, v_cache: Tensor,
                   cos: Tensor, sin: Tensor, a, spec) -> Tensor:
        """qkv (B, T, (nh + 2 nkv) D) -> (B, T, nh D): the q/k norm of the family (a: the layer's attention module),
        rotary (tables cos, sin (S, D)), the cache write and attention."""
        B, T, _ = qkv.shape
        if self.attention == "kernel" and T == 1 and slots.dim() == 1:      # decode: one kernel does all three
            fused = _fusable_norm(a, spec, qkv.dtype)
            if spec.qk_norm and fused is None:
                qkv = self._qk_norm(a, spec, qkv)
            return decode_attention_kernel(qkv.reshape(B, -1), cos, sin, pos.view(B), k_cache, v_cache,
                                           key_ok[:, 0, 0], slots, a.scaling, splits=self.splits,
                                           qk_norm=fused).view(B, T, -1)
        qkv = self._qk_norm(a, spec, qkv)
        return self._attend(qkv, (cos[pos][:, None], sin[pos][:, None]), k_cache, v_cache, slots, key_ok, a.scaling)

    def _attend(self, qkv: Tensor, rot: tuple[Tensor, Tensor], k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                key_ok: Tensor, scale: float) -> Tensor:
        """Layer by layer: qkv (B, T, (nh + 2 nkv) D) -> rotary (rot: (B, 1, T, D) each), cache write at slots
        (T,) (or per row (B, T): a multi-turn chunk), attention (B, T, nh D). The prefill's route, and the
        decode's with attention="sdpa" or "matmul"."""
        B, T, _ = qkv.shape
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
        q = q.view(B, T, nh, D).transpose(1, 2)                              # (B, nh, T, D)
        k = k.view(B, T, nkv, D).transpose(1, 2)                             # (B, nkv, T, D)
        v = v.view(B, T, nkv, D).transpose(1, 2)
        q, k = rotate(q, *rot), rotate(k, *rot)
        if slots.dim() == 1:
            k_cache.index_copy_(2, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(2, slots, v.to(v_cache.dtype))
        else:   # each row's chunk at its own slots (B, T)
            at = slots[:, None, :, None].expand(B, nkv, T, D)
            k_cache.scatter_(2, at, k.to(k_cache.dtype))
            v_cache.scatter_(2, at, v.to(v_cache.dtype))
        if self.attention == "matmul":
            return attend(q, k_cache, v_cache, key_ok, scale)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=key_ok, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, T, nh * D)                       # (B, T, nh * D)
