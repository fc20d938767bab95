"""profile_step: the phase summary's arithmetic on a hand-made trace, and train.py writing it."""
import gzip
import json

import profiling
import train


def test_busy_counts_overlapping_kernels_once():
    assert profiling.busy([]) == 0.0
    assert profiling.busy([(0, 10), (5, 15), (20, 25)]) == 20.0      # [0, 15) and [20, 25)
    assert profiling.busy([(0, 30), (5, 10), (12, 20)]) == 30.0      # nested in the first


def test_summarize_assigns_kernels_to_phases():
    k = lambda ts, dur, name="gemm": {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}   # noqa: E731
    m = lambda ts, phase: {"ph": "X", "cat": "user_annotation", "name": profiling.MARK + phase, "ts": ts, "dur": 0}  # noqa: E731
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 4},
        k(10, 20), k(25, 10),                   # rollout: busy 10..35 = 25 us, the two overlap
        m(50, "rollout"),
        k(45, 10),                              # straddles the mark: 5 us each side
        k(60, 5, "ncclDevKernel_ReduceScatter"), k(70, 10),
        m(100, "update"),
    ]}
    phases, by_kernel, by_op = profiling.summarize(trace)
    assert [p[0] for p in phases] == ["rollout", "update"]
    (_, wall_r, kern_r, comm_r), (_, wall_u, kern_u, comm_u) = phases
    assert (wall_r, kern_r, comm_r) == (50, 30, 0)         # 25 + the first 5 of the straddling kernel
    assert (wall_u, kern_u, comm_u) == (50, 20, 5)         # 5 + 5 (nccl) + 10
    assert sorted(len(v) for v in by_kernel.values()) == [1, 4] and by_op == {"aten::mm": [4]}


def test_train_profile_step_writes_summary_and_trace(tmp_path):
    out = tmp_path / "run"
    train.main(["steps=2", "profile_step=2", f"out_dir={out}", "progress=false", "eval_size=8"])
    text = (out / "profile-rank0.txt").read_text()
    for phase in ("rollout", "logprobs", "reward", "update", "sync", "log", "all"):
        assert f"\n{phase} " in text, phase
    assert "aten::" in text                    # host ops were traced
    with gzip.open(out / "profile-rank0.json.gz") as f:
        assert json.load(f)["traceEvents"]
    assert not list(out.glob("*.tmp"))
