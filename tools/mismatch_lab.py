"""The mismatch lab: switch on one source of rollout/trainer mismatch at a time, repair it (or not) with importance
sampling, and plot the measured mismatch and the learning curve (docs/mismatch.md).

    python tools/mismatch_lab.py                          # every source x every repair, then the plots
    python tools/mismatch_lab.py --sources bf16 --repairs off,token
    python tools/mismatch_lab.py --print                  # the one train.py command of each experiment, nothing run

A source is a one-line config change (SOURCES); a repair is algo.tis (REPAIRS: off, token, seq, mask). Each
experiment is `python train.py <source> <repair>` on the embedded default, run by tools/ablate.py's `launch`
(--jobs at a time, threads=1 each; a run whose directory holds final/ is not run again, so an interrupted lab
resumes where it left off). The run without any source ("none") is every plot's reference curve.
    <out>/<source>.png    logprob_mismatch/mean over steps and held-out accuracy over steps, one line per repair
    <out>/results.md      per experiment: mean and max mismatch, final and best held-out accuracy, wall time
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from tools.ablate import finish_figure, launch, summary  # noqa: E402  (its runner, per-run summary, PNG writer)

SOURCES = {   # each a one-line change of the default run; "none" is the reference without mismatch
    "none": [],
    "bf16": ["engine_dtype=bfloat16"],                       # the engine samples with a bf16 copy, the trainer fp32
    "fp8": ["engine_dtype=fp8_all"],                         # FP8 decode GEMMs (every one: the tiny model's are small)
    "top_k": ["top_k=2", "logprobs_mode=processed"],         # truncated sampling, reported as vLLM reports it
    "top_p": ["top_p=0.8", "logprobs_mode=processed"],
    "stale": ["engine_lag=4"],                               # samples from the weights of 4 steps ago
    "temperature": ["train_temperature=0.7"],                # sampled at 1.0, trained at 0.7
    "exact": ["exact_logprobs=true"],                        # the opposite: no mismatch at all (docs/exact.md)
}
REPAIRS = {"off": [], "token": ["algo.tis=token"], "seq": ["algo.tis=seq"], "mask": ["algo.tis=mask"]}


def repair_args(source: str, repair: str) -> list[str]:
    """algo.tis's override; "off" is the default except with FP8 sampling (token there), so it is said then."""
    fp8 = any(a.startswith("engine_dtype=fp8") for a in SOURCES[source])
    return ["algo.tis=off"] if repair == "off" and fp8 else REPAIRS[repair]


def entry(source: str, repair: str) -> str:
    """tools/ablate.py's entry (algo[:key=value...]) of one experiment; also its label and directory name."""
    return ":".join(["grpo", *SOURCES[source], *repair_args(source, repair)])


def experiments(sources: list[str], repairs: list[str]) -> list[tuple[str, str]]:
    """(source, repair) pairs to run: the reference once, every other source with each repair."""
    return [("none", "off")] + [(s, r) for s in sources if s != "none" for r in repairs]


def command(source: str, repair: str, common: list[str]) -> str:
    return " ".join(["python train.py", *SOURCES[source], *repair_args(source, repair), *common])


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return np.array([s for s, _ in pts]), np.array([v for _, v in pts])


def plot(source: str, runs: dict, path: str):
    """One source's figure: mismatch over steps (log scale) and held-out accuracy, one line per repair."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_mis, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (src, repair), res in runs.items():
        if src not in (source, "none"):
            continue
        label = "no mismatch (reference)" if src == "none" else f"{source}, tis={repair}"
        style = dict(color="gray", linestyle="--") if src == "none" else {}
        steps, mis = series(res["rows"], "logprob_mismatch/mean")
        ax_mis.plot(steps, np.maximum(mis, 1e-7), label=label, **style)
        steps, acc = series(res["rows"], "eval/accuracy")
        ax_acc.plot(steps, acc, marker="o", label=label, **style)
    ax_mis.set(xlabel="step", ylabel="mean |engine - trainer log-prob|", yscale="log",
               title=f"{source}: logprob_mismatch/mean ({' '.join(SOURCES[source])})")
    ax_acc.set(xlabel="step", ylabel="held-out accuracy (greedy)", title=f"{source}: learning curve")
    finish_figure(fig, (ax_mis, ax_acc), path)


def table(runs: dict, common: list[str]) -> str:
    """Per experiment: the mismatch (mean over steps of the per-step mean, and the largest per-step max), the
    repair's mean weight and masked share of tokens, held-out accuracy (final, best) and the wall time."""
    lines = ["| source | repair | mismatch mean | mismatch max | weight mean | masked | final acc. | best acc. | "
             "wall s | command |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (source, repair), res in runs.items():
        rows, s = res["rows"], summary(res["rows"])
        mis, top = series(rows, "logprob_mismatch/mean")[1], series(rows, "logprob_mismatch/max")[1]
        w, masked = series(rows, "tis_weight")[1], series(rows, "tis_masked_frac")[1]
        weight = f"{w.mean():.3f}" if len(w) else "-"
        share = f"{100 * masked.mean():.3f}%" if len(masked) else "-"
        lines.append(f"| {source} | {repair} | {mis.mean():.4f} | {top.max():.3f} | {weight} | {share} | "
                     f"{s['final']:.3f} | {s['best']:.3f} | {res['wall_s']:.0f} | "
                     f"`{command(source, repair, common)}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--sources", default=",".join(s for s in SOURCES if s != "none"), help="comma-separated, of: "
                   + ", ".join(SOURCES))
    p.add_argument("--repairs", default=",".join(REPAIRS), help="comma-separated algo.tis values: " + ", ".join(REPAIRS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (each one CPU thread)")
    p.add_argument("--out", default="runs/mismatch", help="output directory")
    p.add_argument("--print", action="store_true", help="print each experiment's train.py command and stop")
    args, common = p.parse_known_args(argv)
    sources, repairs = args.sources.split(","), args.repairs.split(",")
    bad = [x for x in sources if x not in SOURCES] + [x for x in repairs if x not in REPAIRS]
    bad += [a for a in common if "=" not in a or a.startswith("-")]
    if bad:
        p.error(f"unknown {bad[0]!r}: sources are {', '.join(SOURCES)}; repairs {', '.join(REPAIRS)}; other "
                "arguments key=value overrides for every run")
    todo = experiments(sources, repairs)
    if args.print:
        text = "\n".join(command(s, r, common) for s, r in todo) + "\n"
        print(text, end="")
        return text
    os.makedirs(args.out, exist_ok=True)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:   # save_every=0: a short run restarts whole
        done = list(pool.map(lambda sr: launch(entry(*sr), args.seed, args.out, common, 0), todo))
    runs = dict(zip(todo, done))
    for source in dict.fromkeys(s for s, _ in todo if s != "none"):
        plot(source, runs, os.path.join(args.out, f"{source}.png"))
    text = table(runs, common)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text + f"\nplots: {args.out}/<source>.png")
    return text


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except RuntimeError as e:   # a failed run: ablate.launch names it and its log
        sys.exit(f"error: {e}")
