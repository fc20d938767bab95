"""Compile the exact path's Triton kernels for a Hopper GPU (sm_90) on a machine without one, to catch a kernel
that the interpreter runs but the GPU compiler refuses (a CPU check before a device call; needs triton's ptxas).

    python3 tools/exact_aot.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.exact_attention as ea
import kernels.exact_gemm as eg
import kernels.exact_sample as es


def compile_one(name, fn, sig: dict, const: dict, warps: int, stages: int = 3):
    sig = {**sig, **{k: "constexpr" for k in const}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    print(f"{name}: ok, {k.metadata.shared} B shared, {k.n_regs if hasattr(k, 'n_regs') else '?'} regs", flush=True)


def main():
    bf, i32, i64, f32 = "*bf16", "i32", "*i64", "fp32"
    g = {n: bf for n in ("x_ptr", "w0_ptr", "w1_ptr", "w2_ptr", "b0_ptr", "b1_ptr", "b2_ptr", "y_ptr")}
    g.update({n: i32 for n in ("M", "N", "K", "n1", "n2", "sx", "sy")})
    for cls, (BM, BN, BK, w, st) in eg.TILES.items():
        compile_one(f"_gemm {cls}", eg._gemm, g, dict(HAS_BIAS=True, PRECISION="tf32", BM=BM, BN=BN, BK=BK,
                                                       EXPLICIT=False), w, st)
    compile_one("_silu_mul", eg._silu_mul, {"g_ptr": bf, "y_ptr": bf, "I": i32, "sg": i32}, dict(BI=1024), 4)
    r = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "rows_ptr": i64, "pos_ptr": i64, "cos_ptr": bf, "sin_ptr": bf,
         "kc_ptr": bf, "vc_ptr": bf, "qo_ptr": bf}
    r.update({n: i32 for n in ("sq_n", "sk_n", "sv_n", "sc_l", "sk_b", "sk_h", "sk_s")})
    a = {"q_ptr": bf, "rows_ptr": i64, "pos_ptr": i64, "k_ptr": bf, "v_ptr": bf, "o_ptr": bf, "L": i32,
         "window": i32, "scale": f32}
    a.update({n: i32 for n in ("sq_n", "sq_h", "sk_b", "sk_h", "sk_s", "so_n", "so_h")})
    compile_one("_attend", ea._attend, a, dict(G=7, GP=16, D=64, DP=64, BLOCK=64, PRECISION="tf32", EXPLICIT=False),
                ea.WARPS)
    compile_one("_rope_cache", ea._rope_cache, r, dict(NH=14, NKV=2, HP=16, D=64, DP=64), 4)
    s = {"z_ptr": bf, "tgt_ptr": i64, "inv_t_ptr": "*fp32", "seed_ptr": i64, "step_ptr": i64, "tok_ptr": i64,
         "logp_ptr": "*fp32", "ent_ptr": "*fp32", "R": i32, "V": i32, "stride": i32, "SAMPLE": i32}
    compile_one("_rows", es._rows, s, dict(BV=es.BV), es.WARPS)


if __name__ == "__main__":
    main()
