"""engine_dtype=fp8: the FP8 quantiser and GEMM (kernels/fp8.py), the decoder's fp8 routes
(engines/decode_weights.py: refresh, fp8_group), the engine and the config (tis defaulted, bad values refused).
CPU tests run the torch twin; the GPU tests run torch._scaled_mm and the compiled, graphed decoder."""
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
from kernels.fp8_gemm import Tiles, launch, tiles
from kernels.fp8_quant import merge_quantise
g = torch.Generator().manual_seed(0)
for M, N, K in ((3, 96, 320), (20, 64, 48), (17, 40, 320)):
    x8, sx = quantise_activations(torch.randn(M, K, generator=g))
    w8, s = quantise_rows(torch.randn(N, K, generator=g))
    t = tiles(M, N, K)
    if N == 40:                                                       # ranges of 3 K blocks: the last holds 1
        t = Tiles(t.BM, 32, 32, 4, 96, 4, 2)
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
@pytest.mark.parametrize("gemm,refresh", [("triton", "triton"), ("scaled_mm", "torch")])
def test_fp8_decoder_on_a_gpu_samples_close_to_teacher_forcing(random_model_dir, gemm, refresh, monkeypatch):
    """The compiled, graphed step with FP8 groups (fp8_all: the random model's widths are multiples of 16 but
    the head's 14 rows are not, so the head stays bf16 here), with either GPU GEMM and either refresh."""
    from engines.base import SamplingParams
    from kernels import fp8
    from models import completion_logprobs, load_model
    monkeypatch.setattr(fp8, "GEMM", gemm)
    monkeypatch.setattr(decode_weights, "FP8_REFRESH", refresh)
    model, tok = load_model(random_model_dir, torch.device("cuda"), torch.bfloat16)
    dec = FastDecoder(model, weights="fp8_all")
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
