"""Where the update phase's wall time goes, from a profile_step trace: GPU busy, idle gaps and what the host did.

    python train.py profile_step=3 ... ; python tools/update_profile.py RUN_DIR/profile-rank0.json.gz
    python tools/bench.py --parts ours --set 'profile_step=3' --steps 3 --out OUT
    python tools/update_profile.py OUT/ours-128-ckpt-compile-np1-profile-rank0.json.gz

profiling.py's summary gives a phase's wall against its kernel time; this says why they differ: the GPU's idle
gaps inside the phase (sorted, with the host calls that ended each one: a sync that drained the queue, or the
launch the GPU waited for), the time the host spent blocked in synchronising calls, and the launches per second
the host managed. A phase whose GPU idles while the host is not blocked is launch-bound (too many launches);
one whose idle time sits behind syncs waits for transfers of values to the host.
"""
import gzip
import json
import sys

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")   # blocking calls
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaMemsetAsync", "cudaMemcpyAsync")


def load(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]


def window(events: list[dict], phase: str) -> tuple[float, float]:
    """(start, end) of a phase: from the previous phase's end mark to its own (profiling.mark)."""
    marks = sorted((e["ts"], e["name"].split(":", 1)[1]) for e in events if e.get("name", "").startswith("phase_end:"))
    begin = min(e["ts"] for e in events)
    for (t0, _), (t1, name) in zip([(begin, "")] + marks, marks):
        if name == phase:
            return t0, t1
    raise SystemExit(f"no phase '{phase}' in the trace; phases: {[n for _, n in marks]}")


def report(events: list[dict], phase: str = "update", top: int = 12) -> str:
    t0, t1 = window(events, phase)
    inside = [e for e in events if t0 <= e["ts"] < t1]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in inside if e.get("cat") == "kernel")
    runtime = [e for e in inside if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    busy, gaps, reach = 0.0, [], t0
    for a, b, _ in kernels:
        if a > reach:
            gaps.append((a - reach, reach, a))
        busy += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    gaps.append((t1 - reach, reach, t1))
    wall = t1 - t0
    syncs = [e for e in runtime if e["name"].startswith(SYNCS) and not e["name"].startswith("cudaMemcpyAsync")]
    launches = [e for e in runtime if e["name"].startswith(LAUNCHES)]
    lines = [f"phase {phase}: wall {wall / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({busy / wall:.0%}), "
             f"{len(kernels)} kernels, {len(launches)} launch calls ({sum(e['dur'] for e in launches) / 1e3:.1f} ms "
             f"of host time in them), {len(syncs)} blocking calls ({sum(e['dur'] for e in syncs) / 1e3:.1f} ms)",
             f"idle: {sum(g for g, _, _ in gaps) / 1e3:.1f} ms in {len(gaps)} gaps; "
             f"{sum(g for g, _, _ in gaps if g >= 50) / 1e3:.1f} ms in gaps >= 50 us, "
             f"{sum(g for g, _, _ in gaps if g < 10) / 1e3:.1f} ms in gaps < 10 us",
             "", f"largest idle gaps: us, start (ms into the phase), the host calls that ended it"]
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        near = sorted((e for e in runtime if a - 50 <= e["ts"] <= b), key=lambda e: e["ts"])
        names = [f"{e['name']}({e['dur']:.0f})" for e in near if e["dur"] > 20 or e["name"].startswith(SYNCS)][-4:]
        lines.append(f"{g:9.0f} {(a - t0) / 1e3:8.1f}  {' '.join(names)}")
    ops: dict[str, list[float]] = {}
    for e in inside:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e["name"], []).append(e["dur"])
    lines += ["", "host ops by total time (nested ones count in their parents too): ms, calls, name"]
    for name, ds in sorted(ops.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"{sum(ds) / 1e3:9.2f} {len(ds):7d}  {name[:100]}")
    per: dict[str, list[float]] = {}
    for a, b, k in kernels:
        per.setdefault(k, []).append(b - a)
    lines += ["", "kernels by total time: ms, calls, name"]
    for name, ds in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:20]:
        lines.append(f"{sum(ds) / 1e3:9.2f} {len(ds):7d}  {name[:100]}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__.strip().splitlines()[0] + "\nusage: python tools/update_profile.py TRACE.json[.gz] [PHASE]")
    print(report(load(sys.argv[1]), *(sys.argv[2:3] or ["update"])))
