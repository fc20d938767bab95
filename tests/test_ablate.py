"""tools/ablate.py's steps-to-target statistic on synthetic curves whose answers are known, censored runs included
(no train.py run: tests/test_offline_and_ablate.py runs the script for real)."""
import numpy as np
import pytest

from tools import ablate


def curve(entry, seed, accs, every=5):
    """A run's metrics rows: held-out accuracy accs[i] at step i * every, row 0 the evaluation before training."""
    rows = [{"step": 0, "eval/accuracy": accs[0]}]
    for i, a in enumerate(accs[1:], 1):
        rows += [{"step": i * every - 1, "reward": 0.5}, {"step": i * every, "reward": 0.5, "eval/accuracy": a}]
    return {"entry": entry, "seed": seed, "rows": rows, "wall_s": 1.0}


def row_of(text, entry):
    return next(line for line in text.splitlines() if line.startswith(f"| `{entry}` |"))


def test_steps_to_is_the_first_evaluation_at_or_above_the_target():
    rows = curve("a", 0, [0.2, 0.7, 0.86, 0.8, 0.9])["rows"]
    assert ablate.steps_to(rows, 0.86) == (10.0, 10.0)      # equal counts as reached; the later dip does not matter
    assert ablate.steps_to(rows, 0.2) == (0.0, 0.0)         # reached before training
    assert ablate.steps_to(rows, 0.95) == (20.0, np.inf)    # censored: more than the last evaluated step, 20


def test_interval_ci_is_the_plain_bootstrap_without_censoring_and_open_with_it():
    rng = np.random.default_rng(0)
    x = np.array([10.0, 10.0, 10.0])
    assert ablate.interval_ci(x, x, rng) == (10.0, 10.0)
    x = np.array([0.0, 20.0])
    assert ablate.interval_ci(x, x, rng) == (0.0, 20.0)    # 10,000 draws include both all-0 and all-20
    lo, hi = np.array([10.0, 10.0, 30.0]), np.array([10.0, 10.0, np.inf])   # one censored at >30
    c_lo, c_hi = ablate.interval_ci(lo, hi, rng)
    assert c_lo == 10.0 and c_hi == np.inf   # the draws without the censored seed give the lower end


@pytest.mark.parametrize("lo, hi, text", [(40.0, 40.0, "40"), (41.5, 41.5, "41.5"), (30.0, np.inf, ">30"),
                                          (-np.inf, -5.0, "<-5"), (-np.inf, np.inf, "unknown"), (5.0, 15.0, "5..15")])
def test_bounds_print_as_bounds(lo, hi, text):
    assert ablate.fmt_bound(lo, hi) == text


def test_target_table_counts_a_censored_run_as_a_bound_not_a_number():
    # baseline a reaches 0.86 at step 10 on seeds 0 and 1 and never on seed 2 (20 steps); b at step 5 on every seed
    results = [curve("a", 0, [0.2, 0.5, 0.9, 0.9, 0.9]), curve("a", 1, [0.2, 0.6, 0.87, 0.9, 0.9]),
               curve("a", 2, [0.2, 0.5, 0.6, 0.7, 0.8]),
               *(curve("b", s, [0.2, 0.9, 0.9, 0.9, 0.9]) for s in range(3))]
    text = ablate.target_table(results, ["a", "b"], "a", 0.86, "0.860")
    cells = [c.strip() for c in row_of(text, "a").split("|")[2:-1]]
    assert cells[:3] == ["2/3", "10, 10, >20", ">13.3 [10.0, inf]"]   # mean >= (10+10+20)/3, upper end open
    cells = [c.strip() for c in row_of(text, "b").split("|")[2:-1]]
    assert cells[:3] == ["3/3", "5, 5, 5", "5 [5.0, 5.0]"]
    # paired: -5, -5 and (5 - more than 20) < -15: the mean is below -8.3, the CI's upper end -5 excludes 0
    assert cells[3:] == ["-5, -5, <-15", "<-8.3 [-inf, -5.0]", "fewer steps"]


def test_an_entry_without_a_finished_run_has_no_row():
    text = ablate.target_table([curve("a", 0, [0.2, 0.9]), curve("a", 1, [0.2, 0.9])], ["a", "b"], "a", 0.86, "0.860")
    assert "| `a` | 2/2 | 5, 5 |" in text and "`b`" not in text


def test_target_table_without_censoring_matches_the_plain_bootstrap():
    first = lambda k: [0.2] + [0.2] * k + [0.9] * (4 - k)     # reaches 0.9 at step 5 * (k + 1); never for k = 4
    results = [curve("a", s, first(k)) for s, k in enumerate([0, 1, 2])] + \
              [curve("b", s, first(k)) for s, k in enumerate([3, 3, 4])]
    text = ablate.target_table(results, ["a", "b"], "a", 0.86, "0.860")
    lo, hi = ablate.bootstrap_ci(np.array([5.0, 10.0, 15.0]), np.random.default_rng(0))
    assert f"| 3/3 | 5, 10, 15 | 10 [{lo:.1f}, {hi:.1f}] |" in row_of(text, "a")
    # b: 20, 20 and censored at >20 -> paired differences 15, 10 and more than 5: the mean is above 10
    assert "| 2/3 | 20, 20, >20 |" in row_of(text, "b") and "| 15, 10, >5 | >10 [5.0, inf] | more steps |" in row_of(text, "b")


def test_target_parses_fractions_and_refuses_garbage(capsys):
    assert ablate.parse_target("0.86") == (0.86, "0.860")
    value, label = ablate.parse_target("0.95*0.86")
    assert value == pytest.approx(0.817) and label == "0.95 x 0.86 = 0.817"
    for bad in ("0.9x", "86", "0.5*-1"):
        with pytest.raises(SystemExit):
            ablate.main(["--target", bad, "--out", "/nonexistent/never_made"])
        assert "--target must be" in capsys.readouterr().err
