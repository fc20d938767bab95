"""Tier-1 tests of the replay buffer: eviction order, staleness, reuse limit, priority sampling, persistence."""
import json
import os

import pytest
import torch

from buffer import Experience
from buffer import ReplayBuffer, read_log
from config import ReplayConfig


def make_batch(n: int, version: int, P: int = 3, C: int = 4, adv=None, seed: int = 0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    cmask = torch.ones(n, C)
    cmask[0, C - 1:] = 0                                          # one shorter completion: padding travels too
    adv = torch.ones(n) if adv is None else torch.tensor(adv, dtype=torch.float)
    return Experience(input_ids=torch.randint(2, 14, (n, P + C), generator=g),
                      attention_mask=torch.cat([torch.ones(n, P, dtype=torch.long), cmask.long()], 1),
                      completion_mask=cmask, sample_logprobs=-torch.rand(n, C, generator=g) * cmask,
                      rewards=torch.rand(n, generator=g), group_ids=torch.arange(n) // 2,
                      versions=torch.full((n,), version), truncated=torch.zeros(n, dtype=torch.bool),
                      old_logprobs=-torch.rand(n, C, generator=g) * cmask, advantages=adv[:, None] * cmask)


def cfg(**kw) -> ReplayConfig:
    return ReplayConfig(**{"enabled": True, "capacity": 100, "max_uses": 10**9, "max_staleness": 100, **kw})


def test_fifo_eviction_keeps_the_newest():
    buf = ReplayBuffer(cfg(capacity=5))
    buf.add(make_batch(4, 0))
    assert buf.uid.tolist() == [0, 1, 2, 3]
    buf.add(make_batch(4, 1))
    assert buf.uid.tolist() == [3, 4, 5, 6, 7] and buf.data.versions.tolist() == [0, 1, 1, 1, 1]
    buf.add(make_batch(2, 2))
    assert buf.uid.tolist() == [5, 6, 7, 8, 9]


def test_staleness_limit_in_policy_versions():
    buf = ReplayBuffer(cfg(max_staleness=1))
    for v in range(4):
        buf.add(make_batch(2, v))
        assert set(buf.data.versions.tolist()) == set(range(max(0, v - 1), v + 1))
    assert buf.uid.tolist() == [4, 5, 6, 7]


def test_max_uses_retires_samples():
    buf = ReplayBuffer(cfg(max_uses=2))
    buf.add(make_batch(4, 0))
    g = torch.Generator().manual_seed(0)
    mbs = list(buf.minibatches(2, 3, g))                  # 3 epochs x 2 mini-batches of 2 = 12 draws of 4 samples
    assert len(mbs) == 6 and all(len(mb) == 2 for mb in mbs)
    assert int(buf.uses.sum()) == 12
    used = buf.uses.clone()
    buf.end_step()
    assert len(buf) == int((used < 2).sum())


@pytest.mark.parametrize("priority, kw, weights", [
    ("advantage", {"alpha": 1.0}, [1, 2, 3, 6]),         # |A|^alpha
    ("advantage", {"alpha": 2.0}, [1, 4, 9, 36]),
    ("recency", {"decay": 0.5}, [0.125, 0.25, 0.5, 1.0]),  # decay^age, ages 3, 2, 1, 0
])
def test_priority_sampling_frequencies(priority, kw, weights):
    buf = ReplayBuffer(cfg(priority=priority, **kw))
    for v, a in enumerate([1.0, -2.0, 3.0, -6.0]):        # one sample per version, |advantage| 1, 2, 3, 6
        buf.add(make_batch(1, v, adv=[a]))
    g = torch.Generator().manual_seed(1234)
    n = 5000
    counts = torch.zeros(4)
    for mb in buf.minibatches(1, n, g):                   # n single-sample draws (1 new sample -> 1 per epoch)
        counts[int(mb.versions[0])] += 1
    assert counts.sum() == n
    p = torch.tensor(weights, dtype=torch.float) / sum(weights)
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 16.27, (counts, n * p)                   # chi-square, 3 dof, p = 0.001
    uniform = ((counts - n / 4) ** 2 / (n / 4)).sum().item()
    assert uniform > 100                                    # and clearly not uniform: the test can fail


def test_uniform_sampling_frequencies():
    buf = ReplayBuffer(cfg(priority="uniform"))
    for v, a in enumerate([1.0, -2.0, 3.0, -6.0]):
        buf.add(make_batch(1, v, adv=[a]))
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(4)
    for mb in buf.minibatches(1, 4000, g):
        counts[int(mb.versions[0])] += 1
    chi2 = ((counts - 1000) ** 2 / 1000).sum().item()
    assert chi2 < 16.27, counts


def assert_same(a: Experience, b: Experience):
    for name in Experience.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name


def test_log_round_trip(tmp_path):
    path = str(tmp_path / "replay.jsonl")
    buf = ReplayBuffer(cfg(), log_path=path)
    first, second = make_batch(4, 0, P=3, C=4, seed=1), make_batch(2, 1, P=5, C=2, seed=2)   # different widths
    buf.add(first)
    buf.add(second)
    line = json.loads(open(path).readline())               # plain JSON: readable without this code
    assert line["uid"] == 0 and line["input_ids"] == first.input_ids[0].tolist()
    uid, data = read_log(path)
    assert uid.tolist() == list(range(6))
    assert_same(data, Experience.cat([first, second]))
    assert_same(data, buf.data)


def test_state_dict_round_trip_truncates_the_log(tmp_path):
    path = str(tmp_path / "replay.jsonl")
    buf = ReplayBuffer(cfg(max_uses=3), log_path=path)
    buf.add(make_batch(4, 0, seed=1))
    list(buf.minibatches(2, 1, torch.Generator().manual_seed(0)))
    tensors, meta = buf.state_dict()
    tensors = {k: v.clone() for k, v in tensors.items()}
    size = os.path.getsize(path)
    assert meta["log_bytes"] == size
    buf.add(make_batch(4, 1, seed=2))                      # happens after the checkpoint, then a crash
    assert os.path.getsize(path) > size
    fresh = ReplayBuffer(cfg(max_uses=3), log_path=path)
    fresh.load_state_dict(tensors, meta)
    assert os.path.getsize(path) == size                   # the post-checkpoint sample lines are gone
    assert fresh.uid.tolist() == [0, 1, 2, 3] and torch.equal(fresh.uses, tensors["uses"])
    assert fresh.next_uid == 4 and fresh.version == 0
    fresh.add(make_batch(4, 1, seed=2))                    # continuing logs exactly what the first run logged
    uid, _ = read_log(path)
    assert uid.tolist() == list(range(8))
