"""engine_dtype=fp8: the FP8 quantiser and GEMM (kernels/fp8.py), the decoder's fp8 routes
(engines/decode_weights.py: refresh, fp8_group), the engine and the config (tis defaulted, bad values refused).
CPU tests run the torch twin; the GPU tests run torch._scaled_mm and the compiled, graphed decoder."""
import os

import pytest
import torch

import config
import config_checks
from engines import decode_weights
from engines.decode_weights import FP8_MIN
from engines.fast_decode import FastDecoder
from kernels.fp8 import FP8, check_device, dequantised_mm, fp8_linear, quantise_rows

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_quantise_rows_scales_each_row_to_e4m3s_range():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 30.0, 500.0, 0.0])[:, None]   # (6, 40)
    w8, scale = quantise_rows(w)
    assert w8.dtype == FP8 and scale.dtype == torch.float32 and w8.shape == w.shape
    deq = w8.float() * scale[:, None]
    amax = w.abs().amax(1)
    # the largest element of a row lands on 448 exactly, so each row's absolute max survives to float rounding
    assert torch.allclose(deq.abs().amax(1), amax, rtol=1e-6)
    assert scale[5] == 1 and not w8[5].float().any()                     # a zero row: scale 1, zeros
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, one subnormal step (2^-9) below
    err = (deq - w).abs()
    assert (err <= w.abs() / 16 + scale[:, None] * 2**-9 * 1.001).all()
    assert err.max() > 0                                                 # it did round
    out = (torch.empty_like(w8), torch.empty_like(scale))
    w8b, sb = quantise_rows(w, out)
    assert w8b is out[0] and sb is out[1] and torch.equal(w8b.float(), w8.float()) and torch.equal(sb, scale)


def test_fp8_linear_twin_is_close_to_the_full_precision_product():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(4, 3, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    w8, scale = quantise_rows(w)
    y = fp8_linear(x, w8, scale, b)                                      # (4, 3, 32)
    ref = x @ w.t() + b
    rel = ((y - ref).norm() / ref.norm()).item()
    assert y.shape == (4, 3, 32) and 0 < rel < 0.08, rel                 # FP8's rounding of both operands, no more
    # the activations are quantised per row: scaling one row scales its output alone
    x2 = x.clone()
    x2[0, 0] *= 1000
    assert torch.allclose(fp8_linear(x2, w8, scale)[0, 0], 1000 * fp8_linear(x, w8, scale)[0, 0], rtol=1e-4)
    assert torch.equal(fp8_linear(x2, w8, scale)[1:], fp8_linear(x, w8, scale)[1:])
    assert fp8_linear(x.bfloat16(), w8, scale).dtype == torch.bfloat16


def _fp8_groups(dec) -> tuple[list[list[bool]], bool]:
    """Per layer, which of its four groups are FP8; and whether the head is (its tuple follows the layers')."""
    fp8 = lambda p: p is not None and p[0][0].dtype == FP8
    L = len(dec.model.model.layers)
    return [[fp8(p) for p in layer] for layer in dec.fused[:L]], fp8(dec.fused[L])


def test_refresh_quantises_the_large_groups_and_leaves_the_master_weights(random_model_dir, monkeypatch):
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the random model's groups: q/k/v 128 x 64, gate/up 256 x 64, o 64 x 64, down 64 x 128, the head 14 x 64
    monkeypatch.setitem(FP8_MIN, "fp8", 10_000)
    dec = FastDecoder(model, weights="fp8")
    dec.refresh()
    L = len(model.model.layers)
    assert len(dec.fused) == L + 1                                       # the layers' groups, then the head
    assert _fp8_groups(dec) == ([[False, True, False, False]] * L, False)   # gate/up alone: over 10,000 elements
    assert dec.fused[L][0][0] is model.lm_head.weight                    # the small head stays, read in place
    mlp = model.model.layers[0].mlp
    w8, scale = dec.fused[0][1][0]
    w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])           # (256, 64)
    assert torch.allclose(w8.float() * scale[:, None], w, rtol=1 / 16, atol=float(scale.max()) * 2**-9)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())   # the masters untouched
    ptrs = (w8.data_ptr(), scale.data_ptr())
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)
    dec.refresh()                                                        # refilled in place, with the new weights
    w8, scale = dec.fused[0][1][0]
    assert (w8.data_ptr(), scale.data_ptr()) == ptrs
    assert torch.allclose(w8.float()[128:] * scale[128:, None], 2 * before["model.layers.0.mlp.up_proj.weight"],
                          rtol=1 / 16, atol=float(scale.max()) * 2**-9)
    dec_all = FastDecoder(model, weights="fp8_all")
    dec_all.refresh()
    assert _fp8_groups(dec_all) == ([[True] * 4] * L, True)             # fp8_all: every group and the head


def test_lora_adapters_are_merged_into_the_fp8_copy(random_model_dir, monkeypatch):
    import lora
    from config import LoRAConfig
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    model = lora.wrap(model, LoRAConfig(r=4, alpha=8), "random")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    dec = FastDecoder(model, weights="fp8_all")
    dec.refresh()
    down = model.get_base_model().model.layers[1].mlp.down_proj
    w8, scale = dec.fused[1][3][0]
    merged, base = lora.dense_weight(down), down.base_layer.weight
    deq = w8.float() * scale[:, None]
    assert (deq - merged).abs().max() < (deq - base).abs().max() / 4    # W + B A, not W
    # what FP8_REFRESH="triton" hands the merge-and-quantise kernel (kernels/fp8_quant.py): the adapter's own
    # float32 A and B (read in place) and alpha / r; nothing once the adapters are off
    A, B, scaling = decode_weights._adapter(down)
    assert A is down.lora_A["default"].weight and scaling == 2.0
    assert torch.allclose(base + (B @ A) * scaling, merged, atol=1e-6)
    with model.disable_adapter():
        assert decode_weights._adapter(down) == (None, None, 1.0)


def _engine_gap(model, tok, dtype: str, rollout: bool) -> tuple[float, object]:
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from models import completion_logprobs
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, sample_dtype=dtype)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "123+456=", "7="]]
    r = engine.generate(prompts, 4, SamplingParams(max_new_tokens=10, rollout=rollout), torch.Generator().manual_seed(0))
    C = r.completion_mask.shape[1]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, r.input_ids, r.attention_mask, C, 1.0)
    return float(((logp - r.logprobs).abs() * r.completion_mask).max()), engine


def test_the_engine_samples_training_rollouts_in_fp8_and_evaluates_with_the_policy(random_model_dir):
    from models import load_model
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    gap, engine = _engine_gap(model, tok, "fp8_all", rollout=True)
    assert engine.fp8_decoder is not None and engine.rollout_model is model     # no copy of the policy
    assert 1e-5 < gap < 1.0, gap                                         # FP8's mismatch: present, bounded
    gap, engine = _engine_gap(model, tok, "fp8_all", rollout=False)     # evaluation: the policy itself
    assert engine.fp8_decoder is None and gap < 1e-4, gap


def test_fp8_defaults_tis_to_token_and_refuses_what_it_cannot_do():
    parse = lambda *a: config.fill_defaults(config.parse(list(a)))
    assert parse("engine_dtype=fp8").algo.tis == "token"
    assert parse("engine_dtype=fp8", "algo.tis=off").algo.tis == "off"   # given: it wins, even off
    assert parse("algo.tis=off", "engine_dtype=fp8_all", "algo.tis=seq").algo.tis == "seq"
    assert parse().algo.tis == "off" and parse("engine_dtype=bfloat16").algo.tis == "off"
    config_checks.validate(parse("engine_dtype=fp8", "lora.r=8"))       # LoRA is fine (not a lab-only option)
    from engines import exact
    for args, message in [
        (["engine_dtype=fp8", "top_k=4"], "engine_dtype=fp8 samples through the built-in engine's fast decoder: "
                                          "it needs top_k=0"),
        (["engine_dtype=fp8", "engine=vllm"], "it needs engine=builtin"),
        (["engine_dtype=fp8", "env.name=hilo"], "it needs no env.name"),
        (["engine_dtype=fp8", "exact_logprobs=true"], "exact_logprobs=true needs engine_dtype at its default"),
        (["engine_dtype=fp4"], "config key 'engine_dtype' must be one of auto, float32, bfloat16, fp8, fp8_all")]:
        with pytest.raises(config.UserError, match=message) as e:
            cfg = parse(*args)
            config_checks.validate(cfg)
            exact.check_config(cfg)
        assert "\n" not in str(e.value)


def test_a_gpu_without_fp8_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="engine_dtype=fp8 needs FP8 tensor cores .* NVIDIA A100 is sm_80") as e:
        check_device("cuda:0")
    assert "\n" not in str(e.value)
    check_device("cpu")                                                  # the CPU runs the twin


def test_the_fp8_kernels_match_their_twins_interpreted():
    """Under TRITON_INTERPRET=1 (one subprocess for both kernels: its start costs more than they do).
    kernels/fp8_gemm.py's kernel against the dequantised float32 twin, split over K (the last range shorter),
    rows and columns that leave partial tiles; launched directly (the custom op around it costs the interpreter
    more than the kernel: the GPU test goes through it). kernels/fp8_quant.py's merge-and-quantise: the scales,
    and the quotient before its e4m3 rounding (a float32 w8: the interpreter's e4m3 rounding is not the GPU's),
    with and without adapters."""
    from tests.interpret import run_interpreted
    run_interpreted("""
import torch
from kernels.fp8 import dequantised_mm, quantise_activations, quantise_rows, row_scales
from kernels.fp8_gemm import launch, tiles
from kernels.fp8_quant import merge_quantise
g = torch.Generator().manual_seed(0)
for M, N, K in ((3, 96, 320), (20, 64, 48)):
    x8, sx = quantise_activations(torch.randn(M, K, generator=g))
    w8, s = quantise_rows(torch.randn(N, K, generator=g))
    t = tiles(M, N, K)
    parts = launch(x8, sx.view(M), w8, s, t)                          # (S, M, N)
    assert parts.shape == (t.S, M, N) and t.S > 1, (t, parts.shape)
    assert torch.allclose(parts.sum(0), dequantised_mm(x8, sx, w8, s), atol=1e-4, rtol=1e-5), (M, N, K)
for N, K, R in ((40, 96, 0), (70, 200, 16), (33, 64, 5)):
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    a, b = (torch.randn(R, K, generator=g), torch.randn(N, R, generator=g) * 0.01) if R else (None, None)
    q, s = torch.full((N, K), float("nan")), torch.full((N,), float("nan"))
    scaling = 2.0 if R == 16 else 1.0                                 # a peft adapter's alpha / r, in the kernel
    merge_quantise(w, a, b, (q, s), scaling)
    m = w.float() if a is None else w.float() + (b @ a) * scaling     # (N, K): the merged weight
    ref = row_scales(m)                                               # (N, 1)
    assert torch.allclose(s, ref[:, 0], rtol=1e-6, atol=0) and torch.allclose(q, m / ref, rtol=0, atol=1e-3)
    assert R or (torch.equal(s, ref[:, 0]) and torch.equal(q, m / ref))    # no sum: bit-equal
print("ok")
""")


def test_the_fused_mlp_matches_the_split_route_interpreted():
    """kernels/fp8_mlp.py under TRITON_INTERPRET=1 against the split route's twin (mlp_twin: fp8_linear's rounding
    points). Tight where the interpreter computes as the GPU: SiLU-and-multiply within two bf16 steps (its bf16
    casts truncate), each row's maximum bit-equal to the stored activations' (so no quotient exceeds 448), rows past
    M and other layers' slots untouched. Loose where it does not: triton 3.9's interpreter rounds a value just
    under a power of two to e4m3 at half its size (2.7% of values measured), so the down GEMM's in-kernel
    quantisation and the whole MLP get a 0.15 band against the twin (the GPU: tests below, tools/fp8_gemm_bench.py
    --mlp); the plain and the swapped down GEMM give the same sums."""
    from tests.interpret import run_interpreted
    run_interpreted("""
import torch
from kernels.fp8 import quantise_activations, quantise_rows
from kernels.fp8_mlp import MAX_ROWS, down_launch, fp8_mlp, gate_up_launch, mlp_twin, row_buffer
g = torch.Generator().manual_seed(0)
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
for M, H, I in ((3, 64, 96), (20, 96, 160)):                         # partial row and column tiles
    x = torch.randn(M, H, generator=g).bfloat16()
    w8gu, sgu = quantise_rows(torch.randn(2 * I, H, generator=g) * 0.2)
    w8d, sd = quantise_rows(torch.randn(H, I, generator=g) * 0.2)
    y_twin, h_twin, max_twin = mlp_twin(x, w8gu, sgu, w8d, sd)
    x8, sx = quantise_activations(x)
    rowmax = row_buffer(3, x)
    h = gate_up_launch(x8, sx.view(M), w8gu, sgu, rowmax, 1)          # (M, I) bf16, rowmax[1, :M]
    assert h.shape == (M, I) and h.dtype == torch.bfloat16
    assert ((h.float() - h_twin.float()).abs() <= h_twin.float().abs() * 2**-7 + 1e-6).all(), (M, I)
    assert torch.equal(rowmax[1, :M], h.float().abs().amax(1)), (rowmax[1, :M], h.float().abs().amax(1))
    assert not rowmax[[0, 2]].any() and not rowmax[1, M:].any() and rowmax.shape == (3, MAX_ROWS)
    assert torch.allclose(rowmax[1, :M], max_twin, rtol=2**-7)
    twin_down = mlp_twin(x, w8gu, sgu, w8d, sd)[0]
    plain, swapped = (down_launch(h, rowmax, 1, w8d, sd, swap).sum(0) for swap in (False, True))
    assert torch.allclose(plain, swapped, rtol=1e-5, atol=1e-5) and rel(plain, y_twin) < 0.15, rel(plain, y_twin)
    again = row_buffer(3, x)
    y = fp8_mlp(x, w8gu, sgu, w8d, sd, again, 2)
    assert y.dtype == torch.bfloat16 and y.shape == (M, H) and rel(y, y_twin) < 0.15, rel(y, y_twin)
    assert torch.equal(again[2], rowmax[1]) and not again[:2].any()   # the same maxima, in layer 2's slot
print("ok")
""")


def test_the_fused_mlp_is_taken_only_where_it_fits():
    import torch.nn as nn
    from kernels import fp8_mlp
    w8gu, sgu = quantise_rows(torch.randn(192, 64))                      # I = 96, H = 64
    w8d, sd = quantise_rows(torch.randn(64, 96))
    gu, down = ([w8gu, sgu], None, None, None, 0), ([w8d, sd], None, None, None, 0)
    x = torch.randn(4, 64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_mlp, "INTERPRET", True)                       # as if the kernels could run on this CPU
        assert fp8_mlp.fits(x, gu, down, nn.SiLU()) == fp8_mlp.HAS_TRITON
        assert not fp8_mlp.fits(x, gu, down, nn.GELU())              # another activation: the split route
        assert not fp8_mlp.fits(torch.randn(65, 64), gu, down, nn.SiLU())   # a prefill's rows
        assert not fp8_mlp.fits(x, gu, ([w8d, sd], torch.zeros(64), None, None, 0), nn.SiLU())   # a bias
        assert not fp8_mlp.fits(x, gu, ([torch.randn(64, 96)], None, None, None, 0), nn.SiLU())  # down in bf16
    assert not fp8_mlp.fits(x, gu, down, nn.SiLU())                  # the CPU without the interpreter
    from engines.decode_step import Step
    assert Step.fp8_mlp_route == fp8_mlp.MLP
    assert "FAST_DECODE_FP8_MLP" in os.environ or fp8_mlp.MLP == "split"   # the default: today's route


def test_the_decoder_takes_the_fused_mlp_and_samples_close_to_teacher_forcing(random_model_dir):
    """The fast decoder (fp8_all, eager, interpreted kernels) with fp8_mlp_route="fused": each decode step calls the
    fused MLP once per layer (the prefill's 4 x 6 rows too, under MAX_ROWS), and its log-probs stay as close to
    the float32 policy's as the split route's do (both bounded by FP8's rounding; the interpreter's e4m3
    rounding is coarser, hence the margin)."""
    from tests.interpret import run_interpreted
    run_interpreted(f"""
import torch
from engines.base import SamplingParams
from engines.fast_decode import FastDecoder
from kernels import fp8_mlp
from models import completion_logprobs, load_model
model, tok = load_model({random_model_dir!r}, torch.device("cpu"), torch.float32)
calls, inner = [], fp8_mlp.fp8_mlp
fp8_mlp.fp8_mlp = lambda *a: calls.append(a[-1]) or inner(*a)
ids = torch.randint(2, 14, (4, 6), generator=torch.Generator().manual_seed(0))
gaps = {{}}
for route in ("split", "fused"):
    calls.clear()
    dec = FastDecoder(model, weights="fp8_all", use_graph=False, compile=False)
    dec.fp8_mlp_route = route
    completion, alive, logprobs, _ = dec.sample(ids, torch.ones_like(ids), SamplingParams(max_new_tokens=8), 1, 0,
                                                torch.Generator().manual_seed(0))
    full = torch.cat([ids, completion], 1)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, full, torch.ones_like(full), completion.shape[1], 1.0)
    gaps[route] = float(((logp - logprobs).abs() * alive).max())
    steps = completion.shape[1]                                        # the prefill and steps - 1 decode steps
    assert calls == ([0, 1] * steps if route == "fused" else []), (route, calls)
assert 0 < gaps["fused"] < max(1.0, 3 * gaps["split"]), gaps
print(gaps)
print("ok")
""")


def test_tiles_split_k_exactly_and_fill_the_card_at_w6s_shapes():
    from kernels.fp8_gemm import SMS, tiles, wins
    for M in (1, 64, 128):
        for N, K in ((37888, 3584), (3584, 18944), (152064, 3584), (4608, 3584), (96, 320), (64, 48)):
            t = tiles(M, N, K)
            assert K % t.BK == 0 and t.per % t.BK == 0 and t.per * (t.S - 1) < K <= t.per * t.S, (M, N, K, t)
            assert t.BM >= max(M, 16) and t.BM & (t.BM - 1) == 0
            if M == 64 and K >= 3584:                                    # every W6 GEMM: >= 2 waves of programs
                assert -(-N // t.BN) * t.S >= 2 * SMS, (N, K, t)
    # cuBLAS took the wide outputs at 128 rows, this kernel the narrow ones and everything at 64
    assert wins(64, 37888, 3584) and wins(128, 3584, 18944) and not wins(128, 37888, 3584) and not wins(129, 64, 64)
    assert not wins(64, 64, 48)                                      # 8-bit tl.dot: K steps of 32 on a GPU
    with pytest.raises(ValueError, match="K % 16"):
        tiles(64, 64, 40)


@CUDA
def test_fp8_gemms_match_the_twin_on_a_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    from kernels.fp8 import quantise_activations
    from kernels.fp8_gemm import fp8_gemm
    for M, N, K in ((64, 1024, 512), (64, 1000, 4096), (128, 256, 4096), (5, 64, 128)):   # split, partial tiles
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w8, scale = quantise_rows(torch.randn(N, K, device="cuda", generator=g))
        x8, sx = quantise_activations(x)
        twin = dequantised_mm(x8, sx, w8, scale)                         # the same quantised values, float32
        y = fp8_gemm(x8, sx, w8, scale).sum(0)
        assert torch.allclose(y, twin, rtol=1e-2, atol=1e-2 * twin.abs().max().item()), (M, N, K)
        if N % 16 == 0:
            y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=scale[None], out_dtype=torch.bfloat16)
            assert torch.allclose(y.float(), twin, rtol=2e-2, atol=2e-2 * twin.abs().max().item()), (M, N, K)
        assert fp8_linear(x, w8, scale).dtype == torch.bfloat16


@CUDA
def test_the_fused_mlp_matches_the_twin_on_a_gpu(monkeypatch):
    """kernels/fp8_mlp.py's two kernels (both down GEMMs) against mlp_twin, W6's widths among the shapes; the row
    maxima bit-equal to the stored activations'."""
    from kernels import fp8_mlp
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, H, I in ((64, 3584, 18944), (5, 256, 512), (33, 512, 1056)):
        x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
        w8gu, sgu = quantise_rows(torch.randn(2 * I, H, device="cuda", generator=g) * 0.02)
        w8d, sd = quantise_rows(torch.randn(H, I, device="cuda", generator=g) * 0.02)
        y_twin, h_twin, _ = fp8_mlp.mlp_twin(x, w8gu, sgu, w8d, sd)
        for swap in (False, True):
            monkeypatch.setattr(fp8_mlp, "SWAP", swap)
            rowmax = fp8_mlp.row_buffer(2, x)
            y = fp8_mlp.fp8_mlp(x, w8gu, sgu, w8d, sd, rowmax, 1)
            err = ((y.float() - y_twin).norm() / y_twin.norm()).item()
            assert err < 0.02 and not rowmax[0].any(), (M, H, I, swap, err)
        from kernels.fp8 import quantise_activations
        x8, sx = quantise_activations(x)
        rowmax = fp8_mlp.row_buffer(1, x)
        h = fp8_mlp.gate_up_launch(x8, sx.view(M), w8gu, sgu, rowmax, 0)
        assert torch.equal(rowmax[0, :M], h.float().abs().amax(1)) and not rowmax[0, M:].any()
        assert torch.allclose(h.float(), h_twin.float(), rtol=2**-7, atol=1e-3 * h_twin.float().abs().max().item())


@CUDA
def test_merge_quantise_matches_the_twin_on_a_gpu():
    from kernels.fp8_quant import merge_quantise, merged_twin
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K, R in ((4608, 3584, 16), (100, 200, 0), (33, 64, 5)):
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
        a = torch.randn(R, K, device="cuda", generator=g) if R else None
        b = torch.randn(N, R, device="cuda", generator=g) * 0.01 if R else None
        out = (torch.empty(N, K, dtype=FP8, device="cuda"), torch.full((N,), float("nan"), device="cuda"))
        merge_quantise(w, a, b, out)
        w8, s = merged_twin(w, a, b)
        assert torch.allclose(out[1], s, rtol=1e-6, atol=0), (N, K, R)
        # a few near-ties round to the neighbouring e4m3 value: the sums' order with adapters, and without them
        # the kernel's float32 -> e4m3 conversion against torch's (the first GPU run: 0.035% of values at R = 0)
        got, want = out[0].float(), w8.float()
        step = torch.maximum(got.abs(), want.abs()) / 8 + 2 ** -9                     # one e4m3 step, at most
        same = (got == want).float().mean().item()
        assert same > 0.99 and bool(((got - want).abs() <= step * 1.001).all()), (N, K, R, same)


@CUDA
@pytest.mark.parametrize("gemm,refresh,mlp", [("triton", "triton", "split"), ("scaled_mm", "torch", "split"),
                                              ("triton", "triton", "fused")])
def test_fp8_decoder_on_a_gpu_samples_close_to_teacher_forcing(random_model_dir, gemm, refresh, mlp, monkeypatch):
    """The compiled, graphed step with FP8 groups (fp8_all: the random model's widths are multiples of 16 but
    the head's 14 rows are not, so the head stays bf16 here), with either GPU GEMM and either refresh, and the
    MLP split or fused (kernels/fp8_mlp.py)."""
    from engines.base import SamplingParams
    from kernels import fp8
    from models import completion_logprobs, load_model
    monkeypatch.setattr(fp8, "GEMM", gemm)
    monkeypatch.setattr(decode_weights, "FP8_REFRESH", refresh)
    model, tok = load_model(random_model_dir, torch.device("cuda"), torch.bfloat16)
    dec = FastDecoder(model, weights="fp8_all")
    dec.fp8_mlp_route = mlp
    ids = torch.randint(2, 14, (8, 6), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    completion, alive, logprobs, _ = dec.sample(ids, torch.ones_like(ids), SamplingParams(max_new_tokens=16), 1, 0,
                                                torch.Generator(device="cuda").manual_seed(0))
    C = completion.shape[1]
    full = torch.cat([ids, completion], 1)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, full, torch.ones_like(full), C, 1.0)
    gap = float(((logp.float() - logprobs.float()).abs() * alive).max())
    assert dec.use_graph and gap < 0.5, gap
    dec.refresh()
    assert _fp8_groups(dec) == ([[True] * 4] * len(model.model.layers), False)
    assert decode_weights.FP8_MIN["fp8"] > 0


@CUDA
def test_the_triton_refresh_merges_lora_as_the_torch_route(random_model_dir, monkeypatch):
    """FP8_REFRESH="triton" (kernels/fp8_quant.py, fed by decode_weights._adapter) against "torch" (lora.dense_weight,
    quantise_rows) on a peft model: the same scales up to the torch route's rounding of the sum to bf16, and the
    same e4m3 values but for the near-ties that rounding moves."""
    _refresh_routes_agree(random_model_dir, monkeypatch, "cuda")


def _refresh_routes_agree(random_model_dir, monkeypatch, device: str):
    import lora
    from config import LoRAConfig
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device(device), torch.bfloat16)
    model = lora.wrap(model, LoRAConfig(r=4, alpha=8), "random")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    copies = {}
    for how in ("torch", "triton"):
        monkeypatch.setattr(decode_weights, "FP8_REFRESH", how)
        dec = FastDecoder(model, weights="fp8_all", use_graph=False, compile=False)
        dec.refresh()
        copies[how] = [group[0] for layer in dec.fused[:len(model.get_base_model().model.layers)] for group in layer]
    assert len(copies["torch"]) == 4 * len(model.get_base_model().model.layers)
    for (w8, s), (q8, t) in zip(copies["torch"], copies["triton"]):
        assert w8.dtype == q8.dtype == FP8 and torch.allclose(s, t, rtol=1e-2, atol=0)
        assert (w8.float() == q8.float()).float().mean() > 0.95
