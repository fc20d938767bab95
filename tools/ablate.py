"""Quick ablations with statistics: config variants x paired seeds, one plot and one table with confidence intervals.

    python tools/ablate.py                                             # grpo, ppo, rloo, online_dpo x seeds 0,1,2
    python tools/ablate.py --runs grpo,dr_grpo,dapo --seeds 0,1,2,3 steps=40
    python tools/ablate.py --runs "grpo,grpo:algo.loss_agg=seq-mean-token-mean,grpo:algo.kl_coef=0.05"
    python tools/ablate.py --runs grpo --kernels logprob=torch,triton device=cuda   # kernels, like algorithms

Each entry of --runs is `algo[:key=value[:key=value]]`; its label is the entry itself; the first entry (or
--baseline) is the baseline the others are compared with. An algorithm with a recipe in configs/<algo>.yaml gets
it (`--config`), then the entry's overrides, then the trailing key=value arguments, which apply to every run.
Every entry runs on the same seeds, so seed s of one entry and seed s of the baseline see the same data order
and the same held-out set: differences are taken per seed (paired), which cancels much of the seed-to-seed
spread. Runs are `python train.py ...` subprocesses, --jobs at a time (default: one per core, each threads=1).
--kernels OP=A,B,... compares implementations of one kernel op (kernels/__init__.py; the first is the baseline) on
the first --runs entry: its entries are `<run>:kernels.OP=A`, ...; the table's update-time column shows the speed
(time it on a GPU, --jobs 1), its accuracy columns that the learning is the same.

Resuming: each run has its own directory <out>/<label>/seed<N> and saves a checkpoint every --save-every steps;
a run whose directory holds final/ is not run again, an interrupted one continues from its checkpoint (delete
a directory to rerun it). Per run the script reads metrics.jsonl (row 0: the evaluation before training).

Statistics, per entry over its seeds: the mean and a 95% bootstrap confidence interval (resampling seeds,
10,000 draws, percentile) of the final held-out accuracy, the best one, and the area under the held-out
accuracy curve (AUC: the mean accuracy over the run, trapezoids over steps: sample efficiency). Against the
baseline: the mean paired difference with its bootstrap CI and a verdict: "better" or "worse" when the CI
excludes 0, else "indistinguishable with n seeds".
--target ACC[,ACC...] adds, per target, the steps each run took to first reach held-out accuracy >= ACC (at the
evaluations: set eval_every fine enough), with the same CIs and paired differences. A run that never reached it
is censored: shown as ">N" (its last evaluated step) and counted as "somewhere above N", so every mean and CI it
enters is computed as an interval and printed as a bound (">63.3", an open CI end "inf") instead of being dropped
or set to N (`steps_to`, `interval_ci`); the verdict is "fewer steps" or "more steps" when the CI of the paired
difference excludes 0. ACC may be a product, `0.95*0.86`: a fraction of a teacher's accuracy.
With 3 seeds a bootstrap CI is coarse (it can only be as wide as the seeds' spread): take a verdict of
"indistinguishable" as "needs more seeds", not "equal".
    <out>/curves.png    held-out accuracy (mean over seeds, band: 95% bootstrap CI) and train reward
    <out>/results.md    the table above, in markdown
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repo root
BOOTSTRAP = 10_000
REPORT_S = 20.0   # a line per running run this often: its latest step


def run_dir(out: str, label: str, seed: int) -> str:
    safe = "".join(c if c.isalnum() or c in "._=-" else "_" for c in label.replace(":", "__"))
    return os.path.join(out, safe, f"seed{seed}")


def latest_step(d: str) -> int | None:
    """The last step a run has logged (metrics.jsonl), or None before its first row."""
    try:
        with open(os.path.join(d, "metrics.jsonl")) as f:
            lines = [line for line in f if line.strip()]
        return json.loads(lines[-1])["step"] if lines else None
    except (OSError, ValueError, KeyError):   # not there yet, or a row half-written as we read
        return None


def wait(proc: subprocess.Popen, d: str, label: str) -> int:
    """Wait for a run, printing its latest step every REPORT_S seconds; -> its exit code."""
    last = time.monotonic()
    while proc.poll() is None:
        time.sleep(0.5)
        if time.monotonic() - last >= REPORT_S:
            last = time.monotonic()
            step = latest_step(d)
            print(f"  {label}: " + ("loading / evaluating step 0" if step is None else f"step {step}"), flush=True)
    return proc.returncode


def launch(entry: str, seed: int, out: str, common: list[str], save_every: int, progress: str = "") -> dict:
    """Run one train.py subprocess (or reuse a finished one, or continue an interrupted one); -> its rows.
    progress: '[i/n]' for the lines it prints as the run starts, goes and ends."""
    algo, *overrides = entry.split(":")
    d = run_dir(out, entry, seed)
    recipe = os.path.join(ROOT, "configs", f"{algo}.yaml")
    argv = (["--config", recipe] if os.path.exists(recipe) else []) + [f"algo.name={algo}", *overrides, *common,
                                                                       f"seed={seed}", f"out_dir={d}", "threads=1",
                                                                       "progress=false", f"save_every={save_every}"]
    wall_file = d + ".wall_s"
    if not os.path.exists(os.path.join(d, "final")):
        if os.path.isdir(d) and not os.path.isdir(os.path.join(d, "checkpoints")):
            shutil.rmtree(d)   # interrupted before its first checkpoint: nothing to continue from
        os.makedirs(os.path.dirname(d), exist_ok=True)
        t0 = time.perf_counter()
        label = f"{progress} {entry} seed {seed}".strip()
        print(f"{label}: started (log: {d}.log)", flush=True)
        with open(d + ".log", "a") as log:   # beside the run directory: train.py wants that one to itself
            proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *argv], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT)
            code = wait(proc, d, label)
        if code != 0:
            raise RuntimeError(f"run {entry} seed {seed} failed (exit {code}); see {d}.log")
        with open(wall_file, "w") as f:
            f.write(f"{time.perf_counter() - t0:.1f}\n")
        done = f"done in {time.perf_counter() - t0:.0f} s"
    else:
        done = f"finished before, reused ({d})"
    rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    s = summary(rows)
    print(f"{progress} {entry} seed {seed}: {done}; held-out accuracy {s['start']:.3f} -> {s['final']:.3f}".strip(),
          flush=True)
    return {"entry": entry, "seed": seed, "rows": rows,
            "wall_s": float(open(wall_file).read()) if os.path.exists(wall_file) else float("nan")}


def summary(rows: list[dict]) -> dict:
    """One run's numbers: final, best and AUC of held-out accuracy (row 0 is the evaluation before training)."""
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    steps, acc = np.array([s for s, _ in ev], float), np.array([a for _, a in ev])
    area = ((acc[1:] + acc[:-1]) / 2 * np.diff(steps)).sum()                  # trapezoids over the eval steps
    auc = area / (steps[-1] - steps[0]) if len(ev) > 1 else acc[0]
    return {"start": acc[0], "final": acc[-1], "best": acc.max(), "auc": float(auc)}


def steps_to(rows: list[dict], target: float) -> tuple[float, float]:
    """Steps a run took to reach held-out accuracy >= target, as an interval (lo, hi): (s, s) at the first
    evaluation that reached it (its resolution is eval_every), (N, inf) when no evaluation did (censored: it needs
    more than the last evaluated step N, by an unknown amount)."""
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    hit = next((s for s, a in ev if a >= target), None)
    return (float(hit), float(hit)) if hit is not None else (float(ev[-1][0]), np.inf)


def interval_ci(lo: np.ndarray, hi: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% bootstrap CI of the mean of per-seed values known only within [lo, hi] (censored runs: hi = inf).
    Every draw resamples the same seeds for both ends; the mean is monotone in each value and a percentile in
    each mean, so the true CI (had the censored runs gone on) lies inside [2.5th pct. of the lo means,
    97.5th pct. of the hi means]: that is what this returns, an end being +-inf where censoring leaves it open.
    The percentiles take the nearest draw outward (no interpolation: it would mix a finite draw with an infinite
    one into nan)."""
    idx = rng.integers(0, len(lo), size=(BOOTSTRAP, len(lo)))                  # (draws, seeds)
    return (float(np.percentile(lo[idx].mean(1), 2.5, method="lower")),
            float(np.percentile(hi[idx].mean(1), 97.5, method="higher")))


def fmt_bound(lo: float, hi: float) -> str:
    """A value known within [lo, hi]: '40', '>100' (censored above), '<-60' (censored below), or 'lo..hi'."""
    if np.isnan(lo) or np.isnan(hi):
        raise ValueError("fmt_bound: a bound is nan (an entry without runs?)")
    if lo == hi:
        return f"{lo:.0f}" if float(lo).is_integer() else f"{lo:.1f}"
    if np.isinf(hi) and np.isinf(lo):
        return "unknown"
    if np.isinf(hi):
        return ">" + fmt_bound(lo, lo)
    if np.isinf(lo):
        return "<" + fmt_bound(hi, hi)
    return f"{fmt_bound(lo, lo)}..{fmt_bound(hi, hi)}"


def fmt_interval(lo: np.ndarray, hi: np.ndarray, rng) -> str:
    """Mean [95% CI] of per-seed intervals; an open end of the CI prints as -inf or inf."""
    c_lo, c_hi = interval_ci(lo, hi, rng)
    end = lambda x: "inf" if x == np.inf else "-inf" if x == -np.inf else f"{x:.1f}"
    return f"{fmt_bound(lo.mean(), hi.mean())} [{end(c_lo)}, {end(c_hi)}]"


def target_table(results: list[dict], entries: list[str], baseline: str, target: float, label: str) -> str:
    """Steps to reach held-out accuracy `target`, per entry: each seed's value ('>N': never within its N steps),
    the mean [95% CI] and the paired difference to the baseline; censored runs count as intervals, never dropped."""
    rng = np.random.default_rng(0)
    by = {e: {r["seed"]: steps_to(r["rows"], target) for r in results if r["entry"] == e} for e in entries}
    lines = [f"Steps to held-out accuracy >= {label}: per seed, mean [95% bootstrap CI]; '>N' = not reached in N "
             f"steps (censored: counted as anywhere above N, so a mean or CI end it touches is a bound).", "",
             "| run | reached | per seed | steps to target | minus baseline, per seed | minus baseline (paired) | "
             "verdict |",
             "|---|---|---|---|---|---|---|"]
    for e in (e for e in entries if by[e]):   # an entry without a finished run has no row
        seeds = sorted(by[e])
        lo, hi = (np.array([by[e][s][i] for s in seeds]) for i in (0, 1))
        reached = int(np.isfinite(hi).sum())
        diff_seeds, diff, verdict_text = "", "", ""
        paired = [s for s in seeds if s in by[baseline]]
        if e != baseline and len(paired) > 1:
            d_lo = np.array([by[e][s][0] - by[baseline][s][1] for s in paired])   # interval difference
            d_hi = np.array([by[e][s][1] - by[baseline][s][0] for s in paired])
            diff_seeds, diff = ", ".join(map(fmt_bound, d_lo, d_hi)), fmt_interval(d_lo, d_hi, rng)
            c_lo, c_hi = interval_ci(d_lo, d_hi, rng)
            verdict_text = "fewer steps" if c_hi < 0 else "more steps" if c_lo > 0 else \
                f"indistinguishable with {len(paired)} seeds"
        per_seed = ", ".join(fmt_bound(*by[e][s]) for s in seeds)
        lines.append(f"| `{e}` | {reached}/{len(seeds)} | {per_seed} | {fmt_interval(lo, hi, rng)} | {diff_seeds} | "
                     f"{diff} | {verdict_text} |")
    return "\n".join(lines) + "\n"


def parse_target(text: str) -> tuple[float, str]:
    """'0.86' or '0.95*0.86' (a fraction of an accuracy, e.g. of a teacher's) -> (value, label for the table)."""
    parts = [float(x) for x in text.split("*")]
    value = float(np.prod(parts))
    return value, (f"{text.replace('*', ' x ')} = {value:.3f}" if len(parts) > 1 else f"{value:.3f}")


def update_s(results: list[dict], entry: str) -> str:
    """The mean time/update over an entry's steps and seeds (first step left out: it pays compiles and warm-up);
    blank where no row has it."""
    times = [x["time/update"] for r in results if r["entry"] == entry for x in r["rows"][2:] if "time/update" in x]
    return f"{np.mean(times):.4f}" if times else ""


def bootstrap_ci(x: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile CI of the mean of x (seeds) by resampling seeds with replacement. x: (n,) or (n, T)."""
    idx = rng.integers(0, len(x), size=(BOOTSTRAP, len(x)))                     # (draws, n)
    means = x[idx].mean(1)                                                       # (draws,) or (draws, T)
    return np.percentile(means, 2.5, axis=0), np.percentile(means, 97.5, axis=0)


def verdict(lo: float, hi: float, n: int) -> str:
    return "better" if lo > 0 else "worse" if hi < 0 else f"indistinguishable with {n} seeds"


def fmt(x: np.ndarray, rng) -> str:
    lo, hi = bootstrap_ci(x, rng)
    return f"{x.mean():.3f} [{lo:.3f}, {hi:.3f}]"


def table(results: list[dict], entries: list[str], baseline: str, title: str) -> str:
    rng = np.random.default_rng(0)          # the same draws every time: the table is reproducible
    by = {e: {r["seed"]: summary(r["rows"]) for r in results if r["entry"] == e} for e in entries}
    wall = {e: np.nanmean([r["wall_s"] for r in results if r["entry"] == e]) for e in entries}
    update = {e: update_s(results, e) for e in entries}
    lines = [f"# Ablation: {title}", "", f"Mean over seeds [95% bootstrap CI]; differences are paired by seed "
             f"against `{baseline}`.", "",
             "| run | seeds | acc. at start | final acc. | best acc. | AUC | final - baseline | AUC - baseline | "
             "verdict (final) | wall s/run | update s/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        seeds = sorted(by[e])
        col = {k: np.array([by[e][s][k] for s in seeds]) for k in ("start", "final", "best", "auc")}
        diffs, verdict_text = ["", ""], ""
        paired = [s for s in seeds if s in by[baseline]]
        if e != baseline and len(paired) > 1:
            d_final = np.array([by[e][s]["final"] - by[baseline][s]["final"] for s in paired])
            d_auc = np.array([by[e][s]["auc"] - by[baseline][s]["auc"] for s in paired])
            diffs = [fmt(d_final, rng), fmt(d_auc, rng)]
            verdict_text = verdict(*bootstrap_ci(d_final, rng), len(paired))
        lines.append(f"| `{e}` | {len(seeds)} | {col['start'].mean():.3f} | {fmt(col['final'], rng)} | "
                     f"{fmt(col['best'], rng)} | {fmt(col['auc'], rng)} | {diffs[0]} | {diffs[1]} | {verdict_text} | "
                     f"{wall[e]:.0f} | {update[e]} |")
    return "\n".join(lines) + "\n"


def finish_figure(fig, axes, path: str):
    """Grid and legend on each axis, then the PNG under a temporary name and renamed: never half a file."""
    import matplotlib.pyplot as plt
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path + ".tmp", format="png")
    os.replace(path + ".tmp", path)
    plt.close(fig)


def plot(results: list[dict], entries: list[str], path: str, targets: tuple[float, ...] = ()):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rng = np.random.default_rng(0)
    fig, (ax_acc, ax_rew) = plt.subplots(1, 2, figsize=(12, 4.5))
    for e in entries:
        runs = [r for r in results if r["entry"] == e]
        ev = [[(x["step"], x["eval/accuracy"]) for x in r["rows"] if "eval/accuracy" in x] for r in runs]
        n = min(len(v) for v in ev)
        steps = np.array([s for s, _ in ev[0][:n]])
        acc = np.array([[a for _, a in v[:n]] for v in ev])                     # (seeds, evals)
        lo, hi = bootstrap_ci(acc, rng)
        line, = ax_acc.plot(steps, acc.mean(0), "o-", label=e)
        ax_acc.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
        train = [[x["reward"] for x in r["rows"] if "reward" in x] for r in runs]
        m = min(len(t) for t in train)
        ax_rew.plot(np.arange(1, m + 1), np.array([t[:m] for t in train]).mean(0), color=line.get_color(), label=e)
    for t in targets:
        ax_acc.axhline(t, color="gray", linestyle="--", linewidth=1, label=f"target {t:.3f}")
    ax_acc.set(xlabel="step", ylabel="held-out accuracy", title="held-out accuracy (band: 95% bootstrap CI)")
    ax_rew.set(xlabel="step", ylabel="train reward", title="train reward (mean over seeds)")
    finish_figure(fig, (ax_acc, ax_rew), path)


def main(argv: list[str]) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--runs", default="grpo,ppo,rloo,online_dpo", help="comma-separated algo[:key=value...] entries")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (the same for every entry: paired)")
    p.add_argument("--baseline", default="", help="the entry the others are compared with (default: the first)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time (each uses one CPU thread)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint interval, so an interrupted run continues")
    p.add_argument("--out", default="runs/ablate", help="output directory")
    p.add_argument("--target", default="", help="held-out accuracies to report the steps to, comma-separated; "
                                                "A*B for a fraction of one (e.g. 0.86,0.95*0.86)")
    p.add_argument("--kernels", default="", help="OP=A,B,...: compare implementations of a kernel op on the first "
                                                 "--runs entry (e.g. logprob=torch,triton,liger)")
    args, common = p.parse_known_args(argv)
    bad = [a for a in common if "=" not in a or a.startswith("-")]
    if bad:
        p.error(f"unexpected argument {bad[0]!r}: trailing arguments must be key=value overrides")
    entries = [e.strip() for e in args.runs.split(",") if e.strip()]
    if args.kernels:
        op, _, names = args.kernels.partition("=")
        if not op or not names:
            p.error(f"--kernels must be OP=A,B,... (e.g. logprob=torch,triton), got {args.kernels!r}")
        entries = [f"{entries[0]}:kernels.{op.strip()}={n.strip()}" for n in names.split(",") if n.strip()]
    baseline = args.baseline or entries[0]
    if baseline not in entries:
        p.error(f"--baseline {baseline!r} is not one of the --runs entries: {', '.join(entries)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    try:
        targets = [parse_target(t.strip()) for t in args.target.split(",") if t.strip()]
    except ValueError:
        targets = [(float("nan"), "")]
    if not all(0 < value <= 1 for value, _ in targets):
        p.error(f"--target must be comma-separated accuracies in (0, 1] or A*B products (e.g. 0.86,0.95*0.86), "
                f"got {args.target!r}")
    os.makedirs(args.out, exist_ok=True)
    jobs = [(e, s) for s in seeds for e in entries]      # seed-major: an early stop leaves complete pairs
    print(f"{len(jobs)} runs ({len(entries)} entries x {len(seeds)} seeds), {max(1, args.jobs)} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda ij: launch(*ij[1], args.out, common, args.save_every,
                                                  f"[{ij[0] + 1}/{len(jobs)}]"), enumerate(jobs)))
    text = table(results, entries, baseline, " ".join(common) or "defaults")
    text += "".join("\n" + target_table(results, entries, baseline, value, label) for value, label in targets)
    plot(results, entries, os.path.join(args.out, "curves.png"), [value for value, _ in targets])
    with open(os.path.join(args.out, "results.md.tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(args.out, "results.md.tmp"), os.path.join(args.out, "results.md"))
    print(text + f"\nplot: {os.path.join(args.out, 'curves.png')}")
    return text


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
