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


def test_floor_rows(tmp_path):
    """--floor: the read rate in the json, each row's decode floor at that rate, and the per-parameter ratio at the
    floors, which is bytes per parameter over qwen2's (the rate cancels)."""
    p, rows = run(tmp_path, "--only", "qwen3,qwen3_moe", "--floor")
    assert p.returncode == 0, p.stdout + p.stderr
    rate = json.loads((tmp_path / "w10.json").read_text())["read_rate"]
    assert rate > 0
    q2 = rows[0]
    for r in rows:
        assert abs(r["decode_floor_s"] - 7 * r["bytes_per_step"] / rate) < 1e-12   # --tiny: 8 new tokens
        assert abs(r["x_floor"] - r["engine_s"] / r["decode_floor_s"]) < 1e-9
        want = (r["bytes_per_step"] / r["params_read"]) / (q2["bytes_per_step"] / q2["params_read"])
        assert abs(r["x_qwen2_at_floors"] - want) < 1e-12
    assert rows[2]["x_qwen2_at_floors"] > 1   # the experts a batch reads, over the top_k a token's parameters count
    assert "| qwen3_moe | " in p.stdout.split("x qwen2 per parameter at the floors")[1]


def test_floor_with_ab_fails_first(tmp_path):
    p, rows = run(tmp_path, "--floor", "--ab", "FAST_DECODE_SHARED_READS")
    assert p.returncode != 0 and "--floor and --ab do not combine" in p.stderr and rows is None
