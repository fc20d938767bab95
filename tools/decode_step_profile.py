"""W1's rollout on the fast decoder, variants of its decode step against each other in one process, one GPU:

    python tools/decode_step_profile.py --out OUT [--variants base,advance] [--rounds 2] [--profile]

The model is a random Qwen2 at W1's shape (tools/bench_w10.py's qwen2: Qwen2.5-0.5B, 128 sequences of 64 prompt
tokens, 256 new tokens, bf16). Each variant is a FastDecoder with the cache kept between calls (graph +
compile, as the engine's default); variants take turns, `--rounds` times `--repeats` timed rollouts each after a
warm-up, so a drift of the card's clock hits all alike. A variant sets the step's switches before its decoder's
first capture: base = fast_decode.COMPILE_ADVANCE off (the step before issue 38 item 2: the bookkeeping after the
sampler eager), advance = on (the default: compiled with the step). --profile:
torch.profiler over 20 replays of each variant's decode graph, kernels by name with calls per token step and time per call
(OUT/profile_<variant>.txt, + as -). Also each variant's sampling log-probs against teacher forcing (mean / max |diff|).
Writes OUT/decode_step.md and prints it.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

VARIANTS = {"base": False, "advance": True}   # fast_decode.COMPILE_ADVANCE


def build():
    """W10's qwen2 (tools/bench_w10.py: W1's random Qwen2.5-0.5B shape, bf16 on the GPU) and W1's prompts."""
    import bench_w10
    model_type, fields, _ = bench_w10.MODELS["qwen2"]
    model, W = bench_w10.build(model_type, fields, False, "cuda", torch.bfloat16), bench_w10.WORK
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (W["prompts"] * W["samples"], W["prompt_len"]), generator=g).cuda()
    return model, ids, W


def decoder(model, variant: str):
    import engines.fast_decode as fd
    fd.COMPILE_ADVANCE = VARIANTS[variant]                            # read when the decoder is built
    return fd.FastDecoder(model, keep_cache=True)


def kernel_table(prof, steps: int) -> list[str]:
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    lines = [f"GPU kernel time {total / 1e3:.2f} ms over {steps} token steps: {total / steps:.1f} us a step; "
             f"{sum(e.count for e in events) / steps:.1f} kernels a step",
             "calls/step | us/call | ms total | kernel"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total):
        lines.append(f"{e.count / steps:10.2f} | {e.self_device_time_total / e.count:7.2f} | "
                     f"{e.self_device_time_total / 1e3:8.2f} | {e.key[:140]}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="base,advance", help=f"comma list of: {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts per variant per round")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    names = a.variants.split(",")
    if any(n not in VARIANTS for n in names):
        raise SystemExit(f"--variants takes {', '.join(VARIANTS)}; got {a.variants!r}")
    if not torch.cuda.is_available():
        raise SystemExit("decode_step_profile needs a CUDA GPU")
    os.makedirs(a.out, exist_ok=True)
    from engines.base import SamplingParams
    from models import completion_logprobs
    model, ids, W = build()
    mask = torch.ones_like(ids)
    sampling = SamplingParams(1.0, 1.0, W["new"])
    eos = model.config.vocab_size                                    # never sampled: every row writes 256 tokens
    decs, times, mism = {}, {n: [] for n in names}, {}
    for n in names:                                                  # build, compile, capture; the check
        decs[n] = decoder(model, n)
        gen = torch.Generator(device="cuda").manual_seed(0)
        comp, alive, logp, _ = decs[n].sample(ids, mask, sampling, eos, 0, gen)
        with torch.no_grad():
            tf, _ = completion_logprobs(model, torch.cat([ids, comp], 1), torch.cat([mask, alive.long()], 1),
                                        comp.shape[1])
        d = (tf.float() - logp).abs()[alive]
        mism[n] = (d.mean().item(), d.max().item())
        print(f"{n}: built; log-prob |diff| vs teacher forcing mean {mism[n][0]:.4f} max {mism[n][1]:.4f}", flush=True)
    for r in range(a.rounds):
        for n in names:
            for _ in range(a.repeats):
                gen = torch.Generator(device="cuda").manual_seed(r)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                decs[n].sample(ids, mask, sampling, eos, 0, gen)
                torch.cuda.synchronize()
                times[n].append(time.perf_counter() - t0)
            print(f"round {r} {n}: {[round(t, 4) for t in times[n][-a.repeats:]]}", flush=True)
    lines = [f"W1 rollout (128 x 256 new tokens after 64-token prompts, random Qwen2.5-0.5B shape, bf16) on "
             f"{torch.cuda.get_device_name()} (torch {torch.__version__}); `python tools/decode_step_profile.py "
             f"{' '.join(sys.argv[1:])}`", "", "| variant | median s | all s | log-prob vs teacher forcing mean / max |",
             "|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {statistics.median(times[n]):.4f} | {' '.join(f'{t:.4f}' for t in times[n])} | "
                     f"{mism[n][0]:.4f} / {mism[n][1]:.4f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "decode_step.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        steps = 20
        for n in names:                        # the decode step alone: replays of its graph from slot 0
            st = next(iter(decs[n].states.values()))
            decs[n]._rewind(st)
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(steps):
                    st["graph"].replay()
                torch.cuda.synchronize()
            table = kernel_table(p, steps)
            with open(os.path.join(a.out, f"profile_{n.replace('+', '-')}.txt"), "w") as f:
                f.write("\n".join(table) + "\n")
            print(f"== {n}\n" + "\n".join(table[:40]), flush=True)


if __name__ == "__main__":
    main()
