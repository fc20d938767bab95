"""tools/bench.py (W1) at toy shapes on CPU: the runner, its variants and its report work end to end."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_small_runs_variants(tmp_path):
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "tools/bench.py", "--small", "--parts", "ours,engine", "--ours", "4:ckpt,4:fused",
                        "--steps", "2", "--set", "prompts_per_step=6", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((out / "bench.json").read_text())
    assert results["_errors"] == {}
    for key in ("ours-4:ckpt", "ours-4:fused"):
        assert len(results[key]["steps_s"]) == 2 and results[key]["step_s"] > 0
        # --set overrides the shape's 4 prompts; tokens/s counts the 6 (x 2 samples x (8 + 8) tokens) that ran
        assert results[key]["tokens_per_s"] * results[key]["step_s"] == pytest.approx(6 * 2 * 16)
        assert "fused_loss=True" in results[key]["argv"] if "fused" in key else "fused_loss=False" in results[key]["argv"]
        log = (out / f"{key.replace(':', '-')}.log").read_text()
        assert "reward failures" not in log          # the reward workers import the bench's reward (once they could not)
    assert "fast: eager (CPU)" in results["engine"]["engine"]
    report = (out / "bench.md").read_text()
    assert "micro_batch_size=4, grad_checkpointing=True" in report and "fused_loss=True" in report
