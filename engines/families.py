"""What differs between the decoder families the fast step covers, read off each model (engines/decode_step.py
writes the step once and asks this file, layer by layer, what to do).

| model_type   | how it differs from the reference shape (qwen2, llama: pre-norms, q/k/v and gate/up, rotary everywhere) |
|--------------|------------------------------------------------------------------------------------------------------|
| qwen3        | RMSNorm on each head of q and k, before rotary                                                        |
| mistral      | a sliding window on every layer (config.sliding_window)                                               |
| phi3         | q/k/v in one projection (qkv_proj), gate/up in one (gate_up_proj); maybe a sliding window            |
| olmo2        | norms after attention and after the MLP instead of before; RMSNorm over all of q and all of k        |
| gemma3_text  | norms before and after both blocks, (1 + w) norms, sqrt(H) embedding scale, query_pre_attn_scalar,    |
|              | sliding and global layers alternating, each kind with its own rotary base                             |
| smollm3      | layers without rotary (no_rope_layers), maybe sliding windows                                          |
| qwen3_moe    | routed experts (engines/moe.py) where the layer has them, per-head q/k norms                          |
| qwen2_vl_text | a Qwen2-VL's (and qwen2_5_vl_text, a Qwen2.5-VL's) text decoder, seen through `text_decoder`:        |
|              | qwen2's layers; a prefill with pictures rotates by M-RoPE's (3, B, T) positions (`mrope_rotation`)    |

Norms, activations and rotary tables come from the model's own modules, so a family's norm formula (gemma's
1 + w) or rotary scaling (llama3, yarn) needs nothing here. What a family adds is a field of `LayerSpec` or
`Arch`; a model that needs something not listed (attention soft-capping, partial rotary, another MLP) gets
None from `arch_of` with the reason, and the engine takes the generic path (engines/generic_decode.py).
"""
from dataclasses import dataclass

import torch
from torch import Tensor

FAMILIES = ("qwen2", "llama", "qwen3", "mistral", "phi3", "olmo2", "gemma3_text", "smollm3", "qwen3_moe")
# vision-language models whose text decoder (TEXT_DECODERS: qwen2's layers) the fast step runs through
# `text_decoder`; the pictures' embeddings and M-RoPE positions come from vision.py. Others (gemma3's VLM attends
# both ways over a picture) keep their own paths. engines/exact.py covers FAMILIES only
VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
TEXT_DECODERS = ("qwen2_vl_text", "qwen2_5_vl_text")
# the layer's norms by role: (before attention, after attention, before the MLP, after the MLP); None: absent
PRE_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)
NORMS = {"olmo2": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
         "gemma3_text": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm")}


@dataclass
class LayerSpec:
    norms: tuple          # 4 modules or None, by role (PRE_NORMS)
    qk_norm: str | None   # "head": over each head's D (qwen3, gemma3); "full": over all heads (olmo2); None
    window: int | None    # sliding window: a key is visible when query position - key position < window
    rope: int             # row of the rotary tables (Arch.rope_kinds)
    moe: bool             # routed experts (engines/moe.py) instead of a dense MLP


@dataclass
class Arch:
    layers: list          # LayerSpec per layer
    rope_kinds: list      # per table row: "default", a gemma3 layer type, or None (no rotary: cos 1, sin 0)
    embed_scale: bool            # gemma3: the embedding times its module's embed_scale (sqrt(H)), in the weights' dtype
    final_softcap: float | None  # logits = cap * tanh(logits / cap)


class TextDecoder(torch.nn.Module):
    """A Qwen2-VL's text decoder seen as a causal LM, the shape the step reads (model.layers, model.norm,
    model.rotary_emb, lm_head, config): the VLM's own modules, nothing copied, the tower left out."""

    def __init__(self, vlm):
        super().__init__()
        self.model, self.lm_head = vlm.model.language_model, vlm.lm_head
        self.config = vlm.config.text_config


def text_decoder(model):
    """model, or for a vision-language model of VLM_FAMILIES its TextDecoder."""
    if getattr(model.config, "model_type", None) in VLM_FAMILIES:
        return TextDecoder(model)
    return model


def mrope_sections(config) -> list | None:
    """The M-RoPE sections (temporal, height, width) of a Qwen2-VL text config, else None."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("mrope_section") if isinstance(rope, dict) else None


def _window(model, a, i: int) -> int | None:
    c = model.config
    if getattr(c, "use_sliding_window", True) is False:     # qwen2/qwen3/smollm3 configs carry a window they disable
        return None
    if hasattr(a, "sliding_window"):                         # set per layer by its layer type
        return a.sliding_window
    types = getattr(c, "layer_types", None)
    if types is not None:
        return c.sliding_window if types[i] == "sliding_attention" else None
    return getattr(c, "sliding_window", None)               # mistral, phi3: every layer


def _rope_kind(model, layer, i: int):
    c, a = model.config, layer.self_attn
    if not getattr(a, "use_rope", True):                     # smollm3's NoPE layers
        return None
    if c.model_type == "gemma3_text":
        return c.layer_types[i]
    return "default"


def _why_not(model) -> str | None:
    """Why the step cannot run this model, or None."""
    c = model.config
    if c.model_type not in FAMILIES + TEXT_DECODERS:
        return f"model_type {c.model_type!r} is none of {', '.join(FAMILIES + VLM_FAMILIES)}"
    if getattr(c, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    if getattr(c, "use_bidirectional_attention", False):
        return "bidirectional attention"
    rope = getattr(c, "rope_parameters", None) or {}
    if not isinstance(rope, dict) or rope.get("partial_rotary_factor", 1.0) != 1.0 \
            or getattr(c, "partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or type(model.lm_head) is not torch.nn.Linear:
        return "no model.layers or an lm_head that is no plain Linear"
    for layer in layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and not (isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
                                        and experts.gate_up_proj.dim() == 3 and hasattr(layer.mlp, "gate")):
            return "experts not stored as (E, 2I, H) and (E, H, I) tensors"
        if experts is not None and getattr(layer.mlp, "shared_expert", None) is not None:
            return "a shared expert"
    if mrope_sections(c) and any(_window(model, layer.self_attn, i) for i, layer in enumerate(layers)):
        return "M-RoPE with a sliding window"   # which of the three positions a window compares is not defined here
    return None


def arch_of(model) -> tuple[Arch | None, str | None]:
    """(Arch, None) for a model the hand-written step covers, else (None, the reason)."""
    why = _why_not(model)
    if why:
        return None, why
    c, m = model.config, model.model
    roles = NORMS.get(c.model_type, PRE_NORMS)
    kinds, specs = [], []
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        kind = _rope_kind(model, layer, i)
        if kind not in kinds:
            kinds.append(kind)
        qk = None
        if getattr(a, "q_norm", None) is not None:
            qk = "head" if a.q_norm.weight.numel() == getattr(a, "head_dim", -1) else "full"
        specs.append(LayerSpec(norms=tuple(getattr(layer, r) if r else None for r in roles), qk_norm=qk,
                               window=_window(model, a, i), rope=kinds.index(kind),
                               moe=hasattr(layer.mlp, "experts")))
    scale = isinstance(getattr(m.embed_tokens, "embed_scale", None), Tensor)
    return Arch(specs, kinds, scale, getattr(c, "final_logit_softcapping", None)), None


def rotary_tables(model, kinds: list, S: int, D: int, device, dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (len(kinds), S, D): a table per kind of layer for positions 0..S-1, from the model's own rotary
    module(s). gemma3: one module taking the layer type (transformers 5), or rotary_emb_local beside rotary_emb
    (older releases)."""
    m = model.model
    x, at = torch.zeros(1, 1, D, device=device, dtype=dtype), torch.arange(S, device=device)[None]
    cos, sin = [], []
    for kind in kinds:
        if kind is None:                                     # the identity rotation
            c, s = torch.ones(1, S, D, device=device, dtype=dtype), torch.zeros(1, S, D, device=device, dtype=dtype)
        elif kind == "default" and mrope_sections(model.config):   # equal (t, h, w) positions: plain rotary
            c, s = _mrope(m.rotary_emb(x, at.expand(3, 1, S)), None)
        elif kind == "default":
            c, s = m.rotary_emb(x, at)
        elif hasattr(m, "rotary_emb_local"):
            c, s = (m.rotary_emb_local if kind == "sliding_attention" else m.rotary_emb)(x, at)
        else:
            c, s = m.rotary_emb(x, at, kind)
        cos.append(c[0])
        sin.append(s[0])
    return torch.stack(cos).contiguous(), torch.stack(sin).contiguous()       # (R, S, D) each


def _mrope(cos_sin: tuple, sections: list | None) -> tuple[Tensor, Tensor]:
    """A Qwen2-VL rotary module's output -> cos, sin (B, T, D). transformers >= 5.2x composes the three sections in
    the module and returns (B, T, D); older ones return (3, B, T, D), one table per axis, and compose them in the
    attention (apply_multimodal_rotary_pos_emb): each (t, h, w) section of the rotary dimensions, repeated for both
    halves, takes its own axis's rows. sections None: the three axes hold equal positions, any one serves."""
    out = []
    for t in cos_sin:
        if t.dim() == 4:
            parts = t.split(list(sections) * 2, dim=-1) if sections else [t]
            t = torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1)
        out.append(t)
    return out[0], out[1]


def mrope_rotation(model, pos: Tensor, dtype) -> tuple[Tensor, Tensor]:
    """M-RoPE positions (3, B, T) of a prompt with pictures (vision.positions) -> cos, sin (B, T, D) from the
    model's own rotary module. After the prompt every token is text: its three positions are equal, and the
    plain table of rotary_tables applies."""
    x = torch.zeros(1, 1, 1, device=pos.device, dtype=dtype)
    return _mrope(model.model.rotary_emb(x, pos), mrope_sections(model.config))
