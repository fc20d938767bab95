"""FastDecoder._capture (engines/fast_decode.py): a compiled step that fails to capture falls back to the uncompiled
step once; if that fails too, the error raised names the compiled step's error (on CPU: the recording is forced to
fail, so no GPU is needed to check the fallback's logic)."""
import os
import subprocess
import sys

import pytest
import torch

from engines.fast_decode import FastDecoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def decoder(random_model_dir, compile_step: bool) -> FastDecoder:
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    return FastDecoder(model, use_graph=False, compile=compile_step)   # torch.compile wraps lazily: no compile here


def test_capture_falls_back_once_then_names_the_first_error(random_model_dir, monkeypatch, capsys):
    dec = decoder(random_model_dir, compile_step=True)
    steps = []

    def record(st):   # each attempt fails, as the illegal memory access did on a GPU, compiled or not
        steps.append(dec._step)
        raise RuntimeError(f"Triton Error [CUDA]: an illegal memory access was encountered (try {len(steps)})")

    monkeypatch.setattr(dec, "_record", record)
    with pytest.raises(RuntimeError, match=r"failed compiled \(RuntimeError: .*illegal memory access.*\(try 1\)\) "
                                           r"and uncompiled \(RuntimeError: .*\(try 2\)\)"):
        dec._capture({})
    assert len(steps) == 2 and steps[0] != dec._forward and steps[1] == dec._forward
    assert capsys.readouterr().err.count("capturing the uncompiled step") == 1


def test_capture_of_the_uncompiled_step_raises_its_own_error(random_model_dir, monkeypatch, capsys):
    dec = decoder(random_model_dir, compile_step=False)

    def record(st):
        raise ValueError("no graph here")

    monkeypatch.setattr(dec, "_record", record)
    with pytest.raises(ValueError, match="no graph here"):
        dec._capture({})
    assert "torch.compile failed" not in capsys.readouterr().err


def test_a_fallback_that_captures_keeps_the_uncompiled_step(random_model_dir, monkeypatch):
    dec = decoder(random_model_dir, compile_step=True)
    seen = []

    def record(st):
        seen.append(dec._step)
        if len(seen) == 1:
            raise RuntimeError("inductor failed")

    monkeypatch.setattr(dec, "_record", record)
    dec._capture({})
    assert len(seen) == 2 and dec._step == dec._forward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_random_model_captures_the_compiled_step_on_a_gpu(random_model_dir, tmp_path):
    """The reproduction of the illegal memory access: the random model in float32, top_p 1 (sampling inside the
    graph, by the inverse-CDF sampler by default), whose graph warm-up ran the sampler at temperature 0. It must
    capture the compiled step itself, with no fallback."""
    r = subprocess.run([sys.executable, "train.py", f"model={random_model_dir}", "steps=1", "eval_every=1",
                        "eval_size=8", "prompts_per_step=4", "samples_per_prompt=2", "dtype=float32", "progress=false",
                        f"out_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
    assert r.returncode == 0 and "torch.compile failed" not in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]


def test_capture_holds_off_the_garbage_collector(monkeypatch):
    """engines/graphs.py `capture`: automatic garbage collection is off inside (a dead decoder's graphs freed by it
    mid-capture would invalidate the capture), on again after, also after an error, and left off if it was off.
    torch.cuda.graph is replaced by a stand-in, so no GPU is needed."""
    import contextlib
    import gc
    import engines.graphs as graphs
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, **kw):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(graphs.torch.cuda, "graph", fake_graph)
    was_on = gc.isenabled()
    try:
        gc.enable()
        with graphs.capture(object()):
            seen.append(gc.isenabled())
        assert seen == [False, False] and gc.isenabled()
        with pytest.raises(ValueError), graphs.capture(object()):
            raise ValueError("a failed capture")
        assert gc.isenabled()
        gc.disable()
        with graphs.capture(object()):
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was_on else gc.disable)()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_capture_while_a_dead_decoders_graphs_would_be_collected():
    """A decoder whose graphs become garbage (decoders sit in reference cycles: the cyclic collector frees them)
    while another decoder captures: enough allocations inside that capture to trigger the collector. With
    collection held off (engines/graphs.py) the capture succeeds; without, freeing the dead graphs mid-capture
    invalidated it (the GPU gate's failure of 2026-11-28)."""
    import gc
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from tests.test_architectures import EOS, PAD, prompts, tiny_model
    model = tiny_model("qwen2", seed=5).cuda()

    def run(dec):
        engine = BuiltinEngine(model, EOS, PAD, fast=True, keep_cache=True)
        engine.decoder = dec
        return engine.generate(prompts(), 2, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0))

    hold = [FastDecoder(model, compile=False, keep_cache=True)]
    run(hold[0])
    assert hold[0].states and all(st["graph"] is not None for st in hold[0].states.values())
    dec = FastDecoder(model, compile=False, keep_cache=True)
    step = dec._step

    kept = []

    def dropping_step(*a, **k):
        # inside the capture: the held decoder becomes garbage, then enough allocations that the collector, left
        # on, would make a full pass (thresholds of 1; kept objects past a quarter of the long-lived ones)
        if torch.cuda.is_current_stream_capturing() and hold:
            hold.clear()
            gc.set_threshold(1, 1, 1)
            kept.extend([] for _ in range(len(gc.get_objects()) // 2))
        return step(*a, **k)

    dec._step = dropping_step
    thresholds = gc.get_threshold()
    try:
        out = run(dec)
    finally:
        gc.set_threshold(*thresholds)
        kept.clear()
    assert not hold and dec.captured and out.completion_mask.any()
