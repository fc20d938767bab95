"""W8 benchmark (docs/benchmarks.md): one GRPO step of the shapes task on a VLM at Qwen2-VL-2B shape, this project's
train.py against TRL's GRPOTrainer on the same model, one GPU, one command.

    python tools/bench_w8.py --out bench-w8                          # GPU: ours, then TRL; prints a markdown table
    python tools/bench_w8.py --wheels .whl --out bench-w8             # first installs TRL from the wheels in .whl
                                                                      # (without --wheels: .whl, shared/wheels, ...)
    python tools/bench_w8.py --tiny --out /tmp/w8                     # CPU smoke run of the same code at toy shapes

Workload: Qwen2VLForConditionalGeneration built here from a Qwen2VLConfig at Qwen2-VL-2B's shape (text: hidden 1536,
MLP 8960, 28 layers, 12 query and 2 KV heads, vocabulary 151,936, tied head; vision: 32 blocks of width 1280, patch
14, 2 x 2 merge), random init, bf16. 8 prompts x 8 samples of task=shapes (tasks/shapes.py: one picture each, drawn
at 64 x 64 and resized by the image processor to --image-px square: 448 gives 32 x 32 patches, 256 image tokens),
128 new tokens at temperature 1. The tokenizer's EOS id lies outside the vocabulary (as W1's), so every completion
runs to full length and the work is fixed; the reward is a cheap function of the completion's text that varies
between samples (the shapes answers of a random model would all score 0, and GRPO would have nothing to do).
Parts, each in its own process (clean peak-memory counters):
  ours  train.main itself (the real loop) for 1 warm-up + N measured steps, once per --ours variant
        MICRO[:ckpt][:compile] (micro_batch_size, grad_checkpointing, compile: each language-model layer compiled;
        default 16 and 32 with both, and 16 with neither); the split comes from its metrics.jsonl. Its
        rollouts take the built-in engine's fast path (the pictures in the prefill, then the graphed text step;
        on the CPU eagerly), and the table counts those that did (count_fast_rollouts)
  trl   TRL's GRPOTrainer with W1's peer settings (docs/benchmarks.md: batch 16 x 4 accumulation steps, beta 0, bf16,
        its default gradient checkpointing) and the model's processor (Qwen2VLProcessor: the same image processor
        and tokenizer), conversational prompts with the picture in an `image` column, as TRL's VLM docs ask
--wheels DIR: `pip install --no-deps --target <out>/pylib` of the trl, datasets, dill, multiprocess, xxhash, pyarrow
and fsspec wheels found in DIR (the GPU machines have no TRL and no network; docs/benchmarks.md "Peers"), then the
TRL part runs with that folder on its path. Time: median over the measured steps. Memory: torch's peak allocated and
reserved on the card (ours: the largest phase's peak from train.py's mem/ metrics).
"""
import argparse
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch  # noqa: E402

from registry import register  # noqa: E402
from bench import print_result, run_part, write_report  # noqa: E402  (the runner of tools/bench.py's parts)
from bench_workload import cuda_info, sync  # noqa: E402

SHAPES = {
    "2b": dict(text=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, mrope_section=[16, 24, 24]),
               vision=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4),
               prompts=8, samples=8, new=128, image_px=448),
    "tiny": dict(text=dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, mrope_section=[4, 6, 6]),
                 vision=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
                 prompts=4, samples=2, new=8, image_px=56),
}
W = dict(SHAPES["2b"])          # the shape in use (--tiny switches it before anything reads it)
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz ?"
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# one user turn, its picture as Qwen2-VL's three markers (the processor expands the pad), no role tags: both sides
# render the same tokens (ours: vision.encode_rows has already expanded the pads in the string content)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                 "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                 "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")
WHEELS = ("trl", "datasets", "dill", "multiprocess", "xxhash", "pyarrow", "fsspec")
WHEEL_FOLDERS = (".whl", "shared/wheels", "/opt/pypi/files")   # where --wheels looks when not given


def shapes_rows(_cfg=None):
    """task=shapes' rows, as train.py's task (train, held-out), each prompt led by spaces to the longest one's length
    (the tokenizer reads a character a token, so every prompt has the same number of tokens). Why: with left-padded
    prompts, TRL's VLM forward failed in transformers 5.17's M-RoPE index (a (3, 410) value for 398 unmasked
    positions, on an H100 and an H200), and equal lengths keep the padding out of both sides' batches."""
    from tasks import shapes
    train, held = shapes.shapes_samples(64, False), shapes.shapes_samples(16, True)
    width = max(len(r["prompt"]) for r in train + held)
    return [[{**r, "prompt": r["prompt"].rjust(width)} for r in rows] for rows in (train, held)]


def cheap_reward(prompt: str, completion: str, **_) -> float:
    """Varies between samples (so advantages are non-zero) and costs microseconds."""
    return completion.count("1") / (1 + len(completion))


# Registered by the module 'bench_w8' only (see the bottom): reward workers import a reward by its module's name,
# and a worker cannot import '__main__'.
if __name__ != "__main__":
    register("task", "w8_shapes")(shapes_rows)
    register("reward", "w8_cheap")(cheap_reward)


def build_model(path: str):
    """A random Qwen2-VL at W's shape, its tokenizer (characters, the vision markers, filler words up to the
    vocabulary, <eos> outside it) with the chat template, and a PIL image processor resizing every picture to
    image_px square."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    t = dict(W["text"])
    V = t["vocab_size"]
    words = list(CHARS) + VISION_TOKENS + ["<pad>"]
    vocab = {**{w: i for i, w in enumerate(words)}, **{f"t{i}": i for i in range(len(words), V)}, "<eos>": V}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    px = W["image_px"] ** 2
    images = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=px, max_pixels=px)
    ids = {name: tok.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    # pad_token_id=None: a zero-initialised pad embedding row makes RMSNorm's gradient overflow in a deep random
    # model (tools/bench_workload.py: build_model)
    special = dict(eos_token_id=V, pad_token_id=None, bos_token_id=None)
    mrope = t.pop("mrope_section")
    cfg = Qwen2VLConfig(
        text_config=dict(**t, max_position_embeddings=4096, tie_word_embeddings=True, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope}),
        vision_config=dict(**W["vision"], patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True, **special)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    try:   # built on the card in its dtype: a 2B float32 init on the CPU takes minutes
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            Qwen2VLForConditionalGeneration(cfg).save_pretrained(path)
    finally:
        torch.set_default_dtype(default)
    images.save_pretrained(path)
    tok.save_pretrained(path)


def processor(path: str):
    """The Qwen2VLProcessor TRL tokenizes with: the model's tokenizer and image processor, the same chat template.
    Built here rather than saved: transformers builds it only where torchvision is installed (its video part)."""
    from transformers import AutoTokenizer, Qwen2VLProcessor

    import vision

    class ImagesOnly(Qwen2VLProcessor):   # no video processor: skip the class check of the missing one
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)
    parts = dict(image_processor=vision.image_processor(path), tokenizer=AutoTokenizer.from_pretrained(path),
                 chat_template=CHAT_TEMPLATE)
    try:
        return Qwen2VLProcessor(**parts)
    except (AttributeError, ImportError, TypeError):   # transformers without torchvision
        return ImagesOnly(**parts)


# --- parts -------------------------------------------------------------------------------------------
def count_fast_rollouts() -> dict:
    """Make every built-in engine take the fast step (on a GPU it does by default; on the CPU, fast=True runs it
    eagerly, so the smoke run goes the GPU run's way) and count the rollouts, and those whose prompts' pictures
    went through the fast step's prefill (FastDecoder.sample with embeddings): the table says which path ran."""
    from engines.builtin import BuiltinEngine
    from engines.fast_decode import FastDecoder
    counts = {"rollouts": 0, "fast_with_pictures": 0}
    init, generate, sample = BuiltinEngine.__init__, BuiltinEngine.generate, FastDecoder.sample

    def fast_init(self, *args, **kw):
        init(self, *args, **{**kw, "fast": True})

    def counted_generate(self, *args, **kw):
        counts["rollouts"] += 1
        return generate(self, *args, **kw)

    def counted_sample(self, *args, **kw):
        counts["fast_with_pictures"] += kw.get("embeds") is not None
        return sample(self, *args, **kw)
    BuiltinEngine.__init__, BuiltinEngine.generate, FastDecoder.sample = fast_init, counted_generate, counted_sample
    return counts


def part_ours(a) -> dict:
    import train
    counts = count_fast_rollouts()
    run_dir = os.path.join(a.tmp, f"ours-{a.variant.replace(':', '-')}")
    micro, *flags = a.variant.split(":")
    last = a.steps + 1 + a.profile                 # --profile: one more step, under torch.profiler, not timed
    argv = [f"model={a.model}", "task=w8_shapes", "rewards=w8_cheap", f"steps={last}",
            f"prompts_per_step={W['prompts']}", f"samples_per_prompt={W['samples']}", f"max_new_tokens={W['new']}",
            "temperature=1.0", "eval_every=100000", "eval_size=8", "eval_temperature=1.0", "lr=1e-6",
            f"micro_batch_size={micro}", f"grad_checkpointing={'ckpt' in flags}", f"compile={'compile' in flags}",
            f"out_dir={run_dir}",
            "progress=false", *([f"profile_step={last}"] if a.profile else []), *a.set.split()]
    train.main(argv)
    if a.profile:
        shutil.copy(os.path.join(run_dir, "profile-rank0.txt"), os.path.join(a.out, f"ours-{a.variant.replace(':', '-')}.profile.txt"))
    mem = cuda_info()
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    names = sorted({k for r in rows for k in r if k.startswith("mem/")})
    stages = {k: max(r[k] for r in rows if k in r) for k in names}
    if stages:   # train.py resets the peak counters per phase: the run's peak is the largest
        mem["peak_alloc_gib"] = max([mem["peak_alloc_gib"]] + [v for k, v in stages.items() if "reserved" not in k])
        mem["peak_reserved_gib"] = max([mem["peak_reserved_gib"]] + [v for k, v in stages.items() if "reserved" in k])
    # drop step 0 (the evaluation), step 1 (the warm-up) and a profiled step
    rows = [r for r in rows if 2 <= r["step"] <= a.steps + 1]
    keys = ["time/rollout", "time/reward", "time/logprobs", "time/update", "time/sync"]
    steps = [sum(r.get(k, 0.0) for k in keys) for r in rows]
    return {"argv": argv, "step_s": statistics.median(steps), "steps_s": steps, **counts,
            "split_s": {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)},
            "logprob_mismatch_max": [r.get("logprob_mismatch/max") for r in rows], **mem}


def part_trl(a) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from models import load_model
    gpu = torch.cuda.is_available()
    model, _ = load_model(a.model, torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32)
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            sync()
            ends.append(time.perf_counter())

    def reward(prompts, completions, **_):   # conversational: each completion is a list of messages
        text = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
        return [cheap_reward("", t) for t in text]
    import vision
    rows = shapes_rows()[0]
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": r["prompt"].replace(vision.IMAGE, "")}]
                                         for r in rows],
                              "image": [vision.load_image(r["image"]) for r in rows]})
    batch = W["prompts"] * W["samples"]
    proc = processor(a.model)
    # a random model samples the vision markers too; transformers' M-RoPE index then counts a picture that is not
    # there and TRL's log-prob forward fails (shape mismatch in get_rope_index). Never sampling them costs a masked
    # fill per token; ours reads a sampled image pad as text, so it needs no such rule.
    markers = proc.tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    args = GRPOConfig(output_dir=os.path.join(a.tmp, "trl"), per_device_train_batch_size=batch // 4,
                      gradient_accumulation_steps=4, num_generations=W["samples"], beta=0.0, bf16=gpu, use_cpu=not gpu,
                      max_completion_length=W["new"], temperature=1.0, max_steps=a.steps + 1, learning_rate=1e-6,
                      logging_steps=1, report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0,
                      generation_kwargs={"suppress_tokens": markers})
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=proc,
                          train_dataset=data, callbacks=[Clock()])
    sync()
    ends.append(time.perf_counter())
    trainer.train()
    steps = [b - a_ for a_, b in zip(ends, ends[1:])][1:]                        # drop the warm-up step
    lens = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": statistics.median(steps), "steps_s": steps, "completion_len": lens,
            "config": {k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                     "num_generations", "beta", "bf16", "max_completion_length",
                                                     "gradient_checkpointing", "loss_type")}, **cuda_info()}


PARTS = {"ours": part_ours, "trl": part_trl}


def install_wheels(folder: str, target: str) -> str:
    """pip install --no-deps --target target the wheels found in folder of TRL and those of its dependencies that
    this Python cannot import yet (an installed pyarrow stays: datasets' fingerprinting failed to pickle a type of
    another pyarrow version); -> '' or why not."""
    needed = [n for n in WHEELS if n == "trl" or importlib.util.find_spec(n) is None]
    found = [w for name in needed for w in sorted(glob.glob(os.path.join(folder, f"{name}-*.whl")))[-1:]]
    if not any(os.path.basename(w).startswith("trl-") for w in found):
        return f"no trl wheel in {folder}"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", target, *found],
                       capture_output=True, text=True)
    return "" if r.returncode == 0 else f"pip install failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}"


def table(results: dict, a) -> str:
    trl, errors = results.get("trl", {}), results.get("_errors", {})
    dev = next((r["device"] for k, r in results.items() if k != "_errors" and "device" in r), "?")
    lines = [f"# W8 on {dev} (torch {torch.__version__}; {'tiny shapes' if a.tiny else 'Qwen2-VL-2B shape'}, "
             f"{W['prompts']} prompts x {W['samples']} samples, {W['new']} new tokens, "
             f"one {W['image_px']} px picture each; "
             f"{a.steps} measured steps after 1 warm-up)", "",
             "| | step (median) | steps | peak alloc | peak reserved |", "|---|---|---|---|---|"]
    ours = {k: r for k, r in results.items() if k.startswith("ours") and "step_s" in r}
    named = [(f"this project (train.py), micro_batch_size={k.split('-')[1]}, grad_checkpointing={'ckpt' in k}"
              f"{', compile=True' if 'compile' in k else ''}", r)
             for k, r in ours.items()] + [("TRL GRPOTrainer (its defaults: gradient_checkpointing="
                                           f"{trl.get('config', {}).get('gradient_checkpointing', '?')})", trl)]
    for name, r in named:
        if "step_s" in r:
            mem = (f"{r['peak_alloc_gib']:.1f} GiB | {r['peak_reserved_gib']:.1f} GiB" if "peak_alloc_gib" in r
                   else "n/a (CPU) | n/a (CPU)")
            lines.append(f"| {name} | {r['step_s']:.3f} s | {', '.join(f'{x:.2f}' for x in r['steps_s'])} | {mem} |")
    lines += [f"| {name} | failed: {err} | | | |" for name, err in errors.items()]
    cuda = "peak_alloc_gib" in trl
    fits = [r for r in ours.values() if cuda and r.get("peak_alloc_gib", 1e9) <= trl["peak_alloc_gib"]]
    best = min(fits or list(ours.values()) or [{}], key=lambda r: r.get("step_s", 1e9))
    if "step_s" in best and "step_s" in trl:
        lines += ["", f"ratio ours / TRL step time: **{best['step_s'] / trl['step_s']:.3f}** (goal <= 0.25; fastest of "
                      f"ours {'within' if fits else 'OVER' if cuda else '(no CUDA memory figures) at'} "
                      "TRL's peak memory)"]
    if "split_s" in best:
        lines += ["", "split of that step of ours (medians, s): " + ", ".join(
            f"{k.split('/')[1]} {v:.3f}" for k, v in best["split_s"].items()),
            f"logprob_mismatch max (engine vs trainer, per step): {best.get('logprob_mismatch_max')}"]
    if "rollouts" in best:
        lines += [f"rollouts whose pictures took the fast step's prefill: {best['fast_with_pictures']} of "
                  f"{best['rollouts']} (the evaluation's and the steps')"]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-w8", help="folder for w8.json, w8.md and each part's log")
    p.add_argument("--parts", default="ours,trl", help="comma list of: " + ", ".join(PARTS))
    p.add_argument("--ours", default="16:ckpt:compile,32:ckpt:compile,16",
                   help="comma list of variants MICRO[:ckpt][:compile] for ours")
    p.add_argument("--steps", type=int, default=4, help="measured steps (after one warm-up step)")
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (smoke run)")
    p.add_argument("--image-px", type=int, default=0,
                   help="picture side after resizing (0 = the shape's: 448, tiny 56)")
    p.add_argument("--wheels", default="", help="folder of TRL's wheels to install first (pip --no-deps --target); "
                   f"when trl is not importable and this is not given: the first of {', '.join(WHEEL_FOLDERS)} "
                   "that holds a trl wheel")
    p.add_argument("--profile", action="store_true",
                   help="ours: one more step under torch.profiler (not timed); its summary to OUT/ours-VARIANT.profile.txt")
    p.add_argument("--set", default="", help="more train.py settings for ours, e.g. 'algo.kl_coef=0.0'")
    p.add_argument("--part", help=argparse.SUPPRESS)        # internal: run one part in this process
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    a = p.parse_args()
    W.update(SHAPES["tiny" if a.tiny else "2b"])
    if a.image_px:
        if a.image_px % 28:
            p.error(f"--image-px must be a multiple of 28 (patch 14 x merge 2), got {a.image_px}")
        W["image_px"] = a.image_px
    bad = [v for v in a.ours.split(",") if not v.split(":")[0].isdigit() or set(v.split(":")[1:]) - {"ckpt", "compile"}]
    if bad:
        p.error(f"--ours variant(s) {', '.join(bad)} are not MICRO[:ckpt][:compile], e.g. 32:ckpt:compile")
    unknown = set(a.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    if not a.tiny and not torch.cuda.is_available():
        p.error("W8 needs a CUDA device; --tiny runs the toy CPU version")
    if not a.wheels and "trl" in a.parts.split(",") and importlib.util.find_spec("trl") is None:
        a.wheels = next((d for d in WHEEL_FOLDERS if glob.glob(os.path.join(d, "trl-*.whl"))), "")
    if a.wheels and not os.path.isdir(a.wheels):
        p.error(f"--wheels {a.wheels!r} is not a folder")
    if a.part:                                             # child: one part, result as JSON on the last line
        print_result(PARTS[a.part](a))
        return
    os.makedirs(a.out, exist_ok=True)
    results: dict = {"_errors": {}}
    env = dict(os.environ)
    if a.wheels and "trl" in a.parts.split(","):
        lib = os.path.abspath(os.path.join(a.out, "pylib"))
        why = install_wheels(a.wheels, lib)
        if why:
            results["_errors"]["TRL GRPOTrainer"] = why
        env["PYTHONPATH"] = os.pathsep.join([lib] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        build_model(model_dir)
        jobs = [("ours", v) for v in a.ours.split(",")] if "ours" in a.parts.split(",") else []
        jobs += [("trl", "")] if "trl" in a.parts.split(",") and not results["_errors"] else []
        for part, variant in jobs:
            key = f"ours-{variant.replace(':', '-')}" if part == "ours" else part
            args = [sys.executable, __file__, "--part", part, "--variant", variant, "--model", model_dir, "--tmp", tmp,
                    "--out", a.out, "--steps", str(a.steps), "--set", a.set, "--image-px", str(W["image_px"])]
            args += ["--profile"] if a.profile else []
            t0 = time.perf_counter()
            result, err = run_part(args + (["--tiny"] if a.tiny else []), os.path.join(a.out, f"{key}.log"), env)
            if err is not None:
                results["_errors"]["TRL GRPOTrainer" if part == "trl" else key] = err
                print(f"part {key} failed ({time.perf_counter() - t0:.0f} s): {err}", flush=True)
            else:
                results[key] = result
                print(f"part {key} done in {time.perf_counter() - t0:.0f} s", flush=True)
            write_report(a.out, "w8", results, table(results, a))   # after each part: a run cut short still reports
    print(write_report(a.out, "w8", results, table(results, a)))


if __name__ == "__main__":
    import bench_w8   # this file again, as the module 'bench_w8': it registers the task and reward under that name
    bench_w8.main()
