"""Can W1's decode GEMMs get near their weight-read time at 128 rows? Split-K against cuBLAS (issue 38 item 2):

    python tools/decode_gemm_bench.py --out bench_out/gemm      # one GPU: the table, also OUT/decode_gemm.md
    TRITON_INTERPRET=1 python tools/decode_gemm_bench.py --tiny  # CPU: every variant checked at tiny shapes, no times

W1 decodes 128 rows of a random Qwen2.5-0.5B (hidden 896, MLP 4,864, q/k/v 1,152 wide with bias, 24 layers, bf16);
there cuBLAS launches 7-9 tiles of 128 x 128 for q/k/v, o_proj and down on 132 SMs, so those GEMMs wait on
latency, not on the bytes (docs/kernels.md, "What a W1 decode step spends"). The candidate: a split-K Triton GEMM
with many programs that writes fp32 partial sums (split, rows, cols) and leaves their sum to the elementwise
kernel that follows it in the step anyway, compiled by inductor as the step is: down's and o_proj's partials
summed in the residual add + RMSNorm, gate/up's in SiLU x up, q/k/v's in a small kernel that adds the bias (in the
step, the attention kernel could read them instead: the `GEMM alone` column is that bound).
Each row times one GEMM with what follows it, per layer, inside one CUDA graph over 24 layers' random weights
(L2 flushed before each replay, so the weights come from memory as in the step); variants alternate replay by
replay, median of --rounds:
  cublas         today's route: F.linear (+ bias) and a compiled residual add + RMSNorm (or SiLU x up)
  cublas x@Wt    the weight stored transposed (in, out), torch.matmul / addmm
  cublaslt       F.linear with torch.backends.cuda.preferred_blas_library("cublaslt") (restored after)
  splitk ...     the Triton split-K GEMM at (BM, BN, BK, split, warps, stages) + the compiled sum of partials
Every variant's outputs (all 24 layers, as replayed) are checked against cublas's (max |diff| over max |ref|).
TB/s counts the layer's weight bytes only. --budget-s stops capturing new variants when it runs out, so a device
run with a hard limit still prints what it measured. Measured on an H200: docs/speed.md, "Split-K decode GEMMs at 128
rows, measured" (split-K lost, except at down).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def splitk_kernel(x_ptr, w_ptr, p_ptr, M, N, K, SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr):
    # p[s] (M, N) fp32 = x (M, K) @ w (N, K).T over the s-th of SPLIT near-equal runs of K's BK-deep steps;
    # grid (column tiles, SPLIT, row tiles). K % BK == 0 (the launcher checks), so only rows and columns are masked.
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    steps = K // BK
    lo = (pid_s * steps // SPLIT) * BK
    hi = ((pid_s + 1) * steps // SPLIT) * BK
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(lo, hi, BK, num_stages=STAGES):
        ks = k + tl.arange(0, BK)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows < M)[:, None], other=0.0)   # (BM, BK)
        b = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols < N)[:, None], other=0.0)   # (BN, BK)
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(p_ptr + (pid_s * M + rows[:, None]) * N + cols[None, :], acc,
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def splitk_partials(x: Tensor, w: Tensor, cfg: tuple) -> Tensor:
    """x (M, K) @ w (N, K).T as fp32 partial sums (split, M, N); cfg = (BM, BN, BK, split, warps, stages)."""
    BM, BN, BK, split, warps, stages = cfg
    M, K = x.shape
    N = w.shape[0]
    if K % BK or not 1 <= split <= K // BK:
        raise ValueError(f"splitk: K = {K} must be a multiple of BK = {BK} with 1 <= split <= K / BK; "
                         f"got split {split}")
    p = torch.empty(split, M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, BN), split, triton.cdiv(M, BM))
    splitk_kernel[grid](x, w, p, M, N, K, split, BM=BM, BN=BN, BK=BK, STAGES=stages, num_warps=warps)
    return p


# --- the elementwise kernels around the GEMMs: today's (bf16 GEMM output) and the ones that take partials --------

def rmsnorm(x: Tensor, g: Tensor, eps: float) -> Tensor:
    """Qwen2RMSNorm's arithmetic: fp32 statistics, the normalised row rounded to x's dtype, then times g."""
    xf = x.float()
    return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_norm(x: Tensor, y: Tensor, g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x = x + y                                           # (M, H) the residual stream
    return x, rmsnorm(x, g, eps)


def total(parts: Tensor) -> Tensor:
    # a chain of adds, not parts.sum(0): inductor keeps it pointwise and fuses it into the kernel that follows
    y = parts[0]
    for s in range(1, parts.shape[0]):
        y = y + parts[s]
    return y                                            # (M, N) fp32


def parts_add_norm(x: Tensor, parts: Tensor, g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x = (x.float() + total(parts)).to(x.dtype)          # (M, H)
    return x, rmsnorm(x, g, eps)


def silu_mul(gu: Tensor) -> Tensor:
    gate, up = gu.chunk(2, dim=-1)                      # (M, I) each
    return F.silu(gate) * up


def parts_silu_mul(parts: Tensor, dtype: torch.dtype) -> Tensor:
    gate, up = total(parts).chunk(2, dim=-1)            # (M, I) fp32 each
    return (F.silu(gate) * up).to(dtype)


def parts_bias(parts: Tensor, b: Tensor) -> Tensor:
    return (total(parts) + b.float()).to(b.dtype)       # (M, N)


# --- shapes, weights, variants -------------------------------------------------------------------------------------

# rows, hidden, MLP width, q/k/v width, layers: W1's decode (Qwen2.5-0.5B: 14 q heads + 2 x 2 kv heads of 64)
W1 = dict(M=128, H=896, I=4864, QKV=1152, L=24)
# the interpreter's: ragged rows and q/k/v columns against the tiles, float16 (triton 3.9's interpreter gets
# bfloat16 tl.dot wrong; the GPU does not)
TINY = dict(M=24, H=64, I=128, QKV=80, L=2)
# split-K settings per GEMM, (BM, BN, BK, split, warps, stages); programs = cdiv(N, BN) * split on 132 SMs
SPLITK = {
    "down": [(128, 64, 64, 7, 4, 4), (128, 64, 64, 14, 4, 4), (128, 128, 64, 14, 8, 4), (128, 64, 128, 14, 4, 3),
             (128, 32, 64, 14, 4, 4)],
    "o": [(128, 64, 64, 7, 4, 4), (128, 64, 64, 14, 4, 4), (128, 32, 64, 7, 4, 4)],
    "qkv": [(128, 64, 64, 7, 4, 4), (128, 128, 64, 14, 8, 4), (128, 64, 128, 7, 4, 3)],
    "gate_up": [(128, 64, 64, 1, 4, 4), (128, 128, 64, 2, 8, 4), (128, 64, 64, 2, 4, 4)],
}
SPLITK_TINY = {k: [(16, 32, 32, 2, 4, 2), (16, 16, 32, 1, 4, 1)] for k in SPLITK}
# row name, weight's (out, in), the activation it reads, what follows it
ROWS = [("down", "H", "I", "down + add&norm"), ("o", "H", "H", "o_proj + add&norm"),
        ("qkv", "QKV", "H", "q/k/v (+bias)"), ("gate_up", "2I", "H", "gate/up + SiLU x up")]


def setup(shape: dict, device, dtype) -> dict:
    """Random weights for shape["L"] layers (scaled so activations stay O(1)) and one decode step's activations."""
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device=device, generator=gen) * scale).to(dtype)
    M, H, I, QKV, L = (shape[k] for k in ("M", "H", "I", "QKV", "L"))
    size = {"H": H, "I": I, "QKV": QKV, "2I": 2 * I}
    w = {name: [rnd(size[n], size[k], scale=size[k] ** -0.5) for _ in range(L)] for name, n, k, _ in ROWS}
    return dict(w=w, wt={name: [t.t().contiguous() for t in ws] for name, ws in w.items()},
                b=[rnd(QKV, scale=0.1) for _ in range(L)], g=[1 + rnd(H, scale=0.1) for _ in range(L)],
                x=rnd(M, H), h=rnd(M, H), act=rnd(M, I, scale=0.5), eps=1e-6)


def variants(row: str, st: dict, cfgs: list[tuple], compiled) -> dict:
    """name -> (fn(i) -> outputs of layer i, is it checked). `compiled(f)` wraps the elementwise kernels."""
    w, wt, b, g, eps = st["w"], st["wt"], st["b"], st["g"], st["eps"]
    inp = st["act"] if row == "down" else st["h"]                           # (M, K)
    x = st["x"]
    an, pan, sm, psm, pb = map(compiled, (add_norm, parts_add_norm, silu_mul, parts_silu_mul, parts_bias))
    if row in ("down", "o"):
        after = lambda i, y: an(x, y, g[i], eps)
        after_parts = lambda i, p: pan(x, p, g[i], eps)
        gemm = lambda i, wi: F.linear(inp, wi)
        gemm_t = lambda i, wti: torch.matmul(inp, wti)
    elif row == "qkv":
        after, after_parts = (lambda i, y: y), (lambda i, p: pb(p, b[i]))
        gemm = lambda i, wi: F.linear(inp, wi, b[i])
        gemm_t = lambda i, wti: torch.addmm(b[i], inp, wti)
    else:
        after, after_parts = (lambda i, y: sm(y)), (lambda i, p: psm(p, inp.dtype))
        gemm = lambda i, wi: F.linear(inp, wi)
        gemm_t = lambda i, wti: torch.matmul(inp, wti)
    out = {"cublas": (lambda i: after(i, gemm(i, w[row][i])), True),
           "cublas GEMM alone": (lambda i: gemm(i, w[row][i]), False),
           "cublas x@Wt": (lambda i: after(i, gemm_t(i, wt[row][i])), True),
           "cublaslt": (lambda i: after(i, gemm(i, w[row][i])), True)}
    for cfg in cfgs:
        name = "splitk " + "/".join(map(str, cfg))
        out[name] = (lambda i, cfg=cfg: after_parts(i, splitk_partials(inp, w[row][i], cfg)), True)
        out[name + " GEMM alone"] = (lambda i, cfg=cfg: splitk_partials(inp, w[row][i], cfg), False)
    return out


class blas:
    """preferred_blas_library(lib) inside the block, the previous library restored after."""
    def __init__(self, lib: str | None):
        self.lib = lib

    def __enter__(self):
        self.prev = torch.backends.cuda.preferred_blas_library()
        if self.lib:
            torch.backends.cuda.preferred_blas_library(self.lib)

    def __exit__(self, *exc):
        torch.backends.cuda.preferred_blas_library(self.prev)


def flat(outs) -> list[Tensor]:
    return [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]


def rel_diff(got: list[Tensor], want: list[Tensor]) -> float:
    """max |got - want| over max |want|, the worst output tensor of all layers."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, want))


COMPILED = {}


def compiled(f):
    # one torch.compile wrapper per function for the whole run: a new wrapper could recompile what another has
    if f not in COMPILED:
        COMPILED[f] = torch.compile(f, dynamic=False, fullgraph=True)
    return COMPILED[f]


def measure_row(row: str, st: dict, L: int, cfgs: list[tuple], rounds: int, deadline: float, flush: Tensor) -> dict:
    """name -> dict(us per layer, rel diff or None): one CUDA graph of L layers' calls per variant, the variants'
    replays alternating, each after an L2 flush; variants not captured before `deadline` are left out."""
    graphs, res = {}, {}
    for name, (fn, checked) in variants(row, st, cfgs, compiled).items():
        if time.time() > deadline:
            print(f"  {row}: out of --budget-s, {name} not measured", flush=True)
            continue
        try:
            with blas("cublaslt" if name == "cublaslt" else None):
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):   # compiles, autotunes, cuBLAS handles: not in the graph
                    for i in range(L):
                        fn(i)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    outs = [fn(i) for i in range(L)]
        except Exception as e:   # one setting the card cannot take (shared memory) leaves the others
            print(f"  {row}: {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        graphs[name] = (g, outs, checked)
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        marks = []
        for name, (g, _, _) in graphs.items():
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            marks.append((name, a, b))
        torch.cuda.synchronize()
        for name, a, b in marks:
            times[name].append(a.elapsed_time(b) * 1000 / L)
    want = flat(graphs["cublas"][1]) if "cublas" in graphs else None
    for name, (g, outs, checked) in graphs.items():
        res[name] = dict(us=statistics.median(times[name]),
                         diff=rel_diff(flat(outs), want) if checked and want is not None else None)
    return res


def check_tiny() -> int:
    """Every variant at TINY shapes on the CPU (the Triton kernel interpreted), against the cuBLAS route's math."""
    st = setup(TINY, "cpu", torch.float16)
    failed = 0
    for row, *_ in ROWS:
        vs = variants(row, st, SPLITK_TINY[row], lambda f: f)
        want = flat([vs["cublas"][0](i) for i in range(TINY["L"])])
        for name, (fn, checked) in vs.items():
            if not checked or name == "cublaslt":   # cuBLASLt is a GPU library: on the CPU the same call as cublas
                continue
            d = rel_diff(flat([fn(i) for i in range(TINY["L"])]), want)
            failed += d > 2e-2
            print(f"{'ok' if d <= 2e-2 else 'FAIL':4s} {row:8s} {name:28s} max |diff| / max |ref| {d:.1e}")
    print(f"{'all variants match' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


def table(results: dict, shape: dict) -> str:
    size = {"H": shape["H"], "I": shape["I"], "QKV": shape["QKV"], "2I": 2 * shape["I"]}
    lines = ["| GEMM (+ what follows) | weights MB | variant | us per layer | TB/s | max diff / max ref |",
             "|---|---|---|---|---|---|"]
    best = {}
    for row, n, k, title in ROWS:
        if row not in results:
            continue
        mbytes = size[n] * size[k] * 2 / 1e6
        for name, r in sorted(results[row].items(), key=lambda kv: kv[1]["us"]):
            d = "" if r["diff"] is None else f"{r['diff']:.1e}"
            lines.append(f"| {title} | {mbytes:.2f} | {name} | {r['us']:.2f} | {mbytes / r['us']:.2f} | {d} |")
        for fam in ("cublas", "cublas x@Wt", "cublaslt", "splitk", "cublas GEMM alone", "splitk GEMM alone"):
            alone = fam.endswith("GEMM alone")
            got = [r["us"] for name, r in results[row].items() if name.endswith("GEMM alone") == alone and
                   (name.startswith("splitk ") if fam.startswith("splitk") else name == fam)]
            if got:
                best.setdefault(fam, {})[row] = min(got)
    lines += ["", "| variant (best setting per GEMM) | " + " | ".join(t for r, _, _, t in ROWS) + " | sum |",
              "|---|" + "---|" * (len(ROWS) + 1)]
    for fam, per in best.items():
        cells = [f"{per[r]:.2f}" if r in per else "-" for r, *_ in ROWS]
        whole = f"{sum(per.values()):.2f}" if len(per) == len(ROWS) else "-"
        lines.append(f"| {fam} | " + " | ".join(cells) + f" | {whole} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="also write the table to OUT/decode_gemm.md")
    ap.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: check every variant, no timing")
    ap.add_argument("--rounds", type=int, default=30, help="alternating replays per variant (median)")
    ap.add_argument("--rows", default=",".join(r for r, *_ in ROWS), help="GEMMs to time, in this order")
    ap.add_argument("--budget-s", type=float, default=1e9, help="capture no new variant after this many seconds")
    args = ap.parse_args()
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--tiny runs the Triton kernel on the CPU: set TRITON_INTERPRET=1")
        raise SystemExit(check_tiny())
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemm_bench needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    st = setup(W1, "cuda", torch.bfloat16)
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)   # 256 MB: over the L2 (50 MB on H100/H200)
    results = {}
    for row in args.rows.split(","):
        results[row] = measure_row(row, st, W1["L"], SPLITK[row], args.rounds, t0 + args.budget_s, flush)
        print(f"{row} done at {time.time() - t0:.0f} s", flush=True)
        print(table(results, W1), flush=True)
    text = (f"Decode GEMMs at W1's shapes on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton "
            f"{triton.__version__}); `python tools/decode_gemm_bench.py {' '.join(sys.argv[1:])}`\n\n"
            + table(results, W1) + "\n")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_gemm.md"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
