"""compile_graphs (issue 38): the compiled layers' forward and backward replayed from CUDA graphs take the same
update steps as the layers run without graphs, gradient accumulation over micro-batches included (update.
zero_filled_grads); settings that would record a graph on every call are refused in one line."""
import pytest
import torch

import config
import config_checks
import microbatch
import registry
import run_setup
import update
from buffer import OnPolicyBuffer
from models import load_model
from test_update_step import B, batch


def run_updates(model, graphs: bool, device: torch.device, steps: int = 3) -> list[torch.Tensor]:
    """update() `steps` times over 2 micro-batches of 4 rows and unequal widths; -> the parameters after."""
    cfg = config.Config()
    cfg.micro_batch_size, cfg.samples_per_prompt, cfg.lr, cfg.compile_graphs = 4, 4, 0.1, graphs
    config.fill_defaults(cfg)
    algo = registry.get("algo", "grpo")
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)   # steps in proportion to the gradients: no Adam
    # normalisation to blow a rounding difference in a near-zero gradient up to a whole step
    learner = update.Learner(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), algo,
                             cfg, device)
    for i in range(steps):   # on a GPU: a warm-up, a recording, then replays of each layer's graphs
        buffer = OnPolicyBuffer()
        b = batch(model.config.vocab_size, seed=i)
        b.advantages = algo.advantages(b, cfg.algo)
        buffer.add(b)
        update.update(learner, buffer, torch.Generator().manual_seed(i), step=i + 1, n_samples=B)
    return [p.detach().clone() for p in model.parameters()]


def test_bucket_lengths():
    """At most GRAPH_LENGTHS_PER_OCTAVE lengths per doubling, never shorter, padding under a quarter of the row."""
    got = [microbatch.bucket_length(T) for T in range(1, 1025)]
    assert all(b >= T and (b - T) * 4 < max(b, 64) for T, b in enumerate(got, 1))
    assert len({b for b in got if 512 < b <= 1024}) == microbatch.GRAPH_LENGTHS_PER_OCTAVE
    assert (microbatch.bucket_length(320), microbatch.bucket_length(321), microbatch.bucket_length(10)) == (320, 384, 16)


def test_padded_micro_batches_and_zero_filled_grads_take_the_same_steps(random_model_dir):
    """On a CPU no graph is recorded: what compile_graphs changes there is that each micro-batch gets padding columns
    in front up to its bucket's length (10 -> 16 columns here) and that gradients add into zeros."""
    cpu = torch.device("cpu")
    want = run_updates(load_model(random_model_dir, cpu, torch.float32)[0], False, cpu)
    got = run_updates(load_model(random_model_dir, cpu, torch.float32)[0], True, cpu)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_take_the_same_steps(random_model_dir):
    """Each layer compiled with the cudagraphs backend (the cudagraph trees reduce-overhead uses, without inductor's
    code generation, so it compiles in seconds) against the eager layers: the same parameters after three updates
    of two micro-batches each, and no layer left out of the graphs. Static shapes: that backend records its graphs
    at compile time, so one of a dynamic graph would replay at the wrong size (inductor's records at run time,
    once per size); with 4 rows each and widths padded to one bucket, both micro-batches have one shape."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees
    cuda = torch.device("cuda")
    want = run_updates(load_model(random_model_dir, cuda, torch.float32)[0], False, cuda)
    torch._dynamo.reset()
    counters.clear()
    model = load_model(random_model_dir, cuda, torch.float32)[0]
    for layer in model.model.layers:   # as run_setup.build_models sets them up, with the lighter backend
        layer.compile(backend="eager")
        run_setup.graphed(layer, backend="cudagraphs", dynamic=False)
    try:
        got = run_updates(model, True, cuda)
        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        recorded = next(manager.graph_counter) if manager is not None else 0   # graphs recorded so far
    finally:   # the trees' pools and recordings are process-wide: later tests capture graphs of their own
        torch._dynamo.reset()
        cudagraph_trees.reset_cudagraph_trees()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert recorded >= 2 * len(model.model.layers), recorded   # each layer's forward and backward at least
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["compile_graphs=true"], "it needs compile=true"),
    (["compile_graphs=true", "compile=true", "pack=true"], "set pack=false"),
    (["compile_graphs=true", "compile=true", "offload=true"], "use parallel=replicate"),
    (["compile_graphs=true", "compile=true", "grad_checkpointing=true", "compiled_recompute=false"],
     "set compiled_recompute=true"),
])
def test_bad_graph_settings_refused_in_one_line(flags, message):
    with pytest.raises(config.UserError, match=message) as e:
        config_checks.validate(config.fill_defaults(config.parse(flags)))
    assert "\n" not in str(e.value)
