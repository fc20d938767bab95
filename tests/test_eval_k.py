"""eval_k: n samples per held-out prompt give mean@n and the unbiased pass@k (rollout.py)."""
import math

import pytest

from conftest import step_rows
from rollout import pass_at, report_ks


def test_pass_at_k_by_hand():
    assert pass_at(4, 0, 1) == 0.0 and pass_at(4, 4, 2) == 1.0
    assert pass_at(4, 1, 1) == pytest.approx(0.25)             # pass@1 is the fraction correct
    assert pass_at(4, 1, 2) == pytest.approx(1 - 3 / 6)        # C(3,2)/C(4,2) = 3/6 pairs miss the one correct
    assert pass_at(5, 2, 3) == pytest.approx(1 - 1 / 10)       # C(3,3)/C(5,3)
    assert pass_at(3, 1, 3) == 1.0                             # every draw of 3 holds the correct one
    # against brute force over all k-subsets
    from itertools import combinations
    ok = [1, 0, 0, 1, 0, 0]
    for k in range(1, 7):
        subsets = list(combinations(ok, k))
        assert pass_at(6, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert report_ks(8) == [1, 2, 4, 8] and report_ks(6) == [1, 2, 4, 6] and report_ks(1) == [1]


def test_train_logs_pass_at_k_at_step_0_and_after(tmp_path, random_model_dir):
    import train
    out = tmp_path / "run"
    train.main([f"model={random_model_dir}", f"out_dir={out}", "steps=2", "eval_every=2", "eval_size=6", "eval_k=4",
                "prompts_per_step=2", "samples_per_prompt=2", "progress=false", "threads=1"])
    import json
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    last = step_rows(out)[-1]
    for row in (first, last):
        assert {"eval/mean@4", "eval/pass@1", "eval/pass@2", "eval/pass@4"} <= row.keys()
        assert row["eval/pass@1"] == pytest.approx(row["eval/mean@4"])
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"] <= 1 and math.isfinite(row["eval/accuracy"])
