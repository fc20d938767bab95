"""The fast decoder's model step, written once for every family engines/families.py describes.

`Step._forward` runs the model by hand over its own modules (embedding weight, norms, projections through
engines/decode_weights.py's fused or packed groups, activations, rotary tables) with the static cache
engines/fast_decode.py allocates. Per layer, the spec (families.LayerSpec) says which norms sit where, whether
q and k are normed, which rotary table applies (the identity for layers without rotary), the sliding window,
and whether the MLP is routed experts (engines/moe.py).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from engines.decode_weights import project
from engines.moe import moe_block
from kernels import decode_attention_kernel
from kernels.decode_attention_ref import rotate


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


class Step:
    """Mixed into FastDecoder: needs self.model, self.arch, self.fused, self.attention, self.n_heads, self.n_kv,
    self.head_dim, self.splits and self.moe_grouped (engines/moe.py: grouped GEMMs or the dense form)."""

    def _forward(self, ids: Tensor, pos: Tensor, slots: Tensor, key_ok: Tensor, ks: list[Tensor], vs: list[Tensor],
                 cos: Tensor, sin: Tensor, kpos: Tensor | None = None, routes: list | None = None,
                 share: tuple | None = None, embeds: Tensor | None = None) -> Tensor:
        """ids, pos (B, T); writes these T tokens' K/V at cache slots (T,), or (B, T) per row, of ks, vs (per layer
        (B, nkv, S, D)); key_ok (B, 1, T, S) says which slots each query may see; cos, sin (R, S, D) rotary tables,
        a row per kind of layer (or (S, D): one); kpos (B, S): each slot's position, updated here (needed only
        for sliding windows); routes: per MoE layer a (B, S, k) buffer that gets each token's experts at its slot
        (routing replay); share (src (B,), shared (1,)): a decode step's rows read their slots below shared from row
        src's copy (kernels/decode_attention.py; the shared prefill sets them); embeds (B, T, H): input embeddings in
        place of the ids' (a prefill with pictures).
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
        n_moe = 0
        for i, (layer, spec) in enumerate(zip(m.layers, arch.layers)):
            ok = windowed.get(spec.window, key_ok)
            pre_a, post_a, pre_m, post_m = spec.norms
            p_qkv, p_gu, p_o, p_down = self.fused[i]
            qkv = project(_norm(pre_a, x), p_qkv)                            # (B, T, (nh + 2 nkv) D)
            x = x + _norm(post_a, project(self._attention(qkv, pos, slots, ok, ks[i], vs[i], cos[spec.rope],
                                                          sin[spec.rope], layer.self_attn, spec, share), p_o))
            h = _norm(pre_m, x)
            if spec.moe:   # routes: routing replay's record (engines/moe.py), one (B, S, k) buffer per MoE layer
                y = moe_block(layer.mlp, h, self.moe_grouped, None if routes is None else routes[n_moe], slots)
                n_moe += 1
            else:
                gate, up = project(h, p_gu).chunk(2, dim=-1)                 # (B, T, I) each
                act = getattr(layer.mlp, "act_fn", None) or layer.mlp.activation_fn
                y = project(act(gate) * up, p_down)
            x = x + _norm(post_m, y)
        h = m.norm(x[:, -1])                                  # (B, H); the fp8 routes' head follows the layers'
        logits = project(h, self.fused[-1]) if len(self.fused) > len(m.layers) else self.model.lm_head(h)  # (B, V)
        if arch.final_softcap:
            logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
        return logits

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
                   cos: Tensor, sin: Tensor, a, spec, share: tuple | None = None) -> Tensor:
        """qkv (B, T, (nh + 2 nkv) D) -> (B, T, nh D): the q/k norm of the family (a: the layer's attention module),
        rotary (tables cos, sin (S, D)), the cache write and attention."""
        B, T, _ = qkv.shape
        if self.attention == "kernel" and T == 1 and slots.dim() == 1:      # decode: one kernel does all three
            fused = _fusable_norm(a, spec, qkv.dtype)
            if spec.qk_norm and fused is None:
                qkv = self._qk_norm(a, spec, qkv)
            return decode_attention_kernel(qkv.reshape(B, -1), cos, sin, pos.view(B), k_cache, v_cache,
                                           key_ok[:, 0, 0], slots, a.scaling, splits=self.splits,
                                           qk_norm=fused, share=share).view(B, T, -1)
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
