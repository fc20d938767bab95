"""Kernels, imported directly by the code that runs them. Each entry point below runs the implementation chosen for
its op: by default ("auto") the fused Triton version where it runs (CUDA tensors and an importable triton, or
TRITON_INTERPRET=1 for tests on CPU) and the torch reference twin elsewhere, so the caller never checks the device:

    from kernels import token_logprobs, linear_logprobs, linear_logprob_loss_kernel, sample_token, decode_attention_kernel
    logp, ent = token_logprobs(logits, targets, temperature)                          # logits (..., V)
    logp, ent = linear_logprobs(hidden, lm_head_weight, targets, temperature)         # hidden (..., H)
    loss, logp, ent = linear_logprob_loss_kernel(hidden, lm_head_weight, targets, temperature, loss_fn)
        # loss_fn(rows, logp (b, C), entropy (b, C)) -> scalar; the gradient is computed in the forward
        # (3 matmuls instead of 4): see kernels/logprob_loss.py for when a loss qualifies
    tok, logp = sample_token(logits, inv_t, seed, step)     # (B, V) -> (B,), (B,): Gumbel-max
    o = decode_attention_kernel(qkv, cos, sin, pos, k, v, key_ok, last, scale)   # rotary + cache write +
                                                            # attention of one new token per sequence

exact_logprobs' kernels (kernels/exact_gemm.py: exact_linear, exact_linear_cat, exact_silu_mul, exact_rmsnorm;
kernels/exact_attention.py: exact_attention, exact_rope_cache; kernels/exact_sample.py: exact_row_logprobs, the
log-softmax, sampling and entropy per row shared by the engine and the trainer's head) are not chosen here: the
engine and the trainer must take the same path on a device, so engines/exact.py picks one per device (`on_gpu`),
with the torch path as its portable twin. Nor are the decode step's expert GEMMs (kernels/moe_experts.py:
expert_gate_up, expert_down) and its routing (kernels/decode_route.py: route, route_linear, with the twin
route_reference): engines/moe.py takes them where `triton_experts` allows and keeps torch's grouped GEMM and
topk elsewhere. Nor are engine_dtype=fp8's (engines/decode_weights.py calls them): kernels/fp8.py (quantise_rows,
fp8_linear, with its torch twin), kernels/fp8_gemm.py (fp8_gemm, the Triton FP8 GEMM for a decode step's few rows)
and kernels/fp8_quant.py (merge_quantise: a projection's LoRA merge and FP8 quantisation in one kernel).

Targets < 0 mark padded tokens: logp = entropy = 0 there, and no gradient flows from them.

Implementations register themselves in the registry's "kernel" kind as "<op>.<name>" (below: an op's
implementations take the same arguments). A config picks one per op (`kernels.logprob=torch`, train.py calls
choose() before any work), and tools/ablate.py compares them like algorithms (`--kernels logprob=torch,triton`).
A new implementation: a function with `@register("kernel", "<op>.<name>")` taking its op's arguments (and
`@needs("triton", ...)` for what it imports), in a module imported here.
"""
import importlib.util
import os

import torch
from torch import Tensor

from kernels.decode_attention import decode_attention
from kernels.decode_attention_ref import decode_attention_reference
from kernels.fused_kl import fused_kl, fused_kl_reference  # noqa: F401  (full-vocabulary KL: kernels/fused_kl.py)
from kernels.linear_logprob import linear_logprob_entropy
from kernels.logprob_loss import linear_logprob_loss
from kernels.logprob import HAS_TRITON, logprob_entropy, logprob_entropy_reference
from kernels.sample import cdf_sample, gumbel_sample, gumbel_sample_reference
from registry import RegistryError, get, names, register

OPS = ("logprob", "linear_logprob", "logprob_loss", "sample", "decode_attention")
_chosen = dict.fromkeys(OPS, "auto")   # process-wide, like torch's backend flags: set once by choose() at start


def use_triton(*tensors: Tensor) -> bool:
    if not HAS_TRITON:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or all(t.is_cuda for t in tensors)


def implementations(op: str) -> list[str]:
    """The registered implementations of op (the names after "<op>.")."""
    return [n.split(".", 1)[1] for n in names("kernel") if n.split(".", 1)[0] == op]


def choose(**choice: str) -> dict[str, str]:
    """Set the implementation per op (auto or a registered name); -> the previous choices (to restore them).
    An unknown op or name, or one whose package is missing, is a one-line RegistryError (the entry scripts print
    it as one line) listing the valid ones."""
    for op, name in choice.items():
        if op not in OPS:
            raise RegistryError(f"unknown kernel op {op!r}; ops: {', '.join(OPS)}")
        valid = ["auto", *implementations(op)]
        if name not in valid:
            raise RegistryError(f"kernels.{op} must be one of {', '.join(valid)}; got {name!r}")
        packages = () if name == "auto" else getattr(_impl(op, name), "needs", ())
        for package in packages:
            if importlib.util.find_spec(package) is None:
                raise RegistryError(f"kernels.{op}={name} needs the {package} package, which is not installed "
                                    f"(pip install {package.replace('_', '-')}; or kernels.{op}=auto)")
        if "triton" in packages and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise RegistryError(f"kernels.{op}={name} runs Triton kernels, which need a CUDA device (or "
                                f"TRITON_INTERPRET=1), and there is none: choose kernels.{op}=auto or torch")
    before = dict(_chosen)
    _chosen.update(choice)
    return before


def _impl(op: str, name: str):
    return get("kernel", f"{op}.{name}")


def _pick(op: str, *tensors: Tensor):
    """The chosen implementation of op for these tensors: auto = Triton where it runs, else torch."""
    name = _chosen[op]
    if name == "auto":
        name = "triton" if use_triton(*tensors) else "torch"
    fn = _impl(op, name)
    if "triton" in getattr(fn, "needs", ()) and not use_triton(*tensors):   # Triton launches on CUDA tensors
        raise ValueError(f"kernels.{op}={name} runs Triton kernels, which need CUDA tensors (or TRITON_INTERPRET=1); "
                         f"got {tensors[0].device} ones: choose kernels.{op}=auto or torch")
    return fn


def needs(*packages: str):
    """Mark an implementation with the packages it imports ("triton": it also needs CUDA tensors or the
    interpreter); choose() refuses it up front where they are missing."""
    def mark(fn):
        fn.needs = packages
        return fn
    return mark


# ------------------------------------------------------------------ the implementations, by "<op>.<name>"
@register("kernel", "logprob.triton")
@needs("triton")
def _logprob_triton(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    return logprob_entropy(logits, targets, temperature, use_triton=True)   # (N, V), (N,) -> (N,), (N,)


register("kernel", "logprob.torch")(logprob_entropy_reference)


@register("kernel", "logprob.liger")
@needs("triton", "liger_kernel")
def _logprob_liger(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Liger-Kernel's cross-entropy kernel gives logp and its gradient; Liger computes no entropy, so it comes from
    the torch twin's formula (the (N, V) softmax in float32): compare Liger's log-prob, not its memory."""
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    z = logits.float() / temperature                                  # a new tensor: Liger writes its gradient in it
    nll = LigerCrossEntropyFunction.apply(z if temperature != 1 else z.clone(), targets, None, -100, 0.0, 0.0,
                                          "none")[0]                  # (N,), 0 where targets < 0
    _, entropy = logprob_entropy_reference(logits, targets, temperature)
    return -nll, entropy


@register("kernel", "linear_logprob.triton")
@needs("triton")
def _linear_triton(hidden, weight, targets, temperature, into_grad):
    return linear_logprob_entropy(hidden, weight, targets, temperature, use_triton=True, into_grad=into_grad)


@register("kernel", "linear_logprob.torch")
def _linear_torch(hidden, weight, targets, temperature, into_grad):
    return linear_logprob_entropy(hidden, weight, targets, temperature, use_triton=False, into_grad=into_grad)


@register("kernel", "logprob_loss.triton")
@needs("triton")
def _loss_triton(hidden, weight, targets, temperature, loss_fn, rows_per_chunk, into_grad):
    return linear_logprob_loss(hidden, weight, targets, temperature, loss_fn, rows_per_chunk, use_triton=True,
                               into_grad=into_grad)


@register("kernel", "logprob_loss.torch")
def _loss_torch(hidden, weight, targets, temperature, loss_fn, rows_per_chunk, into_grad):
    return linear_logprob_loss(hidden, weight, targets, temperature, loss_fn, rows_per_chunk, use_triton=False,
                               into_grad=into_grad)


@register("kernel", "sample.triton")
@needs("triton")
def _sample_triton(logits, inv_t, seed, step, method):
    return (cdf_sample if method == "cdf" else gumbel_sample)(logits, inv_t, seed, step)


@register("kernel", "sample.torch")
def _sample_torch(logits, inv_t, seed, step, method):
    return gumbel_sample_reference(logits, inv_t, seed, step)   # the Gumbel race for both methods


@register("kernel", "decode_attention.triton")
@needs("triton")
def _decode_triton(qkv, cos, sin, pos, k, v, key_ok, last, scale, splits, qk_norm=None, share=None):
    return decode_attention(qkv, cos, sin, pos, k, v, key_ok, last, scale, splits=splits, qk_norm=qk_norm,
                            share=share)


@register("kernel", "decode_attention.torch")
def _decode_torch(qkv, cos, sin, pos, k, v, key_ok, last, scale, splits, qk_norm=None, share=None):
    # no splits (one pass); share checked, then its rows' own equal copies read
    return decode_attention_reference(qkv, cos, sin, pos, k, v, key_ok, last, scale, qk_norm, share)


# ------------------------------------------------------------------ the entry points the callers use
def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """logits (..., V), targets (...) -> (logp, entropy), each shaped like targets."""
    shape = targets.shape
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    logp, ent = _pick("logprob", logits)(flat, tgt, temperature)
    return logp.view(shape), ent.view(shape)


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                    into_grad: bool = False) -> tuple[Tensor, Tensor]:
    """hidden (..., H), lm_head weight (V, H), targets (...) -> (logp, entropy), each shaped like targets.
    Gradients flow to hidden and weight (into_grad: straight into weight.grad, see kernels/linear_logprob.py);
    the (N, V) logits are never held whole on either path."""
    return _pick("linear_logprob", hidden, weight)(hidden, weight, targets, temperature, into_grad)


def linear_logprob_loss_kernel(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, loss_fn,
                               rows_per_chunk: int | None = None, into_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """hidden (B, C, H), weight (V, H), targets (B, C) -> (loss, logp (B, C), entropy (B, C)); loss.backward()
    gives hidden.grad and weight.grad (into_grad: straight into weight.grad). loss_fn(rows: slice, logp (b, C),
    entropy (b, C)) -> that chunk's scalar."""
    return _pick("logprob_loss", hidden, weight)(hidden, weight, targets, temperature, loss_fn, rows_per_chunk,
                                                  into_grad)


SAMPLERS = ("gumbel", "cdf")


def sample_token(logits: Tensor, inv_t: Tensor, seed: Tensor, step: Tensor, method: str = "gumbel") -> tuple[Tensor, Tensor]:
    """logits (B, V), inv_t / seed / step (1,) device tensors -> tok (B,), logp (B,): one token per row at
    temperature 1 / inv_t, noise keyed by seed and step (kernels/sample.py; the decode graph replays it).
    method: "gumbel" (exponential race) or "cdf" (inverse CDF, one uniform per row): same distribution,
    different draws for the same seed; the CPU twin is the Gumbel one for both."""
    if method not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {method!r}")
    return _pick("sample", logits)(logits, inv_t, seed, step, method)


def decode_attention_kernel(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k: Tensor, v: Tensor,
                            key_ok: Tensor, last: Tensor, scale: float, splits: int = 1,
                            qk_norm: tuple | None = None, share: tuple | None = None) -> Tensor:
    """qkv (B, (nh + 2 nkv) D), rotary tables cos/sin (S, D), pos (B,), caches k/v (B, nkv, S, D), key_ok (B, S),
    last (1,) -> (B, nh D): rotary, the new K/V written at slot `last`, and attention over the slots up to it
    (kernels/decode_attention.py). splits > 1: the kernel's flash-decoding form (the CPU twin ignores it).
    qk_norm (q weight (D,), k weight (D,), eps): qwen3's RMSNorm of each head of q and k before the rotation.
    share (src (B,), shared (1,)): row b's slots below shared hold row src[b]'s values; the kernel reads them there
    (one copy per prompt from memory), the twin reads its own."""
    return _pick("decode_attention", qkv)(qkv, cos, sin, pos, k, v, key_ok, last, scale, splits, qk_norm, share)
