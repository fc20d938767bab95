"""pytest plugin for tools/gpu_tests.sh (`-p tools.gpu_only`): keeps only the tests that use a GPU.

Those are the tests with a skipif whose reason says they need CUDA or GPUs (the project's markers: "needs CUDA",
"needs a CUDA GPU", "needs 2 CUDA devices"), plus ALSO below: tests without such a marker that run on the GPU
when there is one and check something only a GPU run shows. A new GPU test with the usual marker is found
without editing this file.
"""
import re

NEEDS_GPU = re.compile(r"\bneeds\b(?!.*\bwithout\b).*\b(cuda|gpus?)\b", re.IGNORECASE)
ALSO = {
    "tests/test_lora.py::test_tf32_is_set_for_adapters_on_a_gpu_only",        # the precision flag on a GPU
    "tests/test_lora.py::test_offload_options_change_memory_not_losses",       # moves real memory on a GPU
}


def uses_gpu(item) -> bool:
    if item.nodeid.split("[")[0] in ALSO:
        return True
    return any(NEEDS_GPU.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    keep = [i for i in items if uses_gpu(i)]
    config.hook.pytest_deselected(items=[i for i in items if not uses_gpu(i)])
    items[:] = keep
