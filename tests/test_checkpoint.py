"""Checkpoint/resume and the non-finite guard.

The kill test SIGKILLs a training subprocess at named points (RL_CRASH_AT, see checkpoint.crash_point): during a
rollout, in the middle of an update and in the middle of a checkpoint write. After each kill the checkpoint
directory must be loadable; the run then resumes by itself (out_dir holds a checkpoint) and, on CPU with a fixed
seed, must end with exactly the metrics, replay log and weights of an uninterrupted run.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import registry
import run_dir
from algos import grpo
from algos.common import Algorithm
from config import UserError
from conftest import script_here, train_here
from rewards.pool import RewardPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("time/", "tokens_per_s")
# float noise (CPU-model dependent): never compared exactly; the runs' rewards and losses check the weights
NOISE = (*TIMING, "logprob_mismatch/")


def small_run(model_dir, out_dir, *extra) -> list[str]:
    # replay on with |advantage| priority and two mini-batches per step: every piece of state matters
    return [f"model={model_dir}", f"out_dir={out_dir}", "steps=6", "prompts_per_step=2", "samples_per_prompt=4",
            "eval_every=3", "eval_size=8", "arithmetic.n_train=200", "arithmetic.n_eval=20", "save_every=1",
            "keep_checkpoints=2", "algo.minibatch_size=4", "replay.enabled=true", "replay.priority=advantage",
            "replay.max_uses=2", "replay.capacity=12", "threads=1", "progress=false", *extra]


def run_train(args, crash_at=None):
    env = {**os.environ, **({"RL_CRASH_AT": crash_at} if crash_at else {})}
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(NOISE)} for line in f]
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]     # the evaluation before training is a row
    return rows[1:]


def assert_checkpoints_whole(run_dir):
    """Every checkpoint directory under its final name is complete and loads."""
    root = os.path.join(run_dir, "checkpoints")
    names = [n for n in os.listdir(root) if checkpoint.STEP_DIR.match(n)]
    assert (checkpoint.latest(str(run_dir)) is not None) == bool(names)
    for name in names:
        d = os.path.join(root, name)
        meta = json.load(open(os.path.join(d, "meta.json")))
        assert f"step_{meta['step']:06d}" == name
        for f in ("model.safetensors", "model_optimizer.safetensors", "rank_state.safetensors"):
            assert load_file(os.path.join(d, f))
    return sorted(names)


def test_sigkill_anywhere_then_resume_is_exact(tmp_path, random_model_dir, capsys):
    base, killed = tmp_path / "base", tmp_path / "killed"
    train_here(small_run(random_model_dir, base))

    # killed while writing the first checkpoint: nothing to resume, and a fresh run refuses the directory (it
    # would overwrite its files) until it is removed
    r = run_train(small_run(random_model_dir, killed), crash_at="checkpoint:1")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert assert_checkpoints_whole(killed) == [] and len(metrics(killed)) == 1
    with pytest.raises(UserError, match="is not empty and holds no checkpoint to resume"):
        run_dir.check(str(killed), resuming=checkpoint.latest(str(killed)) is not None)
    shutil.rmtree(killed)
    # each later run resumes from the newest checkpoint the previous one left (save_every=1)
    for crash_at, expect in [("rollout:2", ["step_000001"]),
                             ("update:4", ["step_000002", "step_000003"]),       # keep_checkpoints=2
                             ("checkpoint:5", ["step_000003", "step_000004"])]:   # step_000005.tmp half written
        r = run_train(small_run(random_model_dir, killed), crash_at=crash_at)
        assert r.returncode == -signal.SIGKILL, (crash_at, r.stderr[-3000:])
        assert assert_checkpoints_whole(killed) == expect, crash_at
    assert os.path.isdir(killed / "checkpoints" / "step_000005.tmp")
    assert len(metrics(killed)) == 5            # step 5 was logged, but its checkpoint never completed

    # the newest checkpoint is damaged (a truncated copy): resume falls back to step 3 with a warning, and the
    # run still ends exactly as the uninterrupted one
    weights = killed / "checkpoints" / "step_000004" / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    capsys.readouterr()
    train_here(small_run(random_model_dir, killed))
    said = capsys.readouterr().out
    assert f"checkpoint {killed}/checkpoints/step_000004 is damaged" in said
    assert f"resuming from {killed}/checkpoints/step_000003" in said
    assert metrics(killed) == metrics(base)     # same steps, once each, same numbers (noise metrics aside)
    assert (killed / "replay.jsonl").read_bytes() == (base / "replay.jsonl").read_bytes()
    a, b = load_file(killed / "final" / "model.safetensors"), load_file(base / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert assert_checkpoints_whole(killed) == ["step_000005", "step_000006"]

    # resume=<an older checkpoint> rewinds: later checkpoints go, steps 6.. run again, identically
    train_here(small_run(random_model_dir, killed)[1:] + [f"resume={killed}/checkpoints/step_000005"])
    assert metrics(killed) == metrics(base)


def test_default_on_policy_resume_is_exact(tmp_path, random_model_dir, capsys):
    args = lambda out: [f"model={random_model_dir}", f"out_dir={out}", "steps=4", "prompts_per_step=2",
                        "samples_per_prompt=4", "eval_every=2", "eval_size=8", "arithmetic.n_train=200",
                        "arithmetic.n_eval=20", "save_every=2", "algo.epochs=2", "threads=1", "progress=false"]
    train_here(args(tmp_path / "base"))
    r = run_train(args(tmp_path / "killed"), crash_at="update:3")   # second of two PPO epochs never runs
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    capsys.readouterr()
    train_here(args(tmp_path / "killed"))
    assert metrics(tmp_path / "killed") == metrics(tmp_path / "base")
    assert " over 2 steps; " in capsys.readouterr().out   # the summary counts the steps this run did (3 and 4)


def test_ppo_resume_restores_the_critic(tmp_path, random_model_dir):
    """PPO's value model and its optimizer are part of the state: a resumed PPO run logs the same values."""
    args = lambda out: [f"model={random_model_dir}", f"out_dir={out}", "steps=4", "prompts_per_step=2",
                        "samples_per_prompt=4", "eval_every=2", "eval_size=8", "arithmetic.n_train=200",
                        "arithmetic.n_eval=20", "save_every=2", "algo.name=ppo", "threads=1", "progress=false"]
    train_here(args(tmp_path / "base"))
    r = run_train(args(tmp_path / "killed"), crash_at="rollout:3")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert os.path.exists(tmp_path / "killed" / "checkpoints" / "step_000002" / "critic.safetensors")
    train_here(args(tmp_path / "killed"))
    rows = metrics(tmp_path / "killed")
    assert rows == metrics(tmp_path / "base") and all("value_loss" in row for row in rows)


def test_resume_errors_are_one_line(tmp_path, random_model_dir):
    r = script_here("train.py", [f"model={random_model_dir}", f"resume={tmp_path}/nothing", "progress=false"])
    assert r.returncode == 2 and r.stderr.strip() == \
        f"error: resume='{tmp_path}/nothing' is neither a checkpoint nor a run directory holding one"


def test_a_checkpoint_that_does_not_load_changes_nothing_on_disk(tmp_path, random_model_dir, monkeypatch):
    """A checkpoint of another model: a one-line error, and the run directory exactly as it was (config.yaml used
    to be rewritten before the checkpoint loaded)."""
    import run_setup
    import train
    from test_bad_input import snapshot, tiny_checkpoints
    run = tmp_path / "run"
    tiny_checkpoints(str(run))                         # a linear policy's: it does not fit the random model
    (run / "config.yaml").write_text("the run's own\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    before = snapshot(run)
    pools = []
    monkeypatch.setattr(run_setup, "RewardPool", lambda *a, **kw: pools.append(RewardPool(*a, **kw)) or pools[-1])
    try:
        with pytest.raises(UserError, match="does not fit this model"):
            train.main([f"resume={run}", f"model={random_model_dir}", "arithmetic.n_train=50", "arithmetic.n_eval=8",
                        "reward_workers=1", "progress=false"])
    finally:
        for pool in pools:
            pool.close()
    assert snapshot(run) == before


def nan_algo(monkeypatch, bad_calls):
    """GRPO whose loss (odd calls) or gradient (even calls) is non-finite on the given update numbers."""
    calls = []

    def loss_fn(new, batch, cfg):
        loss, m = grpo.clipped_policy_loss(new, batch, cfg)
        calls.append(1)
        if bad_calls == "all" or len(calls) in bad_calls:
            if len(calls) % 2:
                loss = loss * float("nan")
            else:   # finite value, NaN gradient: d sqrt(x)/dx is inf at 0, times d(x - x) = 0
                s = new["logprobs"].sum()
                loss = loss + torch.sqrt(s - s)
        return loss, m
    monkeypatch.setitem(registry._REGISTRY["algo"], "nan_test", Algorithm(grpo.grpo_advantages, loss_fn))


def nan_run(model_dir, out_dir, *extra):
    return [f"model={model_dir}", f"out_dir={out_dir}", "algo.name=nan_test", "steps=5", "prompts_per_step=2",
            "samples_per_prompt=4", "eval_every=5", "eval_size=8", "arithmetic.n_train=200", "arithmetic.n_eval=20",
            "max_bad_updates=3", "progress=false", *extra]


def test_non_finite_updates_are_skipped_and_the_run_goes_on(tmp_path, random_model_dir, monkeypatch):
    import train
    nan_algo(monkeypatch, {2, 3})                 # steps 2 (NaN gradient) and 3 (NaN loss); one update per step
    train.main(nan_run(random_model_dir, tmp_path / "run"))
    rows = metrics(tmp_path / "run")
    assert [r["skipped_updates"] for r in rows] == [0, 1, 1, 0, 0]
    assert math.isfinite(rows[1]["loss"]) and math.isnan(rows[1]["grad_norm"]) and math.isnan(rows[2]["loss"])
    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert checkpoint.latest(str(tmp_path / "run")).endswith("step_000005")


def test_too_many_non_finite_updates_stop_with_a_checkpoint(tmp_path, random_model_dir, monkeypatch):
    import train
    from config import UserError
    nan_algo(monkeypatch, "all")
    with pytest.raises(UserError, match=r"3 updates in a row had a non-finite loss or gradient \(last at step 3\); "
                                        r"stopped with a checkpoint in .*step_000003"):
        train.main(nan_run(random_model_dir, tmp_path / "run"))
    assert [r["skipped_updates"] for r in metrics(tmp_path / "run")] == [1, 1, 1]
    assert checkpoint.latest(str(tmp_path / "run")).endswith("step_000003")


def _two_rank_worker(rank: int, init_file: str, run_dir: str):
    """One of two gloo ranks: train a step, save (rank 0 writes), rebuild from scratch, load, compare."""
    import torch.distributed as dist
    from config import Config
    from buffer import ReplayBuffer
    from config import ReplayConfig
    from test_replay import make_batch
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        buf = ReplayBuffer(ReplayConfig(enabled=True), os.path.join(run_dir, f"replay.rank{rank}.jsonl"))
        return model, opt, sched, buf, {"data": torch.Generator(), "sample": torch.Generator()}

    model, opt, sched, buf, gens = build()
    model(torch.randn(3, 4)).sum().backward()
    opt.step(), sched.step()
    buf.add(make_batch(2 + rank, version=rank, seed=rank))           # each rank holds its own samples
    gens["sample"].manual_seed(100 + rank)
    torch.rand(rank + 1, generator=gens["sample"])
    torch.manual_seed(7 + rank)
    order = torch.randperm(10 + rank)
    written = checkpoint.save(run_dir, Config(), 3, 2, model, opt, sched, buf, gens, order, 5, {"start": {}})
    assert (written is not None) == (rank == 0)                      # rank 0 alone writes
    expect = {"sample": gens["sample"].get_state(), "torch": torch.get_rng_state(), "uid": buf.uid.clone(),
              "params": [p.detach().clone() for p in model.parameters()], "lr": sched.get_last_lr()}

    model, opt, sched, buf, gens = build()
    s = checkpoint.load(os.path.join(run_dir, "checkpoints", "step_000003"), model, opt, sched, buf, gens)
    assert s["step"] == 3 and s["version"] == 2 and s["cursor"] == 5 and len(s["order"]) == 10 + rank
    assert torch.equal(gens["sample"].get_state(), expect["sample"])
    assert torch.equal(torch.get_rng_state(), expect["torch"])
    assert torch.equal(buf.uid, expect["uid"]) and len(buf) == 2 + rank
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), expect["params"]))
    assert sched.get_last_lr() == expect["lr"] and len(opt.state) == 4
    dist.barrier()   # no early teardown: gloo can abort a peer that is still working
    dist.destroy_process_group()


def test_two_ranks_rank0_writes_every_rank_loads_its_own_state(tmp_path):
    import torch.multiprocessing as mp
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # forked from this process: a spawned rank would import torch and the project again first
    mp.start_processes(_two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="fork")
