"""The generic decode path's own compiled step (engines/generic_decode.py): under the engine's force_eager stance,
with the model's layers compiled for training as run_setup.py compiles them, the step still runs through one
compiled graph of its own, samples the portable loop's tokens, and compiles nothing for the layers themselves."""
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
