"""Every Triton kernel at edge shapes, in CI: tools/kernel_sweep.py's "cpu" size under the Triton interpreter, each
kernel against its torch twin (tiny and real vocabularies, odd sizes, batch 1, one cache slot, padded rows, the
decode graph's warm-up at temperature 0). On a GPU, tools/gpu_tests.sh runs the same sweep under compute-sanitizer.
Also: a shape a kernel cannot take is refused in one line before any launch.
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.linear_logprob import linear_logprob_entropy  # noqa: E402
from kernels.logprob import logprob_entropy  # noqa: E402
from kernels.sample import cdf_sample, gumbel_sample  # noqa: E402
from tests.interpret import run_interpreted  # noqa: E402


def test_every_kernel_matches_its_twin_at_edge_shapes_interpreted():
    # one interpreter process for all families (~30 s of CPU); a failing case prints its own line
    run_interpreted("import sys; from tools.kernel_sweep import FAMILIES, sweep\n"
                    "passed, failed = sweep(list(FAMILIES), 'cpu', 'cpu')\n"
                    "sys.exit(1 if failed or not passed else 0)")


def sample_args(V=16, B=2, **change):
    args = dict(logits=torch.randn(B, V), inv_t=torch.tensor([1.0]), seed=torch.tensor([1]), step=torch.tensor([0]))
    return {**args, **change}


@pytest.mark.parametrize("fn", [cdf_sample, gumbel_sample])
@pytest.mark.parametrize("change, error", [
    (dict(logits=torch.randn(16)), "logits must be a float (B, V)"),
    (dict(logits=torch.randn(0, 16)), "B, V >= 1"),
    (dict(logits=torch.randn(2, 0)), "B, V >= 1"),
    (dict(logits=torch.ones(2, 16, dtype=torch.long)), "logits must be a float"),
    (dict(inv_t=torch.tensor([1.0], dtype=torch.float64)), "inv_t must be a (1,) torch.float32"),
    (dict(seed=torch.tensor([1, 2])), "seed must be a (1,) torch.int64"),
    (dict(step=torch.tensor([0], dtype=torch.int32)), "step must be"),
    (dict(block=96), "block must be a power of two"),
    (dict(split=0), "split must be >= 1"),
])
def test_samplers_refuse_what_they_cannot_take(fn, change, error):
    kw = sample_args(**change)
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")) as e:
        fn(kw.pop("logits"), kw.pop("inv_t"), kw.pop("seed"), kw.pop("step"), **kw)
    assert "\n" not in str(e.value)


def test_gumbel_blocks_hold_four_groups_and_cdf_walks_whole_blocks():
    with pytest.raises(ValueError, match="block must be a power of two >= 4"):
        gumbel_sample(**sample_args(), block=2)
    with pytest.raises(ValueError, match="pick_block must be a power of two"):
        cdf_sample(**sample_args(), pick_block=1000)


def attention_args(B=2, nh=4, nkv=2, S=10, D=8):
    kv = torch.zeros(B, nkv, S, D)
    return dict(qkv=torch.zeros(B, (nh + 2 * nkv) * D), cos=torch.zeros(S, D), sin=torch.zeros(S, D),
                pos=torch.zeros(B, dtype=torch.long), k=kv, v=kv.clone(), key_ok=torch.ones(B, S, dtype=torch.bool),
                last=torch.tensor([3]), scale=1.0)


@pytest.mark.parametrize("change, error", [
    (dict(block=8), "block must be a power of two >= 16"),
    (dict(splits=3), "splits must be a power of two"),
    (dict(v=torch.zeros(2, 2, 10, 8, dtype=torch.bfloat16)), "one dtype"),
    (dict(qkv=torch.zeros(0, 64), pos=torch.zeros(0, dtype=torch.long), key_ok=torch.ones(0, 10, dtype=torch.bool),
          k=torch.zeros(0, 2, 10, 8), v=torch.zeros(0, 2, 10, 8)), "B, S >= 1"),
    (dict(cos=torch.zeros(9, 8), sin=torch.zeros(9, 8)), "cos, sin must be"),
    (dict(last=torch.tensor([3], dtype=torch.int32)), "last must be"),
])
def test_decode_attention_refuses_what_it_cannot_take(change, error):
    kw = {**attention_args(), **change}
    with pytest.raises(ValueError, match=error) as e:
        decode_attention(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("call, error", [
    (lambda: logprob_entropy(torch.randn(3, 16), torch.zeros(3, dtype=torch.long), float("inf")), "finite"),
    (lambda: logprob_entropy(torch.randn(3, 0), torch.full((3,), -100), 1.0), "at least one column"),
    (lambda: logprob_entropy(torch.ones(3, 16, dtype=torch.long), torch.zeros(3, dtype=torch.long)), "must be float"),
    (lambda: linear_logprob_entropy(torch.randn(3, 0), torch.randn(16, 0), torch.zeros(3, dtype=torch.long)),
     "V, H >= 1"),
])
def test_log_prob_kernels_refuse_what_they_cannot_take(call, error):
    with pytest.raises(ValueError, match=error) as e:
        call()
    assert "\n" not in str(e.value)


def test_no_tokens_give_empty_results():
    t = torch.zeros(0, dtype=torch.long)
    for lp, en in (logprob_entropy(torch.randn(0, 16), t, use_triton=False),
                   linear_logprob_entropy(torch.randn(0, 8), torch.randn(16, 8), t, use_triton=False)):
        assert lp.shape == en.shape == (0,)


# the sweep's cases: importable without a GPU, each family has some at every size (a renamed size would skip silently)
@pytest.mark.parametrize("size", ["gpu", "sanitizer", "cpu"])
def test_the_sweep_has_cases_for_every_family(size):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import kernel_sweep
    for name, (cases, _) in kernel_sweep.FAMILIES.items():
        n = len(list(cases(size)))
        assert n > 0 or (name == "decoder" and size == "cpu"), (name, size)



def test_every_family_runs_in_the_gpu_gate_once_swept_and_once_under_memcheck():
    # tools/gpu_tests.sh names the families of each process: a family added to the sweep but not there never runs
    import re
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import kernel_sweep
    text = open(os.path.join(ROOT, "tools", "gpu_tests.sh")).read()
    for kind in ("sweep", "sanitize"):
        named = [f for line in re.findall(rf"^{kind} [\w-]+ \S+ (?:[01] )?([\w,]+) &$", text, re.M)
                 for f in line.split(",")]
        assert sorted(named) == sorted(kernel_sweep.FAMILIES), (kind, named)


def test_a_card_without_fp8_skips_the_fp8_families_in_one_line(monkeypatch):
    import io
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import kernel_sweep
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    out = io.StringIO()
    assert kernel_sweep.sweep(["fp8_gemm", "fp8_quant"], "sanitizer", "cuda", out) == (0, 0)   # no case started
    lines = out.getvalue().splitlines()
    assert lines[:2] == [f"skip {f:8s} needs FP8 tensor cores (compute capability 8.9+); NVIDIA A100 is sm_80"
                         for f in ("fp8_gemm", "fp8_quant")] and lines[2] == "0 passed, 0 failed", lines


def test_the_exact_gemm_shapes_sit_in_the_tile_classes_they_are_filed_under():
    # kernels/exact_gemm.py's classes move when its tiles are re-picked: each class must keep its own shapes
    from kernels.exact_gemm import TILES, shape_class
    from tools import kernel_families_exact as fams
    for table in (fams.GEMM_SHAPES, fams.GEMM_SHAPES_GPU, fams.GEMM_SHAPES_CPU):
        for cls, shapes in table.items():
            assert [shape_class(N, K) for _, K, N in shapes] == [cls] * len(shapes), (cls, shapes)
    assert set(fams.GEMM_SHAPES) == set(TILES), "a TILES class without shapes in the sweep, or the reverse"
