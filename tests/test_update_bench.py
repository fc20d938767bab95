"""tools/update_bench.py: its variant flags and the kinds its kernel table groups by (the GPU run is a benchmark)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import update_bench  # noqa: E402


def test_variant_flags():
    assert update_bench.parse("ckpt:keep0.7:fused") == dict(ckpt=True, budget=0.7, fused=True, autotune=False,
                                                            cdt=False)
    with pytest.raises(SystemExit, match="unknown flag 'graphs'"):
        update_bench.parse("ckpt:graphs")


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMM"),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_4", "elementwise/norm/rope (inductor)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_add_cat_mul_neg_slice", "attention"),
    ("_grad_kernel", "head log-probs"),
    ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", "optimizer"),
    ("Memset (Device)", "memset/fill"),
    ("void at::native::vectorized_elementwise_kernel<4, BinaryFunctor<MulFunctor>>", "other"),
])
def test_kernel_kinds(name, kind):
    assert update_bench.kind(name) == kind
