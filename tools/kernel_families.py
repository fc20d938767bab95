"""tools/kernel_sweep.py's families for the fused KL's, the FP8 rollout's and the MoE decode experts' Triton kernels,
and the helpers every family shares (tools/kernel_families_exact.py has the exact path's; the sweep's runner and
its first families fill tools/kernel_sweep.py).

  fused_kl    kernels/fused_kl.py: fused_kl's forward and backward kernels on ragged tiles (`_stats_kernel`,
              `_grad_kernel`) and fused_kl_loss's split rows (`_part_kernel`, `_merge_kernel`), both directions ->
              fused_kl_reference and autograd through it
  fp8_gemm    kernels/fp8_gemm.py: the FP8 x FP8 split-K GEMM (its default tiles and a K split whose last range is
              shorter) -> kernels/fp8.py dequantised_mm on the same quantised values
  fp8_quant   kernels/fp8_quant.py: merge_quantise with and without LoRA factors, partial row blocks and K steps, a
              zero row -> merged_twin
  moe         kernels/moe_experts.py: the decode step's expert kernels (gate/up with SiLU, down) over routings with
              empty experts and one past a row block -> expert_gate_up_reference, expert_down_reference
  moe_route   kernels/decode_route.py: a decode step's routing (softmax, top-k, weights, expert order) -> route_reference
The FP8 families need FP8 tensor cores on a GPU (compute capability 8.9+): elsewhere the sweep skips them with one
line (`NEEDS`), counting neither a pass nor a failure. Under the interpreter they run on CPU tensors, with float32
where the GPU would round to e4m3 in the kernel (triton 3.9's interpreter rounds e4m3 unfaithfully).
"""
import importlib
import math
import os
import zlib

import torch

F32, BF16 = torch.float32, torch.bfloat16
QWEN_V = 151936
# bfloat16 bands in ulps: 1 where the GPU rounds to nearest; 2 under TRITON_INTERPRET=1, whose bfloat16 casts
# truncate (a cast inside the kernel and the store's can each lose most of an ulp)
BF16_ULPS = 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1


def rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))   # the same inputs in every process


def worst_excess(got, want, rtol: float, atol: float) -> float:
    """max |got - want| / (rtol |want| + atol) over the elements (<= 1: inside torch.allclose's band); inf on nan."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).abs() / (rtol * want.abs() + atol)).max().item() if got.numel() else 0.0


# --- fused_kl ------------------------------------------------------------------------------------------------------

def check_fused_kl(device, op, N, Hs, Ht, V, dtype, reverse, temperature, rows_per_block, split=None,
                   chunk_bytes=1) -> float:
    """op "kl": fused_kl (Triton forward `_stats_kernel`, backward `_grad_kernel`) in `rows_per_block`-row token
    blocks and tiles of chunk_bytes (1: 128-column blocks, the last ragged); op "loss": fused_kl_loss
    (`_part_kernel` with `split` programs per row, `_merge_kernel`, then `_grad_kernel` in the forward) in chunks of
    rows_per_block rows.
    Against fused_kl_reference on float32 copies of the inputs, gradients through autograd: tests/test_fused_kl.py's
    allclose band (float32 1e-4, bfloat16 5e-2; 1e-1 for the loss: below). Returns the worst error as a fraction of the band."""
    fk = importlib.import_module("kernels.fused_kl")   # kernels/__init__.py's fused_kl (a function) hides it
    g = gen("fused_kl", op, N, Hs, Ht, V, dtype, reverse, temperature, rows_per_block, split, chunk_bytes)
    hs = (torch.randn(N, Hs, generator=g) * 2 / Hs ** 0.5).to(dtype)                   # logits ~ N(0, 4)
    ws = torch.randn(V, Hs, generator=g).to(dtype)
    ht, wt = (torch.randn(N, Ht, generator=g) * 2 / Ht ** 0.5).to(dtype), torch.randn(V, Ht, generator=g).to(dtype)
    weights = torch.rand(N, generator=g)
    hd, wd = hs.to(device, copy=True).requires_grad_(), ws.to(device, copy=True).requires_grad_()
    if op == "kl":
        kl = fk.fused_kl(hd, wd, ht.to(device), wt.to(device), temperature, reverse, use_triton=True,
                         chunk_bytes=chunk_bytes, rows_per_block=rows_per_block)
        (kl * weights.to(device)).sum().backward()
    else:
        saved = dict(fk.LOSS_LAUNCH)
        fk.LOSS_LAUNCH.update(SPLIT=split, BLOCK=128 if split > 1 else 4096)
        try:
            loss, kl = fk.fused_kl_loss(hd, wd, ht.to(device), wt.to(device), weights.to(device), temperature, reverse,
                                        use_triton=True, chunk_bytes=2 * hs.element_size() * V * rows_per_block)
        finally:
            fk.LOSS_LAUNCH.clear()
            fk.LOSS_LAUNCH.update(saved)
        loss.backward()
    f32 = [t.detach().to(device).float().requires_grad_(i < 2) for i, t in enumerate((hs, ws, ht, wt))]
    ref = fk.fused_kl_reference(*f32, temperature, reverse)                             # (N,)
    (ref * weights.to(device)).sum().backward()
    # bf16: the test file's band, twice it for the loss (the first GPU run put one loss case, N = 130 over 3 row
    # chunks, V = 4097 with a 1-column last block, reverse at temperature 0.8, at 1.28x of 5e-2; not explained yet)
    tol = 1e-4 if dtype == F32 else 5e-2 if op == "kl" else 1e-1
    err = max(worst_excess(kl, ref, tol, tol), worst_excess(hd.grad, f32[0].grad, tol, tol),
              worst_excess(wd.grad, f32[1].grad, tol, tol))
    assert err <= 1, f"error {err:.3g} x the tolerance"
    return err


def fused_kl_cases(size):
    # (N, Hs, Ht, V, rows_per_block, chunk_bytes): one token; token blocks that leave a ragged last one; V = 300
    # (two 128-column blocks and 44 left over) and 1,000; fused_kl's backward over several token blocks
    shapes = [(1, 16, 8, 300, 8, 1), (19, 16, 40, 300, 8, 1), (37, 64, 64, 1000, 16, 1)]
    if size == "gpu":   # a real vocabulary in the default tiles (16,384 columns, the last ragged)
        shapes += [(3, 896, 896, QWEN_V, 2, None), (130, 64, 32, 4097, 64, 1)]
    if size == "cpu":
        shapes = [(1, 16, 8, 300, 8, 1), (10, 16, 40, 300, 8, 1)]
    for N, Hs, Ht, V, rows, chunk in shapes:
        for dtype in (F32, BF16):
            for reverse in (True, False):
                if size == "cpu" and reverse != (dtype == F32):
                    continue
                temperature = 0.8 if reverse else 1.0
                case = dict(N=N, Hs=Hs, Ht=Ht, V=V, dtype=dtype, reverse=reverse, temperature=temperature,
                            rows_per_block=rows)
                yield dict(op="kl", **case, chunk_bytes=chunk or (256 << 20))
                for split in (1, 3):
                    if size != "cpu" or split == (3 if reverse else 1):
                        yield dict(op="loss", **case, split=split)


# --- fp8_gemm ------------------------------------------------------------------------------------------------------

def fp8_needs(device) -> str | None:
    """Why this device cannot run the FP8 kernels (None: it can): tl.dot on e4m3 and e4m3 stores want sm_89+."""
    if device != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9):
        return None
    return f"needs FP8 tensor cores (compute capability 8.9+); {torch.cuda.get_device_name()} is sm_{major}{minor}"


def check_fp8_gemm(device, M, N, K, split) -> float:
    """kernels/fp8_gemm.py's kernel, launched with tiles(M, N, K) (split "default") or with K cut into 32-deep
    steps, a few per range, so that the last range is shorter ("short_last"), against dequantised_mm on the same
    quantised values: tests/test_fp8.py's GPU band (rtol 1e-2, atol 1e-2 x the largest output). On CUDA the default
    split goes through fp8_gemm, the custom op the compiled decode step calls."""
    from kernels.fp8 import dequantised_mm, quantise_activations, quantise_rows
    from kernels.fp8_gemm import Tiles, fp8_gemm, launch, tiles
    g = gen("fp8_gemm", M, N, K, split)
    x8, sx = quantise_activations(torch.randn(M, K, generator=g))                      # (M, K) e4m3, (M, 1)
    w8, sw = quantise_rows(torch.randn(N, K, generator=g) * 0.05)                      # (N, K) e4m3, (N,)
    t = tiles(M, N, K)
    if split == "short_last":   # p 32-deep blocks per range, p not dividing K's: the last range is shorter
        nk = K // 32
        p = next(p for p in (3, 2, 5, 7) if nk % p)
        t = Tiles(t.BM, 64, 32, -(-nk // p), 32 * p, 4, 2)
        assert t.S > 1 and t.per * t.S > K, (t, K)
    put = lambda x: x.to(device)
    if device == "cuda" and split == "default":
        parts = fp8_gemm(put(x8), put(sx), put(w8), put(sw))
    else:
        parts = launch(put(x8), put(sx.view(M)), put(w8), put(sw), t)
    assert parts.shape == (t.S, M, N) and parts.dtype == F32, (parts.shape, t)
    twin = dequantised_mm(x8, sx, w8, sw)                                               # (M, N) float32
    err = worst_excess(parts.sum(0), twin, 1e-2, 1e-2 * twin.abs().max().item())
    assert err <= 1, f"error {err:.3g} x the tolerance"
    return err


def fp8_gemm_cases(size):
    # K a multiple of 32: tl.dot on e4m3 takes no step shallower than 32 on a GPU
    shapes = [(1, 64, 128), (3, 1000, 320), (17, 33, 96), (64, 1024, 512), (100, 96, 4096), (128, 257, 1024)]
    if size == "gpu":
        shapes += [(64, 4608, 3584), (1, 3584, 18944)]
    if size == "cpu":
        shapes = [(1, 64, 128), (17, 33, 96), (3, 100, 320)]
    for M, N, K in shapes:
        for split in ("default", "short_last"):
            yield dict(M=M, N=N, K=K, split=split)


# --- fp8_quant -----------------------------------------------------------------------------------------------------

def check_fp8_quant(device, N, K, R, dtype) -> float:
    """merge_quantise(w, a, b) (R = 0: w alone) into e4m3 (on CUDA; under the interpreter a float32 w8 takes the
    quotient before its rounding) against merged_twin: the scales within 1e-6 relative; the e4m3 values at most
    1% one e4m3 step away, none further (near-ties: see below); the float32
    quotient within 1e-3 (tests/test_fp8.py). Row 0 is all zeros (its scale is 1). Returns the worst scale error."""
    from kernels.fp8 import FP8, row_scales
    from kernels.fp8_quant import merge_quantise, merged_twin
    g = gen("fp8_quant", N, K, R, dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    w[0] = 0
    a = torch.randn(R, K, generator=g) if R else None
    b = torch.randn(N, R, generator=g) * 0.01 if R else None
    if R:
        b[0] = 0
    put = lambda x: None if x is None else x.to(device)
    q8 = torch.full((N, K), float("nan")).to(FP8 if device == "cuda" else F32).to(device)   # nan: not written
    scale = torch.full((N,), float("nan"), device=device)
    merge_quantise(put(w), put(a), put(b), (q8, scale))
    w8, s = (x.cpu() for x in merged_twin(put(w), put(a), put(b)))                    # on the device, as the GPU test
    q8, scale = q8.cpu(), scale.cpu()
    err = ((scale - s).abs() / s).max().item() if torch.isfinite(scale).all() else math.inf
    assert err <= 1e-6 and scale[0] == 1, f"scales off by {err} (relative); row 0's scale {scale[0].item()}"
    if device != "cuda":
        m = w.float() if a is None else w.float() + b @ a                              # (N, K)
        q_err = (q8 - m / row_scales(m)).abs().max().item() if torch.isfinite(q8).all() else math.inf
        assert q_err <= 1e-3, f"quotient off by {q_err}"
        return err
    got, want = q8.float(), w8.float()
    differ = got != want
    # a few near-ties round to the neighbouring e4m3 value: the sums' order with adapters, and without them the
    # kernel's float32 -> e4m3 conversion against torch's (the first GPU run: 0.04-0.16% of values, R = 0)
    step = torch.maximum(got.abs(), want.abs()) / 8 + 2 ** -9                         # one e4m3 step, at most
    assert (differ.float().mean() <= 1e-2 and ((got - want).abs() <= step * 1.001).all()
            ), f"{int(differ.sum())} of {differ.numel()} e4m3 values differ, max {(got - want).abs().max()}"
    return err


def fp8_quant_cases(size):
    # (N, K, R): row blocks of 32 and K steps of 128 left partial; ranks 0, 1, 5 (padded to 16) and 16, 64
    shapes = [(1, 64, 0), (33, 200, 5), (100, 128, 0), (70, 300, 16), (64, 3584, 1), (257, 896, 64)]
    if size == "gpu":
        shapes += [(4608, 3584, 16), (512, 3584, 16)]               # K split 7 ways; 512 (a 7B's k_proj): 28
    if size == "cpu":
        shapes = [(1, 64, 0), (33, 200, 5)]
    for N, K, R in shapes:
        for dtype in (BF16, F32):
            if size != "cpu" or dtype == (BF16 if R else F32):
                yield dict(N=N, K=K, R=R, dtype=dtype)


# --- moe ----------------------------------------------------------------------------------------------------------

def check_moe(device, N, H, I, E, k, skew, dtype, cfg) -> float:
    """kernels/moe_experts.py's expert_gate_up (x gathered by token, SiLU(gate) * up in the epilogue) and
    expert_down over N tokens routed top-k of E experts (kernels/decode_route.py's by_expert), against their twins
    (expert_*_reference): tests/test_moe_experts.py's relative Frobenius bounds (bf16 1e-2; float32 5e-3 on a GPU,
    whose float32 dots take TF32, 1e-5 interpreted). skew: most pairs on expert 1 (more than a row block), none on
    expert E-1. cfg: (BM, BN, BK, warps, stages[, CN]), None for the kernels' SETTINGS."""
    from kernels.decode_route import by_expert
    from kernels.moe_experts import expert_down, expert_down_reference, expert_gate_up, expert_gate_up_reference
    g = gen("moe", N, H, I, E, k, skew, dtype, cfg)
    flat = torch.rand(N, E, generator=g).topk(k, -1).indices.reshape(-1)               # (N k,) each pair's expert
    if skew:
        flat = torch.where(torch.rand(flat.shape, generator=g) < 0.8, 1, flat % (E - 1))
    order, _, offs = by_expert(flat, E)
    token = order // k                                                                 # (M,) sorted by expert
    x = torch.randn(N, H, generator=g).to(dtype)
    gu = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    dn = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    put = lambda t: t.to(device)
    a_ref = expert_gate_up_reference(x, token, offs, gu)                               # (M, I)
    a = expert_gate_up(put(x), put(token), put(offs), put(gu), cfg)
    y = expert_down(put(a_ref), put(offs), put(dn), cfg)                               # (M, H)
    y_ref = expert_down_reference(a_ref, offs, dn)
    tol = 1e-2 if dtype == BF16 else 5e-3 if device == "cuda" else 1e-5
    for got, want in ((a, a_ref), (y, y_ref)):
        assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
    err = max(rel(a, a_ref), rel(y, y_ref))
    assert err <= tol, f"error {err} > {tol}"
    return err


def moe_cases(size):
    # (N, H, I, E, k, skew): one token (most experts empty); sizes no tile divides; an expert past one row block
    # and one with no pair; W10's qwen3_moe decode shape (gpu)
    shapes = [(1, 64, 32, 4, 2, False), (9, 40, 24, 5, 2, False), (40, 64, 48, 3, 1, True), (128, 256, 96, 8, 4, True)]
    if size == "gpu":
        shapes.append((128, 1024, 768, 32, 4, False))
    if size == "cpu":   # float32 only: the interpreter's bf16 tl.dot is wrong (FACTS.md)
        for N, H, I, E, k, skew, cfg in ((9, 40, 24, 5, 2, False, None), (40, 64, 48, 3, 1, True, (16, 16, 16, 4, 2)),
                                         (9, 64, 48, 3, 2, False, (16, 16, 16, 4, 2, 12))):   # CN: 12 of 16 columns
            yield dict(N=N, H=H, I=I, E=E, k=k, skew=skew, dtype=F32, cfg=cfg)
        return
    for N, H, I, E, k, skew in shapes:
        for dtype in (F32, BF16):
            for cfg in (None, (16, 16, 16, 4, 2), (16, 32, 16, 4, 2, 24)):   # the tuned tiles; small ones: several
                if cfg is None or size == "gpu" or dtype == BF16:              # row and column tiles; CN < BN
                    yield dict(N=N, H=H, I=I, E=E, k=k, skew=skew, dtype=dtype, cfg=cfg)


def check_moe_route(device, N, E, k, norm, dtype, H=0) -> float:
    """kernels/decode_route.py's route (H = 0: on logits (N, E)) or route_linear (H > 0: on hidden states (N, H)
    and a router (E, H), the GEMM in the kernel) against route_reference on the same logits. Ties aside, the same
    experts: the kernel's experts hold the k largest probabilities, in order (within the dtype's rounding of the
    logits: route_linear's sums are not cuBLAS's); the pairs' order, places and offsets are exactly those of its
    own experts (`by_expert`'s counting pass); the weights within the dtype's precision."""
    import torch.nn.functional as F
    from kernels.decode_route import by_expert, route, route_linear, route_reference
    g = gen("moe_route", N, E, k, norm, H)
    if H:
        x, w = torch.randn(N, H, generator=g).to(dtype), (torch.randn(E, H, generator=g) / H ** 0.5).to(dtype)
        z = F.linear(x, w)
        got = [t.cpu() for t in route_linear(x.to(device), w.to(device), k, norm)]
    else:
        z = torch.randn(N, E, generator=g).to(dtype)
        got = [t.cpu() for t in route(z.to(device), k, norm, dtype)]
    want = route_reference(z, k, norm, dtype)
    probs = z.float().softmax(-1)
    tol = 1e-2 if dtype == BF16 else 1e-5
    top = probs.topk(k, -1).values
    assert (probs.gather(1, got[1]) - top).abs().max().item() <= tol * top.max().item(), "not the top-k experts"
    order, at, offs = by_expert(got[1].reshape(-1), E)
    for name, a, b in zip(("token", "at", "offs"), got[2:], (order // k, at, offs)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs"
    assert got[0].dtype == dtype and got[1].dtype == torch.int64
    err = rel(got[0], want[0])
    assert err <= tol, f"weights' error {err}"
    return err


def moe_route_cases(size):
    # (N, E, k, norm, H): one token; sizes no power of two; W10's qwen3_moe decode batch (128 x 32, top-4), its
    # router's GEMM in the kernel (H 1024 on a GPU); the most tokens the kernel takes, more experts than 32
    shapes = [(1, 8, 2, True, 0), (7, 12, 3, False, 0), (128, 32, 4, True, 0), (9, 12, 3, True, 40)]
    if size != "cpu":       # the sanitizer: W10's with the GEMM; the GPU sweep: every edge (each compiles anew)
        shapes += [(128, 32, 4, True, 1024)]
    if size == "gpu":
        shapes += [(512, 64, 8, True, 0), (100, 60, 1, False, 0), (512, 64, 8, True, 200)]
    for N, E, k, norm, H in shapes:
        yield dict(N=N, E=E, k=k, norm=norm, dtype=BF16 if size == "gpu" else F32, H=H)


FAMILIES = {"fused_kl": (fused_kl_cases, check_fused_kl), "fp8_gemm": (fp8_gemm_cases, check_fp8_gemm),
            "fp8_quant": (fp8_quant_cases, check_fp8_quant), "moe": (moe_cases, check_moe),
            "moe_route": (moe_route_cases, check_moe_route)}
NEEDS = {"fp8_gemm": fp8_needs, "fp8_quant": fp8_needs}   # family -> fn(device) -> why it cannot run here, or None
