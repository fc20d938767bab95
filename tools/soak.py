"""Soak test: a long CPU run with the replay buffer and frequent checkpoints, RSS sampled throughout.

    python tools/soak.py                          # 500 steps, small config, prints RSS against step and its drift
    python tools/soak.py --steps 200 --model assets/tiny-model -- replay.priority=recency

Memory must stay flat: the replay buffer is bounded, checkpoints are written and pruned, logs go to disk. The run
is a train.py subprocess; its resident set size (VmRSS in /proc) is sampled every 0.5 s together with the number
of steps logged so far. The report gives RSS at a few points of the loop and its slope over the loop's second half;
the end of the run (saving final/, drawing curve.png with matplotlib) is reported apart.
Without --model it builds the tests' random 2-layer model in a temporary folder (no hub needed).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repo root


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--model", default="", help="model folder (default: a random tiny model)")
    ap.add_argument("--out", default="", help="run directory (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="extra train.py key=value options")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="soak-")
    model = args.model
    if not model:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import make_random_model
        model = make_random_model(os.path.join(tmp, "model"))
    out = args.out or os.path.join(tmp, "run")
    cmd = [sys.executable, "train.py", f"model={model}", f"out_dir={out}", f"steps={args.steps}",
           "prompts_per_step=4", "samples_per_prompt=4", "eval_every=100", "eval_size=16", "save_every=25",
           "keep_checkpoints=2", "replay.enabled=true", "replay.capacity=64", "replay.max_uses=2",
           "replay.priority=advantage", "algo.minibatch_size=8", "threads=1", "progress=false", *args.overrides]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []                                   # (seconds, steps logged, RSS MB)
    metrics = os.path.join(out, "metrics.jsonl")
    while proc.poll() is None:
        rss = rss_mb(proc.pid)
        steps = sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0
        if rss is not None:
            samples.append((time.time() - t0, steps, rss))
        time.sleep(0.5)
    if proc.returncode != 0:
        sys.exit(f"error: train.py exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
    wall = time.time() - t0
    running = [s for s in samples if 1 <= s[1] < args.steps]   # the loop: after step 1, before the end-of-run work
    print(f"{args.steps} steps in {wall:.0f} s ({wall / args.steps:.2f} s/step incl. start-up); "
          f"{len(samples)} RSS samples")
    print("step   RSS MB")
    for frac in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        s = running[min(len(running) - 1, int(frac * (len(running) - 1)))]
        print(f"{s[1]:>4}   {s[2]:.1f}")
    half = [s for s in running if s[1] >= args.steps // 2]
    n = len(half)
    mx, my = sum(s[1] for s in half) / n, sum(s[2] for s in half) / n
    slope = sum((s[1] - mx) * (s[2] - my) for s in half) / max(1e-9, sum((s[1] - mx) ** 2 for s in half))
    print(f"peak {max(s[2] for s in running):.1f} MB; min after step 1 {min(s[2] for s in running):.1f} MB; "
          f"second-half slope {slope * 100:+.2f} MB per 100 steps; end of run (final save, plot) peak "
          f"{max([s[2] for s in samples if s[1] >= args.steps] or [float('nan')]):.1f} MB")


if __name__ == "__main__":
    main()
