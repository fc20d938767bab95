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
import copy
import inspect
import sys

import torch
from torch import Tensor

from engines.fast_decode import FastDecoder, base_of


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


class GenericDecoder(FastDecoder):
    def __init__(self, model, use_graph: bool | None = None, compile: bool | None = None, check_every: int = 16,
                 keep_cache: bool = False, backend: str = "inductor", **_):
        self.model = model = base_of(model)
        self.keep_cache, self.check_every = keep_cache, check_every
        device = next(model.parameters()).device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.compile = self.use_graph if compile is None else compile
        self.states, self.fused, self.packs = {}, [], None
        self.arch, self.attention, self.weights = None, "model", "model"
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
        from transformers import StaticCache
        cache = StaticCache(config=_static_config(self.model.config), max_cache_len=S)
        empty = torch.zeros(1, S, 2, device=device, dtype=dtype)
        return {"k": [cache], "v": [], "cos": empty, "sin": empty}   # the StaticCache travels in k

    def _masks(self, key_ok: Tensor, pos: Tensor, kpos: Tensor, dtype):
        """key_ok (B, 1, T, S) bool -> additive masks (0 visible, dtype's min hidden): a dict by layer type, or one."""
        hide = torch.finfo(dtype).min
        out = {}
        for name, w in self.windows.items():
            ok = key_ok if w is None else key_ok & (kpos[:, None, None, :] > pos[:, None, :, None] - w)
            out[name] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, hide)
        return out[None] if None in out else out

    def _forward(self, ids: Tensor, pos: Tensor, slots: Tensor, key_ok: Tensor, ks: list, vs: list, cos: Tensor,
                 sin: Tensor, kpos: Tensor | None = None, routes: list | None = None) -> Tensor:
        """FastDecoder._forward's contract, through the model's own forward; ks[0] is the StaticCache. routes: always
        None here (routing replay refuses this path: engines/builtin.py)."""
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
        kw = {self.cache_kw: cache, "attention_mask": self._masks(key_ok, pos, kpos, dtype), "position_ids": pos,
              "use_cache": True}
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
