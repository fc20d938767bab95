"""Every Triton kernel against its torch twin over edge shapes: tiny and real vocabularies, odd sizes, batch 1,
one cache slot, padded rows, both dtypes. tools/gpu_tests.sh runs it under `compute-sanitizer --tool memcheck`
(an out-of-bounds access fails there even when the numbers come out right); tests/test_kernel_edges.py runs its
`cpu` size under the Triton interpreter in CI.

    python tools/kernel_sweep.py                               # CUDA, every family, size "gpu"
    python tools/kernel_sweep.py --only sample,decode --size sanitizer
    TRITON_INTERPRET=1 python tools/kernel_sweep.py --size cpu --device cpu

Prints one line per case (`ok` or `FAIL` with the family, the case and the error against the twin), then
`N passed, N failed`; exits 1 on any failure. Families (kernel -> twin):
  sample   gumbel_sample / cdf_sample -> log_softmax at the drawn token, the token inside the row, never a banned
           column, a row with one live token gives that token, and gumbel_sample_reference on the same rows
  decode   decode_attention -> decode_attention_reference (output and the cache write)
  decode_opts  the same with its options: Qwen3's q/k head norms (the kernel's `_head_norm`), several KV heads a
           program
  logprob  logprob_entropy (forward and backward; the split row_stats path too) -> logprob_entropy_reference
  linear   linear_logprob_entropy (cuBLAS + passes, and fuse_matmul's GEMM kernels) -> the reference on h @ w.T
  loss     linear_logprob_loss (gradients in the forward) -> autograd through the reference
  exact_gemm, exact_cat, exact_silu, exact_attn, exact_rope, exact_rows, fused_kl, fp8_gemm, fp8_quant, moe
           the exact path's GEMMs, RMSNorm, SiLU, attention, rotary and sampling, the fused KL's passes, the FP8
           GEMM, the FP8 refresh and the MoE decode experts: tools/kernel_families*.py say what each checks.
           fp8_* need FP8 tensor cores on a GPU (sm_89+): on an older card the sweep prints one `skip` line per
           family and counts neither a pass nor a failure
  decoder  engines/fast_decode.py end to end on the random test model (graph, both samplers, prompt length 1
           and odd, one new token) -> teacher-forced log-probs (GPU sizes only)
LoRA's decode packing (engines/decode_weights.py) has one Triton kernel, the FP8 refresh (fp8_quant); the rest of
it is torch, so nothing else of it is swept here.
Sizes: "gpu" and "sanitizer" hold the same edge shapes (the sanitizer's without the biggest products: it runs
every kernel ~100x slower); "cpu" keeps what the interpreter runs in seconds (float32 where a kernel uses tl.dot:
the interpreter's bf16 dot is wrong, FACTS.md; the exact path's kernels take bf16 there, their dot being an
explicit product under the interpreter).
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import logprob as logprob_mod  # noqa: E402
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.decode_attention_ref import decode_attention_reference  # noqa: E402
from kernels.linear_logprob import linear_logprob_entropy  # noqa: E402
from kernels.logprob import logprob_entropy, logprob_entropy_reference  # noqa: E402
from kernels.logprob_loss import linear_logprob_loss  # noqa: E402
from kernels.sample import cdf_sample, gumbel_sample, gumbel_sample_reference  # noqa: E402
from tools import kernel_families, kernel_families_exact  # noqa: E402
from tools.kernel_families import BF16, F32, QWEN_V, gen, rel  # noqa: E402

TOL = {F32: 1e-4, BF16: 1e-2}      # relative L2 error, as tests/test_kernels.py


# --- sample -----------------------------------------------------------------------------------------------------

def check_sample(device, method, B, V, dtype, inv_t) -> float:
    """Per row: the token inside [0, V), at a finite logit, with logp = log_softmax(z * inv_t)[tok]; row 1 (B > 1)
    has one live column, row 2 (B > 2) none (any token inside the row; at inv_t = 0 both are left out: every
    logit times 0 is 0 or nan, the warm-up's case is the finite rows)."""
    z = torch.randn(B, V, generator=gen(method, B, V, inv_t)) * 3                      # (B, V)
    special = inv_t > 0 and B > 1
    if special:
        z[1] = -math.inf
        z[1, V // 2] = 0.5
        if B > 2:
            z[2] = -math.inf
    z = z.to(dtype)
    fn = {"cdf": cdf_sample, "gumbel": gumbel_sample}[method]
    args = (torch.tensor([inv_t], device=device), torch.tensor([11], device=device), torch.tensor([3], device=device))
    tok, logp = fn(z.to(device), *args)
    tok, logp = tok.cpu(), logp.cpu()
    assert tok.shape == (B,) and tok.dtype == torch.long and logp.shape == (B,), (tok.shape, logp.shape)
    assert ((tok >= 0) & (tok < V)).all(), f"token outside the row: {tok.min().item()}..{tok.max().item()}"
    want = torch.log_softmax(z.double() * inv_t, -1)                                   # (B, V)
    rows = torch.ones(B, dtype=torch.bool)
    if special and B > 2:
        rows[2] = False                                                                # no distribution to match
    if special:
        assert tok[1] == V // 2, f"the one live column is {V // 2}, drew {tok[1].item()}"
    picked = want[torch.arange(B), tok]                                                # (B,)
    assert torch.isfinite(picked[rows]).all(), "drew a banned (-inf) column"
    err = (logp[rows].double() - picked[rows]).abs().max().item()
    assert err <= 2e-4, f"logp off by {err}"
    rtok, rlogp = gumbel_sample_reference(z, torch.tensor([inv_t]), torch.tensor([11]), torch.tensor([3]))  # the twin
    assert (rlogp[rows].double() - want[torch.arange(B), rtok][rows]).abs().max() <= 2e-4
    return err


def sample_cases(size):
    if size == "cpu":   # the interpreter: the Gumbel kernel takes ~15 s per row at 152k columns
        for method, B, V, dtype in (("cdf", 1, 16, F32), ("cdf", 3, 16, BF16), ("cdf", 3, 4097, F32),
                                    ("cdf", 1, QWEN_V, F32), ("gumbel", 3, 16, F32), ("gumbel", 3, 4097, BF16)):
            for inv_t in (0.0, 1 / 0.7):
                yield dict(method=method, B=B, V=V, dtype=dtype, inv_t=inv_t)
        return
    for method in ("cdf", "gumbel"):
        for V in (16, 1000, 4097, QWEN_V):
            for B in (1, 3, 128):
                for dtype in (F32, BF16):
                    for inv_t in (0.0, 1 / 0.7):
                        yield dict(method=method, B=B, V=V, dtype=dtype, inv_t=inv_t)


# --- decode attention -------------------------------------------------------------------------------------------

def check_decode(device, B, nh, nkv, D, S, last, dtype, splits, qk_norm=False, heads=None) -> float:
    """The kernel and its twin on the same inputs (cache clones): output and cache within TOL (bf16: the kernel
    takes P in the cache's dtype for P @ V, the twin float32). qk_norm: each q and k head RMS-normed first (Qwen3's
    q_norm / k_norm, the kernel's `_head_norm`). heads: KV heads per program (None: the kernel's default for D)."""
    g = gen("decode", B, nh, nkv, D, S, last, splits, *(("qk_norm",) if qk_norm else ()))
    qkv = torch.randn(B, (nh + 2 * nkv) * D, generator=g).to(dtype)
    k, v = (torch.randn(B, nkv, S, D, generator=g).to(dtype) for _ in range(2))
    ang = torch.arange(S + 1)[:, None] * 0.1 / (1 + torch.arange(D))[None]            # (S + 1, D) rotary-like
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    pos = torch.randint(0, S + 1, (B,), generator=g)
    ok = torch.rand(B, S, generator=g) > 0.3
    ok[0] = False                                                                      # row 0: only its new token
    norm = tuple((1 + 0.3 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)) + (1e-6,) if qk_norm else None
    put = lambda t: t.to(device)
    kk, vv = put(k), put(v)
    out = decode_attention(put(qkv), put(cos), put(sin), put(pos), kk, vv, put(ok), put(torch.tensor([last])), 0.125,
                           splits=splits, qk_norm=norm and (put(norm[0]), put(norm[1]), norm[2]), heads=heads)
    kr, vr = k.clone(), v.clone()
    want = decode_attention_reference(qkv, cos, sin, pos, kr, vr, ok, torch.tensor([last]), 0.125, qk_norm=norm)
    tol = 2e-2 if dtype == BF16 else TOL[F32]
    err = max(rel(out, want), rel(kk, kr), rel(vv, vr))
    assert err <= tol, f"error {err} > {tol}"
    return err


def decode_cases(size):
    if size == "cpu":   # float32 only: the interpreter's bf16 tl.dot is wrong (FACTS.md)
        for B, nh, nkv, D, S, last, splits in ((1, 2, 1, 32, 64, 0, 1), (3, 2, 1, 32, 64, 7, 1),
                                               (3, 14, 2, 64, 64, 63, 1), (1, 4, 4, 128, 64, 0, 4),
                                               (3, 2, 1, 32, 320, 201, 4), (1, 14, 2, 64, 320, 201, 1)):
            yield dict(B=B, nh=nh, nkv=nkv, D=D, S=S, last=last, dtype=F32, splits=splits)
        return
    heads = ((2, 1), (14, 2), (4, 4))                   # the random test model's, Qwen2.5-0.5B's, MHA
    for D in (32, 64, 128):
        for (nh, nkv) in heads:
            for dtype in (F32, BF16):
                if size == "sanitizer":                 # every (head_dim, heads, dtype); each edge of the rest once
                    for B, S, last, splits in ((1, 64, 0, 1), (3, 64, 63, 4), (128, 64, 7, 1), (3, 320, 201, 1)):
                        yield dict(B=B, nh=nh, nkv=nkv, D=D, S=S, last=last, dtype=dtype, splits=splits)
                    continue
                for B in (1, 3, 128):
                    for S, last in ((64, 0), (64, 7), (64, 63), (320, 201)):
                        for splits in (1, 4):
                            if splits == 1 or (S, last) in ((64, 0), (320, 201)):
                                yield dict(B=B, nh=nh, nkv=nkv, D=D, S=S, last=last, dtype=dtype, splits=splits)


def decode_opts_cases(size):
    """decode_attention's options: Qwen3's q/k head norms (GQA 14/2) and several KV heads a program (MHA 4/4: 4
    a program unsplit, 2 with splits), with and without splits, at one cache slot and later ones."""
    if size == "cpu":
        yield dict(B=3, nh=14, nkv=2, D=64, S=64, last=63, dtype=F32, splits=4, qk_norm=True)
        yield dict(B=3, nh=4, nkv=4, D=32, S=64, last=7, dtype=F32, splits=1, heads=4)
        return
    edges = ((1, 64, 0, 1), (3, 64, 63, 4), (3, 320, 201, 1))
    if size == "gpu":
        edges += ((3, 64, 7, 1), (3, 320, 201, 4), (1, 64, 0, 4))
    for D in (32, 64, 128):
        for dtype in (F32, BF16):
            for B, S, last, splits in edges:
                yield dict(B=B, nh=14, nkv=2, D=D, S=S, last=last, dtype=dtype, splits=splits, qk_norm=True)
                # 4 heads of 64 slots x 64 in float32 need 384 KiB of shared memory at 3 stages (an H200 has
                # 227): no setting asks for it, so that tile takes 2 heads
                four = splits == 1 and not (dtype == F32 and D == 64)
                yield dict(B=B, nh=4, nkv=4, D=D, S=S, last=last, dtype=dtype, splits=splits, heads=4 if four else 2)


# --- log-prob / entropy from logits -------------------------------------------------------------------------------

def targets_for(N, V, g):
    t = torch.randint(0, V, (N,), generator=g)
    t[1::4] = -100                                                                     # padded tokens
    return t


def check_logprob(device, N, V, dtype, temperature, split) -> float:
    """logprob_entropy forward and backward (the grad kernel), and row_stats (the split-row launch and its merge
    kernel, what linear_logprob_loss uses) with `split` programs per row, against the twin in float64."""
    g = gen("logprob", N, V, split)
    x = (torch.randn(N, V, generator=g) * 3).to(dtype)
    t = targets_for(N, V, g)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    xd = x.to(device, copy=True).requires_grad_()
    lp, en = logprob_entropy(xd, t.to(device), temperature)
    (lp * gl.to(device) + en * ge.to(device)).sum().backward()
    x64 = x.detach().to(device).double().requires_grad_()
    rl, re = logprob_entropy_reference(x64, t.to(device), temperature)
    (rl * gl.to(device).double() + re * ge.to(device).double()).sum().backward()
    saved = logprob_mod.LAUNCH["SPLIT"]
    logprob_mod.LAUNCH["SPLIT"] = split
    try:
        sl, se, _, _ = logprob_mod.row_stats(x.to(device), t.to(device), 1 / temperature, True)
    finally:
        logprob_mod.LAUNCH["SPLIT"] = saved
    err = max(rel(lp, rl), rel(en, re), rel(xd.grad, x64.grad), rel(sl, rl), rel(se, re))
    assert err <= TOL[dtype], f"error {err} > {TOL[dtype]}"
    return err


def logprob_cases(size):
    if size == "cpu":
        for N, V, dtype in ((1, 16, F32), (3, 16, BF16), (3, 4097, F32), (1, QWEN_V, BF16)):
            yield dict(N=N, V=V, dtype=dtype, temperature=0.7, split=3)
        return
    for V in (16, 4097, QWEN_V):
        for N in (1, 3, 128):
            for dtype in (F32, BF16):
                yield dict(N=N, V=V, dtype=dtype, temperature=0.7, split=1 if N == 128 else 3)


# --- log-prob / entropy from hidden states ------------------------------------------------------------------------

def logits_as_computed(h64, w64, dtype, fused: bool):
    """h @ w.T in float64, its values rounded to `dtype` where the kernel gets them from cuBLAS in that dtype
    (not fused), the gradient exact (straight through): the twin of what the kernel sees."""
    z = h64 @ w64.T                                                                    # (N, V)
    return z if fused else z + (z.detach().to(dtype).double() - z.detach())


def linear_reference(h, w, t, temperature, gl, ge, fused):
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rl, re = logprob_entropy_reference(logits_as_computed(h64, w64, h.dtype, fused), t, temperature)
    (rl * gl.double() + re * ge.double()).sum().backward()
    return rl, re, h64.grad, w64.grad


def check_linear(device, N, H, V, dtype, fuse) -> float:
    """linear_logprob_entropy (forward, recompute and both gradients) against float64 on h @ w.T; bf16 inputs
    through cuBLAS get bf16 logits, hence bf16's tolerance."""
    g = gen("linear", N, H, V, fuse)
    h = (torch.randn(N, H, generator=g) / H ** 0.5 * 3).to(dtype)
    w = torch.randn(V, H, generator=g).to(dtype)
    t = targets_for(N, V, g)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    hd, wd = h.to(device, copy=True).requires_grad_(), w.to(device, copy=True).requires_grad_()
    lp, en = linear_logprob_entropy(hd, wd, t.to(device), 0.7, use_triton=True, fuse_matmul=fuse)
    (lp * gl.to(device) + en * ge.to(device)).sum().backward()
    rl, re, rh, rw = linear_reference(h.to(device), w.to(device), t.to(device), 0.7, gl.to(device), ge.to(device), fuse)
    err = max(rel(lp, rl), rel(en, re), rel(hd.grad, rh), rel(wd.grad, rw))
    assert err <= TOL[dtype], f"error {err} > {TOL[dtype]}"
    return err


def linear_cases(size):
    shapes = [(1, 64, 16), (3, 64, QWEN_V), (128, 896, 4097), (3, 4096, 16), (130, 100, 300)]
    if size == "gpu":
        shapes.append((128, 4096, QWEN_V))
    if size == "cpu":   # the interpreter: 152k columns take ~10 s a case here (the log-prob family has them)
        shapes = [(1, 64, 16), (3, 4096, 16), (130, 100, 300)]
    for N, H, V in shapes:
        for dtype in (F32, BF16):
            for fuse in (False, True):
                yield dict(N=N, H=H, V=V, dtype=dtype, fuse=fuse)


# --- the fused loss -----------------------------------------------------------------------------------------------

def check_loss(device, B, C, H, V, dtype, rows_per_chunk) -> float:
    """linear_logprob_loss of a GRPO-like loss (advantage-weighted log-probs, an entropy bonus) over (B, C) tokens
    with padding (one row all padded when B > 1): loss, logp and both gradients against autograd in float64."""
    g = gen("loss", B, C, H, V)
    h = (torch.randn(B, C, H, generator=g) / H ** 0.5 * 3).to(dtype)
    w = torch.randn(V, H, generator=g).to(dtype)
    t = targets_for(B * C, V, g).view(B, C)
    if B > 1:
        t[1] = -100
    adv = torch.randn(B, generator=g)
    n = max(1, int((t >= 0).sum()))

    def loss_fn(rows, logp, ent, adv=adv.to(device)):
        return -(logp * adv[rows, None]).sum() / n - 0.01 * ent.sum() / n

    hd, wd = h.to(device, copy=True).requires_grad_(), w.to(device, copy=True).requires_grad_()
    loss, lp, _ = linear_logprob_loss(hd, wd, t.to(device), 0.7, loss_fn, rows_per_chunk=rows_per_chunk)
    loss.backward()
    h64, w64 = h.detach().to(device).double().requires_grad_(), w.detach().to(device).double().requires_grad_()
    rl, re = logprob_entropy_reference(logits_as_computed(h64.view(B * C, H), w64, dtype, False), t.view(-1).to(device),
                                       0.7)
    want = -(rl.view(B, C) * adv.to(device).double()[:, None]).sum() / n - 0.01 * re.sum() / n
    want.backward()
    err = max(rel(loss.view(1), want.view(1)), rel(lp, rl.view(B, C)), rel(hd.grad, h64.grad), rel(wd.grad, w64.grad))
    assert err <= TOL[dtype], f"error {err} > {TOL[dtype]}"
    return err


def loss_cases(size):
    shapes = [(1, 1, 64, 16), (3, 5, 64, QWEN_V), (4, 33, 896, 4097), (2, 3, 4096, 16)]
    if size == "cpu":
        shapes = [(1, 1, 64, 16), (3, 5, 64, 4097), (2, 3, 4096, 16)]
    for B, C, H, V in shapes:
        for dtype in (F32, BF16):
            yield dict(B=B, C=C, H=H, V=V, dtype=dtype, rows_per_chunk=1 if B > 1 else None)


# --- the decoder end to end ----------------------------------------------------------------------------------------

def random_model(device, dtype):
    """tests/conftest.py's random model without its tokenizer: 2-layer Qwen2, hidden 64, head_dim 32, vocab 16
    (the shape whose graph warm-up met the inverse-CDF sampler's out-of-bounds read); eos 1, pad 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True,
                      eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).to(device, dtype).eval()


def check_decoder(device, B, P, N, dtype, sampler, compile) -> float:
    """engines/fast_decode.py's FastDecoder through BuiltinEngine.generate (on CUDA: its CUDA graph, whose capture
    warms up with the temperature still 0), prompts of P tokens and shorter (left padding), N new tokens, top_p 1
    (sampling in the graph): tokens inside the vocabulary, and the sampled log-probs equal to teacher-forced ones
    (float32; bf16: finite, the distance reported)."""
    import engines.fast_decode as fast_decode
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from models import completion_logprobs
    model = random_model(device, dtype)
    g = gen("decoder", B, P, N)
    prompts = [torch.randint(2, 16, (max(1, P - 3 * i),), generator=g).tolist() for i in range(B)]
    engine = BuiltinEngine(model, eos_id=1, pad_id=0, fast=True)
    engine.decoder = fast_decode.FastDecoder(model, use_graph=device == "cuda", compile=compile)
    saved, fast_decode.SAMPLER = fast_decode.SAMPLER, sampler
    try:
        r = engine.generate(prompts, 1, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=N),
                            torch.Generator(device=device).manual_seed(1))
    finally:
        fast_decode.SAMPLER = saved
    C = r.completion_mask.shape[1]
    assert 1 <= C <= N and ((r.input_ids >= 0) & (r.input_ids < 16)).all(), "a token outside the vocabulary"
    with torch.no_grad():   # the rollout comes back on the CPU
        want, _ = completion_logprobs(model, r.input_ids.to(device), r.attention_mask.to(device), C, 1.0)
    want = want.cpu()
    m = r.completion_mask.bool()
    assert torch.isfinite(r.logprobs[m]).all() and (r.logprobs[m] <= 0).all(), "log-probs not finite or above 0"
    err = (r.logprobs.float() - want.float())[m].abs().max().item()
    assert dtype == BF16 or err <= 1e-4, f"sampled log-probs {err} from teacher-forced ones"
    return err


def decoder_cases(size):
    if size == "cpu":
        return                                  # tests/test_fast_decode.py interprets the kernels in the step
    for sampler in ("cdf", "gumbel"):
        for dtype in (F32, BF16):
            for B, P, N in ((1, 1, 1), (3, 7, 5), (1, 7, 1), (3, 1, 5)):
                # compiled once (tests/test_capture_fallback.py's GPU test compiles the float32 one): inductor's own
                # kernels would take minutes under memcheck, and each compile tens of seconds
                compile = size == "gpu" and (B, P, N, sampler, dtype) == (3, 7, 5, "cdf", BF16)
                yield dict(B=B, P=P, N=N, dtype=dtype, sampler=sampler, compile=compile)


FAMILIES = {"sample": (sample_cases, check_sample), "decode": (decode_cases, check_decode),
            "decode_opts": (decode_opts_cases, check_decode),
            "logprob": (logprob_cases, check_logprob), "linear": (linear_cases, check_linear),
            "loss": (loss_cases, check_loss), **kernel_families_exact.FAMILIES, **kernel_families.FAMILIES,
            "decoder": (decoder_cases, check_decoder)}
NEEDS = kernel_families.NEEDS      # family -> fn(device) -> why it cannot run on this device (None: it can)


def describe(case: dict) -> str:
    return " ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in case.items())


def sweep(families, size: str, device: str, out=sys.stdout) -> tuple[int, int]:
    """Run the families' cases, one line each; -> (passed, failed). A family this device cannot run gets one
    `skip` line and counts in neither."""
    passed = failed = 0
    for name in families:
        cases, check = FAMILIES[name]
        why = NEEDS[name](device) if name in NEEDS else None
        if why:
            print(f"skip {name:8s} {why}", file=out, flush=True)
            continue
        for case in cases(size):
            t = time.perf_counter()
            try:
                err = check(device, **case)
                line, passed = f"ok   {name:8s} {describe(case)}  err={err:.2e}", passed + 1
            except Exception as e:   # a wrong number or a refused launch: this case fails, the sweep goes on
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
                line, failed = f"FAIL {name:8s} {describe(case)}  {why}", failed + 1
            print(f"{line}  ({time.perf_counter() - t:.2f} s)", file=out, flush=True)
            if device == "cuda":
                torch.cuda.synchronize()   # an asynchronous fault is reported at this case, not a later one
    print(f"{passed} passed, {failed} failed", file=out, flush=True)
    return passed, failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    p.add_argument("--size", default="gpu", choices=("gpu", "sanitizer", "cpu"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    families = a.only.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; valid: {', '.join(FAMILIES)}")
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the kernels under the Triton interpreter: set TRITON_INTERPRET=1")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU")
    torch.manual_seed(0)
    return 1 if sweep(families, a.size, a.device)[1] else 0


if __name__ == "__main__":
    sys.exit(main())
