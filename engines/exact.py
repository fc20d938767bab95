"""Exact log-probs (exact_logprobs=true, docs/exact.md): one forward whose per-token result cannot depend on how
many tokens are in the call or where a token sits, used by the engine (prefill, each decode step, each
multi-turn feed: `ExactDecoder`) and by the trainer (`completion_logprobs`), so a sampled token's log-prob is
the same bits on both sides.

How (each rule: docs/exact.md):
- Tokens are rows: a call takes only real tokens, flattened to (N, ...), each with its sequence (row) and position.
- Every op that is not a plain add or multiply (matmul, norm, activation, softmax, exp) runs on chunks of exactly
  ROWS rows (`rowwise`; the last chunk padded with zeros): the library sees one shape, so it takes one kernel,
  one reduction order and one vector/tail split for every row, whatever the batch.
- On a GPU (`on_gpu`) the matmuls (a group's projections in one launch), RMSNorms, rotary with the cache write,
  attention, silu * up and the per-row log-softmax / sampling / entropy are this project's Triton kernels instead,
  one launch per op per layer, invariant by construction (kernels/exact_gemm.py, kernels/exact_attention.py,
  kernels/exact_sample.py); other elementwise ops (residuals, soft-cap) run on the whole tensor (a CUDA
  elementwise kernel computes each element alone). The GPU path gives values only: the trainer differentiates
  the ordinary forward.
- K/V live in a per-row cache at slot = position. Attention runs on tiles of TQ queries of one (row, KV head),
  TILES tiles per call, over blocks of BLOCK keys in slot order: scores, one max over all blocks, then exp, sums
  and p @ V accumulated block after block from zero.
  A block past a row's position adds exact zeros, so a one-token decode step over a long cache gives the bits of
  the same token's row in a full-sequence forward over a shorter one.
- LoRA: each projection applies W + (B @ A) * scale, the same expression (autograd's in the trainer).
- Routed experts (qwen3_moe): routing per row, each expert's tokens in ROWS-row chunks, a token's top_k outputs
  added in its own slot order (`experts`).

Families: those engines/families.py describes (FAMILIES), dense and MoE; `Exact` refuses any other model with the
reason. Where exactness cannot hold, `check_config` refuses the option before any work. Under FSDP2 the
trainer's forward runs inside each unit's hooks (`through`).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from engines.decode_weights import groups
from engines.families import FAMILIES, arch_of, rotary_tables
from engines.fast_decode import base_of
from kernels import use_triton
from kernels.exact_attention import exact_attention, exact_rope_cache
from kernels.exact_gemm import NORM_MODES, exact_linear, exact_linear_cat, exact_rmsnorm, exact_silu_mul
from kernels.exact_sample import exact_row_logprobs
from models import position_ids

def check_config(cfg):
    """Refuse exact_logprobs=true in one line, before any work, where the engine cannot sample from the trainer's
    own distribution with the trainer's own weights and forward (train.prepare calls it; docs/exact.md)."""
    import json
    import os

    from config import Config, UserError
    if not cfg.exact_logprobs:   # an option set that would do nothing: it was meant to change something
        if cfg.exact_check != Config().exact_check:
            raise UserError(f"exact_check={cfg.exact_check} applies to exact_logprobs=true only: drop it, or set "
                            "exact_logprobs=true")
        return
    lab = [("top_k", cfg.top_k > 0), ("logprobs_mode", cfg.logprobs_mode != "raw"), ("engine_lag", cfg.engine_lag > 0),
           ("engine_dtype", cfg.engine_dtype != "auto"), ("train_temperature", cfg.train_temperature > 0)]
    off = [k for k, bad in [("engine=builtin", cfg.engine != "builtin"),
                            ("mode=sync or max_staleness=0", cfg.mode == "async" and cfg.max_staleness > 0),
                            ("top_p=1", cfg.top_p < 1), ("lora.dropout=0", cfg.lora.dropout > 0),
                            *[(f"{k} at its default", on) for k, on in lab]] if bad]
    if off:
        raise UserError(f"exact_logprobs=true needs {', '.join(off)} (docs/exact.md: where exactness cannot hold)")
    path = os.path.join(cfg.model, "config.json")    # a local model: its family is known before it loads
    kind = json.load(open(path)).get("model_type") if os.path.isfile(path) else None
    if kind is not None and kind not in FAMILIES:
        raise UserError(f"exact_logprobs=true covers the model families {', '.join(FAMILIES)}; {cfg.model} is "
                        f"{kind!r} (docs/exact.md: checking a new model)")


ROWS = 256     # rows per call of every op on the torch path: a fixed shape, hence a fixed kernel
BLOCK = 64     # keys per attention block
TQ = 16        # queries of one (row, KV head) per attention tile
TILES = 256    # tiles per attention call: fixed as ROWS is
HEAD_ROWS = 256    # the trainer's predicted tokens per head + log-softmax chunk (a multiple of ROWS): the chunk's
                   # (rows, V) logits and float32 log-probs are the exact pass's largest transients


SILU = ("SiLU", "SiLUActivation")     # activation modules `exact_silu_mul` stands for (transformers', torch's)
GPU_KERNELS = True   # False: the torch path on a GPU too (the same bits on both sides, many more launches)


def on_gpu(x: Tensor) -> bool:
    """The Triton path: CUDA tensors (or TRITON_INTERPRET=1, for the CPU tests), one choice per device, so the
    engine and the trainer on one device always take the same path."""
    return GPU_KERNELS and use_triton(x)


def each(fn, x: Tensor) -> Tensor:
    """An elementwise fn over x (N, ...): on the whole tensor on a GPU, else `rowwise` (a CPU kernel's vector body
    and scalar tail may round an element differently)."""
    return fn(x) if on_gpu(x) else rowwise(fn, x)


def through(module, fn, *args):
    """fn(*args), run as module's forward where FSDP2 shards the module: its hooks gather the unit's weights for fn
    (which reads them off the submodules) and, in the backward, reduce-scatter their gradients. Else fn(*args)."""
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(module, FSDPModule):
        return fn(*args)
    module.forward = fn            # an instance attribute: nn.Module.__call__ runs the hooks around it
    try:
        return module(*args)
    finally:
        del module.forward


def rowwise(fn, x: Tensor) -> Tensor:
    """fn over x (N, ...) in chunks of exactly ROWS rows (the last padded with zeros) -> (N, ...)."""
    N = x.shape[0]
    pad = -N % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return torch.cat([fn(c.contiguous()) for c in x.split(ROWS)])[:N]


def weight_of(m) -> tuple[Tensor, Tensor | None]:
    """The (weight, bias) a Linear applies: its own, or a peft LoRA layer's W + (B @ A) * scale per active adapter
    (differentiable: the trainer's gradient reaches A and B through it)."""
    base = getattr(m, "base_layer", None)
    if base is None:
        return m.weight, m.bias
    w = base.weight
    if not m.disable_adapters and not m.merged:
        for a in m.active_adapters:
            if a in m.lora_A:
                w = w + (m.lora_B[a].weight @ m.lora_A[a].weight) * m.scaling[a]        # (out, in)
    return w, base.bias


def linear(x: Tensor, mods: list) -> Tensor:
    """x (N, in) through each module of a group, outputs concatenated: (N, sum of outs). On a GPU one launch for the
    group (`exact_linear_cat`: its tile is the concatenation's, on both sides)."""
    if on_gpu(x) and len(mods) <= 3:
        wb = [weight_of(m) for m in mods]
        return exact_linear_cat(x, [w for w, _ in wb], [b for _, b in wb])
    outs = []
    for m in mods:
        w, b = weight_of(m)
        outs.append(matmul(x, w, b))
    return torch.cat(outs, -1) if len(outs) > 1 else outs[0]


def matmul(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """F.linear(x, w, b) for x (N, in), each row's bits independent of N: -> (N, out)."""
    return exact_linear(x, w, b) if on_gpu(x) else rowwise(lambda c: F.linear(c, w, b), x)


def _norm(m, x: Tensor) -> Tensor:
    if m is None:
        return x
    mode = NORM_MODES.get(type(m).__name__)
    if mode is not None and on_gpu(x):
        eps = getattr(m, "variance_epsilon", None) or m.eps
        return exact_rmsnorm(x.reshape(-1, x.shape[-1]), m.weight, eps, mode).reshape(x.shape)
    return rowwise(m, x)


class Exact:
    """The exact forward of one model (transformers model or a peft wrapper of one, families engines/families.py
    covers, no routed experts)."""

    def __init__(self, model):
        self.model = base_of(model)
        self.arch, why = arch_of(self.model)
        if self.arch is None:
            raise ValueError(f"exact_logprobs does not cover this model: {why}")
        lora_on_experts = any("experts" in n and "lora_" in n for n, _ in model.named_parameters())
        if lora_on_experts and any(s.moe for s in self.arch.layers):
            raise ValueError("exact_logprobs does not cover LoRA adapters on routed experts "
                             "(lora.targets without them)")
        c = self.model.config
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.tables = {}

    def rotary(self, device, dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (R, L, D) for every position the model takes: one table size, so one set of bits."""
        key = (device, dtype)
        if key not in self.tables:
            L = getattr(self.model.config, "max_position_embeddings", None) or 4096
            self.tables[key] = rotary_tables(self.model, self.arch.rope_kinds, L, self.D, device, dtype)
        return self.tables[key]

    def new_cache(self, B: int, S: int, device, dtype) -> list:
        """Per layer (k, v), each (B, nkv, L, D) with L >= S slots, a whole number of key blocks: slot = position."""
        L = -(-S // BLOCK) * BLOCK
        z = lambda: torch.zeros(B, self.nkv, L, self.D, device=device, dtype=dtype)
        return [(z(), z()) for _ in self.model.model.layers]

    def forward(self, ids: Tensor, rows: Tensor, pos: Tensor, cache: list, inplace: bool) -> Tensor:
        """ids, rows, pos (N,): tokens, their sequence and position; writes their K/V at (row, pos) of cache
        (inplace: into its tensors; else new tensors, for autograd) and returns their last hidden states (N, H)
        after the final norm."""
        m = self.model.model
        cos, sin = self.rotary(ids.device, m.embed_tokens.weight.dtype)
        x = F.embedding(ids, m.embed_tokens.weight)                                    # (N, H)
        if self.arch.embed_scale:
            x = x * m.embed_tokens.embed_scale.to(x.dtype)
        for i, layer in enumerate(m.layers):
            x = through(layer, lambda x, i=i, layer=layer: self._layer(i, layer, x, rows, pos, cos, sin, cache,
                                                                       inplace), x)
        return _norm(m.norm, x)

    def _layer(self, i: int, layer, x: Tensor, rows, pos, cos, sin, cache: list, inplace: bool) -> Tensor:
        """Decoder layer i on x (N, H) -> (N, H); writes its K/V into cache[i] (see forward)."""
        spec = self.arch.layers[i]
        pre_a, post_a, pre_m, post_m = spec.norms
        g_qkv, g_gu, g_o, g_down = groups(layer)
        q, k, v = self._qkv(layer.self_attn, spec, linear(_norm(pre_a, x), g_qkv))      # (N, nh|nkv, D)
        kc, vc = cache[i]                                                              # (B, nkv, L, D) each
        if inplace and on_gpu(x):    # one launch: rotary on q and k, k and v into the cache
            q = exact_rope_cache(q, k, v, rows, pos, cos[spec.rope], sin[spec.rope], kc, vc)
            o = self._attend(q, rows, pos, kc, vc, spec.window, layer.self_attn.scaling)   # (N, nh D)
            x = x + _norm(post_a, linear(o.to(x.dtype), g_o))
            return x + _norm(post_m, self._mlp(layer.mlp, spec, _norm(pre_m, x), g_gu, g_down))
        c, s = cos[spec.rope][pos][:, None], sin[spec.rope][pos][:, None]              # (N, 1, D)
        q, k = _rotate(q, c, s), _rotate(k, c, s)
        if inplace:
            kc.transpose(1, 2).index_put_((rows, pos), k.to(kc.dtype))
            vc.transpose(1, 2).index_put_((rows, pos), v.to(vc.dtype))
        else:   # new tensors, for autograd
            kc = kc.transpose(1, 2).index_put((rows, pos), k.to(kc.dtype)).transpose(1, 2)
            vc = vc.transpose(1, 2).index_put((rows, pos), v.to(vc.dtype)).transpose(1, 2)
            cache[i] = (kc, vc)
        o = self._attend(q, rows, pos, kc, vc, spec.window, layer.self_attn.scaling)   # (N, nh D)
        x = x + _norm(post_a, linear(o.to(x.dtype), g_o))
        return x + _norm(post_m, self._mlp(layer.mlp, spec, _norm(pre_m, x), g_gu, g_down))

    def _mlp(self, mlp, spec, x: Tensor, g_gu: list, g_down: list) -> Tensor:
        """x (N, H) through the layer's dense MLP or its routed experts -> (N, H)."""
        if spec.moe:
            return experts(mlp, x)
        act = getattr(mlp, "act_fn", None) or mlp.activation_fn
        if on_gpu(x) and type(act).__name__ in SILU:           # one launch for silu(gate) * up
            return linear(exact_silu_mul(linear(x, g_gu)), g_down)
        gate, up = linear(x, g_gu).chunk(2, dim=-1)                                    # (N, I) each
        return linear(each(act, gate) * up, g_down)

    def logits(self, h: Tensor) -> Tensor:
        """(N, H) final hidden states -> (N, V) logits (soft-capped where the family does)."""
        z = linear(h, [self.model.lm_head])
        cap = self.arch.final_softcap
        return z if not cap else each(lambda c: torch.tanh(c / cap) * cap, z)

    def _qkv(self, a, spec, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        N, nh, nkv, D = qkv.shape[0], self.nh, self.nkv, self.D
        q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
        if spec.qk_norm == "head":
            q, k = _norm(a.q_norm, q.reshape(N * nh, D)), _norm(a.k_norm, k.reshape(N * nkv, D))
        elif spec.qk_norm == "full":
            q, k = _norm(a.q_norm, q), _norm(a.k_norm, k)
        return q.reshape(N, nh, D), k.reshape(N, nkv, D), v.reshape(N, nkv, D)

    def _attend(self, q: Tensor, rows: Tensor, pos: Tensor, kc: Tensor, vc: Tensor, window, scale: float) -> Tensor:
        """q (N, nh, D) of tokens at (rows, pos) over caches kc, vc (B, nkv, L, D) -> (N, nh D), in float32.
        Queries of one (row, KV head) go in tiles of TQ rows; TILES tiles per call, each a fixed-shape bmm against
        a key block gathered once per tile: a query's row never depends on its tile-mates (as in `rowwise`)."""
        N, nh, D = q.shape
        B, nkv, L, _ = kc.shape
        if on_gpu(q):    # one launch: a program per (token, KV head), its GQA group as the query tile
            return exact_attention(q, rows, pos, kc, vc, window, scale, BLOCK).reshape(N, nh * D)
        dev = q.device
        qi = torch.arange(N * nh, device=dev)
        seq = rows[qi // nh] * nkv + (qi % nh) // (nh // nkv)                          # (N nh,) its (row, KV head)
        order = torch.argsort(seq, stable=True)                                        # queries grouped by seq
        s = seq[order]
        rank = qi - torch.searchsorted(s, s)                                           # (N nh,) place in its group
        tile, slot = torch.cumsum((rank % TQ == 0).long(), 0) - 1, rank % TQ            # (N nh,) each
        # tiles: at most one partial tile per (row, KV head) beyond the full ones; a bound read off the shapes,
        # so no host sync (the CUDA-graphed decode step holds this)
        T = -(-(N * nh // TQ + min(N * nh, B * nkv)) // TILES) * TILES
        Q = q.new_zeros(T, TQ, D, dtype=torch.float32).index_put((tile, slot), q.reshape(N * nh, D)[order].float())
        P = torch.full((T, TQ), L - 1, device=dev).index_put((tile, slot), pos[qi // nh][order])   # (T, TQ)
        S = torch.zeros(T, dtype=torch.long, device=dev).index_put((tile,), s)                      # (T,) its seq
        kt, vt = kc.reshape(B * nkv, L, D).float(), vc.reshape(B * nkv, L, D).float()   # (B nkv, L, D) each

        def one(qq: Tensor, pp: Tensor, ss: Tensor) -> Tensor:     # (TILES, TQ, D), (TILES, TQ, 1), (TILES,)
            scores = []
            for j in range(0, L, BLOCK):
                at = torch.arange(j, j + BLOCK, device=dev)[None, None]                # (1, 1, BLOCK)
                sc = torch.bmm(qq, kt[:, j:j + BLOCK].index_select(0, ss).transpose(1, 2)) * scale  # (TILES, TQ, BLOCK)
                ok = at <= pp if not window else (at <= pp) & (pp - at < window)
                scores.append(sc.masked_fill(~ok, float("-inf")))
            mx = torch.stack([sc.amax(-1) for sc in scores]).amax(0)[..., None]       # (TILES, TQ, 1): order-free
            total, out = qq.new_zeros(len(qq), TQ, 1), qq.new_zeros(len(qq), TQ, D)
            for j, sc in zip(range(0, L, BLOCK), scores):
                e = torch.exp(sc - mx)                                                 # (TILES, TQ, BLOCK); masked: 0
                total = total + e.sum(-1, keepdim=True)
                out = out + torch.bmm(e, vt[:, j:j + BLOCK].index_select(0, ss))     # (TILES, TQ, D)
            return out / total

        o = torch.cat([one(Q[c:c + TILES], P[c:c + TILES, :, None], S[c:c + TILES]) for c in range(0, T, TILES)])
        o = o[tile, slot]                                                              # (N nh, D) in sorted order
        return o.new_empty(o.shape).index_put((order,), o).reshape(N, nh * D)


def experts(mlp, x: Tensor) -> Tensor:
    """A sparse-MoE block (qwen3_moe's: .gate router, .experts with (E, 2I, H) and (E, H, I) weights) on x (N, H).
    Routing is per row (`rowwise`); each expert runs its tokens in ROWS-row chunks whatever their number; a token's
    top_k outputs are added in its own slot order (not expert order): elementwise, so no row depends on another."""
    e, router = mlp.experts, mlp.gate
    k = getattr(router, "top_k", None) or mlp.top_k
    norm = getattr(router, "norm_topk_prob", getattr(mlp, "norm_topk_prob", True))

    def route(c: Tensor) -> Tensor:      # (ROWS, H) -> (ROWS, 2k): top_k weights, then their experts (as floats)
        w, idx = F.linear(c, router.weight).float().softmax(-1).topk(k, dim=-1)
        if norm:
            w = w / w.sum(-1, keepdim=True)
        return torch.cat([w, idx.float()], -1)

    r = rowwise(route, x)                                                              # (N, 2k) float32
    weight, idx = r[:, :k].to(x.dtype), r[:, k:].long()                                # (N, k) each
    slots = x.new_zeros(x.shape[0], k, x.shape[1])                                     # (N, k, H)
    for i in range(e.gate_up_proj.shape[0]):
        tok, slot = (idx == i).nonzero(as_tuple=True)                                  # (n,) each
        if not len(tok):
            continue
        gate, up = matmul(x[tok], e.gate_up_proj[i]).chunk(2, dim=-1)                  # (n, I) each
        y = matmul(each(e.act_fn, gate) * up, e.down_proj[i])                          # (n, H)
        slots = slots.index_put((tok, slot), y * weight[tok, slot][:, None])
    out = slots[:, 0]
    for j in range(1, k):                # slot order: the same additions for a token in any call
        out = out + slots[:, j]
    return out                                                                         # (N, H)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (transformers' rotate_half form) with elementwise ops only: exact per element."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def token_logprobs(logits: Tensor, temperature: float) -> Tensor:
    """(N, V) logits -> (N, V) float32 log-probs at temperature, row by fixed chunk."""
    return rowwise(lambda c: torch.log_softmax(c.float() / temperature, dim=-1), logits)


def exact_of(model) -> Exact:
    """The model's Exact, made once and kept on the model (its rotary tables are built once)."""
    base = base_of(model)
    ex = base.__dict__.get("_exact")
    if ex is None:
        ex = base.__dict__["_exact"] = Exact(model)
    return ex


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, C: int,
                        temperature: float = 1.0, images=None) -> tuple[Tensor, Tensor]:
    """models.completion_logprobs through the exact forward: (B, T) ids -> log-probs and entropies (B, C); the
    gradient is autograd's. Tokens the mask hides get log-prob 0. No pictures (images must be None)."""
    if images is not None:
        raise ValueError("exact_logprobs does not cover prompts with pictures yet (docs/exact.md)")
    ex = exact_of(model)
    B, T = input_ids.shape
    real = attention_mask.bool()
    rows, cols = real.nonzero(as_tuple=True)                                           # (N,) each, row-major
    pos = position_ids(attention_mask)[rows, cols]
    at = (cols >= T - C - 1) & (cols < T - 1)        # the predecessors of the last C columns: t predicts t + 1
    r, c = rows[at], cols[at] - (T - C - 1)
    tgt = input_ids[r, c + T - C]                                                      # (M,)

    def run(ids: Tensor) -> tuple[Tensor, Tensor]:   # inside the root's forward under FSDP: its weights gathered
        dtype = ex.model.model.embed_tokens.weight.dtype
        cache = ex.new_cache(B, int(pos.max()) + 1, ids.device, dtype)
        h = ex.forward(ids, rows, pos, cache, inplace=not torch.is_grad_enabled())[at]   # (M, H)
        logp, ent = [], []
        for hc, tc in zip(h.split(HEAD_ROWS), tgt.split(HEAD_ROWS)):   # (M, V) float32 log-probs held a chunk at a time
            z = ex.logits(hc)                                                          # (m, V)
            if on_gpu(z):    # the engine's kernel (`sample`): one order per row, whatever the chunk
                _, lp, en = exact_row_logprobs(z, inv_temperature(temperature, z.device), tgt=tc)
                logp.append(lp)
                ent.append(en)
                continue
            lp = token_logprobs(z, temperature)                                        # (m, V)
            logp.append(lp.gather(-1, tc[:, None]).squeeze(-1))                        # (m,)
            ent.append(-rowwise(lambda z: (z.exp() * z).sum(-1, keepdim=True), lp).squeeze(-1))   # (m,)
        logp, ent = torch.cat(logp), torch.cat(ent)
        zeros = logp.new_zeros(B, C)
        return zeros.index_put((r, c), logp), zeros.index_put((r, c), ent)

    return through(model, run, input_ids[rows, cols])


def inv_temperature(temperature: float, device) -> Tensor:
    """(1,) float32 1 / temperature: the engine and the trainer scale logits by the same bits."""
    return torch.tensor([1.0 / temperature], dtype=torch.float32, device=device)
