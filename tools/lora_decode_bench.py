"""The LoRA rollout alone, decode_weights=fused against in_place unpacked and packed, and FP8 (engine_dtype=fp8), one
GPU, one command (#22, #38):

    python tools/lora_decode_bench.py --out $OUT/lora_decode          # W6: Qwen2.5-7B shape, r=16 on all linear layers
    python tools/lora_decode_bench.py --out $OUT/fp8 --variants addmm,fp8 --repeats 2   # FP8 vs W6's route
    python tools/lora_decode_bench.py --out $OUT/fp8 --variants addmm,fp8 --repeats 2 --alternate   # rounds
    python tools/lora_decode_bench.py --small --out /tmp/ld          # CPU smoke run (toy shape, eager, no graph)
    python tools/lora_decode_bench.py --out $OUT/sp --variants addmm,fp8 --repeats 2 --alternate --shared-prefill both
                                        # each variant with FAST_DECODE_SHARED_PREFILL off and on, in the same rounds
    python tools/lora_decode_bench.py --out $OUT/gp --variants addmm,fp8 --repeats 2 --alternate --graph-prefill both
                                        # each variant's kept decoder with FAST_DECODE_GRAPH_PREFILL off and on

A random Qwen2 at W6's shape (tools/bench.py SHAPES, bf16, built in memory), peft LoRA r=16 alpha 32 on every
linear layer with B random (peft starts it at zero), 8 x 8 prompts of 64 random tokens, 256 new tokens at
temperature 1, EOS outside the vocabulary (every row runs to full length). Variants, run in the order --variants
gives them (unpacked before the packed ones: packing changes the model's storage for good): fused; in_place
unpacked (engines.decode_weights.PACK off: 15 GEMMs per layer per token); in_place packed, the low-rank product by addmm (8 GEMMs), then by mm and an add
(decode_weights.LOW_RANK="mm"); fp8: the route engine_dtype=fp8 takes (FP8 copies of the merged weights of
every group of at least decode_weights.FP8_MIN elements and of the head, the rest fused in bf16), its decode GEMMs
kernels/fp8_gemm.py's (the default) or, "fp8 scaled_mm" (--variants scaled_mm), torch._scaled_mm's, the
activations quantised per token for both, the FP8 copies made by kernels/fp8_quant.py's merge-and-quantise
kernels (decode_weights.FP8_REFRESH's default); "fp8 torch-refresh" (--variants torch-refresh): fp8 with the copies
made by lora.dense_weight and kernels/fp8.py's quantise_rows, eager (FP8_REFRESH="torch"); fp8_all: every group and
the head in FP8. Per variant: median rollout seconds over --repeats calls after a warm-up call (compile, capture;
every rollout samples from seed 0); with --alternate every decoder is built and warmed first, then the repetitions
run in rounds, one rollout of each variant per round (a drift of the card's clocks reaches all alike), the
peak memory allocated during a rollout, the largest and the mean |engine - teacher-forced| log-prob over 8 rows
(the peft model in bf16: the trainer's side), and on a GPU a torch.profiler summary of one rollout (kernel names
and counts: the GEMMs launched; microseconds per call and per token step) in OUT/profile-<variant>.txt. Also what
packing took: seconds and the peak memory over the model before it (one group's buffer expected, never a model
copy), and of reserved memory. The 64 rows are 8 prompts repeated 8 times, as train.py's rollouts are (before
2026-11-28's shared prefill, 64 distinct prompts: only the prefill tells them apart). --shared-prefill sets
FAST_DECODE_SHARED_PREFILL for every rollout: on (1, the default), off (0: every row prefilled) or both (needs
--alternate: each variant with 0 and 1 in the same rounds, their order swapped each round; the rows with 1 are
named "<variant> +shared prefill"). --graph-prefill sets FAST_DECODE_GRAPH_PREFILL the same way ("<variant> +graph
prefill" rows), and when not off every decoder keeps its state between rollouts (keep_cache, which the graphed
prefill needs), in both modes, so the pair differs in the prefill only; off (the tool's default, as before this
switch) frees the state after each rollout, where the engine never graphs the prefill. One of the two switches may
be both.
Writes OUT/lora_decode.json and OUT/lora_decode.md.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch

from bench import SHAPES   # tools/bench.py: the workloads' shapes

GIB = 2**30
VARIANTS = [   # name (its last word is its --variants name), decode weights, decode_weights.PACK, .LOW_RANK,
    # fp8.GEMM, decode_weights.FP8_REFRESH
    ("fused", "fused", True, "addmm", "triton", "triton"), ("fp8", "fp8", True, "addmm", "triton", "triton"),
    ("fp8 scaled_mm", "fp8", True, "addmm", "scaled_mm", "triton"),
    ("fp8 torch-refresh", "fp8", True, "addmm", "triton", "torch"),
    ("in_place unpacked", "in_place", False, "addmm", "triton", "triton"),
    ("in_place packed addmm", "in_place", True, "addmm", "triton", "triton"),
    ("in_place packed mm", "in_place", True, "mm", "triton", "triton"),
    ("fp8_all", "fp8_all", True, "addmm", "triton", "triton")]


def build(shape: dict, r: int, device, dtype):
    """The random model with LoRA adapters whose B is random too (else the adapters would add nothing)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import lora
    from config import LoRAConfig
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads")
    cfg = Qwen2Config(**{k: shape[k] for k in keys}, max_position_embeddings=4096,
                      tie_word_embeddings=shape.get("tied", True), pad_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            base = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model = lora.wrap(base.eval(), LoRAConfig(r=r, alpha=2 * r), "random")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout_once(dec, ids, mask, sampling, eos: int, device) -> tuple[float, float, tuple]:
    """One rollout: its seconds, its peak allocated GiB and (completion, alive, logprobs)."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    completion, alive, logprobs, _ = dec.sample(ids, mask, sampling, eos, 0, gen)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    return time.perf_counter() - t0, peak, (completion, alive, logprobs)


def gap_row(model, ids, out: tuple) -> dict:
    """The log-prob gap of a rollout's first 8 rows to teacher forcing, and what algo.tis makes of it."""
    from models import completion_logprobs
    completion, alive, logprobs = out
    C = completion.shape[1]
    with torch.no_grad():   # 8 rows: the (rows, C, V) logits of all 64 would not fit beside a 7B model
        full = torch.cat([ids[:8], completion[:8]], 1)
        logp = completion_logprobs(model, full, torch.ones_like(full), C)[0]                # (8, C)
    gap = (logp.float() - logprobs[:8].float()).abs() * alive[:8]                                  # (8, C)
    return {"logprob_gap_max": float(gap.max()), "logprob_gap_mean": float(gap.sum() / alive[:8].sum()),
            "new_tokens": int(alive.sum()), **tis_row(logp.float(), logprobs[:8].float(), alive[:8].float())}


def rollout_row(model, dec, ids, mask, sampling, eos: int, repeats: int, device) -> dict:
    """Times `repeats` rollouts after a warm-up, their peak memory, and the log-prob gap to teacher forcing."""
    runs = [rollout_once(dec, ids, mask, sampling, eos, device) for _ in range(repeats + 1)]
    times = [r[0] for r in runs]
    return {"first_s": times[0], "times_s": times[1:], "median_s": statistics.median(times[1:]),
            "peak_alloc_gib": max(r[1] for r in runs), **gap_row(model, ids, runs[-1][2])}


def tis_row(train_logp, sample_logp, mask, cap: float = 2.0) -> dict:
    """What algo.tis does with the gap (algos/common.py tis_weights at the default tis_cap): token's mean
    weight, the share of tokens it truncates (pi_train / pi_sample > cap), and the share mask would drop
    (outside [1/cap, cap])."""
    from algos.common import tis_weights
    n = mask.sum()
    rho = ((train_logp - sample_logp) * mask).exp()                                                # (8, C)
    return {"tis_token_weight_mean": float(tis_weights(train_logp, sample_logp, mask, "token", cap).sum() / n),
            "tis_truncated_frac": float(((rho > cap).float() * mask).sum() / n),
            "tis_mask_dropped_frac": float(((rho > cap) | (rho < 1 / cap)).float().mul(mask).sum() / n)}


def profile_one(dec, ids, mask, sampling, eos: int, device, path: str):
    """Kernel names, counts and times of one rollout (CUDA graph replays included), top 25 by time, with
    microseconds per call and per token step (sampling.max_new_tokens steps, the prefill's share included)."""
    from torch.profiler import ProfilerActivity, profile
    steps = sampling.max_new_tokens
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        dec.sample(ids, mask, sampling, eos, 0, torch.Generator(device=device).manual_seed(1))
        sync(device)
    wall = time.perf_counter() - t0
    events = [e for e in p.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:25]
    total = sum(e.self_device_time_total for e in events)                          # us
    with open(path, "w") as f:
        f.write(f"GPU kernel time {total / 1e6:.3f} s over {wall:.3f} s of wall (profiled); {steps} token steps: "
                f"{total / steps:.1f} us of kernels per step\n  total s   calls/step  us/call  us/step  kernel\n")
        f.writelines(f"{e.self_device_time_total / 1e6:8.4f} {e.count / steps:8.2f} "
                     f"{e.self_device_time_total / e.count:8.2f} {e.self_device_time_total / steps:8.1f}  "
                     f"{e.key[:100]}\n" for e in top)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--small", action="store_true", help="toy shape on CPU (eager, no graph, no compile)")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="fused,unpacked,addmm,mm", help="some of fused,fp8,scaled_mm,torch-refresh,"
                   "unpacked,addmm,mm,fp8_all, run in the order given (unpacked before addmm and mm: packing is for "
                   "good)")
    p.add_argument("--budget-s", type=float, default=0, help="start no variant after this many seconds (0: no limit)")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled rollout per variant")
    p.add_argument("--alternate", action="store_true", help="build and warm every variant first, then time them in "
                   "rounds (one rollout each per round); no profile")
    p.add_argument("--shared-prefill", default="on", choices=("off", "on", "both"),
                   help="FAST_DECODE_SHARED_PREFILL for the rollouts (on: the default route); both: each variant "
                        "with it off and on, in the same rounds (needs --alternate)")
    p.add_argument("--graph-prefill", default="off", choices=("off", "on", "both"),
                   help="FAST_DECODE_GRAPH_PREFILL for the rollouts; not off: the decoders keep their state "
                        "(keep_cache, which the graphed prefill needs); off: they free it after each rollout, as "
                        "before; both: each variant with it off and on, in the same rounds (needs --alternate)")
    a = p.parse_args()
    for opt_name, value in (("--shared-prefill", a.shared_prefill), ("--graph-prefill", a.graph_prefill)):
        if value == "both" and not a.alternate:
            p.error(f"{opt_name} both times the two in the same rounds: add --alternate")
    if a.shared_prefill == a.graph_prefill == "both":
        p.error("--shared-prefill and --graph-prefill: one of them may be both, not the two")
    values = {"off": ["0"], "on": ["1"], "both": ["0", "1"]}
    # the switch the rounds alternate (the other one fixed): its variable, its rows' suffix, its values
    env, label, modes = (("FAST_DECODE_GRAPH_PREFILL", "+graph prefill", values[a.graph_prefill])
                         if a.graph_prefill == "both" else
                         ("FAST_DECODE_SHARED_PREFILL", "+shared prefill", values[a.shared_prefill]))
    envs_before = {k: os.environ.get(k) for k in ("FAST_DECODE_SHARED_PREFILL", "FAST_DECODE_GRAPH_PREFILL")}
    os.environ["FAST_DECODE_SHARED_PREFILL"] = values[a.shared_prefill][-1]
    os.environ["FAST_DECODE_GRAPH_PREFILL"] = values[a.graph_prefill][-1]   # warm-up and the one-pass route: the last
    start = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    from engines.base import SamplingParams
    from engines.fast_decode import FastDecoder
    shape = SHAPES["small" if a.small else "w6"]
    device = torch.device("cuda" if torch.cuda.is_available() and not a.small else "cpu")
    gpu = device.type == "cuda"
    model = build(shape, a.r, device, torch.bfloat16 if gpu else torch.float32)
    B, P, V = shape["prompts"] * shape["samples"], shape["prompt_len"], shape["vocab_size"]
    ids = torch.randint(1, V, (shape["prompts"], P), generator=torch.Generator().manual_seed(0))
    ids = ids.repeat_interleave(shape["samples"], 0).to(device)               # (B, P): a prompt's samples adjacent
    mask = torch.ones_like(ids)
    sampling = SamplingParams(1.0, 1.0, shape["new"])
    res = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "shape": "small" if a.small else "w6",
           "r": a.r, "model_gib": torch.cuda.memory_allocated(device) / GIB if gpu else 0.0, "variants": {},
           "errors": {}}
    by_key = {v[0].split()[-1]: v for v in VARIANTS}
    todo = a.variants.split(",")
    if set(todo) - set(by_key) or ("unpacked" in todo and {"addmm", "mm"} & set(todo[:todo.index("unpacked")])):
        p.error(f"--variants: a subset of {','.join(by_key)}, unpacked before addmm and mm (packing is for good)")
    warm = {}                                                   # --alternate: name -> (decoder, its settings)
    for v in [by_key[k] for k in todo]:
        name = v[0]
        if a.budget_s and time.perf_counter() - start > a.budget_s:
            print(f"{name}: skipped (--budget-s {a.budget_s:.0f} spent)", flush=True)
            continue
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        mem = lambda: (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)) if gpu else (0, 0)
        before, t0 = mem(), time.perf_counter()
        settle(v)
        dec = FastDecoder(model, weights=v[1], use_graph=gpu, compile=gpu,    # in_place + PACK: packs here
                          keep_cache=a.graph_prefill != "off")
        peaks = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)) if gpu else (0, 0)
        built = {"build_s": time.perf_counter() - t0, "build_peak_over_model_gib": (peaks[0] - before[0]) / GIB,
                 "build_reserved_peak_over_before_gib": (peaks[1] - before[1]) / GIB,
                 "reserved_after_build_gib": mem()[1] / GIB}
        try:   # one variant's failure (a kernel that does not build on this card) is reported, the rest still run
            if a.alternate:
                first, peak, _ = rollout_once(dec, ids, mask, sampling, V, device)
                res["variants"][name] = {**built, "first_s": first, "times_s": [], "peak_alloc_gib": peak}
                print(f"{name}: warm, first call {first:.2f} s", flush=True)
                warm[name] = (dec, v)
                continue
            row = res["variants"][name] = {**built, **rollout_row(model, dec, ids, mask, sampling, V, a.repeats,
                                                                  device)}
        except Exception as e:
            res["errors"][name] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"{name}: failed: {res['errors'][name]}", flush=True)
            dec.release()
            continue
        if gpu and a.profile:
            path = os.path.join(a.out, f"profile-{name.replace(' ', '-')}.txt")
            profile_one(dec, ids, mask, sampling, V, device, path)
        print(f"{name}: {json.dumps(row)}", flush=True)
        dec.release()
        del dec
    last = {}
    for r in range(a.repeats if warm else 0):                   # --alternate: one rollout of each per round
        for (name, (dec, v)), mode in [(w, m) for w in warm.items() for m in (modes if r % 2 == 0 else modes[::-1])]:
            settle(v)
            os.environ[env] = mode
            if mode == "1" and len(modes) > 1:
                name = f"{name} {label}"
                same = {k: x for k, x in res["variants"][name.split(" +")[0]].items() if k != "median_s"}  # its build
                res["variants"].setdefault(name, {**same, "times_s": []})
            try:
                t, peak, last[name] = rollout_once(dec, ids, mask, sampling, V, device)
            except Exception as e:
                res["errors"][name] = f"{type(e).__name__}: {str(e)[:500]}"
                continue
            row = res["variants"][name]
            row["times_s"].append(t)
            row["median_s"] = statistics.median(row["times_s"])
            row["peak_alloc_gib"] = max(peak, row["peak_alloc_gib"])
            print(f"round {r}: {name} {t:.3f} s", flush=True)
        write(res, a.out, quiet=True)
        print("".join(line for line in open(os.path.join(a.out, "lora_decode.md")) if "x the rollout" in line),
              flush=True)                                       # the ratios so far
    for name, out in last.items():
        res["variants"][name].update(gap_row(model, ids, out))
    for k, before in envs_before.items():
        if before is None:
            os.environ.pop(k)
        else:
            os.environ[k] = before
    write(res, a.out)


def settle(v: tuple):
    """Set the module switches variant v was built (or is to be built) under: read when its step is traced or
    refreshed."""
    from engines import decode_weights
    from kernels import fp8
    decode_weights.PACK, decode_weights.LOW_RANK, decode_weights.FP8_REFRESH = v[2], v[3], v[5]
    fp8.GEMM = v[4]


def write(res: dict, out: str, quiet: bool = False):
    with open(os.path.join(out, "lora_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"LoRA rollout, {res['shape']} shape, r={res['r']}, {res['device']}; model {res['model_gib']:.2f} GiB", "",
             "| variant | rollout median s | first s | peak alloc GiB | build s | build peak over model GiB "
             "(reserved) | logprob gap max / mean | tis=token mean weight, truncated | tis=mask dropped |",
             "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, k, spec: format(v[k], spec) if k in v else "-"      # a row in the making lacks some
    lines += [f"| {n} | {f(v, 'median_s', '.3f')} | {v['first_s']:.2f} | {v['peak_alloc_gib']:.2f} "
              f"| {v['build_s']:.2f} "
              f"| {v['build_peak_over_model_gib']:.3f} ({v['build_reserved_peak_over_before_gib']:.3f}) "
              f"| {f(v, 'logprob_gap_max', '.3f')} / {f(v, 'logprob_gap_mean', '.4f')} | "
              f"{f(v, 'tis_token_weight_mean', '.3f')}, {f(v, 'tis_truncated_frac', '.1%')} | "
              f"{f(v, 'tis_mask_dropped_frac', '.1%')} |"
              for n, v in res["variants"].items()]
    v = res["variants"]
    base = next((b for b in ("in_place packed addmm", "fused") if b in v), None)   # W6's route, else the default
    ratio = lambda n, d: f"\n{n} / {d}: {v[n]['median_s'] / v[d]['median_s']:.3f}x the rollout"
    has = lambda n: n in v and "median_s" in v[n]
    fp8s = ("fp8", "fp8 scaled_mm", "fp8 torch-refresh", "fp8_all")
    lines += [ratio(n, base) for n in fp8s if base and has(n) and has(base)]
    for sp in (" +shared prefill", " +graph prefill"):    # the rows of --shared-prefill both, --graph-prefill both
        lines += [ratio(n + sp, base + sp) for n in fp8s if base and has(n + sp) and has(base + sp)]
        lines += [ratio(n, n[:-len(sp)]) for n in v if n.endswith(sp) and has(n) and has(n[:-len(sp)])]
    lines += [f"\n{n}: failed: {e}" for n, e in res["errors"].items()]
    with open(os.path.join(out, "lora_decode.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
