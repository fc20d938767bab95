"""Routed experts as grouped GEMMs (the fast step's MoE layers, qwen3_moe's shape), with no loop over experts.

    y = routed_experts(x (N, H), router (E, H), top_k, norm_topk, gate_up (E, 2I, H), down (E, H, I), act)

Each token's top_k experts come from softmax(x router^T) (float32, as transformers' router); the N * top_k
(token, expert) pairs are sorted by expert, so each expert's tokens are one contiguous block, and one grouped
GEMM (torch._grouped_mm: a GEMM per block in one launch, block bounds read on the device) runs every expert's
gate/up, another every down projection. Shapes stay fixed whatever the routing, so the step still fits in one
CUDA graph. Where torch has no grouped GEMM for this device and dtype (`grouped_ok` probes once), `_dense_mm`
gives the same result by multiplying every pair by all experts' weights and keeping its own expert's block:
E / top_k times the arithmetic, the weights still read once (decode is bound by reading them). A decode step's
few pairs on a GPU go to kernels/moe_experts.py instead (`triton_experts`: SiLU experts in bf16 or fp16), whose
two kernels read each expert's weights at a higher rate than the grouped GEMM at that size and fold the gather
of x and SiLU(gate) * up into the first (docs/architectures.md, "Decode attention and experts, timed"); there
the routing too (softmax, topk, the weights and the expert order) is one kernel, kernels/decode_route.py.
"""
import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from config import UserError, opt, section
from kernels import use_triton
from kernels.decode_route import COUNT_PAIRS, MAX_TOKENS, by_expert, route, route_linear
from kernels.moe_experts import expert_down, expert_gate_up

_PROBED: dict = {}   # (device type, dtype) -> whether torch._grouped_mm runs there
# a decode step's router GEMM as its own launch before the routing kernel ("gemm"), or inside that kernel
# (kernels/decode_route.py: route_linear; "kernel"), which one program computes more slowly than cuBLAS's
# launch costs; chosen by timing at W10's qwen3_moe shape (docs/architectures.md)
ROUTER = os.environ.get("FAST_DECODE_ROUTER", "gemm")
if ROUTER not in ("gemm", "kernel"):
    raise UserError(f"FAST_DECODE_ROUTER must be gemm or kernel, got {ROUTER!r}")


@section("moe", "mixture-of-experts models")
@dataclass
class MoEConfig:
    routing_replay: bool = opt(False, "R3: the rollout records each token's experts per MoE layer and the trainer's "
                                      "forwards reuse them (gating weights from the trainer's router over those "
                                      "experts), so training log-probs follow the sampled routing; MoE models, "
                                      "engine=builtin (engines/moe.py, docs/architectures.md)")


def grouped_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Does torch._grouped_mm run on this device and dtype? Tried once on 16-byte aligned shapes (its rule)."""
    key = (device.type, dtype)
    if key not in _PROBED:
        try:
            x, w = torch.ones(4, 16, device=device, dtype=dtype), torch.ones(2, 16, 16, device=device, dtype=dtype)
            offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
            _PROBED[key] = bool(torch._grouped_mm(x, w.transpose(1, 2), offs=offs).eq(16).all())
        except (AttributeError, RuntimeError, NotImplementedError):
            _PROBED[key] = False
    return _PROBED[key]


def _aligned(*ts: Tensor) -> bool:
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in ts)


def use_grouped(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Grouped GEMMs for these shapes: bf16 (torch.compile's shape rule for _grouped_mm takes no other dtype, though
    the CPU kernel does), where torch runs them, with rows of 16-byte multiples."""
    return x.dtype == torch.bfloat16 and grouped_ok(x.device, x.dtype) and _aligned(x, gate_up.transpose(1, 2), down)


def triton_experts(x: Tensor, mlp) -> bool:
    """Can kernels/moe_experts.py run this MoE block's experts on x? CUDA (or the interpreter), bf16 or fp16
    activations and weights, SiLU experts (the kernel's epilogue), and FAST_DECODE_MOE not "grouped"."""
    e = mlp.experts
    return (os.environ.get("FAST_DECODE_MOE", "triton") == "triton" and use_triton(x, e.gate_up_proj)
            and x.dtype in (torch.bfloat16, torch.float16) and e.gate_up_proj.dtype == e.down_proj.dtype == x.dtype
            and type(e.act_fn).__name__ in ("SiLU", "SiLUActivation"))


def _dense_mm(x: Tensor, w: Tensor, expert: Tensor) -> Tensor:
    """x (M, in), w (E, out, in), expert (M,) -> (M, out): row m times w[expert[m]]^T, through every expert."""
    E, out, _ = w.shape
    y = F.linear(x, w.reshape(E * out, -1)).view(-1, E, out)                 # (M, E, out)
    return y.gather(1, expert[:, None, None].expand(-1, 1, out))[:, 0]       # (M, out)


def _expert_mm(x: Tensor, w: Tensor, expert: Tensor, offs: Tensor, grouped: bool) -> Tensor:
    """x (M, in) sorted by expert; w (E, out, in) -> (M, out)."""
    if grouped:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return _dense_mm(x, w, expert)


def routed_experts(x: Tensor, router: Tensor, top_k: int, norm_topk: bool, gate_up: Tensor, down: Tensor,
                   act, grouped: bool | None = None, chosen: list | None = None, decode: bool = False) -> Tensor:
    """x (N, H) -> (N, H): the weighted sum of each token's top_k experts' MLPs (see the module's docstring).
    grouped: force the grouped GEMM (True) or the dense form (False); None: grouped where it runs; "triton":
    kernels/moe_experts.py's two kernels (SiLU experts; the caller checks with `triton_experts`).
    chosen: a list that gets the experts each token took, (N, top_k) (routing replay's record).
    decode: x is a decode step's one token per sequence; with grouped "triton", the routing too runs as one
    kernel (kernels/decode_route.py)."""
    N, H = x.shape
    E = gate_up.shape[0]
    fused = grouped == "triton" and decode and N <= MAX_TOKENS
    if fused:
        # softmax, topk, the weights and the expert order in one launch. Exact ties (equal probabilities) go to
        # the lower expert index there: at a decode token as rare as the near ties that the engine's and the
        # trainer's roundings already break differently; a prefill, whose padding ties every expert (a zero
        # hidden state), keeps torch's topk, as the trainer's router
        weight, idx, token, at, offs = (route_linear(x, router, top_k, norm_topk) if ROUTER == "kernel" else
                                        route(F.linear(x, router), top_k, norm_topk, x.dtype))
    else:
        probs = F.linear(x, router).float().softmax(-1)                      # (N, E)
        # topk, not a rank computed in one fused pass: exact ties (a padding token's zero hidden state gives
        # equal probabilities) must break as the trainer's router breaks them, which is topk's own order
        weight, idx = probs.topk(top_k, dim=-1)                              # (N, k) each
        if norm_topk:
            weight = weight / weight.sum(-1, keepdim=True)
        weight = weight.to(x.dtype)
        order, at, offs = by_expert(idx.reshape(-1), E)                     # pairs grouped by expert
        token = order // top_k                                               # (N k,) the token of each pair
    if chosen is not None:
        chosen.append(idx)
    # a prefill's many pairs: no kernel for them
    if not fused and (grouped is None or (grouped == "triton" and N * top_k > COUNT_PAIRS)):
        grouped = use_grouped(x, gate_up, down)
    if grouped == "triton":   # x's rows gathered, SiLU(gate) * up and each expert's weights read once, in-kernel
        h = expert_down(expert_gate_up(x, token, offs, gate_up), offs, down)   # (N k, H)
    else:
        expert = idx.reshape(-1)[order]                                      # (N k,) sorted
        h = _expert_mm(x[token], gate_up, expert, offs, grouped)            # (N k, 2I)
        g, u = h.chunk(2, dim=-1)
        h = _expert_mm((act(g) * u).contiguous(), down, expert, offs, grouped)   # (N k, H)
    # back to token order by a gather (at: each pair's row in the sorted layout), then each token's k rows weighted
    # and summed: one fused pass, no zeroed buffer and no atomic scatter-add
    return (h[at].view(N, top_k, H) * weight[..., None]).sum(1)              # (N, H)


def moe_block(mlp, x: Tensor, grouped: bool | None = None, sink: Tensor | None = None,
              slots: Tensor | None = None) -> Tensor:
    """A transformers sparse-MoE block (qwen3_moe: .gate router, .experts with 3-D weights) on x (B, T, H).
    grouped: as routed_experts'; a compiled step decides it before tracing (no probe inside the graph).
    sink (B, S, k) int16, slots (T,) or (B, T): routing replay's record, each token's experts written at its
    cache slot (a device-side write: a CUDA graph replays it)."""
    e, c = mlp.experts, mlp.gate
    top_k = getattr(c, "top_k", None) or mlp.top_k
    norm = getattr(c, "norm_topk_prob", getattr(mlp, "norm_topk_prob", True))
    chosen = [] if sink is not None else None
    y = routed_experts(x.reshape(-1, x.shape[-1]), c.weight, top_k, norm, e.gate_up_proj, e.down_proj, e.act_fn,
                       grouped, chosen, decode=x.shape[1] == 1)
    if sink is not None:
        B, T = x.shape[:2]
        idx = chosen[0].view(B, T, top_k).to(sink.dtype)                    # (B, T, k)
        if slots.dim() == 1:
            sink.index_copy_(1, slots, idx)
        else:
            sink.scatter_(1, slots[:, :, None].expand(B, T, top_k), idx)
    return y.view_as(x)


# --- routing replay (R3: "rollout routing replay"): the trainer's forward follows the experts the rollout chose ----
# An MoE policy's log-probs are a discontinuous function of its router's logits: where the engine's numerics (bf16
# kernels, a KV cache, another batch shape) and the trainer's differ slightly, a token near a tie between experts
# takes other experts in the two forwards, and the training log-probs of everything after it drift from the
# sampling ones. Routing replay records each token's top-k experts in every MoE layer during the rollout (the
# engine: `Recorder`, or the fast step's sink in `moe_block`) and makes the trainer's routers return those experts
# (`replay`, `set_routes`), with gating weights from the trainer's own router probabilities over them
# (renormalised where the model renormalises its top-k), so the router still gets gradients. Routes travel with
# the experience as (B, T, L, k) int16 (buffer.py: Experience.routes), -1 where a token was never forwarded by the
# engine (the last sampled one): those tokens route as usual.

def routers(model) -> list:
    """The router module of each MoE layer, in layer order (transformers' top-k routers: mlp.gate returning
    (logits, weights, indices)); [] for a dense model."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [layer.mlp.gate for layer in layers if hasattr(getattr(layer, "mlp", None), "experts")
            and hasattr(layer.mlp, "gate")]


def why_no_replay(model) -> str | None:
    """Why routing replay cannot run on this model (a dense model, or a router of another form), else None."""
    rs = routers(model)
    if not rs:
        return f"model_type {getattr(model.config, 'model_type', '?')!r} has no routed experts (MoE layers)"
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(getattr(layer, "mlp", None), "experts")]
    if not all("top_k_index" in inspect.signature(e.forward).parameters for e in experts):
        return "its MoE blocks do not take the router's (weights, indices) (transformers >= 5's top-k routers)"
    return None


class Recorder:
    """With it, every forward of the model's routers appends its chosen experts (N, k); `routes(B, T)` assembles
    them as (B, T, L, k) int16, the forwards' tokens laid out in order (a prefill of P columns, then one column per
    decode step), -1 past the last forwarded column. For engines that run the model's own modules (the portable
    loop)."""

    def __init__(self, model):
        self.calls = [[] for _ in routers(model)]
        self.hooks = [r.register_forward_hook(lambda m, a, out, i=i: self.calls[i].append(out[2].detach()))
                      for i, r in enumerate(routers(model))]

    def routes(self, B: int, T: int) -> Tensor:
        per_layer = []
        for calls in self.calls:
            cols = torch.cat([c.reshape(B, -1, c.shape[-1]) for c in calls], 1)[:, :T]       # (B, t, k)
            per_layer.append(F.pad(cols.to(torch.int16), (0, 0, 0, T - cols.shape[1]), value=-1))
        return torch.stack(per_layer, 2).cpu()                                               # (B, T, L, k)

    def close(self):
        for h in self.hooks:
            h.remove()


def _replayed(router, args, out):
    """Forward hook of a router under `replay`: the recorded experts where the row has them, the router's own
    elsewhere; weights = the router's probabilities at those experts (renormalised if it renormalises)."""
    want = router._r3_routes
    if want is None:
        return None
    logits, _, idx = out
    if want.shape != idx.shape:
        raise RuntimeError(f"routing replay: the forward routes {tuple(idx.shape)} tokens x experts, the "
                           f"recorded routes are {tuple(want.shape)} (the batch's layout changed after recording)")
    idx = torch.where(want >= 0, want.to(idx.dtype), idx)                               # (N, k)
    w = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)                     # (N, k)
    if getattr(router, "norm_topk_prob", True):
        w = w / w.sum(-1, keepdim=True)
    return logits, w.to(logits.dtype), idx


def replay(model):
    """Install routing replay on the model's routers (once; inactive until set_routes gives routes)."""
    for r in routers(model):
        if not hasattr(r, "_r3_routes"):
            r._r3_routes = None
            r.register_forward_hook(_replayed)


def set_routes(model, routes: Tensor | None):
    """The routes the next forwards (and the recomputation of their backward) replay: (B, T, L, k) for a forward
    over (B, T) tokens, or None to route freely. A no-op on a model without `replay` installed."""
    for i, r in enumerate(routers(model)):
        if hasattr(r, "_r3_routes"):
            r._r3_routes = None if routes is None else \
                routes[:, :, i].reshape(-1, routes.shape[-1]).to(r.weight.device, torch.long)


def setup_replay(cfg, model):
    """train.py's setup: with moe.routing_replay on, refuse (one line, before any step) what it does not cover,
    then install replay on the policy's routers. Off: nothing."""
    if not cfg.moe.routing_replay:
        return
    why = why_no_replay(model)
    if why:
        raise UserError(f"moe.routing_replay=true needs a mixture-of-experts model: {why}")
    off = [name for name, on in (("engine=builtin", cfg.engine != "builtin"), ("pack=false", cfg.pack),
                                 ("exact_logprobs=false", cfg.exact_logprobs), ("mode=sync", cfg.mode != "sync"),
                                 ("no env.name (single-turn)", bool(cfg.env.name)),
                                 ("replay.enabled=false", cfg.replay.enabled)) if on]
    if off:
        raise UserError(f"moe.routing_replay=true needs {', '.join(off)} (the routes are recorded by the built-in "
                        "engine's single-turn decode and replayed on the padded layout)")
    replay(model)
