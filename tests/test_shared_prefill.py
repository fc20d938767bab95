"""FAST_DECODE_SHARED_PREFILL=1 (engines/fast_prefill.py: _prefill): each distinct prompt row is prefilled once and
copied to the rows that share it. On the CPU (eager, no graph) a rollout with it on must equal one with it off:
the same tokens, log-probs and recorded MoE routes, for repeated prompts of different lengths (left padding), for a
batch with no repeats and for a batch of one prompt."""
import pytest
import torch

from engines.base import SamplingParams
from engines.builtin import BuiltinEngine
from engines.fast_decode import FastDecoder
from engines.fast_prefill import distinct_rows
from tests.test_architectures import EOS, PAD, VOCAB, prompts as family_prompts, tiny_model


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


# --- FAST_DECODE_GRAPH_PREFILL=1 (engines/fast_prefill.py: _replay_prefill): the prefill replayed from a CUDA graph of
# its (distinct rows, bucketed prompt length) shape, when the decoder keeps its state ---------------------------------

def graph_rollouts(model, prompt_sets, n, monkeypatch, on: bool, use_graph: bool = False, routing_replay=False,
                   bucket: int | None = None):
    """One kept decoder's seeded rollouts of each prompt set in turn, with the graphed prefill on or off (use_graph
    False: its buffers and buckets with each replay run eagerly, prefill_graph_eager); -> (rollouts, decoder)."""
    import engines.fast_decode as fast_decode
    monkeypatch.setenv("FAST_DECODE_GRAPH_PREFILL", "1" if on else "0")
    if bucket:
        monkeypatch.setattr(fast_decode, "PREFILL_BUCKET", bucket)
    # on a GPU graphed, not compiled: the prefill is eager code either way, and compiling four tiny decoders would
    # take most of the test's time
    dec = FastDecoder(model, use_graph=use_graph, compile=False, keep_cache=True, record_routes=routing_replay)
    dec.prefill_graph_eager = not use_graph
    engine = BuiltinEngine(model, EOS, PAD, fast=True, routing_replay=routing_replay, keep_cache=True)
    engine.decoder = dec
    out = [engine.generate(p, n, SamplingParams(top_p=1.0, max_new_tokens=10), torch.Generator().manual_seed(0))
           for p in prompt_sets]
    return out, dec


def prefill_graphs(dec) -> list:
    """The (rows, padded prompt length, shared) keys of the prefill graphs the decoder's states hold."""
    return [k for st in dec.states.values() for k in st.get("prefills", {})]


def same_routes(a, b):
    assert (a.routes is None) == (b.routes is None)
    if a.routes is not None:
        assert torch.equal(a.routes, b.routes)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])    # mistral: a sliding window (slot positions)
def test_bucketed_prefill_samples_what_the_plain_prefill_samples(family, monkeypatch):
    """The graphed prefill's route on the CPU (its replay run eagerly): prompts padded on the left to a bucket
    (PREFILL_BUCKET 4 here, so 7 and 5 tokens become 8, 3 becomes 4) sample the unpadded rollout's tokens with its
    log-probs, over repeated prompts, a batch with no repeats (no fan-out) and a second call of one shape (the kept
    graph's buffers take the new inputs). Log-probs within 1e-5 and not exactly: longer padding changes the rows the
    CPU's GEMMs and attention sum over (same's reason)."""
    model = tiny_model(family)
    p = family_prompts()
    sets = [p, p, p[:1], p[1:], p[::-1]]          # P 7, 7, 3 (bucket 4), 7, 7 with the rows in another order
    for n in (4, 1):
        off, _ = graph_rollouts(model, sets, n, monkeypatch, on=False)
        on, dec = graph_rollouts(model, sets, n, monkeypatch, on=True, bucket=4)
        for a, b in zip(off, on):
            same(a, b)
        shared = n > 1
        # three shapes (3, 8), (1, 4), (2, 8) (U for n = 4; B = U rows for n = 1): two kept (PREFILL_GRAPHS)
        assert sorted(prefill_graphs(dec)) == [(1, 4, shared), (2, 8, shared)] or \
            sorted(prefill_graphs(dec)) == [(2, 8, shared), (3, 8, shared)], prefill_graphs(dec)
        assert dec.states, "the state is kept (keep_cache)"


def test_bucketed_prefill_records_the_same_routes(monkeypatch):
    """Routing replay on a tiny qwen3_moe with the graphed prefill's route: the routes come back without the bucket's
    extra padding columns, equal to the plain prefill's."""
    model = tiny_model("qwen3_moe", seed=5)
    sets = [family_prompts(), family_prompts(seed=2)]
    off, _ = graph_rollouts(model, sets, 3, monkeypatch, on=False, routing_replay=True)
    on, dec = graph_rollouts(model, sets, 3, monkeypatch, on=True, routing_replay=True, bucket=16)
    for a, b in zip(off, on):
        same(a, b)
        assert a.routes.shape == b.routes.shape and a.routes.shape[1] == a.input_ids.shape[1]
        same_routes(a, b)
    assert prefill_graphs(dec) == [(3, 16, True)]


def test_graphed_prefill_needs_a_kept_state(monkeypatch):
    """Without keep_cache the prefill stays eager and unpadded (a graph per rollout would cost more than it saves);
    pictures and the generic decoder keep it too (_graphs_prefill). On unless FAST_DECODE_GRAPH_PREFILL=0."""
    from engines.generic_decode import GenericDecoder
    monkeypatch.delenv("FAST_DECODE_GRAPH_PREFILL", raising=False)
    model = tiny_model("qwen2")
    dec = FastDecoder(model, use_graph=False)
    dec.prefill_graph_eager = True
    assert not dec._graphs_prefill(None, None)
    dec.keep_cache = True
    assert dec._graphs_prefill(None, None)
    assert not dec._graphs_prefill(torch.zeros(1), None)
    assert not FastDecoder(model, use_graph=False, keep_cache=True)._graphs_prefill(None, None)   # the CPU: no graphs
    generic = GenericDecoder(model, use_graph=False, keep_cache=True)
    generic.prefill_graph_eager = True
    assert not generic._graphs_prefill(None, None)
    monkeypatch.setenv("FAST_DECODE_GRAPH_PREFILL", "0")
    assert not dec._graphs_prefill(None, None)


def test_large_prefills_stay_eager(monkeypatch):
    """A prefill of more than PREFILL_GRAPH_TOKENS tokens (distinct rows x bucketed length) runs eagerly: no graph
    is kept for it, and it samples what the plain prefill samples."""
    import engines.fast_prefill as fast_prefill
    monkeypatch.setattr(fast_prefill, "PREFILL_GRAPH_TOKENS", 20)
    model = tiny_model("qwen2")
    p = family_prompts()
    sets = [p[:2], p]                                    # 2 x 8 tokens: graphed; 3 x 8: eager (bucket 4)
    off, _ = graph_rollouts(model, sets, 2, monkeypatch, on=False)
    on, dec = graph_rollouts(model, sets, 2, monkeypatch, on=True, bucket=4)
    for a, b in zip(off, on):
        same(a, b)
    assert prefill_graphs(dec) == [(2, 8, True)]


def check_shared_reads(family: str, device: str = "cpu", use_graph: bool = False):
    """FAST_DECODE_SHARED_READS (engines/fast_prefill.py: shared_reads): after a shared prefill each row's state
    points its prompt slots at its prompt's first row (src, shared = the padded prompt length), and the decode,
    reading them there, samples the same tokens and log-probs bit for bit as with each row reading its own copy;
    off, or with no repeated prompt, nothing is shared (shared = 0). Restores the variable (a plain function:
    the interpreted test calls it in a subprocess, without pytest's monkeypatch)."""
    import os
    before = os.environ.get("FAST_DECODE_SHARED_READS")
    try:
        outs = [_shared_reads_rollout(family, device, use_graph, on) for on in ("0", "1")]
    finally:
        os.environ.pop("FAST_DECODE_SHARED_READS", None)
        if before is not None:
            os.environ["FAST_DECODE_SHARED_READS"] = before
    a, b = outs
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logprobs, b.logprobs)


def _shared_reads_rollout(family: str, device: str, use_graph: bool, on: str):
    import os
    os.environ["FAST_DECODE_SHARED_READS"] = on
    model = tiny_model(family, seed=5).to(device)
    p = family_prompts()                                               # 3 prompts, 4 samples each: rows 0-3, 4-7, ...
    dec = FastDecoder(model, use_graph=use_graph, compile=False, keep_cache=True)   # kept: the state to read
    engine = BuiltinEngine(model, EOS, PAD, fast=True, keep_cache=True)
    engine.decoder = dec
    out = engine.generate(p, 4, SamplingParams(top_p=1.0, max_new_tokens=10),
                          torch.Generator(device=device).manual_seed(0))
    (st,) = dec.states.values()
    graphed = list(st.get("prefills", {}))                             # (U, P, shared): a graph's padded length
    P = graphed[0][1] if graphed else max(map(len, p))
    assert st["shared"].item() == (P if on == "1" else 0)
    if on == "1":
        assert st["src"].tolist() == [r // 4 * 4 for r in range(12)]
    engine.generate(p[:2], 1, SamplingParams(top_p=1.0, max_new_tokens=3), torch.Generator(device=device))
    assert [s["shared"].item() for s in dec.states.values() if s["src"].numel() == 2] == [0]   # distinct prompts
    return out


def test_shared_reads_interpreted():
    """check_shared_reads with the decode-attention kernel itself (interpreted), which follows share: the CPU's
    torch twin reads each row's own slots."""
    from tests.interpret import run_interpreted
    run_interpreted("""
from tests.test_shared_prefill import check_shared_reads
check_shared_reads("qwen3")
check_shared_reads("mistral")                                          # a sliding window: the kernel's key mask
print("ok")
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_shared_reads_graphed():
    """check_shared_reads on a GPU, the decode replayed from a CUDA graph (not compiled: tiny models)."""
    check_shared_reads("qwen3", "cuda", use_graph=True)
    check_shared_reads("qwen3_moe", "cuda", use_graph=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_gpu_graphed_prefill_samples_what_the_eager_prefill_samples(family, monkeypatch):
    """On a GPU, graphed: a kept decoder with the prefill replayed from CUDA graphs samples what one with
    the eager prefill samples, over two calls of one shape (the second replays the graph it captured), a second
    prompt length in another bucket (a new capture) and, qwen3_moe, with routing replay (the routes written inside
    the graph). Float32 models: the bucket's extra padding changes the sums' order in the last bits only; log-probs
    within 2e-3 (TF32 matmuls, as _gpu_check), tokens exactly (a gap that size cannot flip these peaked tiny models)."""
    import engines.fast_decode as fast_decode
    model = tiny_model(family, seed=5).cuda()
    g = torch.Generator().manual_seed(3)
    long = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (70, 66)]   # bucket 128, not 64
    sets = [family_prompts(), family_prompts(), long]
    replay = family == "qwen3_moe"
    sampler, fast_decode.SAMPLER = fast_decode.SAMPLER, "gumbel"     # as test_architectures' _gpu_check
    try:
        off, _ = graph_rollouts(model, sets, 4, monkeypatch, on=False, use_graph=True, routing_replay=replay)
        on, dec = graph_rollouts(model, sets, 4, monkeypatch, on=True, use_graph=True, routing_replay=replay)
    finally:
        fast_decode.SAMPLER = sampler
    assert not dec.prefill_failed, "the prefill's capture failed: see stderr"
    assert sorted(prefill_graphs(dec)) == [(2, 128, True), (3, 64, True)]
    for a, b in zip(off, on):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.completion_mask, b.completion_mask)
        assert torch.allclose(a.logprobs, b.logprobs, atol=2e-3, rtol=0), (a.logprobs - b.logprobs).abs().max()
        same_routes(a, b)
