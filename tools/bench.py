"""W1 and W6 benchmarks (docs/benchmarks.md): one GRPO step of this project's train.py against TRL, on one card.

    python tools/bench.py --out bench-out                  # GPU: all parts below, then a table (bench-out/bench.md)
    python tools/bench.py --small --out /tmp/b             # CPU smoke run of the same code at toy shapes
    python tools/bench.py --parts ours,engine --ours 16:ckpt:compile,32  # a subset (ours | engine | hf | trl); ours per variant
    python tools/bench.py --parts ours --ours 64 --gpus 1,2  # ours on 1 GPU, then under torchrun on 2 (the same global batch)
    python tools/bench.py --shape w6 --lora 16 --parts ours,trl --ours 8,32:ckpt --trl-ckpt --set 'lora.r=16'
                                                           # W6: 7B shape, LoRA r=16 on all linear layers, TRL with peft

Workload: a Qwen2 model at Qwen2.5-0.5B shape (random init, bf16, built here from a Qwen2Config: no hub),
16 prompts x 8 samples, prompts of 64 random tokens, 256 sampled tokens each, temperature 1 (--shape w6: the
Qwen2.5-7B shape, untied head, 8 prompts x 8 samples; --lora R gives TRL peft's LoraConfig(r=R, all-linear),
ours gets it from --set 'lora.r=R'). The tokenizer's
EOS id lies outside the model's vocabulary, so every completion runs to full length and the work is fixed.
Parts, each in its own process (clean peak-memory counters):
  ours    train.main itself (the real loop) for 1 warm-up + N measured steps; the split comes from its
          metrics.jsonl (time/rollout, time/reward, time/logprobs, time/update, time/sync; with several GPUs
          rank 0's). One run per --ours variant MICRO[:ckpt][:compile][:fused][:hf][:rep][:keepF][:kcX][:spX][:gpX]
          (micro_batch_size, grad_checkpointing, compile, fused_loss; hf = compiled_recompute=false: transformers'
          checkpoint wrapper; rep = parallel=replicate under torchrun; keepF = activation_budget=F, e.g. keep0.5;
          kcX = engine_keep_cache=X, e.g. kcfalse; spX = FAST_DECODE_SHARED_PREFILL=X, sp0 the per-row prefill;
          gpX = FAST_DECODE_GRAPH_PREFILL=X, gp0 the eager prefill; the default replays it from a CUDA graph when
          the state is kept)
          and per --gpus count (above 1: under torchrun, FSDP2 unless rep, N shares of the batch). With
          FAST_DECODE_TIMES=1 each part's log holds every rollout's split (engines/fast_decode.py: Clock)
  engine  the built-in engine alone on the same batch: fast path (graph + compile) with each attention, with the
          cache kept between calls, and the plain loop;
          sampling log-probs vs teacher-forced ones; a torch.profiler summary of one rollout and one update
  w4      W4 (not in the default --parts; tools/bench_w4.py): multi-turn episodes on the fast path against the
          single-turn rollout of the same length, and the portable multi-turn loop (not with --fast-only);
          `bash tools/gpu_w4.sh OUT` runs it with the GPU tests of tests/test_multiturn.py
  hf      transformers `generate`, default (dynamic) cache and cache_implementation="static"
  trl     TRL's GRPOTrainer with W1's peer settings (docs/benchmarks.md), when trl is importable; --trl-ckpt also
          runs it with gradient checkpointing
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root: tools/ import the project
import torch

from bench_w4 import part_w4, w4_table
from bench_workload import SHAPES, W, build_model, cuda_info, load, prompt_texts, sync, timed
from registry import register

GOALS = {"w1": 0.15, "w6": 0.25}   # ours / TRL step time (docs/benchmarks.md)


def random_prompts(_cfg):
    """Train and held-out sets of random-token prompts (the bench's task; no answers: the reward is synthetic)."""
    return [{"prompt": p} for p in prompt_texts(128)], [{"prompt": p} for p in prompt_texts(128, seed=1)]


def cheap_reward(prompt: str, completion: str, **_) -> float:
    """Varies between samples (so advantages are non-zero) and costs microseconds."""
    return completion.count("1") / (1 + len(completion))


# Registered by the module 'bench' only (see the bottom): reward workers import a reward by its module's name,
# and a worker cannot import '__main__' (every reward failed to start while the script registered them itself).
if __name__ != "__main__":
    register("task", "bench_random")(random_prompts)
    register("reward", "bench_cheap")(cheap_reward)


# --- parts -------------------------------------------------------------------------------------------
def part_ours(a) -> dict:
    import train
    for name, env in (("sp", "FAST_DECODE_SHARED_PREFILL"), ("gp", "FAST_DECODE_GRAPH_PREFILL")):
        if flag(a.variant, name):   # this part's process only: read by the decoder at each rollout
            os.environ[env] = flag(a.variant, name)
    run_dir = os.path.join(a.tmp, f"ours-{a.variant.replace(':', '-')}-np{a.gpus}")   # its own: a reused one resumes
    argv = [f"model={a.model}", "task=bench_random", "rewards=bench_cheap", f"steps={a.steps + 1}",
            f"prompts_per_step={W['prompts']}", f"samples_per_prompt={W['samples']}", f"max_new_tokens={W['new']}",
            "temperature=1.0", "eval_every=100000", "eval_size=128", "eval_temperature=1.0", "lr=1e-6",
            f"micro_batch_size={a.micro}", f"grad_checkpointing={'ckpt' in a.variant}",
            f"compile={'compile' in a.variant}", f"fused_loss={'fused' in a.variant}", f"out_dir={run_dir}",
            f"compiled_recompute={'hf' not in a.variant.split(':')}",
            f"parallel={'replicate' if 'rep' in a.variant.split(':') else 'fsdp'}",
            f"activation_budget={keep(a.variant)}",
            *([f"engine_keep_cache={flag(a.variant, 'kc')}"] if flag(a.variant, "kc") else []),
            "progress=false", *a.set.split()]
    train.main(argv)
    for name in sorted(os.listdir(run_dir)):   # profile_step=N in --set: each rank's summary and trace beside the logs
        if name.startswith("profile-rank") and name.endswith((".txt", ".json.gz")):
            shutil.copy(os.path.join(run_dir, name), os.path.join(a.out, f"{os.path.basename(run_dir)}-{name}"))
    mem = cuda_info()
    if torch.distributed.is_initialized():   # torchrun: every rank's peak memory, then rank 0 alone reports
        per_rank, rank = [None] * torch.distributed.get_world_size(), torch.distributed.get_rank()
        torch.distributed.all_gather_object(per_rank, mem)
        torch.distributed.destroy_process_group()
        if rank:
            return None
        mem = {**mem, **{k: max(m[k] for m in per_rank) for k in mem if k.startswith("peak")},
               "peak_alloc_gib_per_gpu": [m.get("peak_alloc_gib", 0.0) for m in per_rank]}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    stages = {k: max(r[k] for r in rows if k in r) for k in sorted({k for r in rows for k in r if k.startswith("mem/")})}
    if stages:   # train.py resets the peak counters per phase (profiling.phase): the run's peak is the largest
        mem["peak_alloc_gib"] = max([mem["peak_alloc_gib"]] + [v for k, v in stages.items() if "reserved" not in k])
        mem["peak_reserved_gib"] = max([mem["peak_reserved_gib"]] + [v for k, v in stages.items() if "reserved" in k])
    rows = [r for r in rows if r["step"] >= 2]   # drop step 0 (the evaluation) and step 1 (the warm-up)
    keys = ["time/rollout", "time/reward", "time/logprobs", "time/update", "time/sync"]
    # mode=async: the phases overlap across ranks; the trainer's wall time per step is the period (async_rl.py)
    steps = [r["time/step"] if "time/step" in r else sum(r[k] for k in keys) for r in rows]
    med = statistics.median(steps)
    setting = dict(x.split("=", 1) for x in argv)   # the last one wins, as in train.py (--set may override)
    tokens = (int(setting["prompts_per_step"]) * int(setting["samples_per_prompt"])
              * (W["prompt_len"] + int(setting["max_new_tokens"])))
    return {"argv": argv, "step_s": med, "steps_s": steps, "tokens_per_s": tokens / med,
            "split_s": {k: statistics.median(r[k] for r in rows) for k in keys},
            "logprob_mismatch_max": [r.get("logprob_mismatch/max") for r in rows],   # absent: not measured (async)
            # the same seed samples the same first batch: variants that change speed only agree on these
            "loss": [r.get("loss") for r in rows], "grad_norm": [r.get("grad_norm") for r in rows],
            "nproc": int(a.gpus),
            "stage_peaks_gib": stages, **mem}


def part_engine(a) -> dict:
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from engines.fast_decode import FastDecoder
    from models import completion_logprobs, encode_prompts
    model, tok = load(a)
    prompts = encode_prompts(tok, prompt_texts(128)[:W["prompts"]])
    sampling = SamplingParams(1.0, 1.0, W["new"])
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    new_tokens = W["prompts"] * W["samples"] * W["new"]
    res, engines = {}, {}
    fast = dict(fast=True)
    variants = [("fast: graph + compile (default)", fast, {}),
                ("fast: graph + compile, sdpa attention", fast, dict(attention="sdpa")),
                ("fast: graph + compile, matmul attention", fast, dict(attention="matmul")),
                ("fast: graph + compile, cache kept between calls", fast, dict(keep_cache=True)),
                ("plain loop (dynamic cache)", dict(fast=False), {})]
    if not torch.cuda.is_available():
        variants = [("fast: eager (CPU)", fast, dict(use_graph=False)), variants[-1]]
    if a.fast_only:                     # the plain loop takes ~20 s and its figure is known
        variants = variants[:-1]
    for name, kw, dec_kw in variants:
        engine = engines[name] = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, **kw)
        if kw["fast"]:
            engine.decoder = FastDecoder(model, **dec_kw)
        first, times, r = timed(lambda: engine.generate(prompts, W["samples"], sampling, gen),
                                a.repeats if kw["fast"] else 1)
        C = r.completion_mask.shape[1]
        with torch.no_grad():   # engine log-probs vs the trainer's teacher-forced ones, in bf16 on GPU
            logp, _ = completion_logprobs(model, r.input_ids.to(model.device), r.attention_mask.to(model.device), C)
        diff = (logp.float().cpu() - r.logprobs).abs() * r.completion_mask
        res[name] = {"first_s": first, "times_s": times, "median_s": statistics.median(times),
                     "new_tokens_per_s": new_tokens / statistics.median(times), "completion_len": C,
                     "logprob_diff_mean": float(diff.sum() / r.completion_mask.sum()),
                     "logprob_diff_max": float(diff.max())}
    if torch.cuda.is_available():   # profile the first engine again: a new one would compile again
        res["profile"] = profile(a, model, engines[variants[0][0]], prompts, sampling, gen)
    return {"engine": res, **cuda_info()}


def profile(a, model, engine, prompts, sampling, gen) -> dict:
    """Kernel-time summary of one rollout and one update micro-batch, written to profile.txt."""
    from torch.profiler import ProfilerActivity, profile as prof
    from models import completion_logprobs
    r = engine.generate(prompts, W["samples"], sampling, gen)
    out, lines = {}, []
    mb = int(a.micro) or len(r.input_ids)
    ids, mask = r.input_ids[:mb].cuda(), r.attention_mask[:mb].cuda()
    C = r.completion_mask.shape[1]

    def update():
        logp, ent = completion_logprobs(model, ids, mask, C)
        (-logp.mean()).backward()
        model.zero_grad(set_to_none=True)
    update()
    for name, fn in [("rollout", lambda: engine.generate(prompts, W["samples"], sampling, gen)),
                     (f"update micro-batch of {mb}", update)]:
        sync()
        t0 = time.perf_counter()
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            fn()
            sync()
        wall = time.perf_counter() - t0
        events = [e for e in p.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
        total = sum(e.self_device_time_total for e in events) / 1e6
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
        out[name] = {"wall_s_profiled": wall, "gpu_kernel_s": total,
                     "top": [(e.key[:90], e.self_device_time_total / 1e6, e.count) for e in top]}
        lines.append(f"== {name}: wall {wall:.3f} s (profiled), GPU kernel time {total:.3f} s")
        lines += [f"{t:8.4f} s  x{c:<6d} {k}" for k, t, c in out[name]["top"]]
    with open(os.path.join(a.out, "profile.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def part_hf(a) -> dict:
    model, tok = load(a)
    ids = tok(prompt_texts(128)[:W["prompts"]], return_tensors="pt")["input_ids"].repeat_interleave(W["samples"], 0)
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)
    res = {}
    variants = [("hf generate, default cache", {}), ("hf generate, static cache", {"cache_implementation": "static"})]
    for name, kw in variants[:1] if a.fast_only else variants:          # static: ~30 s more, its figure is known
        fn = lambda: model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                    top_p=1.0, max_new_tokens=W["new"], pad_token_id=tok.pad_token_id,
                                    eos_token_id=tok.eos_token_id, **kw)
        first, times, out = timed(fn, a.repeats_hf)
        res[name] = {"first_s": first, "times_s": times, "median_s": statistics.median(times),
                     "new_tokens_per_s": ids.numel() // W["prompt_len"] * W["new"] / statistics.median(times),
                     "completion_len": out.shape[1] - ids.shape[1]}
    return {"engine": res, **cuda_info()}


def part_trl(a) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    model, tok = load(a)
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            sync()
            ends.append(time.perf_counter())

    def reward(prompts, completions, **_):
        return [cheap_reward(p, c) for p, c in zip(prompts, completions)]
    gpu = torch.cuda.is_available()
    args = GRPOConfig(output_dir=os.path.join(a.tmp, "trl"), per_device_train_batch_size=W["prompts"] * W["samples"] // 4,
                      gradient_accumulation_steps=4, num_generations=W["samples"], beta=0.0, bf16=gpu, use_cpu=not gpu,
                      max_completion_length=W["new"], temperature=1.0, max_steps=a.steps + 1, learning_rate=1e-6,
                      logging_steps=1, report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0,
                      gradient_checkpointing="ckpt" in a.variant)
    peft_config = None
    if a.lora:   # the same adapters as ours: lora.r=R, lora.alpha=32 (its default), every linear layer but the head
        from peft import LoraConfig
        peft_config = LoraConfig(r=a.lora, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok, peft_config=peft_config,
                          train_dataset=Dataset.from_dict({"prompt": prompt_texts(128)}), callbacks=[Clock()])
    sync()
    ends.append(time.perf_counter())
    trainer.train()
    steps = [b - a_ for a_, b in zip(ends, ends[1:])][1:]                        # drop the warm-up step
    med = statistics.median(steps)
    lens = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": med, "steps_s": steps, "tokens_per_s": W["prompts"] * W["samples"] *
            (W["prompt_len"] + W["new"]) / med, "completion_len": lens, "config": {
                k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                              "num_generations", "beta", "bf16", "max_completion_length",
                                              "gradient_checkpointing", "loss_type")}, **cuda_info()}


PARTS = {"ours": part_ours, "w4": part_w4, "engine": part_engine, "hf": part_hf, "trl": part_trl, "trl-ckpt": part_trl}


def keep(variant: str) -> str:
    """A variant's activation_budget: its keepF flag's F, else 0."""
    return next((f[len("keep"):] for f in variant.split(":") if f.startswith("keep")), "0")


def flag(variant: str, name: str) -> str:
    """The value of a variant's flag NAME<value> (kcfalse -> "false"), else ""."""
    return next((f[len(name):] for f in variant.split(":")[1:] if f.startswith(name)), "")


def describe(variant: str) -> str:
    micro, *flags = variant.split(":")
    return (f"micro_batch_size={micro}, grad_checkpointing={'ckpt' in flags}, compile={'compile' in flags}"
            + (", fused_loss=True" if "fused" in flags else "") + (", compiled_recompute=False" if "hf" in flags else "")
            + (", parallel=replicate" if "rep" in flags else "")
            + (f", activation_budget={keep(variant)}" if keep(variant) != "0" else "")
            + (f", engine_keep_cache={flag(variant, 'kc')}" if flag(variant, "kc") else "")
            + (f", FAST_DECODE_SHARED_PREFILL={flag(variant, 'sp')}" if flag(variant, "sp") else "")
            + (f", FAST_DECODE_GRAPH_PREFILL={flag(variant, 'gp')}" if flag(variant, "gp") else ""))


def table(results: dict, a) -> str:
    """The report: step time against TRL, the split, and the engine against transformers' generate."""
    trl = results.get("trl", {})
    ours_runs = {k: r for k, r in results.items() if k.startswith("ours") and "step_s" in r}
    dev = next((r["device"] for k, r in results.items() if k != "_errors" and "device" in r), "?")
    lines = [f"# {a.shape.upper()} on {dev} (torch {torch.__version__}; {a.steps} measured steps after 1 warm-up"
             + (f"; LoRA r={a.lora}" if a.lora else "") + ")", "",
             "| | step (median) | tokens/s | peak alloc | peak reserved |", "|---|---|---|---|---|"]
    rows = [(f"this project (train.py), {describe(k[len('ours-'):].split('-np')[0])}"
             + (f", {r['nproc']} GPUs (torchrun, {'replicated' if ':rep' in k else 'FSDP2'})"
                if r.get("nproc", 1) > 1 else ""), r) for k, r in ours_runs.items()]
    trl_ckpt = results.get("trl-ckpt", {})
    for name, r in rows + [("TRL GRPOTrainer", trl), ("TRL GRPOTrainer, gradient_checkpointing=True", trl_ckpt)]:
        if "step_s" in r:
            lines.append(f"| {name} | {r['step_s']:.3f} s | {r['tokens_per_s']:,.0f} | "
                         f"{r.get('peak_alloc_gib', 0):.1f} GiB | {r.get('peak_reserved_gib', 0):.1f} GiB |")
    lines += [f"| {name} | failed: {err} | | | |" for name, err in results.get("_errors", {}).items()]
    for k, r in ours_runs.items():   # several GPUs against the same variant on one, from this same command
        one = ours_runs.get(k.split("-np")[0])
        if r.get("nproc", 1) > 1 and one:
            lines += ["", f"{r['nproc']} GPUs / 1 GPU step time ({describe(k[len('ours-'):].split('-np')[0])}): "
                          f"**{r['step_s'] / one['step_s']:.3f}**; peak alloc per GPU "
                          f"{[round(x, 1) for x in r.get('peak_alloc_gib_per_gpu', [])]} GiB"]
    fits = [r for r in ours_runs.values() if "step_s" in trl and r.get("peak_alloc_gib", 0) <= trl.get("peak_alloc_gib", 0)]
    ours = min(fits or list(ours_runs.values()) or [{}], key=lambda r: r.get("step_s", 1e9))
    if "step_s" in ours and "step_s" in trl:
        lines += ["", f"ratio ours / TRL step time: **{ours['step_s'] / trl['step_s']:.3f}** (goal <= {GOALS.get(a.shape, 0.15)}; fastest "
                      f"of ours {'within' if fits else 'OVER'} TRL's peak memory); speed-up {trl['step_s'] / ours['step_s']:.1f}x"]
    for k, r in ours_runs.items():
        if r.get("stage_peaks_gib"):
            lines += ["", f"peak allocated / reserved by stage, {describe(k[len('ours-'):].split('-np')[0])}: " + ", ".join(
                f"{s[4:-4]} {v:.1f}" + (f" / {r['stage_peaks_gib'].get(s[:-4] + '_reserved_gib', 0):.1f}")
                for s, v in r["stage_peaks_gib"].items() if "reserved" not in s) + " GiB"]
    if "split_s" in ours:
        lines += ["", "split of our step (medians, s): " + ", ".join(
            f"{k.split('/')[1]} {v:.3f}" for k, v in ours["split_s"].items()),
            f"logprob_mismatch max (engine vs trainer, per step): {[None if x is None else round(x, 4) for x in ours['logprob_mismatch_max']]}"]
    engines = {**results.get("engine", {}).get("engine", {}), **results.get("hf", {}).get("engine", {})}
    engines.pop("profile", None)
    if engines:
        base = engines.get("hf generate, default cache", {}).get("median_s")
        lines += ["", f"| generate {W['prompts'] * W['samples']} x {W['new']} tokens | median | first call | new tokens/s | vs HF default | "
                      "completion len | logprob diff mean / max |", "|---|---|---|---|---|---|---|"]
        for name, r in engines.items():
            vs = f"{base / r['median_s']:.1f}x" if base else ""
            diff = f"{r['logprob_diff_mean']:.4f} / {r['logprob_diff_max']:.3f}" if "logprob_diff_mean" in r else ""
            lines.append(f"| {name} | {r['median_s']:.3f} s | {r['first_s']:.1f} s | {r['new_tokens_per_s']:,.0f} | "
                         f"{vs} | {r['completion_len']} | {diff} |")
    prof = results.get("engine", {}).get("engine", {}).get("profile")
    if prof:
        lines += [""] + [f"profile {k}: wall {v['wall_s_profiled']:.3f} s, GPU kernels {v['gpu_kernel_s']:.3f} s; top: "
                         + "; ".join(f"{n[:40]} {t:.3f}s" for n, t, _ in v["top"][:4]) for k, v in prof.items()]
    lines += w4_table(results)
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, logs, profile.txt")
    p.add_argument("--parts", default="ours,engine,hf,trl", help="comma list of: " + ", ".join(PARTS))
    p.add_argument("--small", action="store_true", help="toy shapes (CPU smoke run)")
    p.add_argument("--shape", default="w1", choices=["w1", "w6"], help="w1: Qwen2.5-0.5B shape; w6: Qwen2.5-7B shape")
    p.add_argument("--lora", type=int, default=0, help="TRL's LoRA rank (peft, all linear layers); 0 = full fine-tune")
    p.add_argument("--trl-ckpt", action="store_true", help="also run TRL with gradient checkpointing")
    p.add_argument("--steps", type=int, default=4, help="measured steps (after one warm-up step)")
    p.add_argument("--ours", default="128:ckpt:compile,32:ckpt:compile:kcfalse",   # 32: TRL's checkpointed memory
                   help="comma list of variants MICRO[:ckpt][:compile][:fused][:hf][:rep][:keepF][:kcX][:spX][:gpX]: "
                        "micro_batch_size, grad_checkpointing, compile, fused_loss, compiled_recompute=false, "
                        "parallel=replicate, activation_budget=F, engine_keep_cache=X, FAST_DECODE_SHARED_PREFILL=X, "
                        "FAST_DECODE_GRAPH_PREFILL=X "
                        "(default: W1's headline, one pass over its 128 samples, then the setting within TRL's "
                        "checkpointed memory)")
    p.add_argument("--micro", default="16", help=argparse.SUPPRESS)      # internal: one variant's parts
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--set", default="", help="more train.py settings for ours, e.g. 'profile_step=3 offload=true'")
    p.add_argument("--gpus", default="1", help="GPUs for ours (torchrun processes above 1); a comma list runs ours for each")
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls per engine variant")
    p.add_argument("--repeats-hf", type=int, default=2, help="timed transformers generate calls")
    p.add_argument("--fast-only", action="store_true", help="engine part: the fast-path variants, not the plain loop")
    p.add_argument("--part", help=argparse.SUPPRESS)        # internal: run one part in this process
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    a = p.parse_args()
    W.update(SHAPES["small" if a.small else a.shape])
    if a.trl_ckpt and "trl" in a.parts.split(","):
        a.parts += ",trl-ckpt"
    os.makedirs(a.out, exist_ok=True)
    if a.part:                                             # child: one part, result as JSON on the last line
        print_result(PARTS[a.part](a))
        return
    unknown = set(a.parts.split(",")) - set(PARTS)
    if unknown:
        sys.exit(f"error: unknown part(s) {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}")
    results: dict = {"_errors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        build_model(model_dir, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        variants = a.ours.split(",")
        jobs = [(p_, v, n) for p_ in a.parts.split(",") for v in (variants if p_ == "ours" else [""] if p_ == "trl"
                else ["ckpt"] if p_ == "trl-ckpt" else variants[:1]) for n in (a.gpus.split(",") if p_ == "ours" else ["1"])]
        for part, variant, nproc in jobs:
            key = (f"ours-{variant}" + (f"-np{nproc}" if nproc != "1" else "")) if part == "ours" else part
            micro = variant.split(":")[0]
            if part.startswith("trl"):
                try:
                    import trl  # noqa: F401
                except ImportError:
                    results["_errors"]["TRL GRPOTrainer"] = "trl is not importable here"
                    continue
            args = [*launcher(nproc), __file__, "--part", part, "--model", model_dir, "--tmp", tmp, "--out", a.out,
                    "--gpus", nproc, "--steps", str(a.steps), "--micro", micro, "--variant", variant,
                    "--repeats", str(a.repeats), "--set", a.set, "--shape", a.shape, "--lora", str(a.lora),
                    "--repeats-hf", str(a.repeats_hf)] + (["--small"] if a.small else []) + \
                   (["--fast-only"] if a.fast_only else [])
            t0 = time.perf_counter()
            log = os.path.join(a.out, f"{key.replace(':', '-')}.log")   # ':' cannot travel back
            result, err = run_part(args, log)
            if err is not None:
                results["_errors"]["TRL GRPOTrainer" if part.startswith("trl") else key] = err
                print(f"part {key} failed ({time.perf_counter() - t0:.0f} s): {err}", flush=True)
                continue
            results[key] = result
            print(f"part {key} done in {time.perf_counter() - t0:.0f} s", flush=True)
            write_report(a.out, "bench", results, table(results, a))   # after each part: a run cut short still reports
    print(write_report(a.out, "bench", results, table(results, a)))


# --- the runner: each part in a process of its own (clean peak-memory counters), its result as the last line of
# its output. tools/bench_w5x4.py runs its placements with it too.
def launcher(nproc) -> list[str]:
    """The command that starts a part: python, or torchrun with nproc processes on this host."""
    return [sys.executable] if int(nproc) == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def print_result(result: dict | None):
    """A part's result as its output's last line, for result_of; None (torchrun's ranks but 0) prints nothing."""
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)


def result_of(output: str) -> dict | None:
    """The result a part printed (print_result), or None if it printed none."""
    got = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(got[-1][len("RESULT "):]) if got else None


def run_part(args: list[str], log: str, env: dict | None = None) -> tuple[dict | None, str | None]:
    """Run a part's command (args), its whole output into the file log. -> (its result, None), or (None, why it
    failed: the last line of its stderr that is not a progress bar, as tqdm's lines end a crashed trainer's)."""
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    result = result_of(proc.stdout)
    if proc.returncode == 0 and result is not None:
        return result, None
    lines = [x for x in proc.stderr.strip().splitlines() if "it/s]" not in x and "s/it]" not in x]
    return None, (lines or ["no output"])[-1][:200]


def write_report(out: str, name: str, results: dict, text: str) -> str:
    """The results as OUT/<name>.json, the report's text as OUT/<name>.md; -> the text."""
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    import bench   # this file again, as the module 'bench': it registers the task and reward under that name
    bench.main()
