"""W10 (docs/benchmarks.md): W1's rollout by model family, the built-in engine against transformers' static-cache
`generate`, normalised by the bytes of weights each token reads.

    python tools/bench_w10.py                     # GPU: every model below, bf16, ~5 minutes at most (--budget)
    python tools/bench_w10.py --tiny              # CPU smoke run: the same code on 2-layer toy shapes, seconds
    python tools/bench_w10.py --only qwen3,gemma3 --no-hf --json out.json
    python tools/bench_w10.py --only granite --hf granite --check --profile granite   # + log-prob gap, kernel table
    python tools/bench_w10.py --only qwen2,qwen3,qwen3_moe --no-hf --keep-cache   # states kept, as training's auto
    python tools/bench_w10.py --only qwen3 --no-hf --ab FAST_DECODE_SHARED_READS  # a switch off and on, in one process
    python tools/bench_w10.py --no-hf --keep-cache --floor   # + each model's decode floor at the card's read rate

Workload: 16 prompts x 8 samples, 64 random tokens each, 256 new tokens, temperature 1, top_p 1, random bf16
weights built here from each family's config class (no hub), EOS outside the vocabulary, so every row runs to
full length. Every model is built and warmed up first (BuiltinEngine.generate: the hand-written step for the
families in engines/families.py, the generic graphed path otherwise; the first call compiles and captures and is
not timed); then --repeats rounds each time one rollout of every model in turn, so a drift of the host or the
card during the command moves every family alike (qwen2's own time varied by ~10% between commands); each
model's figure is its median over the rounds, with the range; last, per model, transformers' generate with
cache_implementation="static". Each model runs in a try/except that prints its failure; models not set up when
--budget seconds have passed are skipped, and the table says so.

Normalised: seconds per (parameter read per token), relative to qwen2's fast path in the same round (the median
over rounds, with the range). A token reads every weight except the embedding rows it does not look up (the head
reads the whole vocabulary matrix); an MoE token reads its top_k experts of E. Goals (issue 32): every listed family within 1.3x of qwen2; the generic path
within 2x and at most 0.5x of transformers' static-cache generate. "x qwen2 per byte" divides instead by the bytes
a decode step of the whole batch reads (bytes_per_step: the experts some token of the batch picks, not top_k of
them, and the K/V cache at its mean length), which is what bounds a memory-bound step. --floor measures the
card's read rate in the same command (read_rate) and gives each model its decode floor: its decode steps'
bytes at that rate, the engine's seconds over it, and the per-parameter ratio to qwen2 were both at their floors.
"""
import argparse
import json
import statistics
import sys
import os
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
# inductor's pool of compile workers slows the first steps on a GPU host (docs/speed.md); one thread avoids it
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch

import bench_workload   # tools/: W1's timing helpers
from bench_workload import sync

# name -> (model_type, config fields, path): the shapes of issue 32's table; granite at qwen2's shape stands for
# the generic path (a family the hand-written step does not cover)
MODELS = {
    "qwen2": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                            num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True), "fast"),
    "qwen3": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
              "fast"),
    "llama": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
              "fast"),
    "gemma3": ("gemma3_text", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                   query_pre_attn_scalar=256), "fast"),
    "qwen3_moe": ("qwen3_moe", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_experts=32,
                                    num_experts_per_tok=4, moe_intermediate_size=768, tie_word_embeddings=True),
                  "fast"),
    "granite": ("granite", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                                embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                                logits_scaling=8.0), "generic"),
}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32)
WORK = dict(prompts=16, samples=8, prompt_len=64, new=256)
WORK_TINY = dict(prompts=2, samples=2, prompt_len=8, new=8)


def build(model_type: str, fields: dict, tiny: bool, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    if tiny:
        fields = {k: TINY.get(k, v) for k, v in fields.items()}
        fields.update({k: v for k, v in TINY.items() if k in ("head_dim",)})
    V = fields["vocab_size"]
    cfg = AutoConfig.for_model(model_type, **fields, max_position_embeddings=4096, eos_token_id=V, pad_token_id=None,
                               bos_token_id=None)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def params_read(model, batch: int = 1) -> int:
    """Parameters one decode step of `batch` tokens reads: all but the embedding rows it does not look up (the head
    reads the whole matrix, tied or not); of routed experts, those some token picks: top_k of E for one token, and
    for a batch the expected number of distinct experts, E (1 - (1 - top_k / E)^batch), with uniform routing
    (at 128 tokens, top-4 of 32: all of them)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    n = sum(p.numel() for p in model.parameters()) - emb.numel() + (head.numel() if head is emb else 0)
    c = model.config
    for name, p in model.named_parameters():
        if ".experts." in name:
            n -= p.numel() * (1 - c.num_experts_per_tok / c.num_experts) ** batch
    return int(n)


def bytes_per_step(model, row: dict, work: dict, dtype) -> int:
    """Bytes one decode step reads on average over the rollout: the weights the batch touches (params_read at its
    batch) and every sequence's K/V cache at the mean cached length (prompt + half the new tokens)."""
    B = work["prompts"] * work["samples"]
    weights = params_read(model, B) * torch.finfo(dtype).bits // 8
    return int(weights + B * (work["prompt_len"] + work["new"] / 2) * row["kv_bytes_per_position"])


def read_rate(device, reps: int = 20) -> dict:
    """The device's streaming read rate in bytes/s, the faster of two readers of one bf16 buffer (2 GiB on a GPU,
    256 MiB on a CPU), each the median of `reps` reads: torch.sum, and on a GPU a Triton kernel that only loads
    and adds (torch.sum's reduction read slower on an H200: docs/benchmarks.md, W10); a GPU's reads are replayed
    in a CUDA graph, so no launch gap counts. {"rate": the faster, "by": its reader, reader: rate for each}."""
    x = torch.ones((2 << 30 if device.type == "cuda" else 256 << 20) // 2, dtype=torch.bfloat16, device=device)
    readers = {"torch.sum": lambda: x.sum()}
    if device.type == "cuda":
        from kernels.logprob import HAS_TRITON
        if HAS_TRITON:
            readers["triton"] = _triton_reader(x)
    out = {}
    for name, fn in readers.items():
        if device.type == "cuda":
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            fn = graph.replay
        _, times, _ = bench_workload.timed(fn, reps)
        out[name] = x.numel() * x.element_size() / statistics.median(times)
    out["by"] = max(readers, key=out.get)
    out["rate"] = out[out["by"]]
    return out


def _triton_reader(x: torch.Tensor):
    """A read of x that does nothing else: each program loads ITERS blocks of 4096 elements, software-pipelined,
    and stores one partial sum (so the loads are not dead code)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in tl.range(0, ITERS, num_stages=4):
            o = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))

    grid = triton.cdiv(x.numel(), 4096 * 8)
    out = torch.empty(grid, dtype=torch.float32, device=x.device)
    return lambda: read[(grid,)](x, out, x.numel(), BLOCK=4096, ITERS=8, num_warps=8)


def floors(rows: list[dict], rate: float, work: dict):
    """Each timed row's decode floor (its work["new"] - 1 decode steps' bytes_per_step at `rate`; the prefill and
    sampling left out, so a lower bound), the engine's seconds over it, and its seconds per parameter over qwen2's
    were both engines at their floors (a ratio of bytes per parameter: the rate cancels)."""
    base = next((b for b in rows if b["model"] == "qwen2" and "bytes_per_step" in b), None)
    for r in rows:
        if "engine_s" not in r or "error" in r:
            continue
        r["decode_floor_s"] = (work["new"] - 1) * r["bytes_per_step"] / rate
        r["x_floor"] = r["engine_s"] / r["decode_floor_s"]
        if base is not None:
            r["x_qwen2_at_floors"] = (r["bytes_per_step"] / r["params_read"]) / (base["bytes_per_step"]
                                                                                 / base["params_read"])


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call's seconds: compile and capture, median of `repeats` more)."""
    first, times, _ = bench_workload.timed(fn, repeats)
    return first, statistics.median(times)


def profile(fn, out: str) -> str:
    """One more rollout under torch.profiler: its CUDA kernels by total time (a CUDA graph's replays are reported
    kernel by kernel) written to `out`; returns the path."""
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        fn()
        sync()
    with open(out, "w") as f:
        f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90))
    return out


def logprob_gap(model, out) -> dict:
    """How far the rollout's sampling log-probs are from teacher forcing on its own tokens (models.completion_logprobs,
    16 rows at a time so that a plain head's (rows, C, V) logits stay small): mean and max over completion tokens.
    A float-noise figure (bf16: both sides round), not a pass/fail; a wrong attention shows as a gap of another size."""
    from models import completion_logprobs
    C = out.completion_mask.shape[1]
    mask = out.completion_mask.bool()
    gaps = []
    with torch.no_grad():
        for r in range(0, out.input_ids.shape[0], 16):
            ids, am = (t[r:r + 16].to(model.device) for t in (out.input_ids, out.attention_mask))
            logp, _ = completion_logprobs(model, ids, am, C)
            gaps.append((logp.float().cpu() - out.logprobs[r:r + 16].float())[mask[r:r + 16]].abs())
    g = torch.cat(gaps)
    return {"logprob_gap_mean": g.mean().item(), "logprob_gap_max": g.max().item()}


def setup(name: str, a, work: dict, device, dtype) -> dict:
    """Build one model and its engine and make the first (untimed: compile and capture) rollout; returns the state
    the timed rounds and `finish` use, its row holding the model's sizes and the first call's seconds."""
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    model_type, fields, path = MODELS[name]
    model = build(model_type, fields, a.tiny, device, dtype)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, min(V, 1000), (work["prompts"], work["prompt_len"]), generator=g).tolist()
    c = model.config
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # K and V bytes per cached position of one sequence: what a decode token reads besides the weights
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * D * torch.finfo(dtype).bits // 8
    row = {"model": name, "model_type": model_type, "params_read": params_read(model), "kv_bytes_per_position": kv,
           "keep_cache": a.keep_cache}
    row["bytes_per_step"] = bytes_per_step(model, row, work, dtype)
    engine = BuiltinEngine(model, eos_id=V, pad_id=0, fast=True, keep_cache=a.keep_cache)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=work["new"])
    gen = torch.Generator(device=device).manual_seed(0)
    fn = lambda: engine.generate(prompts, work["samples"], sampling, gen)
    first, _, out = bench_workload.timed(fn, 0)
    row["engine_first_s"], row["engine_times"] = first, []
    row["path"] = type(engine.decoder).__name__ if engine.decoder is not None else "portable loop"
    if getattr(engine.decoder, "use_graph", False) is False and device.type == "cuda":
        row["path"] += " (no graph)"
    if row["path"].startswith("GenericDecoder"):   # its decode attention: kernel, sdpa or the model's own
        row["path"] += f", {engine.decoder.attention} attention"
    return {"name": name, "model": model, "engine": engine, "fn": fn, "prompts": prompts, "out": out, "row": row,
            "V": V}


def time_once(st: dict):
    """One timed rollout of a set-up model (a round's turn); its median and range go to the row. A twin of --ab
    sets its variable first (read by the engine at each rollout)."""
    if "ab" in st:
        os.environ[st["ab"][0]] = st["ab"][1]
    sync()
    t0 = time.perf_counter()
    st["out"] = st["fn"]()
    sync()
    r = st["row"]
    r["engine_times"].append(time.perf_counter() - t0)
    r["engine_s"] = statistics.median(r["engine_times"])
    r["engine_min_s"], r["engine_max_s"] = min(r["engine_times"]), max(r["engine_times"])


def finish(st: dict, a, work: dict, device, emit=lambda row: None) -> dict:
    """After the rounds: the log-prob gap (--check, on the last rollout), the profile, transformers' generate."""
    name, model, row = st["name"], st["model"], st["row"]
    if a.check:
        row.update(logprob_gap(model, st["out"]))
    if name in a.profile.split(",") and device.type == "cuda":
        out = a.profile_out if a.profile == name else a.profile_out.replace(".txt", f".{name}.txt")
        row["profile"] = profile(st["fn"], out)
    emit(row)   # the engine's figures, before transformers' generate (a run cut short keeps them)
    if not a.no_hf and (not a.hf or name in a.hf.split(",")):
        ids = torch.tensor(st["prompts"], device=device).repeat_interleave(work["samples"], 0)
        fn = lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                    temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=work["new"],
                                    min_new_tokens=work["new"], pad_token_id=0, eos_token_id=st["V"],
                                    cache_implementation="static")
        row["hf_static_first_s"], row["hf_static_s"] = timed(fn, 1)
    return row


def round_ratios(rows: list[dict]):
    """Per round, each model's seconds per parameter read over qwen2's in the same round: the ratio's median and
    range over rounds (qwen2 drifts between commands and hosts; a round's pair ran back to back)."""
    for r in rows:   # with --ab, against qwen2 under the same value of the variable
        base = next((b for b in rows if b["model"].split(" ")[0] == "qwen2" and b.get("ab") == r.get("ab")
                     and b.get("engine_times")), None)
        if base is None:
            continue
        n = min(len(r.get("engine_times", [])), len(base["engine_times"]))
        if n and "error" not in r:
            q = [(r["engine_times"][i] / r["params_read"]) / (base["engine_times"][i] / base["params_read"])
                 for i in range(n)]
            r["x_qwen2_rounds"] = q
            r["x_qwen2"], r["x_qwen2_min"], r["x_qwen2_max"] = statistics.median(q), min(q), max(q)


def table(rows: list[dict], device: str) -> str:
    kept = " (states kept between rollouts)" if rows and rows[0].get("keep_cache") else ""
    lines = [f"W10 on {device}{kept}: rollout of {{prompts}} x {{samples}} x {{new}} new tokens; engine s: the median "
             "of the interleaved rounds (min-max); x qwen2 = seconds per parameter read over qwen2's fast path in the "
             "same round, the median over rounds (min-max)", "",
             "| model | path | params read / token | engine s | x qwen2 | GB read / step | x qwen2 per byte | hf static s "
             "| engine / hf | log-prob gap mean, max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "engine_s" not in r:
            lines.append(f"| {r['model']} | failed: {r.get('error', 'no timed round')} | | | | | | | | |")
            continue
        rel = f"{r['x_qwen2']:.2f} ({r['x_qwen2_min']:.2f}-{r['x_qwen2_max']:.2f})" if "x_qwen2" in r else ""
        hf = r.get("hf_static_s")
        hf_s, ratio = ("", "") if hf is None else (f"{hf:.3f}", f"{r['engine_s'] / hf:.2f}")
        gap = f"{r['logprob_gap_mean']:.2e}, {r['logprob_gap_max']:.2e}" if "logprob_gap_mean" in r else ""
        base = next((b for b in rows if b["model"].split(" ")[0] == "qwen2" and b.get("ab") == r.get("ab")
                     and "engine_s" in b), None)
        per_byte = f"{r['engine_s'] / r['bytes_per_step'] / (base['engine_s'] / base['bytes_per_step']):.2f}" \
            if base else ""
        lines.append(f"| {r['model']} | {r['path']} | {r['params_read'] / 1e6:.1f}M | {r['engine_s']:.3f} "
                     f"({r['engine_min_s']:.3f}-{r['engine_max_s']:.3f}) | {rel} | {r['bytes_per_step'] / 1e9:.2f} | "
                     f"{per_byte} | {hf_s} | {ratio} | {gap} |")
    floored = [r for r in rows if "decode_floor_s" in r]
    if floored:
        lines += ["", "| model | decode floor s | engine / floor | x qwen2 per parameter at the floors |",
                  "|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['decode_floor_s']:.3f} | {r['x_floor']:.2f} | "
                  f"{r.get('x_qwen2_at_floors', float('nan')):.2f} |" for r in floored]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="2-layer toy shapes, float32, for a CPU smoke run")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(MODELS)}")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up rollouts: each round times "
                   "one rollout of every model in turn (median and range per model)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds; models not set up by then are skipped")
    p.add_argument("--json", default="", help="also write the rows here (after each stage)")
    p.add_argument("--hf", default="", help="comma-separated models to run transformers' generate for (default: all)")
    p.add_argument("--profile", default="", help="comma-separated models whose engine rollout is profiled once more "
                   "(GPU); with several, each table goes to --profile-out with the model's name before .txt")
    p.add_argument("--profile-out", default="w10_profile.txt", help="where --profile writes its kernel table")
    p.add_argument("--keep-cache", action="store_true",
                   help="each engine keeps its decoder's state between rollouts (engine_keep_cache=true, which auto "
                   "picks in training for models this size): no re-capture per rollout, the prefill from a graph")
    p.add_argument("--ab", default="", metavar="VAR",
                   help="A/B an environment variable the engine reads at each rollout (e.g. FAST_DECODE_SHARED_READS): "
                   "each model's rollout is timed with VAR=0 and VAR=1 in every round, the order alternating by "
                   "round; a row per value; the check, profile and transformers' generate run for VAR=1 only")
    p.add_argument("--floor", action="store_true",
                   help="also measure the card's read rate and give each model its decode floor")
    p.add_argument("--check", action="store_true",
                   help="also measure each engine rollout's log-prob gap to teacher forcing (mean, max)")
    a = p.parse_args()
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"bench_w10: unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if a.repeats < 1:
        sys.exit(f"bench_w10: --repeats must be at least 1 (timed rounds), got {a.repeats}")
    if a.floor and a.ab:
        sys.exit("bench_w10: --floor and --ab do not combine (a twin's floor is its model's); run them apart")
    if "qwen2" not in names:
        names = ["qwen2"] + names                                   # the yardstick
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and not a.tiny else torch.float32
    work = WORK_TINY if a.tiny else WORK
    if a.tiny:
        a.repeats = min(a.repeats, 2)
    start, rows, states = time.perf_counter(), [], []
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    extra = {}   # command-wide figures for the json (--floor's read_rate)

    def save(row: dict | None = None):   # after each stage: a run cut short keeps what it measured
        if row is not None and not any(r is row for r in rows):
            rows.append(row)
        round_ratios(rows)
        if row is not None:
            print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": dev_name, "work": work, "rows": rows, "argv": sys.argv[1:], **extra,
                           "FAST_DECODE_ATTN": os.environ.get("FAST_DECODE_ATTN", "")}, f, indent=1)

    def failed(name: str, e: Exception, row: dict | None, key: str = "error"):
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        row = row if row is not None else {"model": name}
        save(row)
        row[key] = why
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # every model built and warmed up (compile, capture) first, then timed in rounds of one rollout each, in turn:
    # a drift of the host or the card over the command moves every model alike, not one family's ratio
    for name in names:
        if time.perf_counter() - start > a.budget:
            save({"model": name, "error": f"skipped: the {a.budget:.0f} s budget was spent"})
            continue
        try:
            states.append(setup(name, a, work, device, dtype))
            save(states[-1]["row"])
        except Exception as e:   # one family's failure is a row of the table, not the end of the run
            failed(name, e, None)
    before = os.environ.get(a.ab) if a.ab else None
    if a.ab:   # each set-up model as two twins sharing its engine: VAR=0 and VAR=1, each with its own row
        twins = []
        for st in states:
            rows.remove(st["row"])
            for v in "01":
                row = dict(st["row"], model=f"{st['name']} {a.ab}={v}", ab=v, engine_times=[])
                twins.append(dict(st, row=row, ab=(a.ab, v)))
                save(row)
        states = twins
    for i in range(a.repeats):
        for st in list(states) if i % 2 == 0 or not a.ab else [t for pair in zip(states[1::2], states[::2])
                                                                 for t in pair]:
            try:
                time_once(st)
            except Exception as e:
                failed(st["name"], e, st["row"])
                states.remove(st)
        save()
        print(f"bench_w10: round {i + 1} of {a.repeats}: " + ", ".join(
            f"{st['row']['model']} {st['row']['engine_times'][-1]:.3f} s" for st in states), flush=True)
    if a.ab:
        states = [st for st in states if st["ab"][1] == "1"]
    for st in states:
        try:
            save(finish(st, a, work, device))
        except Exception as e:   # the engine ran; the check, profile or transformers' generate failed
            failed(st["name"], e, st["row"], "hf_error")
    if a.ab:
        os.environ.pop(a.ab, None)
        if before is not None:
            os.environ[a.ab] = before
    if a.floor:
        extra["read_rates"] = read_rate(device)
        extra["read_rate"] = extra["read_rates"]["rate"]
        floors(rows, extra["read_rate"], work)
        save()
        rates = extra["read_rates"]
        each = ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in rates.items() if k not in ("by", "rate"))
        print(f"bench_w10: read rate {each}; the floors take {rates['by']}'s", flush=True)
    print(table(rows, dev_name).format(**work))


if __name__ == "__main__":
    main()
