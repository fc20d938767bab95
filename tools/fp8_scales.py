"""Which part of FP8's rounding makes engine_dtype=fp8's log-prob gap: the weights' scale granularity, the
activations' quantisation, the head (#38; docs/mismatch.md, "FP8 engine"). CPU, float32, one command:

    python tools/fp8_scales.py --out OUT                    # W6's widths (Qwen2.5-7B), 2 layers: ~4 min on one core
    python tools/fp8_scales.py --out OUT --shape w1 --layers 24
    python tools/fp8_scales.py --out /tmp/s --shape small   # smoke run

A random Qwen2 (tools/lora_decode_bench.py's build: the W6 bench's model, bf16 weights, no adapters) at a workload's
widths, in float32: the reference (the trainer). One forward over --rows x --len random tokens. Each variant (an
engine) runs the same forward with every Linear (the layers' and the head) computing from rounded copies, the twin of the GPU's GEMMs
(kernels/fp8.py): weights e4m3 with one scale per output channel (the engine's) or per 128-column group; inputs
e4m3 per token (the engine's), per 128-column group, or unrounded; and the whole model in bf16, the scale of the
bf16 engine's gap. At each position one token is drawn from the variant's next-token distribution (what its
rollout would sample there); per variant: the mean and largest |variant - reference| log-prob of the drawn tokens,
the mean KL(reference || variant), and what algo.tis makes of the gap at the default cap 2 (token's mean weight,
the share it truncates, the share mask drops: tools/lora_decode_bench.py tis_row). Writes OUT/fp8_scales.json and OUT/fp8_scales.md.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # tools/: bench, lora_decode_bench
import torch
import torch.nn.functional as F

from kernels.fp8 import FP8, FP8_MAX

GROUP = 128
# name: (weight scales "row" / "group" / None, input scales "row" / "group" / None, head rounded too)
VARIANTS = {"fp8 (engine: W per channel, x per token)": ("row", "row", True),
            "W per channel, x unrounded": ("row", None, True),
            "x per token, W unrounded": (None, "row", True),
            "W per group of 128, x per token": ("group", "row", True),
            "W and x per group of 128": ("group", "group", True),
            "fp8, head unrounded": ("row", "row", False)}


def rounded(t, how: str | None):
    """t (..., K) float32 through e4m3 and back, one scale per row ("row") or per 128 columns ("group"), as
    kernels/fp8.py's row_scales (the row's absolute max over 448); None: t itself."""
    if how is None:
        return t
    shape = t.shape
    v = t.reshape(-1, GROUP) if how == "group" else t.reshape(-1, shape[-1])
    s = v.abs().amax(-1, keepdim=True) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return ((v / s).to(FP8).float() * s).reshape(shape)


def gaps(ref_logp, logp) -> dict:
    """ref_logp (the trainer's), logp (the engine's) (B, T, V) log-softmax; one token per position drawn from logp."""
    from lora_decode_bench import tis_row
    V = logp.shape[-1]
    drawn = torch.multinomial(logp.exp().view(-1, V), 1, generator=torch.Generator().manual_seed(1))
    drawn = drawn.view(*logp.shape[:-1], 1)                                                  # (B, T, 1)
    train, sample = ref_logp.gather(-1, drawn)[..., 0], logp.gather(-1, drawn)[..., 0]        # (B, T)
    d = (train - sample).abs()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return {"gap_mean": float(d.mean()), "gap_max": float(d.max()), "kl_mean": float(kl.mean()),
            **tis_row(train, sample, torch.ones_like(train))}


def main():
    from bench import SHAPES
    from lora_decode_bench import build
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="w6", choices=["w6", "w1", "small"])
    p.add_argument("--layers", type=int, default=2, help="decoder layers (the workload's widths, fewer layers)")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--len", type=int, default=64)
    a = p.parse_args()
    if a.layers < 1 or a.rows < 1 or a.len < 2:
        p.error("--layers, --rows >= 1 and --len >= 2")
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = build({**SHAPES[a.shape], "num_hidden_layers": a.layers}, 0, torch.device("cpu"), torch.bfloat16)
    model = model.float().eval()                              # bf16-representable weights, float32 arithmetic
    V = model.config.vocab_size
    ids = torch.randint(1, V, (a.rows, a.len), generator=torch.Generator().manual_seed(0))      # (B, T)
    with torch.no_grad():
        ref = F.log_softmax(model(ids).logits.float(), -1)                                    # (B, T, V)
    res = {"shape": a.shape, "layers": a.layers, "tokens": a.rows * a.len, "variants": {}}
    t0 = time.perf_counter()
    with torch.no_grad():
        res["variants"]["bf16 model"] = gaps(ref, F.log_softmax(model.bfloat16()(ids).logits.float(), -1))
        model.float()
        print(json.dumps(res["variants"]), flush=True)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        masters = [m.weight.data for m in linears]
        grouped = all(m.in_features % GROUP == 0 for m in linears)         # else the group variants are skipped
        for name, (w_how, x_how, head) in VARIANTS.items():
            if "group" in (w_how, x_how) and not grouped:
                continue
            hooks = []
            for m, w in zip(linears, masters):
                on = head or m is not model.lm_head
                m.weight.data = rounded(w, w_how) if on else w
                if on and x_how:
                    hooks.append(m.register_forward_pre_hook(lambda _m, args, how=x_how: (rounded(args[0], how),)))
            try:
                res["variants"][name] = gaps(ref, F.log_softmax(model(ids).logits.float(), -1))
            finally:
                for h in hooks:
                    h.remove()
                for m, w in zip(linears, masters):
                    m.weight.data = w
            print(name, json.dumps(res["variants"][name]), flush=True)
    res["seconds"] = time.perf_counter() - t0
    with open(os.path.join(a.out, "fp8_scales.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"FP8 rounding variants against the float32 reference: {a.shape} widths, {a.layers} layers, "
             f"{res['tokens']} drawn tokens", "", "| variant | log-prob gap mean | max | KL mean | tis=token mean weight, "
             "truncated | tis=mask dropped |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {v['gap_mean']:.4f} | {v['gap_max']:.3f} | {v['kl_mean']:.5f} | "
              f"{v['tis_token_weight_mean']:.3f}, {v['tis_truncated_frac']:.1%} | {v['tis_mask_dropped_frac']:.1%} |"
              for n, v in res["variants"].items()]
    with open(os.path.join(a.out, "fp8_scales.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
