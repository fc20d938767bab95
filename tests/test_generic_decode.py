"""The generic decode path (engines/generic_decode.py). Its own compiled step: under the engine's force_eager stance,
with the model's layers compiled for training as run_setup.py compiles them, the step still runs through one
compiled graph of its own, samples the portable loop's tokens, and compiles nothing for the layers themselves.
Its decode attention (decode_attention_forward, both routes): the loop's tokens and teacher forcing's log-probs
for granite and gemma3_text, equal to plain attention alone, and with the Triton kernel interpreted on the CPU;
the model's own attention where the route does not apply."""
import pytest
import torch

from test_architectures import rollout, tiny_model


def counting_backend(graphs: list, runs: list):
    """A torch.compile backend that runs the traced graph as is, recording each compile and each call."""
    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))

        def run(*args):
            runs.append(1)
            return gm.forward(*args)
        return run
    return backend


def test_compiled_step_under_force_eager_with_compiled_layers():
    from engines.generic_decode import GenericDecoder
    model = tiny_model("granite", seed=4)
    layer_graphs, graphs, runs = [], [], []
    for layer in model.model.layers:               # as run_setup.py does for compile=true
        layer.compile(backend=counting_backend(layer_graphs, []))
    dec = GenericDecoder(model, use_graph=False, compile=True, backend=counting_backend(graphs, runs))
    fast = rollout(model, dec)                     # BuiltinEngine.generate: the decoder under force_eager
    assert len(graphs) == 1 and graphs[0] > 20, graphs   # one graph for the whole step (all layers, the head)
    assert len(runs) == fast.completion_mask.shape[1] - 1   # every decode step after the prefill ran it
    assert layer_graphs == []                      # the training layers' compiled code: neither run nor compiled
    plain = rollout(model, None)                   # the portable loop, eager: the same tokens
    assert torch.equal(fast.input_ids, plain.input_ids) and torch.equal(fast.completion_mask, plain.completion_mask)
    assert fast.completion_mask.shape[1] > 6
    model(input_ids=plain.input_ids[:, :5])        # a training forward still compiles the layers as before
    assert len(layer_graphs) > 0


def test_compile_off_keeps_the_eager_step():
    from engines.generic_decode import GenericDecoder
    dec = GenericDecoder(tiny_model("granite"), use_graph=False)
    assert not dec.compile and dec.compiled is None and dec._step == dec._forward   # the CPU default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_generic_step_compiled_and_graphed_beside_compiled_layers():
    """On a GPU, the default: inductor compiles the step and the graph captures it, with the layers compiled for
    training; the log-probs it wrote are teacher forcing's."""
    from engines.generic_decode import GenericDecoder
    from test_architectures import _gpu_check
    model = tiny_model("granite").cuda()
    for layer in model.model.layers:
        layer.compile()
    dec = GenericDecoder(model)
    _gpu_check(model, dec)
    assert dec.use_graph and dec.captured and dec._step != dec._forward, "the compiled step fell back: see stderr"
    assert dec.attention == "kernel", dec.why_model_attention          # the decode-attention kernel's route


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_generic_step_sdpa_route_graphed():
    """The other route of decode_attention_forward (sdpa over the cache, GQA as queries of their KV head), compiled
    and captured: log-probs equal teacher forcing."""
    from engines.generic_decode import GenericDecoder
    from test_architectures import _gpu_check
    model = tiny_model("gemma3_text").cuda()
    dec = GenericDecoder(model, attention="sdpa")
    _gpu_check(model, dec)
    assert dec.use_graph and dec.captured and dec.attention == "sdpa"


def spy_kernel(monkeypatch) -> list:
    """Count the decode-attention kernel's calls from the generic decoder's attention (the twin on a CPU)."""
    import engines.generic_decode as gd
    calls, kernel = [], gd.decode_attention_kernel

    def spy(*args, **kw):
        calls.append(args[5].shape)                # the K cache (B, nkv, S, D)
        return kernel(*args, **kw)
    monkeypatch.setattr(gd, "decode_attention_kernel", spy)
    return calls


@pytest.mark.parametrize("family", ["granite", "gemma3_text"])
@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_decode_attention_routes_match_loop_and_teacher_forcing(family, attention, monkeypatch):
    """The decode step's attention through decode_attention_forward (the kernel's twin here, or sdpa over the
    cache with a boolean mask): the portable loop's tokens, teacher forcing's log-probs. gemma3_text: a dict of
    masks by layer type, a sliding window crossed, its own scaling; granite: attention_multiplier as the scale."""
    from engines.generic_decode import GenericDecoder
    from test_architectures import check_against_loop_and_teacher
    calls = spy_kernel(monkeypatch)
    model = tiny_model(family, seed=4)
    before = model.config._attn_implementation
    dec = GenericDecoder(model, use_graph=False, attention=attention)
    assert dec.attention == attention
    check_against_loop_and_teacher(model, dec, temperature=0.8)
    assert model.config._attn_implementation == before           # the prefill and training keep the model's own
    if attention == "kernel":      # every decode step of every layer (10 new tokens: 9 steps after the prefill)
        assert len(calls) >= 9 * model.config.num_hidden_layers and calls[0][2] % 64 == 0
    else:
        assert calls == []


def test_model_attention_kept_where_the_route_does_not_apply():
    """Logit soft-capping (gemma2) is not in decode_attention_forward: the model's own attention, still right."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from engines.generic_decode import GenericDecoder
    from test_architectures import COMMON, check_against_loop_and_teacher
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("gemma2", **{**COMMON, "attn_logit_softcapping": 20.0, "sliding_window": 4,
                                            "query_pre_attn_scalar": 16})
    model = AutoModelForCausalLM.from_config(cfg).eval()
    dec = GenericDecoder(model, use_graph=False)
    assert dec.attention == "model" and "soft-capping" in dec.why_model_attention
    check_against_loop_and_teacher(model, dec)
    with pytest.raises(ValueError, match="attention must be one of"):
        GenericDecoder(model, attention="flash")


def check_decode_attention():
    """decode_attention_forward's two routes against plain masked softmax attention, at one decode token with
    GQA, a slot mid-cache and hidden slots before it: equal outputs, the cache left as it was."""
    from engines.generic_decode import decode_attention_forward
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, S, D, slot = 3, 4, 2, 64, 16, 10
    q = torch.randn(B, nh, 1, D, generator=g)
    k, v = torch.randn(B, nkv, S, D, generator=g), torch.randn(B, nkv, S, D, generator=g)
    ok = (torch.rand(B, 1, 1, S, generator=g) < 0.7) & (torch.arange(S) <= slot)
    ok[..., slot] = True
    kr, vr = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)       # (B, nh, S, D)
    p = ((q @ kr.transpose(-1, -2)) * 0.3).masked_fill(~ok, float("-inf")).softmax(-1)
    want = (p @ vr).transpose(1, 2)                                                    # (B, 1, nh, D)
    cos, sin = (torch.full((1, D), x).expand(S, D) for x in (1.0, 0.0))
    step = {"slot": torch.tensor([slot]), "pos": torch.arange(B) + 5}
    for extra in ({"cos": cos, "sin": sin}, {}):                                       # kernel, then sdpa
        k2, v2 = k.clone(), v.clone()
        out, _ = decode_attention_forward(None, q, k2, v2, ok, scaling=0.3, generic_step={**step, **extra})
        assert out.shape == want.shape and (out - want).abs().max() <= 1e-5, (out - want).abs().max()
        assert torch.equal(k2, k) and torch.equal(v2, v)


def test_decode_attention_forward_routes():
    check_decode_attention()


def test_decode_attention_forward_kernel_interpreted_on_cpu():
    """The same with the Triton kernel itself (TRITON_INTERPRET=1, float32): identity rotary tables of stride 0."""
    from interpret import run_interpreted
    run_interpreted("import sys; sys.path.insert(0, 'tests')\n"
                    "import torch; torch.set_num_threads(1)\n"
                    "import kernels, engines.generic_decode as gd\n"
                    "calls, real = [], gd.decode_attention_kernel\n"
                    "gd.decode_attention_kernel = lambda *a, **k: (calls.append(kernels.use_triton(a[0])), "
                    "real(*a, **k))[1]\n"
                    "import test_generic_decode as t; t.check_decode_attention()\n"
                    "assert calls == [True], calls\n"
                    "print('ok')")
