"""tools/plan.py's placement model on round numbers: R=0.4 (F=0.5), U+L=0.4, A=0.02, W=0.01 (model: its docstring)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from plan import placement, plan  # noqa: E402

ROUND = dict(R=0.4, U=0.3, L=0.1, W=0.01, A=0.02, F=0.5)


def test_colocated_by_hand():
    assert placement(**ROUND, N=1) == pytest.approx(0.8)                   # R + U + L, no sync on one GPU
    # 4 GPUs, the same batch: 0.4*(0.5 + 0.5/4) + 0.4/4 + 0.02 + 0.01 = 0.25 + 0.12 + 0.01
    assert placement(**ROUND, N=4) == pytest.approx(0.38)
    # 4 GPUs at 4x the batch (each GPU the 1-GPU batch): 0.4*(0.5 + 0.5) + 0.4 + 0.02 + 0.01
    assert placement(**ROUND, N=4, s=4) == pytest.approx(0.83)


def test_async_by_hand():
    # 2 + 2 at 2x the batch: rollout 0.4*(0.5 + 0.5*2/2) = 0.4, training 0.4*2/2 + 0.02 = 0.42; overlapped + W
    assert placement(**ROUND, N=4, K=2, s=2) == pytest.approx(0.43)
    assert placement(**ROUND, N=4, K=2, s=2, staleness=0) == pytest.approx(0.83)   # in turn: 0.4 + 0.42 + 0.01
    # 3 + 1 at 3/4 of the batch (12 of 16 prompts): rollout 0.4*(0.5 + 0.5*0.25) = 0.25, one trainer 0.3: it bounds
    assert placement(**ROUND, N=4, K=3, s=0.75) == pytest.approx(0.31)


def test_plan_picks_the_best_split_at_a_scale():
    r = plan(**ROUND, N=4, s=2)
    assert r["K"] == 2 and r["async"] == pytest.approx(0.43) and r["sync"] == pytest.approx(0.4 * 0.75 + 0.2 + 0.03)
    assert plan(**ROUND, N=4)["async"] == pytest.approx(min(placement(**ROUND, N=4, K=k) for k in (1, 2, 3)))
