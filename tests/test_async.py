"""mode=async (async_rl.py, docs/async.md): the logical clock, the batch merge, partial-rollout segments (a scripted
engine), the bad-input errors, the decoupled loss by hand, and train.py end to end under torchrun on CPU (gloo):
- max_staleness=0 with one rollout and one trainer rank gives exactly the one-process synchronous run's metrics,
  with partial.budget_tokens set too (the staleness bound leaves no room for a second segment);
- kill -9 of the trainer mid-update and of rollout ranks mid-run, each followed by resume from the periodic
  checkpoint, ends exactly where an uninterrupted run does (the batches in flight and the partial trajectories
  travel in the checkpoint), and the rollout ranks' death ends the run with a rank named and a checkpoint instead
  of a hang (two resumes from such a checkpoint are identical: the FSDP test). The run has two rollout ranks,
  max_staleness=3 and partial rollouts, so it also shows that two runs of one config give identical metrics (the
  clock is logical, not wall time): that was a separate pair of runs before, the largest cost of this file;
- Ctrl-C (SIGINT to torchrun) finishes the step, saves, ends every rank cleanly and resumes exactly; a run whose
  every reward breaks stops after 3 steps with the synchronous loop's line.
The runs use the embedded tiny model (its rewards are not all zero, so the updates really move the weights).
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
from conftest import step_rows, train_here_beside

import checkpoint
import registry
from algos.common import clipped_policy_loss
from async_link import Clock, segments
from async_rl import advance, merge
from buffer import Experience
from config import Config, UserError, fill_defaults
from config_checks import validate
from engines.base import Rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMING = ("time/", "tokens_per_s")
# Noise metrics: timings, and the log-prob mismatch (float rounding of two forwards, which differs by CPU model
# and by how a batch is split over ranks). Exact comparisons leave them out; where a run's weights are in
# question the mismatch is compared loosely (MISMATCH_TOL: a wrong or stale weight moves it by far more).
NOISE = (*TIMING, "logprob_mismatch/")
MISMATCH_TOL = 1e-4
# arithmetic.n_train: every rank tokenizes the whole training set at start (20000 prompts by default, ~3 s of a
# CI core per rank); these runs draw at most 6 x 8 of them
SMALL = ["steps=4", "eval_every=2", "eval_size=16", "prompts_per_step=8", "samples_per_prompt=4", "threads=1",
         "progress=false", "reward_workers=1", "arithmetic.n_train=256"]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "train.py"]


def launch(*cmds, crash_at=None, here=()):
    """Start the commands side by side (most of their time is importing torch); -> [(returncode, output)].
    crash_at: RL_CRASH_AT for each command (checkpoint.crash_point), None for none. Meanwhile train.py with each
    argument list of `here` runs in this process (conftest.train_here: torch is imported already)."""
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**ENV, "RL_CRASH_AT": at or ""})
             for c, at in zip(cmds, crash_at or [None] * len(cmds))]
    train_here_beside(procs, here)
    return [(p.returncode, out) for p, out in ((p, p.communicate(timeout=300)[0]) for p in procs)]


def untimed(run_dir) -> list[dict]:
    """The rows' deterministic keys: every noise metric (NOISE) left out."""
    return [{k: v for k, v in r.items() if not k.startswith(NOISE)} for r in step_rows(run_dir)]


def same_noise(a: dict, b: dict) -> bool:
    """The two rows log the same mismatch keys, with values equal to float noise."""
    mis = [k for k in a if k.startswith("logprob_mismatch/")]
    return mis == [k for k in b if k.startswith("logprob_mismatch/")] and \
        all(b[k] == pytest.approx(a[k], abs=MISMATCH_TOL) for k in mis)


# ------------------------------------------------------------------------------------------- unit tests

def test_clock_is_a_function_of_step_numbers():
    c = Clock(staleness=2, steps=6)
    assert [c.weights_for(s) for s in range(1, 7)] == [0, 0, 0, 1, 2, 3]   # staleness min(s - 1, 2)
    assert c.prompts_after(0) == [1, 2, 3] and c.prompts_after(1) == [4] and c.prompts_after(4) == []
    sync = Clock(staleness=0, steps=3)
    assert [sync.weights_for(s) for s in (1, 2, 3)] == [0, 1, 2]            # the synchronous loop's
    assert sync.prompts_after(0) == [1] and sync.prompts_after(2) == [3]


def test_partial_clock_spends_staleness_on_segments():
    """max_new_tokens=8, budget 3: 3 segments wanted, max_staleness + 1 allowed; the rest is the iteration lag."""
    cfg = Config()
    cfg.max_new_tokens, cfg.max_staleness, cfg.partial.budget_tokens = 8, 3, 3
    assert segments(cfg) == 3
    c = Clock(staleness=3, steps=8, segments=3)
    assert c.lag == 1 and [c.weights_for(s) for s in range(1, 6)] == [0, 0, 1, 2, 3]   # iteration s's weights
    assert [c.start_weights(s) for s in range(1, 7)] == [0, 0, 0, 0, 1, 2]              # first segment's: oldest
    assert all(s - 1 - c.start_weights(s) <= 3 for s in range(1, 9))                    # never over the bound
    cfg.max_staleness = 0
    assert segments(cfg) == 1                      # staleness 0: every trajectory in one piece, as without budget
    cfg.max_staleness, cfg.partial.budget_tokens = 3, 8
    assert segments(cfg) == 1                      # a budget >= max_new_tokens never cuts


class Scripted:
    """An engine whose row with prompt [100 L] writes 100 L + 1, 100 L + 2, ... and EOS (1) as token L: the
    continuation of a cut row is what the uncut row would have written. Log-prob of a token = -token / 1000."""
    calls: list

    def generate(self, prompts, n, sampling, gen=None):
        self.calls.append((len(prompts), n, sampling.max_new_tokens))
        rows = [list(p) for p in prompts for _ in range(n)]
        outs = []
        for seq in rows:
            out = []
            while len(out) < sampling.max_new_tokens and (not out or out[-1] != 1):
                written = len(seq) - 1 + len(out)
                out.append(1 if written == seq[0] // 100 - 1 else (out or seq)[-1] + 1)
            outs.append(out)
        C, P = max(map(len, outs)), max(map(len, rows))
        ids = torch.tensor([[0] * (P - len(r)) + r + o + [0] * (C - len(o)) for r, o in zip(rows, outs)])
        attn = torch.tensor([[0] * (P - len(r)) + [1] * (len(r) + len(o)) + [0] * (C - len(o))
                             for r, o in zip(rows, outs)])
        cm = attn[:, P:].float()
        return Rollout(ids, attn, cm, -ids[:, P:].float() / 1000 * cm, torch.tensor([o[-1] != 1 for o in outs]),
                       torch.arange(len(prompts)).repeat_interleave(n))


def test_partial_segments_join_into_the_whole_trajectory():
    """Lengths 2, 5, 8 and 9 (> max_new_tokens=8) at budget 3: three iterations (versions 4, 5, 6) give the
    completions one uncut generate gives, each token tagged with its iteration's version."""
    cfg = Config()
    cfg.max_new_tokens, cfg.samples_per_prompt, cfg.partial.budget_tokens = 8, 1, 3
    eng = Scripted()
    eng.calls = []
    prompts = [[200], [500], [800], [900]]
    state = advance(eng, None, prompts, False, 4, cfg, None, 0)
    state = advance(eng, state, None, False, 5, cfg, None, 0)
    state = advance(eng, state, None, True, 6, cfg, None, 0)
    assert eng.calls == [(4, 1, 3), (3, 1, 3), (2, 1, 2)]     # rows still open: the 2-token one ended at once
    whole = eng.generate(prompts, 1, cfg, None)                 # Config has temperature/top_p/max_new_tokens
    for f in ("input_ids", "attention_mask", "completion_mask", "logprobs", "truncated"):
        assert torch.equal(state[f], getattr(whole, f)), f
    v = torch.tensor([4, 4, 4, 5, 5, 5, 6, 6])
    assert (state["versions"] * state["completion_mask"]).tolist() == \
           [(v * torch.tensor([1, 1] + [0] * 6)).tolist(), (v * torch.tensor([1] * 5 + [0] * 3)).tolist(),
            v.tolist(), v.tolist()]
    assert state["segments"].tolist() == [1, 2, 3, 3] and int(state["version0"]) == 4
    cfg.partial.budget_tokens = 0                               # off: one call, the engine's rollout as it is
    eng.calls = []
    state = advance(eng, None, prompts, True, 0, cfg, None, 0)
    assert eng.calls == [(4, 1, 8)] and torch.equal(state["input_ids"], whole.input_ids)


def test_old_segments_mask_or_weight_and_the_token_bound():
    """Trainer version 5, max_staleness 2. Row 0 has two segments (versions 3, 3 | 4), row 1 one (3, 3, 3, 3):
    mask keeps row 0's newest segment only and all of row 1; weight keeps every token (the TIS weight of each
    uses its own behaviour log-prob); a token of version 2 (3 old) stops the step. A trainer that holds row 1
    only (rows=[1], one of two trainer ranks) logs the whole batch's numbers and masks its own row."""
    from types import SimpleNamespace

    from async_rl import check_tokens
    cfg = Config()
    cfg.max_staleness, cfg.partial.budget_tokens = 2, 2
    versions, segs = torch.tensor([[3, 3, 4, 0], [3, 3, 3, 3]]), torch.tensor([2, 1])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])
    batch = SimpleNamespace(completion_mask=mask.clone())
    m = check_tokens(cfg, 5, 1, versions, segs, mask, batch)
    assert torch.equal(batch.completion_mask, mask) and "partial/masked_frac" not in m
    assert m["partial/frac"] == 0.5 and m["partial/segments"] == 1.5
    assert m["staleness/token_mean"] == pytest.approx((2 + 2 + 1 + 2 * 4) / 7)
    cfg.partial.old_segments = "mask"
    whole = check_tokens(cfg, 5, 1, versions, segs, mask, batch)
    assert batch.completion_mask.tolist() == [[0, 0, 1, 0], [1, 1, 1, 1]] and whole["partial/masked_frac"] == 2 / 7
    mine = SimpleNamespace(completion_mask=mask[1:].clone())
    assert check_tokens(cfg, 5, 1, versions, segs, mask, mine, torch.tensor([1])) == whole
    assert mine.completion_mask.tolist() == [[1, 1, 1, 1]]
    versions[1, 0] = 2
    with pytest.raises(RuntimeError, match="a token is 3 versions old"):
        check_tokens(cfg, 5, 1, versions, segs, mask, SimpleNamespace(completion_mask=mask.clone()))


def test_the_clock_is_checked_in_versions():
    """max_staleness=3, 2 segments (iteration i runs on step i - 3's weights): step 6's trajectories start on step
    2's weights and end on step 3's. In versions, not steps: an update skipped at step 1 makes versions 0, 0, 1, 2
    after steps 0..3. A token of a version no iteration of step 6 had stops the step; a lost step's batch, made
    again after a rollout rank died, may be fresher, never staler."""
    from async_rl import check_clock
    clock = Clock(staleness=3, steps=8, segments=2)
    published = {0: 0, 1: 0, 2: 1, 3: 2, 4: 3}
    first, mask = torch.tensor([1, 1]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    versions, newer = torch.tensor([[1, 1, 2], [1, 0, 0]]), torch.tensor([[1, 1, 3], [1, 0, 0]])   # (B, C)
    check_clock(clock, published, set(), 6, first, versions, mask)
    with pytest.raises(RuntimeError, match="tokens of \\[1, 3\\]: not the weights the clock assigns"):
        check_clock(clock, published, set(), 6, first, newer, mask)          # a token of step 4's weights
    check_clock(clock, published, {6}, 6, first, newer, mask)                # remade after the death: fresher
    with pytest.raises(RuntimeError, match="samples of versions \\[0, 1\\]"):
        check_clock(clock, published, {6}, 6, torch.tensor([0, 1]), versions, mask)   # staler: never
    # a checkpoint from before the history: not checked
    check_clock(clock, {4: 3}, {6}, 6, torch.tensor([0, 1]), versions, mask)


def test_a_dead_trainer_rank_is_named(monkeypatch):
    """Trainer rank 1 waiting for a batch's copy from trainer rank 0, which died: a one-line error naming it
    (the copies' group has the async_timeout_s timeout), as a dead rollout rank's is."""
    import torch.distributed as dist

    from async_link import Link
    link = Link.__new__(Link)
    link.cfg, link.T, link.K, link.trainer_objs = Config(), 2, 1, None

    def dead(*a, **k):
        raise RuntimeError("Connection closed by peer\nmore lines")
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", dead)
    with pytest.raises(UserError, match=r"^trainer rank 0 did not answer a batch's copy .*Connection closed by peer$"):
        link.share(None)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    with pytest.raises(UserError, match=r"^a trainer rank \(1\.\.1\) did not answer"):
        link.share([{}])


def test_a_dead_rollout_rank_stops_every_trainer_at_one_point(monkeypatch):
    """Trainer rank 0's broadcast to a dead rollout rank fails: it does not raise there but goes through every
    (name, tensor) pair (under FSDP each is a gather the other trainers are in), remembers why, and hands that to
    the other trainers in place of the next batch (fetch, then share), where every trainer raises RolloutDied before
    any state changes. lost_steps (max_staleness=3, 2 segments, so iteration i runs on step i - 3's weights): after
    step 3 with step 4 received, iteration 5 (step 2's weights) is gone, and with it step 6's first segments."""
    import torch.distributed as dist

    from async_checkpoint import Inflight, lost_steps
    from async_link import Link, RolloutDied
    from async_rl import Trainer, receive_until

    def dead(*a, **k):
        raise RuntimeError("Connection closed by peer")
    monkeypatch.setattr(dist, "broadcast_object_list", dead)
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: pytest.fail("a broadcast after the failure"))
    link = Link.__new__(Link)
    link.cfg, link.T, link.K, link.dead = Config(), 2, 1, None
    link.control = link.weights = None
    pulled = []

    def pairs():
        for i in range(3):
            pulled.append(i)
            yield f"w{i}", torch.zeros(1)
    link.publish(3, 3, {}, pairs())
    assert pulled == [0, 1, 2] and link.dead.startswith("rollout rank 2 did not answer a weight broadcast")
    assert link.fetch(4) == link.dead                                     # no receive tried: the marker at once
    s = Inflight(1, pending={p: [p] for p in (4, 5, 6, 7)}, received={4: []}, states=["state"])
    t = Trainer(Config(), link, None, None, 1, s)
    link.share = lambda msgs: link.dead                                   # trainer rank 1 gets trainer 0's word
    with pytest.raises(RolloutDied, match="did not answer a weight broadcast"):
        receive_until(t, 5)
    assert s.states == ["state"] and sorted(s.received) == [4]
    clock = Clock(staleness=3, steps=8, segments=2)
    assert lost_steps(s, clock, 3) == {5, 6}
    s.received[5] = []
    assert lost_steps(s, clock, 3) == set()                               # what a periodic checkpoint holds
    s.pending, s.received = {4: [4]}, {}
    assert lost_steps(s, Clock(staleness=0, steps=8), 3) == set()        # max_staleness=0: nothing is ever lost


class TrainerZero:
    """Trainer rank 0 as a rollout rank sees it (max_staleness=0, 2 steps, one rollout rank): the start weights
    with step 1's prompts, then step 1's weights with step 2's, or (ends) its stop message in their place. A SIGINT
    lands at each point named in `at` (signal.raise_signal: the handler runs there, as a real one's runs when the
    blocking call returns); at the point `gone` (receive1, barrier) the wait fails as when trainer rank 0 has exited."""
    K = 1

    def __init__(self, at=(), gone=None, ends=False):
        self.clock, self.at, self.gone, self.sent, self.points = Clock(0, 2), at, gone, [], []
        self.msgs = [{"t": 0, "version": 0, "prompts": {1: [0]}, "states": None},
                     {"stop": True} if ends else {"t": 1, "version": 1, "prompts": {2: [1]}}]

    def hit(self, point):
        self.points.append(point)
        if point in self.at:
            signal.raise_signal(signal.SIGINT)
        if point == self.gone:   # gloo's error; a receive's is async_link's line naming the rank
            raise (UserError("trainer rank 0 did not answer the next weights (died, ...): Connection closed by peer")
                   if point.startswith("receive") else RuntimeError("Connection closed by peer"))

    def receive_weights(self, params):
        n = sum(p.startswith("receive") for p in self.points)   # 0: the start, 1: step 1's weights
        self.hit(f"receive{n}")
        return self.msgs[n]

    def send(self, step, payload):
        self.sent.append(payload["stop"])

    def flush(self):
        self.hit("flush")


@pytest.fixture
def rollout_rank(monkeypatch):
    """-> run(link): async_rl.generate_loop as rollout rank 0 on a fake model, data, engine and barrier (no
    process group), under train.Stop as under torchrun -> what it returns, or "interrupted" (KeyboardInterrupt:
    train.py's line and exit 130); the test's own SIGINT handler is back afterwards."""
    import types

    import torch.distributed as dist

    import async_rl
    import train
    cfg = Config()
    cfg.steps, cfg.max_staleness = 2, 0
    engine = types.SimpleNamespace(load_weights=lambda named: None)

    def run(link):
        engine.close = lambda: link.hit("close")
        monkeypatch.setattr(async_rl, "setup_device", lambda cfg: (torch.device("cpu"), torch.float32))
        monkeypatch.setattr(async_rl, "load_model", lambda *a: link.hit("load") or
                            (torch.nn.Linear(1, 1), types.SimpleNamespace(pad_token_id=0)))
        monkeypatch.setattr(async_rl, "build_data", lambda *a: (None, None, [[5], [6]], None))
        monkeypatch.setattr(async_rl, "make_engine", lambda *a, **k: engine)
        monkeypatch.setattr(async_rl, "advance", lambda engine, state, ids, final, version, *a: {
            "versions": torch.full((1, 1), version), "segments": torch.ones(1, dtype=torch.long),
            "version0": torch.tensor(version)})
        monkeypatch.setattr(dist, "barrier", lambda *a, **k: link.hit("barrier"))
        try:
            return async_rl.generate_loop(cfg, link, types.SimpleNamespace(Stop=train.Stop), 0)
        except KeyboardInterrupt:   # a value, so that a wrong one fails the test instead of ending pytest's session
            return "interrupted"
    before = signal.getsignal(signal.SIGINT)
    # what a SIGINT does here depends on the process, not on generate_loop: say so where it is not Python's default
    # (a handler another test left, a blocked signal, a test thread), since the tests below would only see {}
    assert threading.current_thread() is threading.main_thread(), "signal handlers run in the main thread only"
    assert before is signal.default_int_handler, f"SIGINT's handler before the test is {before!r}, not Python's"
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "SIGINT is blocked in this thread"
    yield run
    assert signal.getsignal(signal.SIGINT) is before   # generate_loop put it back (Stop.restore)
    signal.signal(signal.SIGINT, before)                 # ... and if it did not, the next tests still get theirs


@pytest.mark.parametrize("at, stops", [
    ("receive0", ["SIGINT", "SIGINT"]),  # waiting for the first weights (trainer 0 sets up): with the first batch
    ("receive1", [None, "SIGINT"]),      # inside a blocking receive of the next weights: with the next batch
    ("flush", [None, None]),             # the last batch gone, the trainers still training (the CI failure)
    ("close", [None, None]),
    ("barrier", [None, None]),           # in the closing barrier itself
])
def test_a_signal_on_a_rollout_rank_waits_for_the_closing_barrier(rollout_rank, at, stops):
    """Ctrl-C reaches every rank (torchrun passes it on): a rollout rank remembers it until past its closing
    barrier, where the trainers, who finish the step, meet it. After its last batch it used to leave at once
    (KeyboardInterrupt: the handler was put back before that barrier), and the trainer's end_rollouts barrier
    failed with 'Connection closed by peer' (a fresh-clone CI run; reproduced with SIGINT after row 2)."""
    link = TrainerZero(at=(at,))
    assert rollout_rank(link) == {}                               # the trainers end the run, not this rank
    assert link.sent == stops and link.points[-1] == "barrier" and link.points.count("barrier") == 1
    link = TrainerZero(at=("receive1",), ends=True)               # their stop message in place of the weights
    assert rollout_rank(link) == {"stopped": "the trainers"} and link.sent == [None]
    assert link.points[-1] == "barrier" and link.points.count("barrier") == 1


def test_a_rollout_rank_interrupted_ends_as_interrupted(rollout_rank):
    """A signal while loading (before the first weights, as before the synchronous loop's first step) or a
    second signal abandons at once (KeyboardInterrupt); so does trainer rank 0 gone after a signal (it was
    interrupted where no train.Stop holds it: its set-up, train.finish): train.py's 'interrupted' line, not an
    error that blames trainer rank 0 or a traceback. Without a signal that error stays."""
    assert rollout_rank(TrainerZero(at=("load",))) == "interrupted"
    assert rollout_rank(TrainerZero(at=("receive1", "flush"))) == "interrupted"
    link = TrainerZero(at=("receive0",), gone="receive1")
    assert rollout_rank(link) == "interrupted" and "barrier" not in link.points
    assert rollout_rank(TrainerZero(at=("flush",), gone="barrier")) == "interrupted"
    with pytest.raises(UserError, match="^trainer rank 0 did not answer the next weights"):
        rollout_rank(TrainerZero(gone="receive1"))
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):
        rollout_rank(TrainerZero(gone="barrier"))


def test_merge_pads_prompts_left_and_completions_right():
    a = Rollout(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]), torch.tensor([[1.0]]), torch.tensor([[-1.0]]),
                torch.tensor([True]), torch.tensor([0]))                          # P=2, C=1
    b = Rollout(torch.tensor([[8, 9, 4], [8, 3, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]]),
                torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([[-2.0, -3.0], [-4.0, 0.0]]),
                torch.tensor([False, False]), torch.tensor([0, 0]))             # P=1, C=2
    m = merge([a, b], pad_id=0)
    assert m.input_ids.tolist() == [[5, 6, 7, 0], [0, 8, 9, 4], [0, 8, 3, 0]]    # (3, P=2 + C=2)
    assert m.attention_mask.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 0]]
    assert m.completion_mask.tolist() == [[1, 0], [1, 1], [1, 0]]
    assert m.logprobs.tolist() == [[-1, 0], [-2, -3], [-4, 0]]
    assert m.group_ids.tolist() == [0, 1, 1] and m.truncated.tolist() == [True, False, False]
    assert merge([a], 0) is a


@pytest.mark.parametrize("args, world, torchrun_env, message", [
    (["mode=async"], 2, False, "launch with torchrun"),
    (["mode=async", "rollout_ranks=2"], 2, True, "rollout_ranks=2 must be in 1..1"),
    (["mode=async", "rollout_ranks=0"], 2, True, "rollout_ranks=0 must be in 1..1"),
    (["mode=async", "max_staleness=-1"], 2, True, "'max_staleness' must be >= 0"),
    (["mode=async", "algo.tis=token", "algo.name=online_dpo"], 2, True, "cannot weight samples by the behaviour"),
    (["mode=async"], 2, True, "set algo.tis=token"),
    (["mode=async", "algo.tis=token", "prompts_per_step=3", "rollout_ranks=2"], 3, True, "divisible by rollout_ranks"),
    (["mode=async", "algo.tis=token", "rollout_ranks=1"], 4, True, "must be divisible by the trainer ranks"),
    (["mode=async", "algo.tis=token", "rollout_ranks=2", "prompts_per_step=8"], 5, True,
     "valid: a multiple of 6, e.g. 6, 12, 24, 48"),   # 2 rollout ranks and 3 trainer ranks
    (["mode=asynch"], 1, False, "'mode' must be one of sync, async"),
    (["mode=async", "algo.tis=token", "partial.budget_tokens=-1"], 2, True, "'partial.budget_tokens' must be >= 0"),
    (["partial.budget_tokens=4"], 1, False, "only mode=async has"),
    (["mode=async", "algo.tis=token", "partial.budget_tokens=4", "partial.old_segments=drop"], 2, True,
     "'partial.old_segments' must be one of weight, mask"),
])
def test_bad_async_input_is_one_line(monkeypatch, args, world, torchrun_env, message):
    from config import parse
    if torchrun_env:
        monkeypatch.setenv("RANK", "0")
    else:
        monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")) as e:
        validate(fill_defaults(parse(args)), world)
    assert "\n" not in str(e.value)


def test_async_staleness_zero_needs_no_correction(monkeypatch):
    from config import parse
    monkeypatch.setenv("RANK", "0")
    validate(fill_defaults(parse(["mode=async", "max_staleness=0", "algo.name=online_dpo"])), 2)   # no error
    validate(fill_defaults(parse(["mode=async", "algo.tis=seq"])), 2)


def test_decoupled_loss_by_hand():
    """The importance weight is pi_prox / pi_behav (old_logprobs vs the engine's sample_logprobs, truncated at
    tis_cap); the clip is around pi_prox. Two tokens, numbers chosen so every piece shows:
        token 1: ratio = 0.5 / 0.4 = 1.25 -> clipped to 1.2 (A = +1), w = min(0.4 / 0.2, 2) = 2: loss -2.4, no grad
        token 2: ratio = 0.25 / 0.25 = 1 (A = -1),              w = 0.25 / 0.5 = 0.5:     loss +0.5, d/dlogp = 0.5
    token-mean over the 2 tokens: loss -0.95, gradient (0, 0.25)."""
    cfg = Config().algo
    cfg.tis, cfg.tis_cap = "token", 2.0
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()                       # (1, 2) trainer, now
    batch = Experience(input_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3),
                       completion_mask=torch.ones(1, 2), sample_logprobs=torch.log(torch.tensor([[0.2, 0.5]])),
                       rewards=torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.long),
                       versions=torch.zeros(1, dtype=torch.long), truncated=torch.zeros(1, dtype=torch.bool),
                       old_logprobs=torch.log(torch.tensor([[0.4, 0.25]])), advantages=torch.tensor([[1.0, -1.0]]))
    loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(1, 2)}, batch, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-0.95, abs=1e-6)
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.25], abs=1e-6)
    assert m["tis_weight"].item() == pytest.approx(1.25) and m["clip_frac"].item() == pytest.approx(0.5)
    cfg.tis_cap = 1.5   # the cap truncates token 1's weight: -1.2 * 1.5 = -1.8
    loss, _ = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(1, 2)}, batch, cfg)
    assert loss.item() == pytest.approx((-1.8 + 0.5) / 2, abs=1e-6)
    cfg.tis = "mask_high"   # AReaL's: token 1's weight 2 is above the cap 1.5, so it leaves the loss (still counted)
    loss, m = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(1, 2)}, batch, cfg)
    assert loss.item() == pytest.approx((0.0 + 0.5) / 2, abs=1e-6) and m["tis_masked_frac"].item() == 0.5
    cfg.tis_cap = 2.5       # below the cap it stays, with its full weight 2
    loss, _ = clipped_policy_loss({"logprobs": logp, "entropy": torch.zeros(1, 2)}, batch, cfg)
    assert loss.item() == pytest.approx(-0.95, abs=1e-6)


def test_every_algorithm_but_pairs_takes_behaviour_logprobs():
    for name in registry.names("algo"):
        assert registry.get("algo", name).behaviour_weight == (name != "online_dpo"), name


# ------------------------------------------------------------------------------------ end to end (gloo)

def test_staleness_zero_equals_the_synchronous_run(tmp_path):
    """partial.budget_tokens=3 < max_new_tokens is set too: at max_staleness=0 no token may be a version old, so
    no trajectory is cut and the run stays the synchronous one, exactly. Beside it, two trainer ranks
    (parallel=fsdp, each on half of every batch's groups) and one rollout rank give the same metrics to 1e-6
    (the gradient is the mean of two halves' instead of one sum: float rounding apart, the same update), the
    log-prob mismatch (float noise, whose digits depend on the CPU model) to MISMATCH_TOL. FSDP
    rather than replicate: its weights reach the rollout rank through per-unit gathers (step 2's samples and
    rewards would differ if a gathered tensor went out wrong or stale) and reach the trainers' own engine copies
    before evaluation (step 2's eval/*). The samples are the one-process run's, not a 2-rank sync run's: the one
    rollout rank draws them all from the one-process sampling stream."""
    sync, asyn, two = tmp_path / "sync", tmp_path / "async", tmp_path / "two-trainers"
    (ra, out_a), (r2, out_2) = launch(
        [*torchrun(2), *SMALL, "mode=async", "max_staleness=0", f"out_dir={asyn}", "partial.budget_tokens=3"],
        [*torchrun(3), *SMALL, "steps=3", "mode=async", "max_staleness=0", "parallel=fsdp", f"out_dir={two}"],
        here=[[*SMALL, f"out_dir={sync}"]])
    assert ra == 0, out_a[-3000:]
    assert r2 == 0, out_2[-3000:]
    a, b = step_rows(sync), step_rows(asyn)
    assert len(a) == len(b) == 4
    assert a[0]["grad_norm"] > 0 and any(r["reward"] > 0 for r in a)    # real updates, not zero advantages
    for ra_, rb in zip(a, b):
        assert {k: v for k, v in ra_.items() if not k.startswith(NOISE)} == \
               {k: rb[k] for k in ra_ if not k.startswith(NOISE)}
        assert same_noise(ra_, rb) and "logprob_mismatch/max" in rb    # staleness 0: every sample is measured
        assert rb["staleness/max"] == 0 and rb["partial/segments"] == 1
    c = step_rows(two)
    assert len(c) == 3
    for ra_, rc in zip(a, c):
        assert all(rc[k] == pytest.approx(v, rel=1e-6, abs=1e-6) for k, v in ra_.items() if not k.startswith(NOISE))
        assert same_noise(ra_, rc)


def test_two_fsdp_trainers_resume_exactly(tmp_path):
    """One rollout rank, two trainer ranks sharding the policy with FSDP2 over the trainer group, max_staleness=2
    with partial rollouts (2 segments, so iteration s runs on step s - 2's weights): the trainers killed in step 3's
    update and resumed from checkpoint 2 train step 3 as an uninterrupted run does (trainer rank 0 alone talks to
    the rollout rank; the batches in flight travel in its checkpoint). That resumed run's rollout rank dies making
    step 4's batch, which checkpoint 3 needs: both trainers stop at the same point and write a checkpoint of step
    3 that marks step 4 lost. Resumed twice from it, the runs are identical; step 4's batch was made from step 3's
    weights instead of step 2's (fresher, flagged), and everything before it is the uninterrupted run's."""
    args = [*torchrun(3), *SMALL, "mode=async", "max_staleness=2", "algo.tis=token", "partial.budget_tokens=4",
            "save_every=1"]
    base, killed = tmp_path / "base", tmp_path / "killed"
    (rb, ob), (rk, ok) = launch([*args, f"out_dir={base}"], [*args, f"out_dir={killed}"], crash_at=[None, "update:3"])
    assert rb == 0, ob[-3000:]
    assert rk != 0 and len(step_rows(killed)) == 2, ok[-3000:]
    ((rk, ok),) = launch([*args, f"out_dir={killed}"], crash_at=["generate:4"])
    death = killed / "checkpoints" / "step_000003"
    said = rf"rollout rank 2 .*step 3's state is in {re.escape(str(death))} \(step 4's batch lost"
    assert rk != 0 and re.search(said, ok), ok[-3000:]
    assert checkpoint.damage(str(death)) is None
    rows = untimed(base)
    assert untimed(killed) == rows[:3] and len(rows) == 4
    shutil.copytree(killed, tmp_path / "again")
    runs = launch([*args, f"out_dir={killed}"], [*args, f"out_dir={tmp_path / 'again'}"])
    assert all(r == 0 for r, _ in runs), [o[-3000:] for _, o in runs]
    assert untimed(killed) == untimed(tmp_path / "again")
    resumed = untimed(killed)
    assert resumed[:3] == rows[:3] and "staleness/regenerated" not in rows[3]
    assert [r.get("staleness/regenerated") for r in resumed] == [None, None, None, 1.0]
    assert [r["staleness/max"] for r in rows] == [0, 1, 2, 2] and max(r["partial/frac"] for r in rows) > 0
    # step 4's second segments: step 3's weights (version 3) instead of step 2's, one version fresher; its first
    # segments (iteration 3, in checkpoint 3) keep theirs, so the oldest token, staleness/max, is as planned
    assert resumed[3]["staleness/max"] == 2 and resumed[3]["partial/frac"] > 0
    assert resumed[3]["staleness/token_mean"] < rows[3]["staleness/token_mean"]


def test_kill_and_resume_is_exact(tmp_path):
    """Two rollout ranks, max_staleness=3, partial.budget_tokens=4 of max_new_tokens=8 (2 segments, so the rollout
    iterations trail by 2 steps). Trainer SIGKILLed in step 3's update (checkpoint 2 holds steps 3 and 4's batches
    and step 5's half-written trajectories), resumed; the rollout ranks SIGKILLed generating step 5, resumed; the
    result equals an uninterrupted run, which also checks that two runs of one config are identical."""
    args = [*torchrun(3), *SMALL, "steps=5", "mode=async", "rollout_ranks=2", "max_staleness=3", "algo.tis=token",
            "partial.budget_tokens=4", "save_every=1"]
    base, killed = tmp_path / "base", tmp_path / "killed"
    (rb, ob), (rk, ok) = launch([*args, f"out_dir={base}"], [*args, f"out_dir={killed}"], crash_at=[None, "update:3"])
    assert rb == 0, ob[-3000:]
    assert rk != 0 and len(step_rows(killed)) == 2, ok[-3000:]              # step 3 never logged
    with open(killed / "checkpoints" / "step_000002" / "meta.json") as f:
        inflight = json.load(f)["extra"]["async"]
    assert sorted(inflight["received"]) == ["3", "4"] and inflight["partial"] == [[5], [5]]
    ((rk, ok),) = launch([*args, f"out_dir={killed}"], crash_at=["generate:5"])
    # named, and no hang, with a checkpoint of step 3 (save(3) needed step 5's batch, made from step 2's weights)
    death = killed / "checkpoints" / "step_000003"
    said = rf"rollout rank [12] .*step 3's state is in {re.escape(str(death))} \(step 5's batch lost"
    assert rk != 0 and re.search(said, ok), ok[-3000:]
    assert checkpoint.damage(str(death)) is None
    with open(death / "meta.json") as f:
        inflight = json.load(f)["extra"]["async"]
    assert sorted(inflight["received"]) == ["4"] and inflight["lost"] == [5] and inflight["partial"] == [[5], [5]]
    # the periodic checkpoint resumes exactly (the death checkpoint cannot: test_two_fsdp_trainers_resume_exactly)
    ((rk, ok),) = launch([*args, f"resume={killed / 'checkpoints' / 'step_000002'}"])
    assert rk == 0, ok[-3000:]
    rows = untimed(base)
    assert untimed(killed) == rows and len(rows) == 5
    assert [r["staleness/max"] for r in rows] == [0, 1, 2, 3, 3]             # min(step - 1, max_staleness)
    assert max(r["partial/frac"] for r in rows) > 0 and all(math.isfinite(r["tis_weight"]) for r in rows)
    assert step_rows(base)[-1]["time/rollout_idle"] >= 0
    # the log-prob mismatch is measured where the trainer holds the weights that sampled (staleness 0: step 1)
    # and absent elsewhere, never a 0.0 that reads as a perfect match (docs/async.md)
    full = step_rows(base)
    assert ["logprob_mismatch/max" in r for r in full] == [r["staleness/max"] == 0 for r in full] == \
        [True] + [False] * 4


def test_ctrl_c_finishes_the_step_saves_and_resumes_exactly(tmp_path):
    """Ctrl-C at the terminal (torchrun passes SIGINT on to every rank) with max_staleness=1, so that a batch made
    from older weights is in flight: the trainer finishes the step, writes its checkpoint, ends the rollout rank
    (no error of its own) and prints the command that resumes; resumed, the run equals an uninterrupted one.
    Beside it, a run whose every reward breaks (the code reward on arithmetic rows, which have no tests) stops
    after 3 steps with the synchronous loop's one-line reason, its rollout rank ending cleanly too."""
    import time
    # 8 steps: the signal must reach the trainer before its last stop check (after step 7); with 4 that came
    # ~0.1 s after step 1's row on an idle CPU, and a SIGINT sent 0.1-0.2 s late found the run over (3 of 4 runs)
    args = [*torchrun(2), *SMALL, "steps=8", "mode=async", "max_staleness=1", "algo.tis=token"]
    base, cut, bad = tmp_path / "base", tmp_path / "cut", tmp_path / "bad"
    procs = [subprocess.Popen([*args, f"out_dir={d}", *extra], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=ENV)
             for d, extra in ((cut, []), (base, []), (bad, ["rewards=code"]))]
    deadline = time.monotonic() + 240
    while not (cut / "metrics.jsonl").exists() or '"step": 1,' not in (cut / "metrics.jsonl").read_text():
        assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].communicate()[0][-3000:]
        time.sleep(0.01)
    procs[0].send_signal(signal.SIGINT)
    (out, rc), (out_b, rc_b), (out_x, rc_x) = ((p.communicate(timeout=300)[0], p.returncode) for p in procs)
    said = re.search(r"stopped by SIGINT after step (\d); checkpoint (\S+)\. To continue: torchrun <as before> "
                     rf"train.py resume={re.escape(str(cut))}\n", out)
    # no rank's own traceback; on failure the ranks' lines come first (the rank that went first is the one to read)
    ranks = "\n".join(line for line in out.splitlines() if re.search(r"\[rank\d\]:", line))
    assert said and not ranks, f"{ranks[:6000]}\n...\n{out[-2000:]}"
    step = int(said.group(1))
    assert step < 8 and said.group(2) == str(cut / "checkpoints" / f"step_{step:06d}")
    assert checkpoint.damage(said.group(2)) is None and len(step_rows(cut)) == step
    assert rc_b == 0, out_b[-3000:]
    ((rc, out),) = launch([*args, f"out_dir={cut}"])
    assert rc == 0, out[-3000:]
    assert untimed(cut) == untimed(base) and len(untimed(base)) == 8
    assert rc_x != 0 and len(step_rows(bad)) == 2, out_x[-3000:]
    assert re.search(r"error: every sample's reward or episode failed for 3 steps in a row \(step 3: code: "
                     r"ValueError", out_x) and "did not answer" not in out_x, out_x[-3000:]


def test_planner_by_hand():
    """tools/plan.py on round numbers: R=0.4 (F=0.5), U+L=0.4, A=0.02, W=0.01.
    2 GPUs colocated: 0.4*(0.5+0.25) + 0.4/2 + 0.02 + 0.01 = 0.53; async 1+1: max(0.4, 0.4) + 0.01 = 0.41."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from plan import plan
    r = plan(R=0.4, U=0.3, L=0.1, W=0.01, A=0.02, F=0.5, N=2)
    assert r["sync"] == pytest.approx(0.53) and r["async"] == pytest.approx(0.41) and r["K"] == 1
    assert r["async0"] == pytest.approx(0.81)
    assert plan(R=0.4, U=0.3, L=0.1, W=0.01, A=0.02, F=0.5, N=1)["sync"] == pytest.approx(0.8)
