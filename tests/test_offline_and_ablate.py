"""Tier-2 smoke tests of the offline preference script (train_dpo.py), the shipped preference file and tools/ablate.py."""
import json
import os

import pytest
from conftest import script_here, step_rows  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shipped_preferences_match_the_task_and_are_right_vs_wrong():
    from tools.make_preferences import make_pairs
    from registry import get
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "assets", "arithmetic_prefs.jsonl"))]
    # the file is what the script writes from the task as it is now (rerun tools/make_preferences.py if tasks/arithmetic.py changed)
    assert rows == make_pairs(len(rows)), "assets/arithmetic_prefs.jsonl is stale: run python tools/make_preferences.py"
    verify = get("reward", "arithmetic")
    for r in rows:
        assert verify(r["prompt"], r["chosen"], answer=r["chosen"]) == 1.0
        assert verify(r["prompt"], r["rejected"], answer=r["chosen"]) == 0.0
        assert sum(a != b for a, b in zip(r["chosen"], r["rejected"])) == 1   # one digit off


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_offline_dpo_raises_the_margin(loss, random_model_dir, tmp_path):
    import train_dpo
    prefs = tmp_path / "p.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)}) + "\n"
                             for a in range(8)))
    out = train_dpo.main([f"model={random_model_dir}", f"algo.dpo.data={prefs}", f"algo.dpo.loss={loss}", "steps=6",
                          "prompts_per_step=8", "lr=3e-3", "eval_every=6", "eval_size=8", f"out_dir={tmp_path / 'run'}"])
    rows = step_rows(out["run_dir"])
    assert rows[-1]["margin"] > rows[0]["margin"] and rows[-1]["loss"] < rows[0]["loss"]   # same 8 pairs each step
    assert out["best_accuracy"] >= max(out["start_accuracy"], out["end_accuracy"]) and out["best_step"] in (0, 6)
    assert os.path.exists(os.path.join(out["run_dir"], "final", "config.json"))


def test_offline_dpo_bad_file_is_one_line_error(random_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2"}\n')
    for path, message in [(tmp_path / "none.jsonl", "cannot read preference file"), (bad, "line 1 needs string fields")]:
        r = script_here("train_dpo.py", [f"model={random_model_dir}", f"algo.dpo.data={path}"])   # in this process
        err = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(err) == 1 and message in err[0], r.stderr[-1000:]


def test_ablate_runs_entries_x_seeds_and_writes_plot_and_table(random_model_dir, tmp_path, capsys):
    from tools import ablate
    text = ablate.main(["--runs", "grpo,rloo:algo.loss_agg=seq-mean-token-mean", "--seeds", "0,1",
                        "--out", str(tmp_path), f"model={random_model_dir}", "steps=2", "eval_every=1", "eval_size=8",
                        "prompts_per_step=2", "samples_per_prompt=2"])
    assert (tmp_path / "curves.png").stat().st_size > 0
    table = (tmp_path / "results.md").read_text()
    assert table == text and "| `grpo` | 2 |" in table and "| `rloo:algo.loss_agg=seq-mean-token-mean` | 2 |" in table
    cfg = (tmp_path / "rloo__algo.loss_agg=seq-mean-token-mean" / "seed1" / "config.yaml").read_text()
    assert "name: rloo" in cfg and "loss_agg: seq-mean-token-mean" in cfg and "seed: 1" in cfg
    out = capsys.readouterr().out   # a line as each run starts and ends, not silence until the table
    assert out.startswith("4 runs (2 entries x 2 seeds)") and "[1/4] grpo seed 0: started" in out
    assert out.count(": done in ") == 4 and "[4/4] rloo:algo.loss_agg=seq-mean-token-mean seed 1: done in" in out


def fake_run(entry, seed, accs, steps=(0, 5, 10)):
    rows = [{"step": 0, "eval/accuracy": accs[0]}] + [
        {"step": s, "reward": 0.5, **({"eval/accuracy": a} if s in steps else {})} for s, a in zip(steps[1:], accs[1:])]
    return {"entry": entry, "seed": seed, "rows": rows, "wall_s": 1.0}


def test_ablate_statistics_by_hand():
    import numpy as np
    from tools import ablate
    assert ablate.summary(fake_run("a", 0, [0.2, 0.6, 0.4])["rows"]) == {
        "start": 0.2, "final": 0.4, "best": 0.6, "auc": (0.4 * 5 + 0.5 * 5) / 10}
    rng = np.random.default_rng(0)
    assert ablate.bootstrap_ci(np.array([0.3, 0.3, 0.3]), rng) == (0.3, 0.3)     # no spread, no width
    lo, hi = ablate.bootstrap_ci(np.array([0.0, 1.0]), rng)
    assert lo == 0.0 and hi == 1.0
    assert ablate.verdict(0.01, 0.2, 3) == "better" and ablate.verdict(-0.2, -0.01, 3) == "worse"
    assert ablate.verdict(-0.1, 0.2, 3) == "indistinguishable with 3 seeds"
    # b beats the baseline a by 0.3 on every seed (paired), although the seeds themselves spread widely
    results = [fake_run("a", s, [0.1, 0.2 + d, 0.2 + d]) for s, d in enumerate([0.0, 0.3, 0.5])] + \
              [fake_run("b", s, [0.1, 0.5 + d, 0.5 + d]) for s, d in enumerate([0.0, 0.3, 0.5])] + \
              [fake_run("c", s, [0.1, 0.2 + d, 0.2 + d + e]) for s, (d, e) in enumerate([(0.0, 0.1), (0.3, -0.1), (0.5, 0.0)])]
    text = ablate.table(results, ["a", "b", "c"], "a", "test")
    row = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert "| better |" in row["`b`"] and "0.300 [0.300, 0.300]" in row["`b`"]
    assert "indistinguishable with 3 seeds" in row["`c`"]


def test_ablate_restarts_a_run_interrupted_before_its_first_checkpoint(tmp_path):
    from tools import ablate
    d = ablate.run_dir(str(tmp_path), "grpo", 0)
    os.makedirs(d)
    (tmp_path / "grpo" / "seed0" / "metrics.jsonl").write_text("{half a line")   # killed before any checkpoint
    try:
        ablate.launch("grpo", 0, str(tmp_path), ["steps=0"], 10)   # steps=0: train.py refuses or runs nothing
    except RuntimeError:
        pass
    assert not (tmp_path / "grpo" / "seed0" / "metrics.jsonl").exists() or \
        (tmp_path / "grpo" / "seed0" / "metrics.jsonl").read_text() != "{half a line"


def test_train_dpo_refuses_a_used_out_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")             # another run's files
    r = script_here("train_dpo.py", [f"out_dir={tmp_path}"])   # its __main__ block, in this process
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: out_dir '{tmp_path}' is not empty and holds no checkpoint to resume (a run stopped before its first "
        f"save leaves one like it): to start that run again, remove it first (rm -r {tmp_path}), or choose a new "
        "out_dir"], r.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"
