"""tools/bench_w5x4.py (W5 on 4 GPUs) without launching a run: the prompts each placement can split, the timeout
that must leave no process behind, the error line, and the table against hand-computed figures.
The CPU dry run itself (`python tools/bench_w5x4.py OUT --cpu`) takes 75-140 s per 4-process placement on 2 cores,
too slow for CI: docs/benchmarks.md ("W5 on 4 GPUs") has its command."""
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import bench_w5x4 as w5  # noqa: E402

BY_NAME = {p.name: p for p in w5.PLACEMENTS}


def test_prompts_are_whole_shares():
    got = {name: w5.prompts_for(p, 16) for name, p in BY_NAME.items()}
    assert got == {"sync-1gpu": 16, "async-3+1": 15, "async-2+2-fsdp": 16, "replicate-4": 16, "replicate-4-x4": 64,
                   "async-2+2-rep-x2": 32}
    assert w5.prompts_for(BY_NAME["async-3+1"], 4) == 3   # the CPU's toy shape
    assert "rollout_ranks=3" in w5.settings(BY_NAME["async-3+1"], 15, cpu=True).split()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has exited
    except FileNotFoundError:
        return False


# a launcher whose child sleeps in a session of its own, as torchrun's workers do (sh starts in milliseconds)
SPAWN = ["sh", "-c", 'setsid sleep 300 & echo $! > "$0"; sleep 300']


def gone(pid: int) -> bool:
    for _ in range(50):   # SIGKILL is delivered asynchronously
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_timeout_kills_the_tree(tmp_path):
    """A launcher whose child lives in a session of its own (as torchrun's workers do): both end on the timeout."""
    pidfile = tmp_path / "child.pid"
    t0 = time.perf_counter()
    err = w5.run_one([*SPAWN, str(pidfile)], dict(os.environ), str(tmp_path / "run.log"), 3)
    assert err == "timed out after 3 s" and time.perf_counter() - t0 < 30
    assert gone(int(pidfile.read_text()))


def test_stopped_script_ends_the_tree(tmp_path):
    """The script stopped mid-placement (main turns SIGTERM into an exception; here a timer's): no rank survives."""
    pidfile = tmp_path / "child.pid"

    def interrupt(*_):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 2)
        with pytest.raises(KeyboardInterrupt):
            w5.run_one([*SPAWN, str(pidfile)], dict(os.environ), str(tmp_path / "run.log"), 120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert gone(int(pidfile.read_text()))


def test_error_line_names_the_cause(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("step 1\n[rank0]: Traceback (most recent call last):\n"
                   "[rank0]: config.UserError: prompts_per_step=16 must be divisible by rollout_ranks (3)\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\n")
    assert w5.error_line(str(log)).endswith("must be divisible by rollout_ranks (3)")
    assert w5.run_one([sys.executable, "-c", "raise SystemExit('ValueError: bad thing')"], dict(os.environ),
                      str(log), 60) == "exit 1: ValueError: bad thing"


def result(name: str, prompts: int, step: float | None, split: dict, error: str = "") -> dict:
    p = BY_NAME[name]
    r = {"placement": p.__dict__, "prompts": prompts, "samples": prompts * 8, "split_s": split}
    return {**r, "step_s": step, "steps_s": [step] * 3} if step else {**r, "error": error}


def test_report_by_hand():
    """1 GPU: 128 samples in 0.8 s (rollout 0.4, update 0.3, logprobs 0.1). 2 + 2 FSDP2: 128 in 0.4 s = 2.00x;
    plan.py (F=0.75): rollout 0.4*(0.75 + 0.25/2) = 0.35, training 0.4/2 + 0.02 = 0.22, + 0.01 = 0.36 s:
    error (0.36 - 0.4) / 0.4 = -10%, predicted 0.8 / 0.36 = 2.22x."""
    results = {"sync-1gpu": result("sync-1gpu", 16, 0.8, {"rollout": 0.4, "update": 0.3, "logprobs": 0.1}),
               "async-2+2-fsdp": result("async-2+2-fsdp", 16, 0.4, {"rollout": 0.35, "update": 0.2, "sync": 0.01,
                                                                    "trainer_idle": 0.15, "rollout_idle": 0.0}),
               "replicate-4": result("replicate-4", 16, None, {}, "timed out after 150 s")}
    text = w5.report(results, "4 GPUs: test", 8, cpu=False)
    row = next(x for x in text.splitlines() if x.startswith("| async-2+2-fsdp"))
    assert "| 0.400 s | 320.0 | **2.00x** | 0.360 s | 2.22x | -10% |" in row
    assert "timed out after 150 s" in next(x for x in text.splitlines() if x.startswith("| replicate-4"))
    assert "async-2+2-fsdp, **2.00x**" in text and "not met" in text
    bound = next(x for x in text.splitlines() if x.startswith("- async-2+2-fsdp"))
    assert "rollout ranks (generate): generate 0.350 s, trainer busy 0.250 s" in bound
