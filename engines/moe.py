"""Routed experts as grouped GEMMs (the fast step's MoE layers, qwen3_moe's shape), with no loop over experts.

    y = routed_experts(x (N, H), router (E, H), top_k, norm_topk, gate_up (E, 2I, H), down (E, H, I), act)

Each token's top_k experts come from softmax(x router^T) (float32, as transformers' router); the N * top_k
(token, expert) pairs are sorted by expert, so each expert's tokens are one contiguous block, and one grouped
GEMM (torch._grouped_mm: a GEMM per block in one launch, block bounds read on the device) runs every expert's
gate/up, another every down projection. Shapes stay fixed whatever the routing, so the step still fits in one
CUDA graph. Where torch has no grouped GEMM for this device and dtype (`grouped_ok` probes once), `_dense_mm`
gives the same result by multiplying every pair by all experts' weights and keeping its own expert's block:
E / top_k times the arithmetic, the weights still read once (decode is bound by reading them).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

_PROBED: dict = {}   # (device type, dtype) -> whether torch._grouped_mm runs there


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
                   act, grouped: bool | None = None) -> Tensor:
    """x (N, H) -> (N, H): the weighted sum of each token's top_k experts' MLPs (see the module's docstring).
    grouped: force the grouped GEMM (True) or the dense form (False); None: grouped where it runs."""
    N, H = x.shape
    E = gate_up.shape[0]
    probs = F.linear(x, router).float().softmax(-1)                          # (N, E)
    weight, idx = probs.topk(top_k, dim=-1)                                  # (N, k) each
    if norm_topk:
        weight = weight / weight.sum(-1, keepdim=True)
    weight = weight.to(x.dtype)
    flat = idx.reshape(-1)                                                   # (N k,) expert of each pair
    order = flat.argsort(stable=True)                                        # pairs grouped by expert
    expert = flat[order]                                                     # (N k,) sorted
    token = order // top_k                                                   # (N k,) the token of each pair
    # (E,) end of each expert's block; searchsorted, not bincount: its output size would need the host
    offs = torch.searchsorted(expert, torch.arange(E, device=x.device), right=True).to(torch.int32)
    if grouped is None:
        grouped = use_grouped(x, gate_up, down)
    h = _expert_mm(x[token], gate_up, expert, offs, grouped)                # (N k, 2I)
    g, u = h.chunk(2, dim=-1)
    h = _expert_mm((act(g) * u).contiguous(), down, expert, offs, grouped)  # (N k, H)
    h = h * weight.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, h)                       # (N, H)


def moe_block(mlp, x: Tensor, grouped: bool | None = None) -> Tensor:
    """A transformers sparse-MoE block (qwen3_moe: .gate router, .experts with 3-D weights) on x (B, T, H).
    grouped: as routed_experts'; a compiled step decides it before tracing (no probe inside the graph)."""
    e, c = mlp.experts, mlp.gate
    top_k = getattr(c, "top_k", None) or mlp.top_k
    norm = getattr(c, "norm_topk_prob", getattr(mlp, "norm_topk_prob", True))
    y = routed_experts(x.reshape(-1, x.shape[-1]), c.weight, top_k, norm, e.gate_up_proj, e.down_proj, e.act_fn,
                       grouped)
    return y.view_as(x)
