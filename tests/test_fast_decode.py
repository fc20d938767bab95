"""The engine's fast path (engines/fast_decode.py), run on CPU without graphs: same function as the plain loop."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from engines.fast_decode import FastDecoder, supported


@pytest.mark.parametrize("attention", ["matmul", "sdpa", "kernel"])
def test_fast_path_logprobs_match_teacher_forcing(random_model_dir, attention, compile_step=False):
    from models import completion_logprobs, load_model
    from engines.builtin import BuiltinEngine
    from engines.base import SamplingParams
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    assert supported(model)
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, fast=True)
    engine.decoder = FastDecoder(model, attention=attention, compile=compile_step)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "123+456=", "7="]]          # different lengths: left padding
    gen = torch.Generator().manual_seed(0)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        r = engine.generate(prompts, 4, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12), gen)
        C = r.completion_mask.shape[1]
        with torch.no_grad():
            logp, _ = completion_logprobs(model, r.input_ids, r.attention_mask, C, temperature)
        diff = ((logp - r.logprobs).abs() * r.completion_mask).max().item()
        assert diff <= 1e-4, diff
        assert (r.logprobs * r.completion_mask).sum() < 0              # the log-probs were written
    assert engine.decoder is not None                                  # the fast path ran, not the plain loop


def test_decode_attention_kernel_in_the_step(tmp_path):
    """attention="kernel" with the Triton kernel itself (interpreted on CPU), not its torch twin; also inside the
    torch.compile'd step, as on a GPU (the kernel is an opaque custom op there)."""
    from tests.interpret import run_interpreted
    run_interpreted(f"""
import sys
sys.path.insert(0, "tests")
from conftest import make_random_model
from tests.test_fast_decode import test_fast_path_logprobs_match_teacher_forcing
model_dir = make_random_model({str(tmp_path)!r})
test_fast_path_logprobs_match_teacher_forcing(model_dir, "kernel")
test_fast_path_logprobs_match_teacher_forcing(model_dir, "kernel", compile_step=True)
print("ok")
""")


def test_fast_path_stops_early_and_masks_after_eos(random_model_dir):
    from models import load_model
    from engines.builtin import BuiltinEngine
    from engines.base import SamplingParams
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, fast=True)
    engine.decoder = FastDecoder(model, check_every=2)
    r = engine.generate([tok("12+3=")["input_ids"]], 64, SamplingParams(max_new_tokens=30),
                        torch.Generator().manual_seed(1))
    C = r.completion_mask.shape[1]
    comp = r.input_ids[:, -C:]
    lengths = r.completion_mask.sum(-1).long()
    assert C == int(lengths.max())                                      # no column past the last live token
    for row, m, n, trunc in zip(comp, r.completion_mask, lengths, r.truncated):
        assert m[:n].all() and not m[n:].any()
        if not trunc:
            assert row[n - 1] == tok.eos_token_id and (row[n:] == tok.pad_token_id).all()
    assert r.truncated.any() and (~r.truncated).any()


@pytest.mark.parametrize("attention", ["matmul", "sdpa", "kernel"])
def test_hand_written_forward_equals_transformers(random_model_dir, attention):
    from models import load_model
    from models import position_ids
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    dec = FastDecoder(model, attention=attention)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 14, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0                                                     # left padding on one row
    st = dec._state(3, 16, 7, True, ids.device, torch.float32)
    dec.refresh()
    S = torch.arange(16)
    key_ok = (S[:9, None] >= S[None]) & torch.nn.functional.pad(mask.bool(), (0, 7))[:, None]
    key_ok |= (S[:9, None] == S[None])
    ours = dec._forward(ids, position_ids(mask), S[:9], key_ok[:, None], st["k"], st["v"], st["cos"], st["sin"])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -1]
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_wrapped_projection_keeps_the_plain_loop(random_model_dir):
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    assert supported(model)

    class Adapter(torch.nn.Module):          # stands in for a LoRA wrapper around q_proj
        def __init__(self, base):
            super().__init__()
            self.base, self.weight, self.bias = base, base.weight, base.bias

        def forward(self, x):
            return self.base(x) + 1.0
    model.model.layers[0].self_attn.q_proj = Adapter(model.model.layers[0].self_attn.q_proj)
    assert not supported(model)


def test_fast_path_skips_module_hooks_repeats_and_releases(random_model_dir):
    """The decode step reads the embedding by its weight, never through the module: training puts hooks there
    (gradient checkpointing adds one that calls requires_grad_), and with torch 2.11 torch.compile could not
    trace it, which on an H200 silently sent every train.py rollout to the uncompiled step (0.81 s vs 0.37 s).
    A seeded rollout repeats exactly, and the cache is freed after each call unless keep_cache is set (then by
    sleep(): engine_sleep)."""
    from models import load_model
    from engines.builtin import BuiltinEngine
    from engines.base import SamplingParams
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id, fast=True)
    engine.decoder = FastDecoder(model, use_graph=False)
    prompts = [tok(p)["input_ids"] for p in ["1+2=", "45+6="]]
    run = lambda: engine.generate(prompts, 3, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(7))
    a, b = run(), run()
    assert calls == []                                                       # no module hook ran
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.logprobs, b.logprobs)
    assert engine.decoder.states == {} and engine.decoder.fused == []        # released for the update
    engine.decoder.keep_cache = True
    run()
    assert len(engine.decoder.states) == 1
    assert "freed" in engine.sleep() and engine.decoder.states == {}       # engine_sleep frees a kept state
    assert "nothing to free" in engine.sleep()


def test_capture_does_not_retry_bad_settings(random_model_dir, monkeypatch, capsys):
    """A UserError from the capture (a FAST_DECODE_ATTN tile past the card's shared memory:
    kernels/decode_attention.py's too_big) is raised as it is: the uncompiled step would fail the same way."""
    from config_tree import UserError
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    dec = FastDecoder(model, use_graph=False, compile=True)              # torch.compile wraps lazily: no compile
    tries = []

    def record(st):
        tries.append(dec._step)
        raise UserError("FAST_DECODE_ATTN=64=512x4x4x1 (...) needs more shared memory than this GPU has")

    monkeypatch.setattr(dec, "_record", record)
    with pytest.raises(UserError, match="FAST_DECODE_ATTN=64"):
        dec._capture({})
    assert len(tries) == 1 and "torch.compile failed" not in capsys.readouterr().err


def test_engine_keep_cache_reaches_the_engine(random_model_dir, tmp_path, monkeypatch):
    """engine_keep_cache=true in train.py's synchronous loop: the engine's decoder keeps its cache (run_setup's
    make_engine line); false frees it, and so does auto (the default) on the CPU; a bad value is a one-line error
    before any work."""
    import train
    from config import UserError
    from engines.builtin import BuiltinEngine
    seen = []
    init = BuiltinEngine.__init__
    monkeypatch.setattr(BuiltinEngine, "__init__", lambda self, *a, **kw: seen.append(kw["keep_cache"]) or
                        init(self, *a, **kw))
    argv = [f"model={random_model_dir}", "steps=1", "eval_every=1", "eval_size=4", "prompts_per_step=2",
            "samples_per_prompt=2", "max_new_tokens=4", "threads=1", "progress=false"]
    for value, want in (("true", True), ("false", False), ("auto", False)):
        train.main(argv + [f"out_dir={tmp_path / value}", f"engine_keep_cache={value}"])
        assert seen.pop() is want
    with pytest.raises(UserError) as e:
        train.main(argv + [f"out_dir={tmp_path / 'bad'}", "engine_keep_cache=yes"])
    assert str(e.value) == "config key 'engine_keep_cache' must be one of auto, true, false; got 'yes'"
    assert seen == [] and not (tmp_path / "bad").exists()


def test_engine_keep_cache_auto(random_model_dir, monkeypatch):
    """auto keeps when the decoder's state (hand-derived here for the tiny model) is at most 5% of the card, and
    never with an option that frees memory between stages, nor on the CPU."""
    from config import Config
    from engines import builtin
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    cfg = Config(model=random_model_dir, engine_keep_cache="auto", prompts_per_step=4, samples_per_prompt=8,
                 max_new_tokens=34, eval_size=100)
    prompts = [[3] * 10, [4] * 30]
    # 32 training rows and 100 evaluation rows; S = 64 slots (30 + 34 rounded up); per row: 2 layers x K and V x
    # 1 kv head x 32 dims x 64 slots x 4 bytes, plus 2 float32 copies of the 14-token vocabulary; the fused q/k/v
    # (64 x (64 + 32 + 32)) and gate/up (64 x 256) copies of 2 layers, 4 bytes each
    need = (32 + 100) * (2 * 2 * 32 * 64 * 4 + 2 * 4 * 14) + 2 * 4 * (64 * 128 + 64 * 256)
    assert builtin.state_bytes(cfg, model, prompts, world=1) == need
    cuda = torch.device("cuda")
    card = lambda total: monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        total_memory=total))
    card(20 * need)                                                     # exactly 5%
    assert builtin.keep_cache(cfg, model, prompts, cuda)
    card(20 * need - 1)
    assert not builtin.keep_cache(cfg, model, prompts, cuda)
    card(10**12)
    for freeing in ("offload_optimizer", "offload_models", "engine_sleep"):
        assert not builtin.keep_cache(dataclasses.replace(cfg, **{freeing: True}), model, prompts, cuda)
    assert not builtin.keep_cache(dataclasses.replace(cfg, memory_budget_gib=40.0), model, prompts, cuda)
    assert not builtin.keep_cache(cfg, model, prompts, torch.device("cpu"))
    assert builtin.keep_cache(dataclasses.replace(cfg, engine_keep_cache="true"), model, prompts, torch.device("cpu"))
