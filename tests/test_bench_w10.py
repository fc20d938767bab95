"""tools/bench_w10.py on the CPU (--tiny): the table's rows, and --ab's twin rows with their ratios taken against
qwen2 under the same value of the variable."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tmp_path, *args):
    out = tmp_path / "w10.json"
    p = subprocess.run([sys.executable, "tools/bench_w10.py", "--tiny", "--no-hf", "--repeats", "2", "--json",
                        str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != "FAST_DECODE_SHARED_READS"})
    return p, (json.loads(out.read_text())["rows"] if out.exists() else None)


def test_ab_twins_each_value(tmp_path):
    p, rows = run(tmp_path, "--only", "qwen3", "--ab", "FAST_DECODE_SHARED_READS", "--check")
    assert p.returncode == 0, p.stdout + p.stderr
    names = [r["model"] for r in rows]
    assert names == [f"{m} FAST_DECODE_SHARED_READS={v}" for m in ("qwen2", "qwen3") for v in "01"]
    for r in rows:
        assert len(r["engine_times"]) == 2 and len(r["x_qwen2_rounds"]) == 2
        assert ("logprob_gap_mean" in r) == (r["ab"] == "1")          # the check runs for VAR=1 only
    q2 = {r["ab"]: r["engine_times"] for r in rows if r["model"].startswith("qwen2")}
    for r in rows:   # each ratio over qwen2's time under the same value, round by round
        want = [t / r["params_read"] / (b / rows[0]["params_read"]) for t, b in zip(r["engine_times"], q2[r["ab"]])]
        assert r["x_qwen2_rounds"] == want
    assert "| qwen3 FAST_DECODE_SHARED_READS=1 | FastDecoder |" in p.stdout


def test_unknown_model_is_named(tmp_path):
    p, rows = run(tmp_path, "--only", "qwen9")
    assert p.returncode != 0 and "unknown model(s) qwen9" in p.stderr and rows is None
