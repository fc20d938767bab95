"""W4 (docs/benchmarks.md): multi-turn episodes on the built-in engine's fast path against the single-turn rollout of
the same length, and the portable multi-turn loop. tools/bench.py runs it as its part w4 and adds w4_table to its
report:

    python tools/bench.py --parts w4 --out OUT            # GPU (--fast-only: without the portable loop)
    python tools/bench.py --parts w4 --small --out OUT    # the same code at toy shapes, on CPU
    bash tools/gpu_w4.sh OUT                              # with the GPU tests of tests/test_multiturn.py
"""
import os
import statistics
import time

import torch

from bench_workload import W, cuda_info, load, prompt_texts, sync, timed
from registry import register


class BenchEcho:
    """W4's environment: answers every turn with `obs` digits (one token each under the bench tokenizer) and never
    ends an episode itself (env.max_turns does), so the work is fixed."""

    def __init__(self, obs: int = 16):
        self.obs = obs

    def reset(self, fields: dict) -> str:
        return fields["prompt"]

    def step(self, action: str):
        return "".join(str(1 + i % 9) for i in range(self.obs)), 0.0, False, {}


# the environment workers import it from this module by name (engines/multiturn.py: the env class's __module__)
register("env", "bench_echo")(BenchEcho)


def part_w4(a) -> dict:
    """W4: W1's 128 sequences as episodes of 4 turns of W['new'] / 4 tokens with 16-token observations between
    (engines/multiturn.py, cut_turns: the turns end at max_new_tokens), against W1's single-turn rollout of the
    same W['new'] tokens, in tokens/s of model-written tokens; the portable loop for reference."""
    from config import Config
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from engines.fast_decode import FastDecoder
    from engines.multiturn import MultiTurn
    from models import completion_logprobs, encode_prompts
    model, tok = load(a)
    gpu, turns = torch.cuda.is_available(), 4
    cfg = Config()
    cfg.max_new_tokens, obs = W["new"] // turns, 2 if a.small else 16
    cfg.env.name, cfg.env.args, cfg.env.max_turns = "bench_echo", f"obs={obs}", turns
    cfg.env.max_tokens, cfg.env.workers, cfg.env.memory_mb = W["new"] + turns * obs, 2, 0   # workers import torch
    texts = prompt_texts(128)[:W["prompts"]]
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    variants = [("multi-turn: fast path" + (" (graph + compile)" if gpu else " (eager, CPU)"), True),
                ("single-turn W1 rollout: fast path" + (" (graph + compile)" if gpu else " (eager, CPU)"), None),
                ("multi-turn: portable loop", False)]
    res = {}
    for name, fast in variants[:2] if a.fast_only else variants:
        env_s = []
        if fast is None:
            engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, fast=True)
            engine.decoder = FastDecoder(model, use_graph=gpu)
            fn = lambda: engine.generate(encode_prompts(tok, texts), W["samples"], SamplingParams(1.0, 1.0, W["new"]), gen)
        else:
            mt = MultiTurn(model, tok, cfg, fast=fast, cut_turns=True)
            mt.decoder = FastDecoder(model, use_graph=gpu) if fast else None
            run = mt.pool.run

            def timed_run(jobs, run=run):   # the environments' share of a rollout
                t0 = time.perf_counter()
                out = run(jobs)
                env_s[-1] += time.perf_counter() - t0
                return out
            mt.pool.run = timed_run
            fn = lambda: env_s.append(0.0) or mt.generate([], [{"prompt": t} for t in texts], W["samples"],
                                                           SamplingParams(1.0, 1.0, W["new"]), gen)
        first, times, r = timed(fn, a.repeats if fast is not False else 1)
        split = w4_split(mt, fn, model) if fast else None   # after the timed calls: its syncs cost a little
        if fast is not None:
            mt.close()
        C, written = r.completion_mask.shape[1], float(r.completion_mask.sum())
        with torch.no_grad():   # sampling log-probs vs the trainer's teacher-forced ones (bf16 on GPU)
            logp, _ = completion_logprobs(model, r.input_ids.to(model.device), r.attention_mask.to(model.device), C)
        diff = (logp.float().cpu() - r.logprobs).abs() * r.completion_mask
        res[name] = {"first_s": first, "times_s": times, "median_s": statistics.median(times),
                     "model_tokens": written, "model_tokens_per_s": written / statistics.median(times),
                     "sequence_len": C, "env_s_per_call": statistics.median(env_s[1:]) if env_s else None,   # after the warm-up
                     "turns": statistics.mean(r.info["turns"]) if fast is not None else 1, "split_s": split,
                     "logprob_diff_mean": float(diff.sum() / r.completion_mask.sum()), "logprob_diff_max": float(diff.max())}
    return {"w4": res, **cuda_info()}


def w4_split(mt, fn, model) -> dict:
    """Per-phase seconds of one more multi-turn rollout (a device sync at each phase's end; medians of 3), and with
    W4_PROFILE=1 a torch.profiler table of one rollout in $W4_PROFILE_OUT (default ./w4_profile.txt)."""
    from engines.fast_decode import OFF, Split
    runs = []
    for _ in range(3):
        mt.split = Split(next(model.parameters()).device, on=True)
        fn()
        runs.append(mt.split.times)
    mt.split = OFF
    if os.environ.get("W4_PROFILE") == "1" and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        with open(os.environ.get("W4_PROFILE_OUT", "w4_profile.txt"), "w") as f:
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                f.write(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in sorted({k for r in runs for k in r})}


def w4_table(results: dict) -> list[str]:
    """W4's rows and its ratio (docs/benchmarks.md: goal >= 0.7)."""
    res = results.get("w4", {}).get("w4", {})
    if not res:
        return []
    lines = ["", f"| W4: {W['prompts'] * W['samples']} sequences, {W['new']} model tokens each | median | first call | "
                 "model tokens/s | turns | env steps / call | logprob diff mean / max |", "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        env = f"{r['env_s_per_call']:.3f} s" if r["env_s_per_call"] is not None else ""
        lines.append(f"| {name} | {r['median_s']:.3f} s | {r['first_s']:.1f} s | {r['model_tokens_per_s']:,.0f} | "
                     f"{r['turns']:.1f} | {env} | {r['logprob_diff_mean']:.4f} / {r['logprob_diff_max']:.3f} |")
    for name, r in res.items():
        if r.get("split_s"):
            lines += ["", f"split of one {name} rollout (s, synchronised per phase, median of 3): " + ", ".join(
                f"{k} {v:.4f}" for k, v in r["split_s"].items()) + f"; sum {sum(r['split_s'].values()):.3f}"]
    multi, single = (next((r for k, r in res.items() if k.startswith(p)), None) for p in ("multi-turn: fast", "single"))
    if multi and single:
        lines += ["", f"W4 ratio, multi-turn / single-turn model tokens/s: **{multi['model_tokens_per_s'] / single['model_tokens_per_s']:.3f}** "
                      f"(goal >= 0.7; device {results['w4'].get('device', '?')})"]
    return lines
