"""MoE routing replay (R3, moe.routing_replay; engines/moe.py): the rollout/trainer log-prob mismatch it removes, on a
small random qwen3_moe in bf16, on the CPU (docs/architectures.md, "Routing replay").

    python tools/r3_mismatch.py                          # both engines' paths, ~1 minute on one core
    python tools/r3_mismatch.py --save /tmp/moe          # also write the model (with the embedded tokenizer)

Per engine path (the portable loop: transformers' modules with its KV cache; the fast step: engines/decode_step.py,
eager on the CPU), one rollout of --rows sequences with routes recorded, then the trainer's teacher-forced
log-probs (models.completion_logprobs) of the same tokens twice: routing freely, and replaying the rollout's
routes. Printed: |trainer - rollout| log-prob max and mean over the completion tokens, and the share of
(token, MoE layer) pairs whose expert set differs between the rollout and the free trainer forward.
"""
import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch

TINY = "assets/tiny-model"
SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
             norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=True)


def build(seed: int, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    tiny = json.load(open(os.path.join(TINY, "config.json")))
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=tiny["vocab_size"], eos_token_id=tiny["eos_token_id"],
                               bos_token_id=tiny["bos_token_id"], pad_token_id=tiny["pad_token_id"], **SHAPE)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval(), tiny


def measure(model, fast: bool, rows: int, new: int, eos: int, pad: int, vocab: int, seed: int) -> dict:
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from engines.moe import Recorder, replay, set_routes
    from models import completion_logprobs
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 24, (rows,), generator=g)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]
    engine = BuiltinEngine(model, eos + vocab, pad, fast=fast, routing_replay=True)   # EOS out of reach: full length
    r = engine.generate(prompts, 1, SamplingParams(max_new_tokens=new), g)
    C, mask = r.completion_mask.shape[1], r.completion_mask
    replay(model)
    out = {}
    for name, routes in (("free", None), ("replayed", r.routes)):
        set_routes(model, routes)
        rec = Recorder(model)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, r.input_ids, r.attention_mask, C)
        rec.close()
        gap = (logp.float() - r.logprobs).abs() * mask
        out[name] = {"max": gap.max().item(), "mean": (gap.sum() / mask.sum()).item()}
        if routes is None:   # expert sets of the completion tokens the engine forwarded, per MoE layer
            got, want = rec.routes(*r.input_ids.shape)[:, -C:], r.routes[:, -C:]
            seen = (want >= 0).all(-1) & mask.bool()[:, :, None]                      # (B, C, L)
            differ = (got.sort(-1).values != want.sort(-1).values).any(-1) & seen
            out["routing_differs"] = (differ.sum() / seen.sum()).item()
    set_routes(model, None)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="write the model and the embedded tokenizer here (for train.py)")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, tiny = build(a.seed, torch.bfloat16)
    if a.save:
        model.save_pretrained(a.save)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(TINY, f), a.save)
    rows = {}
    for path, fast in (("portable loop", False), ("fast step (eager)", True)):
        rows[path] = measure(model, fast, a.rows, a.new, tiny["eos_token_id"], tiny["pad_token_id"],
                             tiny["vocab_size"], a.seed)
        print(json.dumps({path: rows[path]}), flush=True)
    print(f"\nqwen3_moe {SHAPE['num_hidden_layers']} layers, {SHAPE['num_experts']} experts top-"
          f"{SHAPE['num_experts_per_tok']}, bf16, CPU; {a.rows} rows x {a.new} new tokens; torch {torch.__version__}\n")
    print("| engine path | routing differs (token, layer) | mismatch max free | max replayed | mean free | "
          "mean replayed |")
    print("|---|---|---|---|---|---|")
    for path, r in rows.items():
        print(f"| {path} | {r['routing_differs']:.2%} | {r['free']['max']:.4f} | {r['replayed']['max']:.4f} | "
              f"{r['free']['mean']:.5f} | {r['replayed']['mean']:.5f} |")


if __name__ == "__main__":
    main()
