"""Metric reductions over ranks (distributed.reduce_metrics): each metric declares how it reduces where it is made
(Sum, Max, Min, Mean, Ratio; a plain number by its name). Three gloo processes on CPU hold uneven counts, where the
mean of per-rank means is not the true value: the length of the correct answers is a Ratio of sums."""
import json
import os
import socket
import subprocess
import sys

import pytest

import distributed
from distributed import Max, Mean, Min, Ratio, Sum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each rank: the lengths of its correct answers (2, 1 and 5 of them) and of all its answers (4 each)
WORKER = """
import json, sys
import torch.distributed as dist
import distributed
from distributed import Max, Min, Ratio, Sum
dist.init_process_group("gloo")
r = dist.get_rank()
correct = [[4, 6], [10], [1, 1, 1, 1, 1]][r]
row = {"step": 7, "reward": [0.0, 0.5, 1.0][r], "correct_len": Ratio(sum(correct), len(correct)),
       "correct": Sum(len(correct)), "longest": Max(max(correct)), "shortest": Min(min(correct)),
       "time/update": [0.3, 0.1, 0.2][r], "reward_fail/code": [1, 0, 2][r], "gap/max": [0.5, 0.25, 0.125][r],
       "never": Ratio(0.0, 0.0), "name": f"rank {r}"}
if r == 1:
    row["only_rank_1"] = Ratio(3.0, 2.0)   # measured on one rank only: the others have no say
out = distributed.reduce_metrics(row)
if r == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_ranks_reduce_each_metric_as_declared():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    row = json.loads(outs[0][0])
    # 25 tokens over 8 correct answers; the mean of the ranks' means would say (5 + 10 + 1) / 3 = 5.33
    assert row["correct_len"] == pytest.approx(25 / 8)
    assert row["reward"] == pytest.approx(0.5)                                   # equal shares: the plain mean
    assert (row["correct"], row["longest"], row["shortest"]) == (8, 10, 1)
    assert row["time/update"] == 0.3 and row["gap/max"] == 0.5 and row["reward_fail/code"] == 3   # by name
    assert row["only_rank_1"] == 1.5 and "never" not in row                      # not measured: absent, never 0
    assert row["step"] == 7 and row["name"] == "rank 0"
    assert list(row)[:2] == ["step", "reward"]                                   # the order the row was made in


def test_one_process_keeps_numbers_as_made():
    row = distributed.reduce_metrics({"step": 1, "skipped_updates": 0, "tokens_per_s": Sum(12.5), "x": Mean(0.25),
                                      "m": Max(2.0), "n": Min(-1.0), "r": Ratio(3.0, 4.0), "none": Ratio(1.0, 0)})
    assert row == {"step": 1, "skipped_updates": 0, "tokens_per_s": 12.5, "x": 0.25, "m": 2.0, "n": -1.0, "r": 0.75}
    assert type(row["skipped_updates"]) is int
    with pytest.raises(TypeError, match="declared differently"):
        distributed.combine([Sum(1.0), Max(2.0)])


def test_dynamic_sampling_counts_add_up_over_ranks(monkeypatch):
    """DAPO's rounds (train.draw) count the groups each rank drew and found with signal: over ranks the step's
    counts are their sums, where a mean of the ranks' counts would report one rank's worth. Two ranks are played by
    two draws (each rank's own rounds; both draw 2, as every rank draws as many as the others), then reduced key
    by key as reduce_metrics does (distributed.combine of each rank's declared value)."""
    from test_algos import fake_rounds
    # 3 groups of 2 samples per round; signal: rank A [yes, no, no] then [yes, yes, no], rank B none then one
    ranks = [[[1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 1]], [[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 0, 0]]]
    made = [fake_rounds(monkeypatch, rounds, "dapo", max_rounds=2)[3] for rounds in ranks]
    row = {k: distributed.combine([distributed.declared(k, m[k]) for m in made]) for k in made[0]}
    assert row == {"dynamic_sampling/rounds": 2, "dynamic_sampling/groups_drawn": 12,
                   "dynamic_sampling/groups_with_signal": 4}
