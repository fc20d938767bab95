"""rollout.py: run directly it samples, scores and reports with confidence intervals; accuracy and pass@k come from
the named verifier (accuracy_reward), never from the total reward reaching the sum of the weights."""
import json
import os
import sys

import pytest
import torch

import registry
import rollout
from config import Config, UserError
from conftest import step_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def length_penalty(prompt: str, completion: str, **_) -> float:
    """A shaping reward whose best is 0: minus a tenth of the completion's characters."""
    return -len(completion) / 10


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_run_directly_it_samples_scores_and_writes_what_the_viewer_reads(tmp_path, capsys, keep_threads):
    out = tmp_path / "eval"
    result = rollout.main(["n=4", "eval_size=8", "threads=1", "reward_workers=1", f"out_dir={out}"])
    printed = capsys.readouterr().out
    assert "pass@4" in printed and "bootstrap" in printed
    assert result["prompts"] == 8 and result["n"] == 4 and result["accuracy_reward"] == "arithmetic"
    for k in ("reward", "mean@4", "pass@1", "pass@2", "pass@4"):
        assert result[k]["low"] <= result[k]["value"] <= result[k]["high"], k
    assert result["pass@1"]["value"] == pytest.approx(result["mean@4"]["value"])
    assert result["pass@1"]["value"] <= result["pass@2"]["value"] <= result["pass@4"]["value"]
    recs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(recs) == 32 and json.loads((out / "eval.json").read_text())["n"] == 4
    # the printed mean@4 is the records' share of samples the verifier gave 1
    right = [r["rewards"]["arithmetic"] == 1.0 for r in recs]
    assert sum(right) / len(right) == pytest.approx(result["mean@4"]["value"])
    assert all(len(r["pieces"]) == len(r["logprobs"]) == len(r["tokens"]["completion"]) for r in recs)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import trajectories
        import view
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    assert "arithmetic" in view.build(str(out))
    batch = trajectories.read_scored(str(out / "trajectories.jsonl"), pad_id=0)
    assert len(batch) == 32 and torch.equal(batch.rewards, torch.tensor([r["reward"] for r in recs]))


def test_bad_options_are_one_line_errors_before_any_work(tmp_path):
    for args, message in [(["n=0"], "n must be"), (["split=test"], "split must be"),
                          (["accuracy_reward=format"], "accuracy_reward 'format' is not one of the rewards")]:
        with pytest.raises(UserError, match=message) as e:
            rollout.main(args + [f"out_dir={tmp_path / 'x'}"])
        assert "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()


def test_accuracy_name_defaults_to_the_first_reward():
    cfg = Config()
    cfg.rewards = "math:1.0,format:0.2"
    assert rollout.accuracy_name(cfg) == "math"
    cfg.accuracy_reward = "format"
    assert rollout.accuracy_name(cfg) == "format"
    info = {"per_reward": {"math": torch.tensor([1.0, 0.0, 1.0]), "format": torch.tensor([1.0, 1.0, 0.5])}}
    assert rollout.accuracy(info, cfg) == {"accuracy": pytest.approx(2 / 3)}
    cfg.accuracy_reward = ""
    assert rollout.accuracy(info, cfg) == {"accuracy": pytest.approx(2 / 3)}
    assert rollout.accuracy({"metrics": {"accuracy": 0.5}}, cfg) == {}   # episodes: their own success


def test_a_shaping_reward_whose_best_is_0_leaves_accuracy_and_pass_at_k_to_the_verifier(tmp_path, monkeypatch,
                                                                                        keep_threads):
    """Beside a length penalty (best 0) the total never reaches the sum of the weights: accuracy, the held-out
    accuracy and pass@k must still count the arithmetic verifier's right answers."""
    import train
    monkeypatch.setitem(registry._REGISTRY["reward"], "length_penalty", length_penalty)
    out = tmp_path / "run"
    train.main([f"out_dir={out}", "steps=1", "eval_every=1", "eval_size=24", "eval_k=2", "prompts_per_step=8",
                "samples_per_prompt=4", "rewards=arithmetic:1.0,length_penalty:0.5", "progress=false", "threads=1",
                "reward_workers=1"])
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    row = step_rows(out)[0]
    assert row["reward/length_penalty"] < 0
    assert row["accuracy"] == pytest.approx(row["reward/arithmetic"]) and row["accuracy"] > 0   # a 0/1 verifier
    for r in (start, row):
        assert r["eval/accuracy"] > 0 and 0 < r["eval/pass@1"] <= r["eval/pass@2"], r


def test_dynamic_sampling_keeps_each_reward_s_scores_of_the_rows_it_keeps(monkeypatch):
    """DAPO's rounds are cut to a full batch (train.draw): the verifier's scores must follow the same rows, or the
    accuracy of a multi-round step would count samples that never entered the batch."""
    import types
    import config
    import train
    from test_algos import batch_of
    # signal per group: round 1 [no, yes, no], round 2 [yes, yes, yes]: round 2's last group is surplus
    rounds = [[1, 1, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0]]
    calls = []

    def collect(run, step, times):
        r = rounds[len(calls)]
        calls.append(r)
        per_reward = {"arithmetic": torch.tensor(r, dtype=torch.float32), "length_penalty": -torch.ones(len(r))}
        return batch_of(r, [[1, 1, 0]] * len(r), [0, 0, 1, 1, 2, 2]), {"metrics": {}, "per_reward": per_reward}
    monkeypatch.setattr(train, "collect", collect)
    cfg = config.Config()
    cfg.algo.name, cfg.samples_per_prompt, cfg.prompts_per_step = "dapo", 2, 3
    cfg.rewards = "arithmetic:1.0,length_penalty:0.5"
    config.fill_defaults(cfg)
    run = types.SimpleNamespace(cfg=cfg, learner=types.SimpleNamespace(algo=registry.get("algo", "dapo")),
                                tok=types.SimpleNamespace(pad_token_id=0))
    batch, info, _, metrics = train.draw(run, 1, {})
    assert metrics["dynamic_sampling/rounds"] == 2 and len(batch) == 10   # 6 + 4: the surplus group dropped
    assert torch.equal(info["per_reward"]["arithmetic"], batch.rewards)
    assert rollout.accuracy(info, cfg) == {"accuracy": pytest.approx(5 / 10)}
