"""W7 (docs/benchmarks.md): the update on long-tailed completion lengths, packed (pack=true) against today's
length-bucketed micro-batches, timed in one command.

    python tools/bench_w7.py --out w7-out                     # GPU: bucketed, packed (pack=true's attention), packed sdpa
    python tools/bench_w7.py --out w7-out --packed-attn auto,sdpa-per-sample,flex_attention   # other packed rows
    python tools/bench_w7.py --tiny --out /tmp/w7             # CPU smoke run of the same code at toy shapes

Workload: W1's model (tools/bench_workload.py: a random Qwen2 at Qwen2.5-0.5B shape) and 16 prompts x 8 samples,
prompts of 64 tokens; each completion's length is drawn from a lognormal (median 200, sigma 0.75) and cut at 1,024
tokens; the lengths are forced (the batch is built here, no rollout), so both variants see the same tokens. One
GRPO optimizer step over the 128 samples (update.update, the loop's own), micro_batch_size 32 with gradient
checkpointing by default. Report: median update time over --repeats after one warm-up, the tokens each variant's
forwards run (real + padding), the peak memory, and packed / bucketed.
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # tools/: bench_workload

import algos  # noqa: E402,F401  (registers the algorithms)
import update  # noqa: E402
from bench_workload import SHAPES, W, cuda_info, timed  # noqa: E402
from buffer import Experience, OnPolicyBuffer  # noqa: E402
from microbatch import micro_batches, packed_micro_batches  # noqa: E402

TINY = dict(SHAPES["small"], prompts=4, samples=4)   # 16 samples: enough rows for several micro-batches
PER_SAMPLE = "sdpa-per-sample"   # --packed-attn row: packed_varlen without torch's varlen kernel


def w7_batch(n: int, group: int, prompt_len: int, median: float, sigma: float, max_len: int, vocab: int,
             seed: int = 0) -> Experience:
    """n samples with completion lengths ~ lognormal(log median, sigma) cut to [1, max_len], random tokens (padding
    0, as the bench tokenizer's pad), advantages left to the caller."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g)).round().clamp(1, max_len).long()
    C = int(lengths.max())
    cmask = (torch.arange(C) < lengths[:, None]).float()                                   # (n, C)
    prompt = torch.randint(1, 10, (n, prompt_len), generator=g)                            # digits, no pad id
    completion = torch.randint(10, vocab, (n, C), generator=g) * cmask.long()              # (n, C)
    return Experience(input_ids=torch.cat([prompt, completion], 1),
                      attention_mask=torch.cat([torch.ones(n, prompt_len, dtype=torch.long), cmask.long()], 1),
                      completion_mask=cmask, sample_logprobs=-3 * torch.rand(n, C, generator=g) * cmask,
                      rewards=torch.rand(n, generator=g), group_ids=torch.arange(n) // group,
                      versions=torch.zeros(n, dtype=torch.long), truncated=lengths >= max_len)


def forward_tokens(batch: Experience, cfg) -> dict:
    """Tokens the policy's forwards run per update: real ones, and what each layout adds as padding."""
    buckets = [p for p, _ in micro_batches(batch, cfg.micro_batch_size, "token-mean")]
    pieces = [p for p, _ in packed_micro_batches(batch, cfg.micro_batch_size, "token-mean")]
    return {"real": int(batch.attention_mask.sum()), "bucketed": sum(p.input_ids.numel() for p in buckets),
            "packed": sum(int(p.attention_mask.sum()) for p in pieces),
            "packed_max_piece": max(int(p.attention_mask.sum()) for p in pieces),
            # the lm_head's rows: every completion column of a bucket; only the loss tokens when packed
            "head_bucketed": sum(p.completion_mask.numel() for p in buckets),
            "head_packed": int(batch.completion_mask.sum())}


def run(a) -> dict:
    import config
    import config_checks
    import registry
    import run_setup
    import train  # noqa: F401  (the plugin packages register their names)
    from bench_workload import build_model
    W.update(TINY if a.tiny else SHAPES["w1"])
    gpu = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32
    tmp = tempfile.mkdtemp(prefix="w7-")
    build_model(tmp, dtype)
    cfg = config.Config()
    cfg.model, cfg.micro_batch_size, cfg.samples_per_prompt = tmp, a.micro, W["samples"]
    cfg.grad_checkpointing, cfg.compile, cfg.fused_loss = a.ckpt, a.compile, a.fused
    cfg.algo.name, cfg.threads = "grpo", a.threads
    config.fill_defaults(cfg)
    config_checks.validate(cfg)
    if a.threads:
        torch.set_num_threads(a.threads)
    policy, _, _ = run_setup.build_models(cfg, device, dtype, fsdp=False)
    if a.attn:
        policy.set_attn_implementation(a.attn)
    auto = update.packed_attention_name
    algo = registry.get("algo", "grpo")
    n = W["prompts"] * W["samples"]
    batch = w7_batch(n, W["samples"], W["prompt_len"], a.median, a.sigma, a.max_len, W["vocab_size"])
    batch.advantages = algo.advantages(batch, cfg.algo)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-7)
    learner = update.Learner(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), algo,
                             cfg, device)
    tokens = forward_tokens(batch, cfg)
    res = {"workload": {"samples": n, "prompt_len": W["prompt_len"], "median": a.median, "sigma": a.sigma,
                        "max_len": a.max_len, "mean_completion": float(batch.completion_mask.sum(-1).mean()),
                        "longest": int(batch.completion_mask.sum(-1).max()), "micro_batch_size": a.micro,
                        "grad_checkpointing": a.ckpt, "compile": a.compile, "fused_loss": a.fused,
                        "torch": torch.__version__},
           "tokens": tokens, "variants": {}}
    rows, seen = [("bucketed", None, policy.config._attn_implementation)], set()
    for attn in a.packed_attn.split(","):   # one row per distinct attention (on a CPU, auto runs sdpa per sample)
        chosen = auto(policy) if attn == "auto" else update.VARLEN if attn == PER_SAMPLE else attn
        what = (chosen, attn == PER_SAMPLE or (chosen == update.VARLEN and not (gpu and update.TORCH_VARLEN)))
        if what not in seen:
            seen.add(what)
            rows.append((f"packed, {attn}", attn, chosen))
    kernel = update.TORCH_VARLEN
    for name, attn, chosen in rows:
        cfg.pack = attn is not None
        update.packed_attention_name = lambda model, chosen=chosen: chosen
        update.TORCH_VARLEN = None if attn == PER_SAMPLE else kernel   # VARLEN's fallback: sdpa sample by sample

        def one():
            buf = OnPolicyBuffer()
            buf.add(batch)
            return update.update(learner, buf, torch.Generator().manual_seed(0), 1, n)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        try:
            first, times, stats = timed(one, a.repeats)
        except Exception as e:   # one attention failing here still leaves the others' rows
            res["variants"][name] = {"attention": chosen, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: {res['variants'][name]['error']}", flush=True)
            continue
        label = attention_label(chosen, attn is None, gpu and update.TORCH_VARLEN is not None)
        res["variants"][name] = {"first_s": first, "times_s": times, "median_s": statistics.median(times),
                                 "attention": label, "loss": stats.get("loss"), **cuda_info()}
    update.packed_attention_name, update.TORCH_VARLEN = auto, kernel
    base = res["variants"]["bucketed"].get("median_s")
    for r in res["variants"].values():
        if base and "median_s" in r:
            r["over_bucketed"] = r["median_s"] / base
    return res


def attention_label(chosen: str, padded: bool, flash: bool) -> str:
    """What the row's attention is, in words."""
    if not padded and chosen in ("sdpa", "eager"):
        return f"{chosen} + transformers' packed mask"
    if chosen == update.VARLEN:
        return f"{chosen} (" + ("torch varlen_attn, flash" if flash else "sdpa per sample") + ")"
    return chosen


def table(res: dict) -> str:
    w, t, v = res["workload"], res["tokens"], res["variants"]
    lines = [f"W7: {w['samples']} samples, prompts of {w['prompt_len']}, completions lognormal (median {w['median']}, "
             f"sigma {w['sigma']}, cut at {w['max_len']}): mean {w['mean_completion']:.0f}, longest {w['longest']}; "
             f"micro_batch_size={w['micro_batch_size']} grad_checkpointing={w['grad_checkpointing']} "
             f"compile={w['compile']} fused_loss={w['fused_loss']}; device {v['bucketed'].get('device')}, "
             f"torch {w.get('torch')}",
             "", "| update | median | / bucketed | runs | tokens: body (real {:,}) / head | attention | peak allocated |"
             .format(t["real"]), "|---|---|---|---|---|---|---|"]
    for name, r in v.items():
        kind = "bucketed" if name == "bucketed" else "packed"
        toks = f"{t[kind]:,} / {t['head_' + kind]:,}"
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:120]} | | | {toks} | {r['attention']} | |")
            continue
        peak = f"{r['peak_alloc_gib']:.1f} GiB" if "peak_alloc_gib" in r else "n/a (CPU)"
        lines.append(f"| {name} | {r['median_s']:.3f} s | {r.get('over_bucketed', float('nan')):.2f} | "
                     f"{' '.join(f'{x:.3f}' for x in r['times_s'])} | {toks} | {r['attention']} | {peak} |")
    lines += ["", "Goal (issue 34): packed / bucketed <= 0.6."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="w7-out", help="folder for w7.json and w7.md")
    p.add_argument("--tiny", action="store_true", help="toy shapes on CPU (median 12, cut at 48 tokens)")
    p.add_argument("--micro", type=int, default=32, help="micro_batch_size (both variants)")
    p.add_argument("--no-ckpt", dest="ckpt", action="store_false", help="without gradient checkpointing")
    p.add_argument("--compile", action="store_true", help="compile=true (per-layer torch.compile)")
    p.add_argument("--fused", action="store_true", help="fused_loss=true")
    p.add_argument("--attn", default="", help="the model's attn_implementation (sdpa, eager, flex_attention, ...)")
    p.add_argument("--packed-attn", default="auto,sdpa",
                   help="comma list: one packed row per attention (auto = what pack=true picks: "
                        "update.packed_attention_name; or packed_varlen, sdpa-per-sample (packed_varlen without "
                        "torch's varlen kernel), flex_attention, sdpa, eager, ...)")
    p.add_argument("--median", type=float, default=200.0, help="median completion length")
    p.add_argument("--sigma", type=float, default=0.75, help="lognormal sigma of the completion lengths")
    p.add_argument("--max-len", type=int, default=1024, help="longest completion")
    p.add_argument("--repeats", type=int, default=5, help="timed updates per variant, after one warm-up")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    a = p.parse_args(argv)
    if a.tiny and (a.median, a.max_len) == (200.0, 1024):
        a.median, a.max_len = 12.0, 48
    if a.micro < 1 or a.repeats < 1 or not 1 <= a.median <= a.max_len:
        p.error("--micro and --repeats must be >= 1 and 1 <= --median <= --max-len")
    if not a.tiny and not torch.cuda.is_available():
        p.error("W7 needs a GPU; --tiny runs the same code at toy shapes on the CPU")
    res = run(a)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "w7.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = table(res)
    with open(os.path.join(a.out, "w7.md"), "w") as f:
        f.write(md)
    print(md, end="")


if __name__ == "__main__":
    main()
