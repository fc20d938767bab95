"""FP8 (float8_e4m3fn) GEMMs for the rollout's decode step (engine_dtype=fp8: engines/decode_weights.py), with their
torch twin, the same functions on every device:

    w8, scale = quantise_rows(w)                 # w (N, K) -> w8 (N, K) e4m3, scale (N,) float32: w ~ w8 * scale[:, None]
    y = fp8_linear(x, w8, scale, bias)           # x (..., K) -> y (..., N) in x's dtype, ~ x @ w.T + bias

Weights are scaled per output channel (one float32 scale per row of W, its absolute max over 448, e4m3's largest
finite value); activations per row (per token), quantised on the fly inside the step. On a GPU with FP8 tensor
cores (compute capability 8.9+: Ada, Hopper) `fp8_linear` is one FP8 GEMM with float32 accumulation, output in
x's dtype: the weight bytes a decode step reads halve against bf16. At a decode step's few rows it is
kernels/fp8_gemm.py's Triton kernel (GEMM = "triton", the default: it streams the weight nearer the card's
bandwidth than cuBLAS at these shapes, docs/lora.md); for more rows (a prefill: fp8_gemm.wins), or with
GEMM = "scaled_mm", `torch._scaled_mm` with rowwise scales. Elsewhere (the CPU, and the tests) it is the torch
twin: the same quantised values dequantised and multiplied in float32, so the twin's numbers are the GPU's up to
the order of the sums; it simulates FP8's rounding, it is not faster. A GPU without
FP8 is refused before any work (`check_device`).
"""
import os

import torch
from torch import Tensor

from kernels.fp8_gemm import HAS_TRITON, fp8_gemm, wins

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max      # 448.0: e4m3's largest finite value
ROWS = 4096                         # rows quantised at a time: the float32 temporary of a 7B head stays ~60 MB
# the GPU's GEMM at decode-sized row counts (where fp8_gemm.wins): "triton" (kernels/fp8_gemm.py) or "scaled_mm"
# (torch._scaled_mm); both take the activations quantised per token. Read when the step is traced, so set it
# before building a decoder (tools/lora_decode_bench.py compares both)
GEMMS = ("triton", "scaled_mm")
GEMM = os.environ.get("FAST_DECODE_FP8_GEMM", "triton")
if GEMM not in GEMMS:
    raise ValueError(f"FAST_DECODE_FP8_GEMM={GEMM!r}: use one of {', '.join(GEMMS)}")


def has_fp8(device) -> bool:
    """Can this device run `torch._scaled_mm` in e4m3 (the real FP8 GEMM rather than the twin)?"""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_device(device):
    """Refuse, in one line, a GPU without FP8 tensor cores: its only route would be the slow twin."""
    device = torch.device(device)
    if device.type == "cuda" and not has_fp8(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"engine_dtype=fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper, "
                         f"Blackwell); {torch.cuda.get_device_name(device)} is sm_{major}{minor}: use "
                         "engine_dtype=auto")


def gemm_fits(n: int, k: int) -> bool:
    """torch._scaled_mm takes matrices whose dimensions are multiples of 16."""
    return n % 16 == 0 and k % 16 == 0


@torch.no_grad()
def quantise_rows(w: Tensor, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """w (N, K) -> (w8 (N, K) e4m3, scale (N,) float32) with w ~ w8 * scale[:, None]; into out's buffers when
    given (the last rollout's: captured graphs keep their addresses). Three passes over a chunk of rows (its
    absolute max, the float32 quotient, its rounding into w8): this runs over every FP8 weight at each refresh."""
    N, K = w.shape
    w8, scale = out if out is not None else (torch.empty(N, K, dtype=FP8, device=w.device),
                                              torch.empty(N, dtype=torch.float32, device=w.device))
    for i in range(0, N, ROWS):
        rows = w[i:i + ROWS]                                                       # (r, K)
        s = row_scales(rows)                                                       # (r, 1)
        w8[i:i + ROWS].copy_(rows / s)                                             # rounds to nearest e4m3
        scale[i:i + ROWS].copy_(s[:, 0])
    return w8, scale


def row_scales(x: Tensor) -> Tensor:
    """x (M, K) -> (M, 1) float32: each row's absolute max over 448, so that x / scale fits e4m3 (no clamp needed:
    the row's max lands on 448 up to float32 rounding, which e4m3 rounds back to 448); a row of zeros gets 1."""
    s = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).float() / FP8_MAX
    return torch.where(s > 0, s, torch.ones_like(s))


def quantise_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) -> (x8 (M, K) e4m3, scale (M, 1) float32), one scale per row (token); inside the compiled step
    this fuses into one kernel with what produced x."""
    s = row_scales(x)                                                              # (M, 1)
    return (x / s).to(FP8), s


def fp8_linear(x: Tensor, w8: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) -> (..., N) in x's dtype: x @ (w8 * scale[:, None]).T + bias, x quantised per row to e4m3 first.
    One FP8 GEMM on CUDA (a GPU without FP8 was refused before: check_device), the float32 twin elsewhere; with
    GEMM = "triton", decode-sized row counts on CUDA take kernels/fp8_gemm.py (where fp8_gemm.wins), whose
    partial sums over K ranges are added here, in order."""
    lead, K = x.shape[:-1], x.shape[-1]
    x8, sx = quantise_activations(x.reshape(-1, K))                                # (M, K), (M, 1)
    if x.is_cuda and GEMM == "triton" and HAS_TRITON and wins(x8.shape[0], w8.shape[0], K):
        y = fp8_gemm(x8, sx, w8, scale).sum(0).to(x.dtype)                         # (M, N)
    elif x.is_cuda:
        # w8.t() is (K, N) column-major, the layout _scaled_mm wants for its second operand
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=scale[None], out_dtype=x.dtype)   # (M, N)
    else:
        y = dequantised_mm(x8, sx, w8, scale).to(x.dtype)
    y = y.view(*lead, -1)
    return y if bias is None else y + bias


def dequantised_mm(x8: Tensor, sx: Tensor, w8: Tensor, scale: Tensor) -> Tensor:
    """The twin of the scaled GEMM: (x8 * sx) @ (w8 * scale[:, None]).T in float32, (M, N)."""
    return (x8.float() * sx) @ (w8.float() * scale[:, None]).t()
