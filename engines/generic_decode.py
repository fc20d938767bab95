"""The fast path for any other causal LM: the model's own forward over transformers' StaticCache, the decode
step captured in a CUDA graph, so no architecture falls to the dynamic-cache loop on a GPU.

    dec = GenericDecoder(model)            # a model engines/fast_decode.py's hand-written step does not cover
    completion, alive, logprobs, done = dec.sample(ids, mask, sampling, eos_id, pad_id, generator)

It is FastDecoder with the model step swapped: the sampling loop, the in-graph sampler, the static buffers and
the capture are FastDecoder's; `_forward` calls the model itself with a StaticCache of S slots and the attention
masks built here (4-D, additive), so that what transformers would compute from the cache (its length, its
masks) never needs the host during a replay. The cache's layers are all full-length (a copy of the config
without sliding layers): the sliding windows live in the masks, as in the hand-written step. The masks come as
a dict by layer type for models that have layer types (transformers' `causal_mask_mapping`), else one tensor.

Decode attention (`attention`, "kernel" by default): during a decode step the model's attention modules call
`decode_attention_forward`, registered in transformers' AttentionInterface, instead of their own implementation
(the decoder switches the configs' attn implementation for the step only: `_attention_as`; the prefill keeps the
model's). transformers' sdpa path, given a mask, copies each layer's K/V cache once per query head of a group
(repeat_kv) and attends over all S slots with an additive mask; here the step's boolean (B, 1, 1, S) masks are
built once per step (one per window), and each layer either runs kernels/decode_attention.py's kernel (reading
each row's cache only up to the current slot; its rotary is the identity, the model has rotated q and k already)
or, where the kernel's shapes do not fit, sdpa with the g query heads of a KV head as g queries of it (no copy).
Models whose attention does not go through the AttentionInterface, or needs what these two do not do (logit
soft-capping, attention sinks), keep the model's own attention with additive masks (`attention="model"`;
`why_not_attention` says why).

The decode step is compiled on its own (`compile`, on with the graph by default): torch.compile of `_forward`
with fullgraph, called under a nested `torch.compiler.set_stance("default")`. BuiltinEngine runs this decoder
under set_stance("force_eager"), so that layers compiled for training (`layer.compile()`, run_setup.py) run
eagerly instead of recompiling at every cache length; this step's compile traces through those same modules
(a compiled module called inside a compiled region is inlined into it), so it makes one graph of its own per
batch and cache shape and neither runs nor recompiles the training layers' code. The prefill stays eager (its
shapes change with every prompt length). A step that does not compile (a graph break, a compiler error) is
captured uncompiled, with the reason printed (FastDecoder._capture).

Not covered: multi-turn (feed writes per-row slots, which StaticCache cannot). LoRA works as the model's own
peft modules apply it. Correct on the CPU without a graph (tests/test_architectures.py; the compiled step with
torch.compile's eager backend: tests/test_generic_decode.py); a capture that fails on a GPU (a host
synchronisation inside some model's forward) leaves the eager static-cache loop, with the reason printed.
"""
import contextlib
import copy
import inspect
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.fast_decode import FastDecoder, base_of
from kernels import decode_attention_kernel

ATTENTION = "rlhack_generic_decode"     # the name decode_attention_forward is registered under
ROUTES = ("kernel", "sdpa", "model")


def _static_config(config):
    """A copy of the config whose layers are all full attention, for the StaticCache."""
    cfg = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
    if hasattr(cfg, "sliding_window"):
        cfg.sliding_window = None
    return cfg


def windows(config) -> dict:
    """Mask name -> sliding window (None: full attention); name None: one mask for every layer."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    w = None if getattr(c, "use_sliding_window", True) is False else getattr(c, "sliding_window", None)
    if getattr(c, "layer_types", None):
        return {"full_attention": None, "sliding_attention": w}
    return {None: w}


def decode_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
                             dropout: float = 0.0, scaling: float | None = None, generic_step: dict | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract for one decode token: query (B, nh, 1, D), key and value the whole
    static cache (B, nkv, S, D) with this token already written, attention_mask (B, 1, 1, S) bool (True: visible)
    -> ((B, 1, nh, Dv), None). generic_step (GenericDecoder._forward): the token's slot (1,) and, for the kernel
    route, identity rotary tables (S, D) and positions (B,)."""
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"generic_decode's attention does not apply {name}; use attention='model'")
    B, nh, T, D = query.shape
    nkv, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if T != 1 or attention_mask is None or attention_mask.dtype != torch.bool or dropout or nh % nkv:
        raise ValueError(f"generic_decode's attention takes one decode token with a boolean mask and nh % nkv == 0; "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}, mask "
                         f"{None if attention_mask is None else attention_mask.dtype}, dropout {dropout}")
    scale = D ** -0.5 if scaling is None else scaling
    step = generic_step or {}
    cos = step.get("cos")
    if cos is not None and cos.shape == (S, D) and Dv == D == key.shape[-1] and D % 2 == 0 and D <= 256 \
            and query.dtype == key.dtype == value.dtype and key.stride(-1) == value.stride(-1) == 1:
        slot = step["slot"]                                                      # (1,)
        # the kernel takes the new token's q, k, v side by side; k and v are already in the cache at `slot` (the
        # kernel writes them there again, unchanged: its rotary is the identity)
        qkv = torch.cat([query.reshape(B, nh * D), key.index_select(2, slot).reshape(B, nkv * D),
                         value.index_select(2, slot).reshape(B, nkv * D)], dim=-1)     # (B, (nh + 2 nkv) D)
        o = decode_attention_kernel(qkv, cos, step["sin"], step["pos"], key, value, attention_mask[:, 0, 0], slot,
                                    scale)                                       # (B, nh D)
        return o.view(B, 1, nh, D), None
    # the g query heads of a KV head as g queries of it: GQA without repeating the cache, one mask for all heads
    q = query.reshape(B, nkv, nh // nkv, D)                                      # (B, nkv, g, D)
    o = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scale)   # (B, nkv, g, Dv)
    return o.reshape(B, nh, 1, Dv).transpose(1, 2), None                        # (B, 1, nh, Dv)


def why_not_attention(model) -> str | None:
    """Why decode_attention_forward cannot stand in for this model's attention (then attention="model"), or None."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface"
    if getattr(c, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks"
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()):
        return f"{type(model).__name__}.forward takes no **kwargs (the step's slot could not reach attention)"
    return None


class GenericDecoder(FastDecoder):
    SHARES_PREFILL = False   # its cache is one transformers StaticCache, whose rows are not views to prefill apart
    GRAPHS_PREFILL = False   # its prefill runs the model's own forward, whose host work a graph may not hold: eager
    def __init__(self, model, use_graph: bool | None = None, compile: bool | None = None, check_every: int = 16,
                 keep_cache: bool = False, backend: str = "inductor", attention: str = "kernel", **_):
        if attention not in ROUTES:
            raise ValueError(f"attention must be one of {', '.join(ROUTES)}, got {attention!r}")
        self.model = model = base_of(model)
        self.keep_cache, self.check_every = keep_cache, check_every
        device = next(model.parameters()).device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.compile = self.use_graph if compile is None else compile
        self.states, self.fused, self.packs = {}, [], None
        self.arch, self.weights = None, "model"
        self.why_model_attention = why_not_attention(model) if attention != "model" else None
        self.attention = "model" if self.why_model_attention else attention
        if self.why_model_attention:
            print(f"generic_decode: the model's own attention ({self.why_model_attention})", file=sys.stderr)
        if self.attention != "model":
            from transformers import AttentionInterface, PretrainedConfig
            AttentionInterface.register(ATTENTION, decode_attention_forward)
            # every config an attention module reads (a VLM's text config is its own object)
            self.configs = list({id(c): c for m in model.modules()
                                 if isinstance(c := getattr(m, "config", None), PretrainedConfig)}.values())
        c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.compact_always, self.captured = False, False
        self.windows = windows(model.config)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params          # transformers before 5.2x passes it along
        self.keep_logits = "logits_to_keep" in params
        self.compiled = torch.compile(self._forward, dynamic=False, fullgraph=True, backend=backend) \
            if self.compile else None
        self._step = self._compiled_step if self.compile else self._forward

    def _compiled_step(self, *args) -> Tensor:
        """The decode step through this decoder's own compiled graph, whatever stance the caller runs under."""
        with torch.compiler.set_stance("default"):
            return self.compiled(*args)

    def refresh(self):
        """Nothing to re-read: the model's own modules read its parameters."""

    def _cache(self, B: int, S: int, device, dtype) -> dict:
        """The StaticCache (it travels in k) and, for the kernel route, the identity rotary tables (S, D) it takes
        (one row repeated: stride 0, so any position reads it)."""
        from transformers import StaticCache
        cache = StaticCache(config=_static_config(self.model.config), max_cache_len=S)
        D = self.head_dim
        cos, sin = (torch.full((1, D), x, device=device, dtype=dtype).expand(S, D) for x in (1.0, 0.0))
        return {"k": [cache], "v": [], "cos": cos, "sin": sin}

    @contextlib.contextmanager
    def _attention_as(self, name: str):
        """The model's attention modules call `name` (an AttentionInterface entry) inside this block."""
        before = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = name
        try:
            yield
        finally:                        # outer configs first: their setter also resets their sub-configs
            for c, b in zip(self.configs, before):
                c._attn_implementation = b

    def _decode(self, st: dict):
        """FastDecoder._decode with the decode attention in place of the model's own (not in the prefill)."""
        if self.attention == "model":
            return super()._decode(st)
        with self._attention_as(ATTENTION):
            return super()._decode(st)

    def _masks(self, key_ok: Tensor, pos: Tensor, kpos: Tensor, dtype):
        """key_ok (B, 1, T, S) bool -> masks with the windows applied: additive (0 visible, dtype's min hidden), or
        boolean (True visible) when dtype is None; a dict by layer type, or one."""
        out = {}
        for name, w in self.windows.items():
            ok = key_ok if w is None else key_ok & (kpos[:, None, None, :] > pos[:, None, :, None] - w)
            out[name] = ok if dtype is None else \
                torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, torch.finfo(dtype).min)
        return out[None] if None in out else out

    def _forward(self, ids: Tensor, pos: Tensor, slots: Tensor, key_ok: Tensor, ks: list, vs: list, cos: Tensor,
                 sin: Tensor, kpos: Tensor | None = None, routes: list | None = None,
                 share: tuple | None = None) -> Tensor:
        """FastDecoder._forward's contract, through the model's own forward; ks[0] is the StaticCache. routes: always
        None here (routing replay refuses this path: engines/builtin.py); share too (SHARES_PREFILL is off)."""
        if slots.dim() != 1:
            raise NotImplementedError("the generic decoder writes shared cache slots only (no multi-turn feed)")
        cache = ks[0]
        if ids.shape[1] > 1:            # the prefill starts the cache over (transformers 5.2x counts its length)
            for layer in getattr(cache, "layers", []):
                if isinstance(getattr(layer, "cumulative_length", None), Tensor):
                    layer.cumulative_length.zero_()
        if kpos is not None:
            kpos.index_copy_(1, slots, pos)
        dtype = next(self.model.parameters()).dtype
        if ids.shape[1] == 1 and self.attention != "model":       # decode: boolean masks, the step for attention
            masks = self._masks(key_ok, pos, kpos, None)
            step = {"slot": slots, "pos": pos.view(-1)}
            if self.attention == "kernel":
                step.update(cos=cos, sin=sin)
            kw = {"generic_step": step}
        else:
            masks, kw = self._masks(key_ok, pos, kpos, dtype), {}
        kw.update({self.cache_kw: cache, "attention_mask": masks, "position_ids": pos, "use_cache": True})
        if self.cache_position:
            kw["cache_position"] = slots
        if self.keep_logits:
            kw["logits_to_keep"] = 1
        return self.model(input_ids=ids, **kw).logits[:, -1]                  # (B, V)

    def _capture(self, st: dict):
        try:
            super()._capture(st)
        except Exception as e:          # a forward that needs the host: the static-cache loop, eagerly
            print(f"generic_decode: no CUDA graph for {type(self.model).__name__} ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]}); decoding eagerly", file=sys.stderr)
            st["graph"], self.use_graph = None, False
            torch.cuda.synchronize()

    def start_episodes(self, *a, **k):
        raise NotImplementedError("multi-turn runs through the fast step or the portable loop, not the generic decoder")
