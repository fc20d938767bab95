"""The reward pool: weighted sums, failures that score 0 with a reason, real overlap with a forward pass."""
import math
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rewards.pool import CATEGORIES, RewardPool, Score, write_reasons  # noqa: E402
# the rewards live in a module of their own: the workers import it by name, like any plugin
from reward_fns import (batched_len, batched_share, field_count, flaky, length, length_penalty, matches,  # noqa: E402
                        slow)


def test_weighted_sum_and_per_reward_values():
    with RewardPool([(length, 0.5), (matches, 2.0)], workers=2, timeout_s=30) as pool:
        h = pool.submit(["p"] * 3, ["ab", "42", "x"], [{"answer": "x"}, {"answer": "42"}, {"answer": "x"}])
        rewards, info = h.result()
    assert rewards.dtype == torch.float32 and rewards.shape == (3,)
    assert rewards.tolist() == [1.0, 3.0, 2.5]
    assert info["per_reward"]["matches"].tolist() == [0.0, 1.0, 1.0]
    assert info["failures"] == {"length": 0, "matches": 0} and info["reasons"] == []
    assert info["metrics"]["reward/length"] == pytest.approx(5 / 3)


def test_failures_score_zero_with_reasons_and_the_pool_recovers():
    t0 = time.monotonic()
    with RewardPool([(flaky, 1.0)], workers=2, timeout_s=2.0) as pool:
        rewards, info = pool.submit([""] * 5, ["ok", "boom", "nan", "hang", "die"]).result()
        took = time.monotonic() - t0
        assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert info["failures"] == {"flaky": 4}
        reasons = "\n".join(info["reasons"])
        assert "flaky[1]: RuntimeError: cannot score this" in reasons
        assert "flaky[2]: non-finite value nan" in reasons
        assert "flaky[3]: timeout after 2s" in reasons
        assert "flaky[4]: worker died (exit code 3)" in reasons
        assert took < 15, f"a hung reward must cost about its timeout, took {took:.1f}s"
        # replaced workers keep serving
        rewards, info = pool.submit([""] * 4, ["ok"] * 4).result()
        assert rewards.tolist() == [1.0] * 4 and pool.restarts == 2


def test_a_reward_the_workers_cannot_import_scores_zero_with_the_reason():
    import types
    mod = types.ModuleType("only_in_the_trainer")        # exists in this process, not in a fresh one
    exec("def ghost(prompt, completion, **f):\n    return 1.0", mod.__dict__)
    sys.modules["only_in_the_trainer"] = mod
    try:
        with RewardPool([(mod.ghost, 1.0)], workers=1, timeout_s=30) as pool:
            rewards, info = pool.submit(["a", "b"], ["c", "d"]).result()
    finally:
        del sys.modules["only_in_the_trainer"]
    assert rewards.tolist() == [0.0, 0.0] and info["failures"] == {"ghost": 2}
    assert "cannot start: ModuleNotFoundError" in info["reasons"][0]


def test_kwargs_and_dict_specs_and_batched_rewards():
    specs = [{"name": batched_len, "weight": 1.0, "args": {"scale": 10.0}}, (length, 1.0)]
    with RewardPool(specs, workers=1, timeout_s=30) as pool:
        rewards, info = pool.submit(["a", "b"], ["xyz", ""]).result()
    assert rewards.tolist() == [33.0, 0.0]
    assert info["names"] == ["batched_len", "length"]


def test_a_reward_gets_token_counts_and_max_new_tokens_by_naming_them():
    """A length penalty declares completion_tokens and max_new_tokens; the pool passes them to it alone, over a row
    field of the same name, and rollout.submit_rewards takes the counts from the rollout's completion mask."""
    from rollout import submit_rewards
    specs = [(length_penalty, 1.0), (field_count, 1.0), (batched_share, 1.0),
             (length_penalty, 1.0, {"max_new_tokens": 6})]      # a reward_args keyword wins over the pool's
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])   # (B, C): 2, 4, 6, 8 tokens
    rollout = type("Rollout", (), {"completion_mask": mask})
    samples = [{"prompt": "p", "completion_tokens": 99} for _ in range(4)]   # a data column cannot fake the count
    with RewardPool(specs, workers=1, timeout_s=30, max_new_tokens=8) as pool:
        _, info = submit_rewards(pool, samples, ["a", "b", "c", "d"], rollout).result()
        with pytest.raises(ValueError, match="reward 'length_penalty#1' asks for completion_tokens"):
            pool.submit(["p"], ["a"])
    per = info["per_reward"]
    assert per["length_penalty#1"].tolist() == [0.0, 0.0, -0.5, -1.0]   # penalised past 8 - 4 tokens
    assert per["length_penalty#2"].tolist() == [0.0, -0.5, -1.0, -1.0]  # past 6 - 4
    assert per["field_count"].tolist() == [1.0] * 4                     # only the row's field: it asked for nothing
    assert per["batched_share"].tolist() == [0.25, 0.5, 0.75, 1.0]
    assert not info["failed"]
    with pytest.raises(ValueError, match="reward 'length_penalty' asks for max_new_tokens"):
        RewardPool([(length_penalty, 1.0)], workers=1)


def test_bad_specs_are_named():
    with pytest.raises(ValueError, match="expected keys name, weight, args"):
        RewardPool([{"nmae": "math"}])
    with pytest.raises(ValueError, match="2 prompts, 1 completions"):
        with RewardPool([(length, 1.0)], workers=1) as pool:
            pool.submit(["a", "b"], ["c"])


def test_scoring_overlaps_a_forward_pass():
    """A 1.5 s reward and a ~1.5 s forward pass take about the max of the two, not the sum."""
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    x = torch.randn(256, 512)

    def forward_for(seconds):
        end = time.monotonic() + seconds
        with torch.no_grad():
            while time.monotonic() < end:
                model(x)

    with RewardPool([(slow, 1.0)], workers=2, timeout_s=30) as pool:
        pool.wait_ready()
        t0 = time.monotonic()
        h = pool.submit(["", ""], ["1.5", "1.5"])
        assert not h.done(), "submit must return before scoring finishes"
        forward_for(1.5)
        rewards, _ = h.result()
        both = time.monotonic() - t0
    assert rewards.tolist() == [1.0, 1.0]
    print(f"overlap: reward 1.5 s + forward 1.5 s took {both:.2f} s")
    assert both < 2.4, f"reward (1.5 s) + forward (1.5 s) took {both:.2f}s: not overlapped (sum would be 3.0)"


def test_hostile_code_through_the_pool(tmp_path):
    from rewards.code import code_reward
    tests = {"tests": [{"input": "", "output": "1"}]}
    with RewardPool([(code_reward, 1.0, {"wall_s": 1.0, "memory_mb": 48}), (length, 0.0)], workers=2, timeout_s=20) as pool:
        programs = ["print(1)", "while True: pass", "import os\nos.kill(os.getppid(), 9)", "print(2)",
                    "a = []\nwhile True:\n    a.append(bytearray(2**26))", "while True:\n    print('x' * 4096)",
                    "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "print(1/0)"]
        rewards, info = pool.submit([""] * 8, programs, [tests] * 8).result()
        _, again = pool.submit([""], ["print(1)"], [tests]).result()
    assert rewards.tolist() == [1.0] + [0.0] * 7
    assert info["failures"]["code_reward"] == 0       # a failing program is a score, not a reward failure
    # ... but its reasons reach the trainer, counted by category (samples per category, per step)
    assert info["failure_counts"]["code_reward"] == {"timeout": 1, "memory": 1, "output_limit": 1, "signal": 1,
                                                     "setup": 0, "error": 2, "wrong_answer": 1}
    m = info["metrics"]
    assert m["reward_fail/code_reward/error"] == 2.0 and m["reward_fail/code_reward/wrong_answer"] == 1.0
    assert "reward_fail/length/timeout" not in m      # a reward that never failed adds no keys
    assert again["metrics"]["reward_fail/code_reward/timeout"] == 0.0    # once seen, every step has the keys
    assert [f["sample"] for f in info["failed"]] == list(range(1, 8))
    assert info["reasons"][5].startswith("code_reward[6]: case 0: killed by signal 11")
    # a sample of the reasons goes to the run directory, categories taking turns
    path = tmp_path / "reward_failures.jsonl"
    assert write_reasons(str(path), 3, info["failed"], limit=6, rank=0) == 6
    assert write_reasons(str(path), 4, again["failed"]) == 0
    import json
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["category"] for r in rows}) == 6 and 7 not in [r["sample"] for r in rows]   # 2nd error waits
    assert all(r["step"] == 3 and r["rank"] == 0 and r["reward"] == "code_reward" for r in rows)


def scored(prompt, completion, **fields):
    return Score(0.5, [("memory", "half of it ran out of memory")])


def test_pool_level_failures_are_categorised_and_scores_carry_theirs():
    with RewardPool([(flaky, 1.0), (scored, 1.0)], workers=1, timeout_s=1.0) as pool:
        rewards, info = pool.submit([""] * 3, ["hang", "boom", "ok"]).result()
    assert rewards.tolist() == [0.5, 0.5, 1.5]
    assert info["failure_counts"]["flaky"] == {**dict.fromkeys(CATEGORIES, 0), "timeout": 1, "error": 1}
    assert info["failure_counts"]["scored"]["memory"] == 3
    assert pickle_roundtrip(Score(0.25, [("error", "x")])).failures == [("error", "x")]


def pickle_roundtrip(x):
    import pickle
    return pickle.loads(pickle.dumps(x))


def test_names_from_the_registry():
    import rewards  # noqa: F401  (registers every reward by name)
    with RewardPool([("math", 1.0), ("format", 0.5)], workers=1, timeout_s=60) as pool:
        total, info = pool.submit(["q"], ["<think>2+2</think><answer>\\boxed{4}</answer>"], [{"answer": "4"}]).result()
    assert info["reasons"] == [] and math.isclose(total.item(), 1.5)


def test_closing_with_calls_in_flight_scores_them_zero():
    pool = RewardPool([(slow, 1.0)], workers=1, timeout_s=30)
    h = pool.submit(["", ""], ["5", "5"])
    pool.close()
    rewards, info = h.result()
    assert rewards.tolist() == [0.0, 0.0] and info["failures"] == {"slow": 2}
    assert all("reward pool closed" in r for r in info["reasons"])


def bad_batched(prompts, completions, fields):
    return [1.0] * (len(prompts) - 1) + ["not a number"]


bad_batched.batched = True


def test_a_broken_batched_reward_and_repeated_names():
    with RewardPool([(bad_batched, 1.0), (length, 1.0), (length, 2.0)], workers=1, timeout_s=30) as pool:
        h = pool.submit(["a", "b"], ["xy", "z"])
        rewards, info = h.result()
        again, _ = h.result()
    assert rewards.tolist() == [6.0, 3.0] and again.tolist() == rewards.tolist()
    assert info["names"] == ["bad_batched", "length#1", "length#2"]
    assert info["failures"]["bad_batched"] == 2 and "could not convert" in info["reasons"][0]


def test_a_pool_timeout_takes_the_sandbox_down_with_the_worker():
    from hostile_programs import left_on_host, sandbox_processes
    from rewards.code import code_reward
    spec = (code_reward, 1.0, {"wall_s": 60.0})             # the sandbox alone would wait a minute
    before = set(sandbox_processes())                       # other jobs' sandboxes, if any
    with RewardPool([spec], workers=1, timeout_s=2.0) as pool:
        t0 = time.monotonic()
        flood = "print('x' * 2**20)\nwhile True:\n    pass"      # 1 MB of stdout held for the worker
        rewards, info = pool.submit([""], [flood], [{"tests": [{"input": "", "output": "1"}]}]).result()
        took = time.monotonic() - t0
    assert rewards.tolist() == [0.0] and info["reasons"] == ["code_reward[0]: timeout after 2s"] and took < 6
    assert info["failure_counts"]["code_reward"]["timeout"] == 1
    deadline = time.monotonic() + 5      # PR_SET_PDEATHSIG: the launcher ends its sandbox when the worker dies
    while (set(sandbox_processes()) - before or left_on_host()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(sandbox_processes()) - before == set() and left_on_host() == {}


TRAINER = """
import sys, time
sys.path.insert(0, {repo!r})
from rewards.code import code_reward
from rewards.pool import RewardPool
pool = RewardPool([(code_reward, 1.0, {{"wall_s": 30}})], workers=2, timeout_s=60)
pool.wait_ready()
pool.submit(["", ""], ["import time\\ntime.sleep(30)"] * 2, [{{"tests": [{{"input": "", "output": "x"}}]}}] * 2)
print("running", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("kill", ["trainer", "trainer_and_workers"])
def test_a_killed_trainer_leaves_nothing_behind(kill):
    """kill -9 of a trainer mid-step (its workers each in a sandbox): the workers notice, stop their
    sandboxes, remove their temp dirs and leave; killed together with it, the next pool sweeps their dirs."""
    import glob
    import signal
    import subprocess
    import tempfile
    from hostile_programs import left_on_host
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER.format(repo=repo)], stdout=subprocess.PIPE,
                               start_new_session=True, text=True)
    try:
        assert trainer.stdout.readline().strip() == "running"
        time.sleep(1.0)                                  # the two sandboxes are up
        dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"reward-worker-{trainer.pid}-*"))
        assert len(dirs) == 2
        if kill == "trainer":
            os.kill(trainer.pid, signal.SIGKILL)
        else:
            os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
        if kill != "trainer":       # nobody was left to clean up: the next pool does
            RewardPool([(length, 1.0)], workers=1).close()
        deadline = time.monotonic() + 10
        while (left_on_host() or any(map(os.path.exists, dirs))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(os.path.exists, dirs)) and left_on_host() == {}
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()


def test_bad_code_reward_args_are_named_before_any_work():
    from rewards.code import code_reward
    with pytest.raises(ValueError, match="unknown argument.*wal_s.*valid: wall_s"):
        RewardPool([(code_reward, 1.0, {"wal_s": 5})])
    with pytest.raises(ValueError, match="memory_mb must be a positive number, got -1"):
        RewardPool([(code_reward, 1.0, {"memory_mb": -1})])


def test_a_sigterm_after_the_worker_left_prints_nothing(tmp_path):
    """The trainer's exit sends its workers SIGTERM (PR_SET_PDEATHSIG). One that arrives after serve() returned,
    during the interpreter's shutdown, must not print a _Stop traceback on the trainer's stderr: that breaks the
    one-line error a bad input gets."""
    import subprocess
    code = ("import os, signal, socket, sys; sys.path.insert(0, %r)\n"
            "from rewards.pool import serve\n"
            "ours, theirs = socket.socketpair(); ours.close()\n"      # the trainer is gone before the first message
            "serve(theirs.detach())\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"                  # the parent-death signal, late
            "print('left')\n") % os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "left", ""), r.stderr[-2000:]
