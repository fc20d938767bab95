"""FAST_DECODE_SHARED_PREFILL=1 (engines/fast_decode.py: _prefill): each distinct prompt row is prefilled once and
copied to the rows that share it. On the CPU (eager, no graph) a rollout with it on must equal one with it off:
the same tokens, log-probs and recorded MoE routes, for repeated prompts of different lengths (left padding), for a
batch with no repeats and for a batch of one prompt."""
import pytest
import torch

from engines.base import SamplingParams
from engines.builtin import BuiltinEngine
from engines.fast_decode import FastDecoder, distinct_rows
from tests.test_architectures import EOS, PAD, prompts as family_prompts, tiny_model


def rollouts(model, prompt_ids, n, monkeypatch, routing_replay=False, top_p=1.0):
    """The same seeded rollout with the switch off, then on; -> (off, on, rows the prefill forwarded each time)."""
    out, seen = [], []
    for on in ("0", "1"):
        monkeypatch.setenv("FAST_DECODE_SHARED_PREFILL", on)
        dec = FastDecoder(model, use_graph=False, record_routes=routing_replay)
        forward_rows = dec._prefill_rows
        dec._prefill_rows = lambda st, ids, *a: seen.append(ids.shape[0]) or forward_rows(st, ids, *a)
        engine = BuiltinEngine(model, EOS, PAD, fast=True, routing_replay=routing_replay)
        engine.decoder = dec
        out.append(engine.generate(prompt_ids, n, SamplingParams(top_p=top_p, max_new_tokens=10),
                                   torch.Generator().manual_seed(0)))
    return out[0], out[1], seen


def same(a, b):
    """Tokens exactly; log-probs within 1e-5. Why a tolerance: the prefill's GEMMs run over U rows instead of B, and
    the CPU's GEMM may block a different row count differently, so the sums can round apart in the last bits (a
    difference that size cannot flip a sampled token of these peaked tiny models, so the tokens must be equal)."""
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0), (a.logprobs - b.logprobs).abs().max()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3"])   # mistral: a sliding window (slot positions)
def test_shared_prefill_samples_what_the_per_row_prefill_samples(family, monkeypatch):
    model = tiny_model(family)
    p = family_prompts()                                               # 3 prompts of 3, 7 and 5 tokens
    for top_p in (1.0, 0.9):                                           # graph-style sampling, and eager torch
        off, on, seen = rollouts(model, p, 4, monkeypatch, top_p=top_p)
        same(off, on)
        assert seen == [12, 3]                                         # off: every row; on: each prompt once
    off, on, seen = rollouts(model, p, 1, monkeypatch)                 # no repeats: nothing to share
    same(off, on)
    assert seen == [3, 3]
    off, on, seen = rollouts(model, p[1:2], 5, monkeypatch)            # every row one prompt
    same(off, on)
    assert seen == [5, 1]
    # two prompts with the same tokens after different padding are different rows (the mask tells them apart)
    off, on, seen = rollouts(model, [p[0], [PAD] + p[0], p[0]], 2, monkeypatch)
    same(off, on)
    assert seen == [6, 2]


def test_shared_prefill_records_the_same_routes(monkeypatch):
    """Routing replay on a tiny qwen3_moe: each row's prompt columns get the experts its shared prefill chose."""
    model = tiny_model("qwen3_moe", seed=5)
    off, on, seen = rollouts(model, family_prompts(), 3, monkeypatch, routing_replay=True)
    same(off, on)
    assert seen == [9, 3]
    P = off.input_ids.shape[1] - off.completion_mask.shape[1]
    assert (on.routes[:, :P][on.attention_mask[:, :P].bool()] >= 0).all()     # every real prompt token recorded
    assert torch.equal(off.routes, on.routes)


def test_distinct_rows():
    ids = torch.tensor([[0, 5, 6], [4, 5, 6], [0, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])  # row 3: row 0's ids, but 0 is a token there
    u_ids, u_mask, inverse = distinct_rows(ids, mask)
    assert len(u_ids) == 3 and u_mask.dtype == mask.dtype
    assert torch.equal(u_ids[inverse], ids) and torch.equal(u_mask[inverse], mask)
    assert inverse[0] == inverse[2] and len(set(inverse.tolist())) == 3
    assert distinct_rows(ids[:2], mask[:2]) is None                    # all distinct: today's prefill
