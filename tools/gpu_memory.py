"""Per-stage GPU memory of full fine-tuning with the offload options off and on (issue 22), in one command.

    python tools/gpu_memory.py --shape 1.5b --out mem-1.5b                  # 1 GPU: offload options off, on
    python tools/gpu_memory.py --shape 7b --gpus 2 --steps 2 --out mem-7b --variants 'stream=offload_optimizer=true' \\
        --set 'micro_batch_size=32 grad_checkpointing=true'            # FSDP2 on 2 GPUs (docs/lora.md has both)
    python tools/gpu_memory.py --shape small --steps 1 --out /tmp/m            # the same code at toy shapes, CPU
    python tools/gpu_memory.py --shape w1 --steps 6 --set 'compile=true' --variants \\
        'hand=micro_batch_size=32 grad_checkpointing=true;b19=memory_budget_gib=19.1 micro_batch_size=0;b5=memory_budget_gib=5.32 micro_batch_size=0'
                                         # memory_budget_gib at TRL's two W1 peaks: predicted vs measured per stage

The model is a random Qwen2 built from a config in bf16 (tools/bench.py's build_model and its random-token task
and cheap reward): 1.5b is Qwen2.5-1.5B's shape (hidden 1536, MLP 8960, 28 layers, 12 / 2 heads, tied head), 7b
Qwen2.5-7B's (tools/bench.py's W6 shape), w1 Qwen2.5-0.5B's. The batch is W6's: 8 prompts x 8 samples, 64 + 256
tokens (w1: W1's 16 x 8). --set holds train.py settings for every variant (default: a KL reference, so
offload_models has a model to move); each variant adds its own. A variant is NAME=SETTINGS; variants are separated by ';'.
Checkpoints and final/ are not written (at 7B they would be 120 GB of disk and minutes of writing): each
variant's process replaces train.save, the final gather and save_final with no-ops. The step time is the median
over --steps steps after one warm-up; the stage table is the largest mem/<stage>_gib over the run (train.py
resets the peak at each phase), allocated / reserved, the largest over ranks.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (registers the task bench_random and the reward bench_cheap)

SHAPES = {
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tied=True),
    "7b": {k: v for k, v in bench.SHAPES["w6"].items()},
    "w1": bench.SHAPES["w1"],            # Qwen2.5-0.5B with W1's own batch (16 x 8), docs/benchmarks.md
    "small": bench.SHAPES["small"],
}
BATCH = dict(prompts=8, samples=8, prompt_len=64, new=256)
VARIANTS = "off=;on=offload_models=true offload_optimizer=true"
BASE = "algo.kl_coef=0.05 micro_batch_size=16 grad_checkpointing=true"
STAGES = ("rollout", "logprobs", "reward", "update", "sync")


def shape(name: str) -> dict:
    return {**SHAPES[name], **(BATCH if name in ("1.5b", "7b") else {})}


def child(a):
    """One variant, in this process (torchrun: one rank): train.main through tools/bench.py's part_ours."""
    import train
    train.save = lambda run, step: None                              # no checkpoints (see the docstring)
    train.distributed.full_state = lambda model, optimizer=None: ({}, {})
    train.run_dir.save_final = lambda *args, **kw: None
    a.variant, a.micro = "x", "16"                                   # part_ours' defaults; --set overrides them
    result = bench.part_ours(a)
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)


def run_variant(a, name: str, settings: str, model_dir: str, tmp: str) -> dict | None:
    launcher = [sys.executable] if a.gpus == "1" else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.gpus}"]
    args = [*launcher, __file__, "--part", "--shape", a.shape, "--model", model_dir, "--tmp", os.path.join(tmp, name),
            "--out", a.out, "--gpus", a.gpus, "--steps", str(a.steps), "--set", f"eval_size=16 {a.set} {settings}"]
    os.makedirs(os.path.join(tmp, name))
    # its own process group: at --timeout the launcher and every rank it started end together
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=a.timeout or None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nstopped after --timeout {a.timeout} s"
    with open(os.path.join(a.out, f"{name}.log"), "w") as f:
        f.write(" ".join(args) + "\n" + out + err)
    got = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not got:
        lines = [x for x in err.strip().splitlines() if "it/s]" not in x and "s/it]" not in x]
        print(f"{name}: failed: {(lines or ['no output'])[-1][:300]}", flush=True)
        return None
    return {**json.loads(got[-1][len("RESULT "):]), **predicted(out)}


def predicted(out: str) -> dict:
    """memory_budget_gib's log line (memory.apply_budget) -> its choice and predicted GiB per stage."""
    line = next((x for x in out.splitlines() if x.startswith("memory_budget_gib=")), None)
    if line is None:
        return {}
    stages = line.split("predicted peak GiB: ")[1].split(" (at")[0]
    return {"budget_choice": line.split(": ")[1].split(";")[0],
            "predicted_gib": {k: float(v) for k, v in (x.split() for x in stages.split(", "))}}


def report(results: dict, a) -> str:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"{a.shape} shape on {a.gpus} x {dev}, torch {torch.__version__}; --set '{a.set}'; median of "
             f"{a.steps} steps after 1 warm-up; peak GiB allocated / reserved by stage (largest over ranks)", "",
             "| variant | step s | rollout / logprobs / update / sync s | " + " | ".join(STAGES) + " |",
             "|---|---|---|" + "---|" * len(STAGES)]
    for name, (settings, r) in results.items():
        if r is None:
            lines.append(f"| {name} ({settings}) | failed | | " + " | " * len(STAGES))
            continue
        split = " / ".join(f"{r['split_s'][f'time/{s}']:.2f}" for s in ("rollout", "logprobs", "update", "sync"))
        peaks = [f"{r['stage_peaks_gib'].get(f'mem/{s}_gib', 0):.1f} / "
                 f"{r['stage_peaks_gib'].get(f'mem/{s}_reserved_gib', 0):.1f}" for s in STAGES]
        lines.append(f"| {name} ({settings}) | {r['step_s']:.2f} | {split} | " + " | ".join(peaks) + " |")
    budgeted = [(name, r) for name, (_, r) in results.items() if r and "predicted_gib" in r]
    if budgeted:   # memory_budget_gib's prediction (memory.py) against the allocated peaks above
        lines += ["", "| variant | memory_budget_gib chose | stage: predicted / measured allocated GiB |", "|---|---|---|"]
        for name, r in budgeted:
            pairs = [f"{s} {p:.1f} / {r['stage_peaks_gib'].get(f'mem/{s}_gib', 0):.2f}"
                     for s, p in r["predicted_gib"].items()]
            lines.append(f"| {name} | {r['budget_choice']} | {', '.join(pairs)} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--gpus", default="1")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--set", default=BASE)
    p.add_argument("--out", default="mem-out")
    p.add_argument("--timeout", type=float, default=0, help="seconds a variant may take (0 = no limit)")
    p.add_argument("--part", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    a = p.parse_args()
    bench.W.update(shape(a.shape))
    os.makedirs(a.out, exist_ok=True)
    if a.part:
        return child(a)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        bench.build_model(model_dir, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()                      # the build's 15 GB (7b) would stay reserved on GPU 0
        for variant in a.variants.split(";"):
            name, settings = variant.split("=", 1)
            results[name] = (settings, run_variant(a, name, settings, model_dir, tmp))
            text = report(results, a)
            with open(os.path.join(a.out, "memory.md"), "w") as f:
                f.write(text + "\n")
            with open(os.path.join(a.out, "memory.json"), "w") as f:
                json.dump(results, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
