"""CUDA graph capture that Python's garbage collector cannot interrupt.

    with capture(graph):      # as torch.cuda.graph(graph), with the cyclic collector held off until it ends
        out = step(...)

Why: a CUDAGraph that is freed resets itself, and CUDA refuses that call while any stream is capturing: the
capture in progress is invalidated ("operation failed due to a previous error during capture"). Decoders sit in
reference cycles (a bound method of the decoder stored on it as its step), so an unused decoder and its graphs are
freed by the cyclic collector, which runs whenever enough Python objects have been allocated: sometimes in the
middle of another decoder's capture, whose own Python work allocates plenty. torch.cuda.graph collects once
before it begins; this also keeps automatic collection off until the capture ends, then restores it.
"""
import contextlib
import gc

import torch


@contextlib.contextmanager
def capture(graph: "torch.cuda.CUDAGraph", **kw):
    """torch.cuda.graph(graph, **kw) with automatic garbage collection off for its duration."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **kw):
            yield
    finally:
        if was_on:
            gc.enable()
