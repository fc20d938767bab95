"""Quick ablations: algorithms (or any config variants) x seeds on the same task, one plot and one table.

    python tools/ablate.py                                             # grpo, ppo, rloo, online_dpo x seeds 0,1,2
    python tools/ablate.py --runs grpo,dr_grpo,dapo --seeds 0,1 steps=40
    python tools/ablate.py --runs "grpo,grpo:algo.loss_agg=seq-mean-token-mean,grpo:algo.kl_coef=0.05"

Each entry of --runs is `algo[:key=value[:key=value]]`; its label is the entry itself. An algorithm with a
recipe in configs/<algo>.yaml gets it (`--config`), then the entry's overrides, then the trailing key=value
arguments, which apply to every run. Runs are `python train.py ...` subprocesses, --jobs at a time (default 2,
each with threads=1: one core each). Each run keeps its own directory <out>/<label>/seed<N>; a run whose
directory already holds final/ is not run again (delete it to rerun). The script writes:
    <out>/curves.png    held-out accuracy and train reward against step: mean over seeds, band = min..max
    <out>/results.md    per entry: held-out accuracy at start and end (mean +- std over seeds), wall time
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repo root


def run_dir(out: str, label: str, seed: int) -> str:
    safe = "".join(c if c.isalnum() or c in "._=-" else "_" for c in label.replace(":", "__"))
    return os.path.join(out, safe, f"seed{seed}")


def launch(entry: str, seed: int, out: str, common: list[str]) -> dict:
    """Run one train.py subprocess (or reuse a finished one); returns its rows and wall time."""
    algo, *overrides = entry.split(":")
    d = run_dir(out, entry, seed)
    recipe = os.path.join(ROOT, "configs", f"{algo}.yaml")
    argv = (["--config", recipe] if os.path.exists(recipe) else []) + [f"algo.name={algo}", *overrides, *common,
                                                                       f"seed={seed}", f"out_dir={d}", "threads=1",
                                                                       "progress=false"]
    wall_file = os.path.join(d, "wall_s")
    if not os.path.exists(os.path.join(d, "final")):
        os.makedirs(d, exist_ok=True)
        t0 = time.perf_counter()
        with open(os.path.join(d, "stdout.log"), "w") as log:
            r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT)
        if r.returncode != 0:
            raise RuntimeError(f"run {entry} seed {seed} failed (exit {r.returncode}); see {d}/stdout.log")
        with open(wall_file, "w") as f:
            f.write(f"{time.perf_counter() - t0:.1f}\n")
    rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    start, rows = rows[0], rows[1:]   # row 0: the held-out evaluation before training
    return {"entry": entry, "seed": seed, "rows": rows, "start_acc": start["eval/accuracy"],
            "wall_s": float(open(wall_file).read()) if os.path.exists(wall_file) else float("nan")}


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def report(results: list[dict], entries: list[str], out: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = [f"# Ablation: {title}", "",
             "| run | seeds | held-out acc. at start | held-out acc. at end (mean ± std) | best held-out acc. | "
             "wall time per run (s) |", "|---|---|---|---|---|---|"]
    for entry in entries:
        runs = [r for r in results if r["entry"] == entry]
        ev = [[(0, r["start_acc"])] + [(x["step"], x["eval/accuracy"]) for x in r["rows"] if "eval/accuracy" in x]
              for r in runs]
        n = min(len(e) for e in ev)
        steps = np.array([s for s, _ in ev[0][:n]])
        acc = np.array([[a for _, a in e[:n]] for e in ev])                                   # (seeds, evals)
        line, = ax_acc.plot(steps, acc.mean(0), "o-", label=entry)
        ax_acc.fill_between(steps, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.2)
        m = min(len(r["rows"]) for r in runs)
        rew = np.array([[x["reward"] for x in r["rows"][:m]] for r in runs])                   # (seeds, steps)
        ax_rew.plot(np.arange(1, m + 1), rew.mean(0), color=line.get_color(), label=entry)
        ax_rew.fill_between(np.arange(1, m + 1), rew.min(0), rew.max(0), color=line.get_color(), alpha=0.15)
        lines.append(f"| `{entry}` | {len(runs)} | {mean_std(acc[:, 0].tolist())} | {mean_std(acc[:, -1].tolist())} "
                     f"| {mean_std(acc.max(1).tolist())} | {statistics.mean(r['wall_s'] for r in runs):.0f} |")
    ax_acc.set(xlabel="step", ylabel="held-out accuracy", title="held-out accuracy (band: min..max over seeds)")
    ax_rew.set(xlabel="step", ylabel="train reward", title="train reward (mean over seeds)")
    for ax in (ax_acc, ax_rew):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    return text


def main(argv: list[str]) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--runs", default="grpo,ppo,rloo,online_dpo", help="comma-separated algo[:key=value...] entries")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (each uses one CPU thread)")
    p.add_argument("--out", default="runs/ablate", help="output directory")
    args, common = p.parse_known_args(argv)
    bad = [a for a in common if "=" not in a or a.startswith("-")]
    if bad:
        p.error(f"unexpected argument {bad[0]!r}: trailing arguments must be key=value overrides")
    entries = [e.strip() for e in args.runs.split(",") if e.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    os.makedirs(args.out, exist_ok=True)
    jobs = [(e, s) for e in entries for s in seeds]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda job: launch(*job, args.out, common), jobs))
    text = report(results, entries, args.out, " ".join(common) or "defaults")
    print(text + f"\nplot: {os.path.join(args.out, 'curves.png')}")
    return text


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
