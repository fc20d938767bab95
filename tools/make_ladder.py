"""Build the task ladder's warm starts: assets/ladder-<rung>/ for the rungs add4 and mul2 (tasks/add4.py, mul2.py).

    python tools/make_ladder.py                         # every rung (1-4 minutes each on one CPU thread)
    python tools/make_ladder.py --rungs mul2 --steps 200 --out_root /tmp/ladder

Each warm start is the shipped tiny model (assets/tiny-model, tools/make_tiny_model.py) with '*' added to its
character vocabulary (one new embedding row, for mul2's prompts) and a short supervised fine-tune on the rung's
train problems with correct answers. The fine-tune is deliberately short (`--steps`, per rung below): the
model learns the rung's format and part of its arithmetic, so that held-out accuracy at the start of RL is low but
not zero and samples of one prompt disagree (group advantages carry signal). Everything is seeded, single-
threaded (--threads 1) and in float32, so a rerun writes the same weights. The script ends by printing, and
saving in make_ladder.json, the held-out accuracy (greedy; sampled at temperature 1.0) and pass@8 of what it wrote.
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import tasks  # noqa: E402,F401  (registers the rungs)
from engines.base import SamplingParams  # noqa: E402
from engines.builtin import BuiltinEngine  # noqa: E402
from registry import get  # noqa: E402
from tasks.arithmetic import CHARS  # noqa: E402
from tasks.mul2 import MUL_CHAR  # noqa: E402
from tools.make_tiny_model import build_tokenizer  # noqa: E402

# per rung: SFT steps (chosen so that held-out greedy accuracy starts low but above zero; make_ladder.json
# records what each gives) and SFT learning rate. sum3 (tasks/sum3.py) has none yet: 600 steps at lr 1e-3 left its
# loss at ~1.38 (format learned, digits at chance) and held-out accuracy at 0.000.
RUNGS = {"add4": {"steps": 600, "lr": 1e-3}, "mul2": {"steps": 800, "lr": 2e-3}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rungs", default=",".join(RUNGS), help=f"comma-separated rungs: {', '.join(RUNGS)}")
    p.add_argument("--base", default="assets/tiny-model", help="the model every rung starts from")
    p.add_argument("--out_root", default="assets", help="writes <out_root>/ladder-<rung>/")
    p.add_argument("--steps", type=int, default=0, help="SFT steps (0 = the rung's own, RUNGS above)")
    p.add_argument("--batch", type=int, default=64, help="SFT sequences per step")
    p.add_argument("--seed", type=int, default=0, help="seed for the new embedding row, SFT order and eval sampling")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: reproducible and shares the CPU)")
    args = p.parse_args()
    bad = [r for r in args.rungs.split(",") if r not in RUNGS]
    if bad:
        p.error(f"unknown rung {bad[0]!r}; rungs: {', '.join(RUNGS)}")
    return args


def load_base(path: str, seed: int):
    """The base model with the ladder's vocabulary (base characters + '*': ids of the old ones unchanged)."""
    tok = build_tokenizer(CHARS + MUL_CHAR)
    old = AutoTokenizer.from_pretrained(path)
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in old.get_vocab().items()), "vocab must extend the base"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    model.resize_token_embeddings(len(tok), mean_resizing=False)   # the new row: seeded normal init
    return model, tok


def batch_of(rows: list[dict], tok):
    """Right-padded (ids, labels), both (B, T); labels are -100 on prompt and padding (loss on answers only)."""
    seqs = [(tok.encode(r["prompt"]), tok.encode(r["answer"]) + [tok.eos_token_id]) for r in rows]
    T = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(rows), T), tok.pad_token_id)                         # (B, T)
    labels = torch.full((len(rows), T), -100)                                   # (B, T)
    for i, (p, c) in enumerate(seqs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    return ids, labels


def sft(model, tok, train: list[dict], steps: int, batch: int, lr: float, seed: int):
    rng = random.Random(f"ladder-sft-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    t0 = time.time()
    for step in range(steps):
        ids, labels = batch_of([train[rng.randrange(len(train))] for _ in range(batch)], tok)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  sft step {step:4d}  loss {loss.item():.4f}  {time.time() - t0:.0f}s", flush=True)


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], seed: int, n: int = 8) -> dict:
    """Held-out greedy accuracy, sampled accuracy at temperature 1.0 (mean over n samples) and pass@n."""
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True)          # left-padded
    greedy = model.generate(**enc, do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(greedy[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    out = {"greedy": sum(t.strip() == r["answer"] for t, r in zip(texts, rows)) / len(rows)}
    engine = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id)
    ro = engine.generate([tok.encode(r["prompt"]) for r in rows], n=n, generator=torch.Generator().manual_seed(seed),
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=8))
    texts = tok.batch_decode(ro.input_ids[:, -ro.completion_mask.shape[1]:], skip_special_tokens=True)
    ok = torch.tensor([t.strip() == rows[i // n]["answer"] for i, t in enumerate(texts)]).view(-1, n)  # (P, n)
    out.update({"sampled": ok.float().mean().item(), f"pass@{n}": ok.any(1).float().mean().item()})
    return out


def make_rung(rung: str, args) -> dict:
    spec = RUNGS[rung]
    steps = args.steps or spec["steps"]
    model, tok = load_base(args.base, args.seed)
    train, held = get("task", rung)(None)
    print(f"{rung}: {len(train)} train / {len(held)} held-out problems, SFT {steps} steps x {args.batch}")
    sft(model, tok, train, steps, args.batch, spec["lr"], args.seed)
    out = os.path.join(args.out_root, f"ladder-{rung}")
    os.makedirs(out, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    tok.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)   # the numbers below belong to the files on disk
    metrics = evaluate(model, tok, held[:200], args.seed)
    print(f"{rung}: held-out (200): greedy {metrics['greedy']:.3f}  sampled@T=1 {metrics['sampled']:.3f}  "
          f"pass@8 {metrics['pass@8']:.3f}")
    with open(os.path.join(out, "make_ladder.json"), "w") as f:
        json.dump({"args": {**vars(args), "rungs": rung, "steps": steps, "lr": spec["lr"]}, "held_out": metrics},
                  f, indent=1)
    return metrics


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    for rung in args.rungs.split(","):
        make_rung(rung, args)


if __name__ == "__main__":
    main()
