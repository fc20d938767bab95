"""Time exact_linear's candidate tiles per weight shape class on this card (kernels/exact_gemm.py: TILES, tile_of).

    python3 tools/exact_gemm_tiles.py --out DIR           # W1's shapes (Qwen2.5-0.5B, bf16): DIR/exact_tiles.md
    python3 tools/exact_gemm_tiles.py --write             # also rewrite TILES with each class's best (CUDA only)
    python3 tools/exact_gemm_tiles.py --hidden 4096 --inter 11008 --kv 1024 --vocab 152064   # another model

A class's weights (kernels/exact_gemm.py: shape_class; a group's concatenation is one weight: narrow: a lone k or v;
long_k: down; wide: gate/up; vocab: the head; other: q/k/v, o) are timed inside a CUDA graph (the decode step
replays one, so a standalone launch would time Triton's host launch cost instead) at the decode
step's M (--decode, default 128 rows) and at the trainer's one exact micro-batch (--train, default 10240 tokens);
the score is what one W1 step spends in that class: steps x t(decode) + t(train) summed over its weights, so the
decode step (256 calls a rollout) decides. A tile is fixed per weight, never per M: changing TILES changes which
bits a row gets, on the engine's and the trainer's side alike (both read the same table), so a run stays exact.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch
import torch.nn.functional as F

import kernels.exact_gemm as eg

CANDIDATES = [(64, 64, 64, 4, 3), (64, 32, 64, 4, 4), (32, 32, 128, 4, 3), (16, 32, 128, 4, 4), (16, 64, 128, 4, 4),
              (64, 16, 64, 4, 4), (32, 64, 64, 4, 4), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (128, 32, 64, 4, 4)]


def weights(a) -> dict:
    """class -> [(N, K), ...] of one layer (and the head), each weight once per use."""
    H, I, kv, V = a.hidden, a.inter, a.kv, a.vocab
    return {"narrow": [(kv, H)], "long_k": [(H, I)], "vocab": [(V, H)], "wide": [(2 * I, H)],
            "other": [(H + 2 * kv, H), (H, H)]}


def bench(fn) -> float:
    import triton.testing
    fn()                                                        # compiled before the capture
    return triton.testing.do_bench_cudagraph(fn, rep=20)                       # ms


def timed(x, w, tile) -> float:
    """ms of one exact_linear with tile forced for this weight's class."""
    cls = eg.shape_class(w.shape[0], w.shape[1])
    old = eg.TILES[cls]
    eg.TILES[cls] = tile
    try:
        return bench(lambda: eg.exact_linear(x, w))
    finally:
        eg.TILES[cls] = old


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--inter", type=int, default=4864)
    p.add_argument("--kv", type=int, default=128, help="k (and v) projection outputs: KV heads x head_dim")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--decode", type=int, default=128, help="rows of a decode step")
    p.add_argument("--train", type=int, default=10240, help="tokens of the trainer's exact micro-batch")
    p.add_argument("--steps", type=int, default=256, help="decode steps per rollout (the score's weight)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--write", action="store_true", help="rewrite kernels/exact_gemm.py's TILES with the best")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tools/exact_gemm_tiles.py times a GPU: no CUDA device here")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = ["| class | weights (N x K) | tile (BM, BN, BK, warps, stages) | decode ms | train ms | score ms | cuBLAS "
            "decode / train ms |", "|---|---|---|---|---|---|---|"]
    best = {}
    with torch.no_grad():
        for cls, shapes in weights(a).items():
            ws = {s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for s in set(shapes)}
            xs = {(m, k): torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
                  for m in (a.decode, a.train) for _, k in shapes}
            ref = [sum(bench(lambda: F.linear(xs[m, k], ws[n, k])) for n, k in shapes) for m in (a.decode, a.train)]
            scores = []
            for tile in CANDIDATES:
                t = [sum(timed(xs[m, k], ws[n, k], tile) for n, k in shapes) for m in (a.decode, a.train)]
                scores.append((a.steps * t[0] + t[1], tile, t))
            scores.sort()
            best[cls] = scores[0][1]
            names = ", ".join(f"{n}x{k}" for n, k in shapes)
            for score, tile, t in scores:
                mark = " **best**" if tile == best[cls] else ""
                rows.append(f"| {cls} | {names} | {tile}{mark} | {t[0]:.4f} | {t[1]:.3f} | {score:.2f} | "
                            f"{ref[0]:.4f} / {ref[1]:.3f} |")
            print(rows[-len(scores)], flush=True)
    text = "\n".join([f"{torch.cuda.get_device_name()}, M = {a.decode} (decode) and {a.train} (train)", "", *rows])
    os.makedirs(a.out, exist_ok=True)
    open(os.path.join(a.out, "exact_tiles.md"), "w").write(text + "\n")
    print(text)
    if a.write:
        path = eg.__file__
        src = open(path).read()
        body = "".join(f'    "{c}": {best[c]},\n' for c in eg.TILES)
        src = re.sub(r"(# TILES-BEGIN\nTILES = \{\n)(.*?)(\}\n# TILES-END)", lambda m: m[1] + body + m[3], src,
                     flags=re.S)
        open(path, "w").write(src)
        print("wrote", path, best)


if __name__ == "__main__":
    main()
