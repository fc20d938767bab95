"""W5 on 4 GPUs (docs/benchmarks.md, "W5"): W1 on one GPU (sync) against four-GPU placements, in one command, with
tools/plan.py's prediction beside each measurement.

    python tools/bench_w5x4.py OUT                     # needs 4 GPUs; OUT/w5x4.md: the table; OUT/<placement>/: logs
    python tools/bench_w5x4.py OUT --cpu               # the same code path on the CPU: 4 gloo processes, toy shapes
    python tools/bench_w5x4.py OUT --only sync-1gpu,async-2+2-fsdp --steps 12

Placements (every run is tools/bench.py's `ours` part, i.e. train.main, 32:ckpt:compile; async ones with
max_staleness=1 algo.tis=token):
  sync-1gpu          W1 on one GPU: the baseline
  async-3+1          mode=async, 3 rollout ranks + 1 trainer; 15 prompts (a multiple of 3: 120 samples a step)
  async-2+2-fsdp     mode=async, 2 rollout ranks + 2 trainer ranks sharding with FSDP2
  replicate-4        colocated: every GPU generates then trains (parallel=replicate)
  replicate-4-x4     the same at W1's batch per GPU (4x W1's global batch): weak scaling
  async-2+2-rep-x2   2 + 2 with replicated trainers at W1's batch per rollout GPU (2x W1's): weak scaling
The first four keep W1's global batch (strong scaling); the last two keep each GPU's batch. Samples/s are compared
with the 1-GPU run of this same command.
Each placement runs in its own process tree (torchrun above 1 process) under its own timeout; the whole command
keeps to --budget seconds (placements that would start later are reported as skipped). A placement that fails or
times out prints its error line and the table still prints. Its log and metrics.jsonl land in OUT/<placement>/.
The split per placement is what each mode records (train.py's phases; mode=async also the trainer's wait for
batches and the rollout ranks' wait for weights: async_rl.py), and the line "bound by" reads it.
"""
import argparse
import glob
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, TOOLS)
import plan   # noqa: E402  (tools/plan.py: the same model that prints its table)
from bench import launcher, result_of, write_report   # noqa: E402  (the runner of bench.py's parts)
from bench_workload import SHAPES, W, build_model   # noqa: E402

GOAL = 3.4   # samples/s of the best 4-GPU placement over the 1-GPU run's (issue 39)


@dataclass
class Placement:
    name: str
    nproc: int
    K: int            # rollout ranks (mode=async); 0: colocated, every rank generates and trains
    parallel: str     # the trainers among themselves: fsdp or replicate
    scale: int = 1    # global batch as a multiple of W1's prompts
    what: str = ""


PLACEMENTS = [
    Placement("sync-1gpu", 1, 0, "fsdp", 1, "1 GPU, sync (baseline)"),
    Placement("async-3+1", 4, 3, "fsdp", 1, "async, 3 rollout + 1 trainer"),
    Placement("async-2+2-fsdp", 4, 2, "fsdp", 1, "async, 2 rollout + 2 trainers (FSDP2)"),
    Placement("replicate-4", 4, 0, "replicate", 1, "colocated, parallel=replicate"),
    Placement("replicate-4-x4", 4, 0, "replicate", 4, "colocated, replicate, W1's batch per GPU"),
    Placement("async-2+2-rep-x2", 4, 2, "replicate", 2, "async, 2 + 2 (replicate), W1's batch per rollout GPU"),
]


def prompts_for(p: Placement, base: int) -> int:
    """W1's prompts x scale, rounded down to what every rank can split in whole groups (config_checks)."""
    unit = math.lcm(p.K, p.nproc - p.K) if p.K else p.nproc
    n = base * p.scale // unit * unit
    if n == 0:
        sys.exit(f"error: {p.name} needs a multiple of {unit} prompts; the shape has {base}")
    return n


def settings(p: Placement, prompts: int, cpu: bool) -> str:
    s = [f"prompts_per_step={prompts}"]
    if p.K:
        s += ["mode=async", f"rollout_ranks={p.K}", "max_staleness=1", "algo.tis=token"]
    if cpu:
        s += ["threads=1"]
    return " ".join(s)


def descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun starts its workers in sessions of their own: a process-group kill misses
    them), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def run_one(cmd: list[str], env: dict, log: str, timeout: float) -> str | None:
    """Run cmd with its output in log; -> None, or why it failed. On timeout (or when this script is stopped):
    SIGTERM to the launcher (torchrun passes it on; the async trainers stop at the next batch), then SIGKILL to
    everything it started, so that no rank keeps a GPU from the next placement."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            return f"timed out after {timeout:.0f} s"
        except BaseException:   # SIGTERM (main's handler) or Ctrl-C: the tree goes with this script
            stop(proc)
            raise
    return None if rc == 0 else f"exit {rc}: {error_line(log)}"


def stop(proc: subprocess.Popen):
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    alive = proc.poll() is None   # else its pid may be another process's by now
    for pid in [*tree, *([proc.pid, *descendants(proc.pid)] if alive else [])]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def error_line(log: str) -> str:
    """The line that names the failure: the last exception line of a worker's traceback (torchrun's own
    ChildFailedError summary names no cause), else the last line."""
    lines = [x.strip() for x in open(log, errors="replace").read().splitlines() if x.strip()]
    errs = [x for x in lines if re.search(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Died)\b.*:", x)
            and "ChildFailedError" not in x]
    return ((errs or lines or ["no output"])[-1])[:240]


def split_of(metrics: str) -> dict:
    """Medians over the measured steps (step >= 2: step 0 is the evaluation, 1 the warm-up) of every time/* key."""
    rows = [json.loads(x) for x in open(metrics)]
    rows = [r for r in rows if r["step"] >= 2]
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {k[5:]: statistics.median(r[k] for r in rows if k in r) for k in keys}


def bound_by(p: Placement, split: dict, step: float) -> str:
    """Which side sets the step, from the split the run recorded."""
    if p.K:   # the trainer's busy time is its period less its wait for batches; the rollout ranks' is generate
        wait, idle = split.get("trainer_idle", 0.0), split.get("rollout_idle", 0.0)
        gen, train = split.get("rollout", 0.0), step - wait
        side = "rollout ranks (generate)" if gen >= train else "trainer"
        return (f"{side}: generate {gen:.3f} s, trainer busy {train:.3f} s of the {step:.3f} s step "
                f"(update {split.get('update', 0.0):.3f}, weight broadcast {split.get('sync', 0.0):.3f}); "
                f"trainer waits {wait:.3f} s for batches, rollout ranks {idle:.3f} s for weights")
    parts = {k: split.get(k, 0.0) for k in ("rollout", "reward", "logprobs", "update", "sync")}
    top = max(parts, key=parts.get)
    return f"{top} {parts[top]:.3f} s of {step:.3f} s ({parts[top] / step:.0%}); colocated phases add up"


def predict(p: Placement, base: dict | None, prompts: int, w1_prompts: int) -> float:
    """plan.py's step time for p, from the 1-GPU run's split measured here (its defaults, W1's H100 split,
    without one)."""
    d = dict(R=0.426, U=0.361, L=0.025)
    if base:
        d = dict(R=base["rollout"], U=base["update"], L=base.get("logprobs", 0.0) + base.get("reward", 0.0))
    return plan.placement(**d, W=0.01, A=0.02, F=0.75, N=p.nproc, K=p.K, s=prompts / w1_prompts)


def cards(cpu: bool) -> str:
    import torch
    if cpu or not torch.cuda.is_available():
        model = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
        return f"CPU ({model}, {os.cpu_count()} cores), gloo"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} GPUs: " + ", ".join(names)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for w5x4.md, w5x4.json and each placement's log and metrics.jsonl")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU: gloo, toy shapes, threads=1, no compile")
    ap.add_argument("--steps", type=int, default=None, help="measured steps after 1 warm-up (default 8; --cpu 3)")
    ap.add_argument("--only", default="", help="comma list of placements: " + ", ".join(p.name for p in PLACEMENTS))
    ap.add_argument("--timeout", type=float, default=None, help="seconds per placement (default 180; --cpu 240)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole command; later placements are skipped (default 400; --cpu 1500)")
    ap.add_argument("--rebuild", action="store_true",
                    help="no run: the table again from OUT's w5x4.json and each placement's metrics.jsonl (a "
                         "placement whose result line was lost after its steps ran gets its step times from there)")
    a = ap.parse_args()
    if a.rebuild:
        return rebuild(a.out)
    names = [p.name for p in PLACEMENTS]
    chosen = [p for p in PLACEMENTS if not a.only or p.name in a.only.split(",")]
    bad = set(filter(None, a.only.split(","))) - set(names)
    if bad:
        sys.exit(f"error: unknown placement(s) {', '.join(sorted(bad))}; known: {', '.join(names)}")
    pick = lambda given, cpu, gpu: given if given is not None else cpu if a.cpu else gpu   # noqa: E731
    steps, timeout, budget = pick(a.steps, 3, 8), pick(a.timeout, 240, 180), pick(a.budget, 1500, 400)
    if steps < 1 or timeout <= 0 or budget <= 0:
        sys.exit("error: --steps, --timeout and --budget must be positive")
    os.makedirs(a.out, exist_ok=True)
    signal.signal(signal.SIGTERM, on_term)   # run_one then ends the running tree
    started = time.perf_counter()
    import torch
    if not a.cpu and torch.cuda.device_count() < max(p.nproc for p in chosen):
        sys.exit(f"error: these placements need {max(p.nproc for p in chosen)} GPUs, this machine has "
                 f"{torch.cuda.device_count()}; --cpu runs them on the CPU")
    W.update(SHAPES["small" if a.cpu else "w1"])
    device = cards(a.cpu)
    print(f"W5 x4 on {device}; torch {torch.__version__}; {steps} measured steps after 1 warm-up", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    if a.cpu:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    results, stopped = {}, None
    with tempfile.TemporaryDirectory() as tmp:   # the runs' folders hold final/ (the full weights): not for OUT
        model = os.path.join(tmp, "model")
        build_model(model, torch.float32 if a.cpu else torch.bfloat16)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        for i, p in enumerate(chosen):
            prompts = prompts_for(p, W["prompts"])
            res = results[p.name] = {"placement": p.__dict__, "prompts": prompts,
                                     "samples": prompts * W["samples"], "set": settings(p, prompts, a.cpu)}
            left = budget - (time.perf_counter() - started)
            if stopped or left < 30:
                res["error"] = f"skipped: {stopped or f'{budget:.0f} s budget spent'}"
            else:
                # after the first run inductor's cache is warm: its compile-worker pool would only slow the
                # first steps (docs/speed.md)
                run_env = {**env, "TORCHINDUCTOR_COMPILE_THREADS": "1"} if i and not a.cpu else env
                try:
                    run_placement(p, res, a, model, tmp, steps, run_env, min(timeout, left))
                except Stopped as e:   # the table of what ran still prints
                    stopped = res["error"] = str(e)
            took = f" ({res['wall_s']:.0f} s)" if "wall_s" in res else ""
            print(f"{p.name}: {res.get('error') or 'done'}{took}", flush=True)
    print(write_report(a.out, "w5x4", results, report(results, device, steps, a.cpu)))
    if stopped:
        sys.exit(stopped)


def rebuild(out: str):
    """--rebuild: step times as bench.py's ours part reads them (time/step under mode=async, else the phases'
    sum; the measured steps are those after the warm-up), for placements that recorded steps but no result."""
    with open(os.path.join(out, "w5x4.json")) as f:
        results = json.load(f)
    head = open(os.path.join(out, "w5x4.md")).readline()
    device = head[head.index("(") + 1:head.rindex(")")] if "(" in head else "?"
    phases = ["time/rollout", "time/reward", "time/logprobs", "time/update", "time/sync"]
    for name, r in results.items():
        metrics = os.path.join(out, name, "metrics.jsonl")
        if "step_s" in r or not os.path.exists(metrics):
            continue
        rows = [x for x in map(json.loads, open(metrics)) if x["step"] >= 2]
        if rows:
            r["steps_s"] = [x["time/step"] if "time/step" in x else sum(x[k] for k in phases) for x in rows]
            r["step_s"] = statistics.median(r["steps_s"])
            r["rebuilt"] = r.pop("error", "")
    steps = max(len(r.get("steps_s", [])) for r in results.values())
    text = report(results, device, steps, cpu=device.startswith("CPU"))
    rebuilt = [n for n, r in results.items() if "rebuilt" in r]
    if rebuilt:
        text += (f"\nRebuilt from metrics.jsonl (their runs ended with an error after the steps): {', '.join(rebuilt)}\n")
    with open(os.path.join(out, "w5x4.md"), "w") as f:
        f.write(text)
    print(text)


class Stopped(Exception):
    """SIGTERM reached this script: the running placement's tree ends (run_one), the rest are skipped."""


def on_term(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second one must not cut the tree's clean-up short
    raise Stopped("stopped by SIGTERM")


def run_placement(p: Placement, res: dict, a, model: str, tmp: str, steps: int, env: dict, timeout: float):
    """One placement: tools/bench.py's ours part, under torchrun above one process; its log, metrics and
    result (or error) into OUT/<name>/ and res."""
    out = os.path.join(a.out, p.name)
    os.makedirs(out, exist_ok=True)
    # micro-batch 32 as W1, or the largest size under it that divides the step's samples (3+1: 120 samples)
    micro = max(d for d in range(1, 33) if res["samples"] % d == 0)
    v = f"{micro}:ckpt" + ("" if a.cpu else ":compile") + (":rep" if p.parallel == "replicate" else "")   # no inductor
    cmd = [*launcher(p.nproc), os.path.join(TOOLS, "bench.py"), "--part", "ours", "--model", model,
           "--tmp", os.path.join(tmp, p.name), "--out", out, "--gpus", str(p.nproc), "--steps", str(steps),
           "--micro", v.split(":")[0], "--variant", v, "--set", res["set"]] + (["--small"] if a.cpu else [])
    t0 = time.perf_counter()
    try:
        err = run_one(cmd, env, os.path.join(out, "run.log"), timeout)
    finally:
        res["wall_s"] = time.perf_counter() - t0
    collect(res, out, os.path.join(tmp, p.name), err)


def collect(res: dict, out: str, run_tmp: str, err: str | None):
    """The rank-0 result line, the run's metrics.jsonl (copied to out) and its split into res."""
    log = os.path.join(out, "run.log")
    r = result_of(open(log, errors="replace").read())
    for m in glob.glob(os.path.join(run_tmp, "*", "metrics.jsonl")):
        shutil.copy(m, os.path.join(out, "metrics.jsonl"))
        try:
            res["split_s"] = split_of(m)
        except (ValueError, KeyError, statistics.StatisticsError):
            pass   # a run cut short: no measured step
    if err or r is None:
        res["error"] = err or f"no result line: {error_line(log)}"
        return
    res.update(step_s=r["step_s"], steps_s=r["steps_s"], peak_alloc_gib=r.get("peak_alloc_gib"))


def report(results: dict, device: str, steps: int, cpu: bool) -> str:
    unit, units = ("process", "processes") if cpu else ("GPU", "GPUs")
    base = results.get("sync-1gpu", {})
    shape = SHAPES["small" if cpu else "w1"]
    w1 = shape["prompts"]   # W1's prompts per step (the toy shape's on the CPU)
    base_rate = base["samples"] / base["step_s"] if "step_s" in base else None
    lines = [f"# W5 on 4 {units} against 1 ({device})", "",
             f"{steps} measured steps after 1 warm-up; medians. plan.py predicts each from the 1-{unit} run's split "
             f"in this command{'' if 'split_s' in base else ' (missing: from its defaults, W1 H100 split)'}.", "",
             f"| placement | {units} | samples/step | step | samples/s | vs 1 {unit} | plan.py step | plan.py vs 1 | "
             "plan.py error | split (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    base_pred = predict(PLACEMENTS[0], base.get("split_s"), w1, w1)
    best, bounds = None, []
    for name, r in results.items():
        p = Placement(**r["placement"])
        pred = predict(p, base.get("split_s"), r["prompts"], w1)
        pred_x = (r["samples"] / pred) / (w1 * shape["samples"] / base_pred)   # predicted samples/s ratio
        split = ", ".join(f"{k} {v:.3f}" for k, v in r.get("split_s", {}).items() if k != "step")
        if "step_s" not in r:
            lines.append(f"| {name}: {p.what} | {p.nproc} | {r['samples']} | {r['error']} | | | {pred:.3f} s | "
                         f"{pred_x:.2f}x | | {split} |")
            continue
        rate = r["samples"] / r["step_s"]
        x = rate / base_rate if base_rate else None
        if p.nproc > 1 and x and (best is None or x > best[1]):
            best = (name, x)
        lines.append(f"| {name}: {p.what} | {p.nproc} | {r['samples']} | {r['step_s']:.3f} s | {rate:.1f} | "
                     + (f"**{x:.2f}x**" if x else "-") + f" | {pred:.3f} s | {pred_x:.2f}x | "
                     f"{(pred - r['step_s']) / r['step_s']:+.0%} | {split} |")
        if "split_s" in r:
            bounds.append(f"- {name}: bound by {bound_by(p, r['split_s'], r['step_s'])}; steps (s) "
                          + " ".join(f"{t:.3f}" for t in r["steps_s"]))
    lines += ["", "plan.py error = (predicted - measured) / measured step time.", ""]
    if best:
        lines.append(f"Best 4-{unit} placement: {best[0]}, **{best[1]:.2f}x** the 1-{unit} samples/s "
                     f"(goal >= {GOAL}x: {'met' if best[1] >= GOAL else 'not met'}).")
    return "\n".join(lines + ["", "What bounds each step (from its split):"] + bounds) + "\n"


if __name__ == "__main__":
    main()
