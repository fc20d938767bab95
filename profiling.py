"""One training step under torch.profiler: where its time goes, phase by phase, on every rank.

    python train.py profile_step=3                                  # <run_dir>/profile-rank0.txt and .json.gz
    torchrun --nproc_per_node=2 train.py profile_step=3 ...         # one pair of files per rank

profile-rankR.txt has, per phase of train.py's step (rollout, logprobs, reward, update, sync, log: the
phases its time/* metrics time), the wall time against the GPU kernel time inside it: kernels busy for
most of the wall means the GPU bounds that phase; far less means the host does (launches, Python, syncs)
or the GPU waits on another rank. Collective (NCCL) kernel time is counted apart, since under torchrun it
includes waiting for the slowest rank. Then the kernels and host ops that took longest. profile-rankR.json.gz
is the whole trace: open it in https://ui.perfetto.dev or chrome://tracing.

Choose a step after the first: step 1 pays for compiles and CUDA graph captures. Profiling slows the host,
so the profiled step's own time/* metrics read high; the kernel times are unaffected.
"""
import contextlib
import gzip
import json
import os
import shutil
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MARK = "phase_end:"     # train.py calls mark(name) as each phase ends: a zero-length span in the trace


def start() -> profile:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    prof.start()
    return prof


def mark(name: str):
    """Where a phase ends, in the trace's own clock (so kernels can be assigned to phases afterwards)."""
    with record_function(MARK + name):
        pass


@contextlib.contextmanager
def phase(times: dict, name: str):
    """Time one phase of the step into times[f"time/{name}"] and mark its end in the trace (when profiling).
    On CUDA also its peak allocated and reserved memory, times[f"mem/{name}_gib"] and [f"mem/{name}_reserved_gib"]
    (offload.memory_table prints them)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    yield
    times[f"time/{name}"] = time.perf_counter() - t0
    if cuda:
        times[f"mem/{name}_gib"] = torch.cuda.max_memory_allocated() / 2**30
        times[f"mem/{name}_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    mark(name)


def busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: kernels on several streams may overlap."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def summarize(trace: dict) -> tuple[list[tuple], dict, dict]:
    """From a Chrome trace: per phase (name, wall us, kernel-busy us, collective us); kernel and host-op totals."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = sorted((e["ts"], e["name"][len(MARK):]) for e in events if e.get("name", "").startswith(MARK))
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel"]
    # cpu_op only: python_function spans nest, so summed they would count the same time many times
    host = [e for e in events if e.get("cat") == "cpu_op" and not e["name"].startswith(MARK)]
    begin = min([e["ts"] for e in events] or [0.0])
    phases, prev = [], begin
    for ts, name in marks:
        inside = [(max(a, prev), min(b, ts)) for a, b, _ in kernels if b > prev and a < ts]
        comm = [(a, b) for a, b, k in kernels if "nccl" in k.lower() and b > prev and a < ts]
        phases.append((name, ts - prev, busy(inside), busy([(max(a, prev), min(b, ts)) for a, b in comm])))
        prev = ts
    by_kernel: dict[str, list[float]] = {}
    for a, b, k in kernels:
        by_kernel.setdefault(k, []).append(b - a)
    by_op: dict[str, list[float]] = {}
    for e in host:
        by_op.setdefault(e["name"], []).append(e["dur"])
    return phases, by_kernel, by_op


def finish(prof: profile, run_dir: str, rank: int, step: int, top: int = 25):
    """Stop, write profile-rank{rank}.json.gz (the trace) and profile-rank{rank}.txt (the summary)."""
    prof.stop()
    os.makedirs(run_dir, exist_ok=True)       # rank 0 made it; another node's ranks may not see that one
    fd, raw = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
        phases, by_kernel, by_op = summarize(trace)
        final = os.path.join(run_dir, f"profile-rank{rank}.json.gz")
        with open(raw, "rb") as src, gzip.open(final + ".tmp", "wb") as dst:   # temporary name, then rename
            shutil.copyfileobj(src, dst)
        os.replace(final + ".tmp", final)
    finally:
        os.remove(raw)
    lines = [f"step {step}, rank {rank}: wall time per phase against GPU kernel time in it (ms)",
             f"{'phase':10s} {'wall':>9s} {'kernels':>9s} {'busy':>6s} {'nccl':>9s}"]
    for name, wall, kern, comm in phases + [("all", *(sum(p[i] for p in phases) for i in (1, 2, 3)))]:
        lines.append(f"{name:10s} {wall / 1e3:9.1f} {kern / 1e3:9.1f} {kern / max(wall, 1e-9):6.0%} {comm / 1e3:9.1f}")
    if not by_kernel:
        lines.append("(no GPU kernels were traced: a CPU run)")
    for title, table in (("kernels", by_kernel), ("host ops (self and children)", by_op)):
        lines += ["", f"top {title} by total time: total ms, calls, name"]
        for name, ds in sorted(table.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"{sum(ds) / 1e3:10.2f} {len(ds):7d}  {name[:110]}")
    path = os.path.join(run_dir, f"profile-rank{rank}.txt")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return path
