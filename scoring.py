"""From completions to rewards: decoding, scoring in the reward pool, and the held-out evaluation.

    handle = submit_rewards(pool, samples, decode(tok, rollout))   # returns at once: the workers score
    rewards, info = handle.result()                                 # (B,) weighted sums, failures with reasons
    record_failures(run_dir, step, info)                            # a sample to reward_failures.jsonl
    metrics = evaluate(cfg, engine, tok, eval_set, eval_ids, pool, specs, generator)   # eval/accuracy, eval/reward
"""
import os

import torch

import distributed
from engines.base import SamplingParams
from rewards.pool import write_reasons


def decode(tok, rollout) -> list[str]:
    """The completions as text, each cut at its own length (EOS included, padding not)."""
    C = rollout.completion_mask.shape[1]
    ids = rollout.input_ids[:, -C:]
    lengths = rollout.completion_mask.sum(-1).long()
    return [tok.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(ids, lengths)]


def submit_rewards(pool, samples: list[dict], completions: list[str]):
    """Start scoring in the reward workers and return at once; `.result()` gives (rewards (B,), info)."""
    return pool.submit([s["prompt"] for s in samples], completions,
                       [{k: v for k, v in s.items() if k != "prompt"} for s in samples])


def record_failures(run_dir: str, step: int, info: dict) -> str | None:
    """Append a sample of this step's reward failures (every category gets its turn) to
    <run_dir>/reward_failures.jsonl; -> a one-line summary by category, or None when nothing failed. The counts
    themselves are in the metrics row (reward_fail/<reward>/<category>)."""
    if not info.get("failed"):
        return None
    write_reasons(os.path.join(run_dir, "reward_failures.jsonl"), step, info["failed"], limit=20,
                  rank=distributed.rank())
    # a wrong answer is the policy's failure, not the reward's: logged, but not worth a line on screen
    broken = [f for f in info["failed"] if f["category"] != "wrong_answer"]
    if not broken:
        return None
    counts = ", ".join(f"{name} {cat} {n}" for name, cats in info.get("failure_counts", {}).items()
                       for cat, n in cats.items() if n and cat != "wrong_answer")
    return f"step {step}: reward failures ({counts}), e.g. {broken[0]['reason'][:120]}"


@torch.no_grad()
def evaluate(cfg, engine, tok, samples, prompt_ids, pool, specs, generator) -> dict:
    """Held-out accuracy: the fraction of prompts whose total reward reaches its maximum (greedy by default)."""
    sampling = SamplingParams(temperature=max(cfg.eval_temperature, 1e-5), top_p=cfg.top_p if cfg.eval_temperature else 1.0,
                              max_new_tokens=cfg.max_new_tokens)
    samples, prompt_ids = distributed.share(samples), distributed.share(prompt_ids)   # each rank its part
    rewards = [torch.zeros(0)]
    for start in range(0, len(samples), 256):
        rollout = engine.generate(prompt_ids[start:start + 256], 1, sampling, generator)
        rewards.append(submit_rewards(pool, samples[start:start + 256], decode(tok, rollout)).result()[0])
    r = torch.cat(rewards)
    best = sum(w for _, w in specs)
    total, correct, count = distributed.all_sum([r.sum(), (r >= best - 1e-6).sum(), len(r)])
    return {"eval/reward": total / max(count, 1), "eval/accuracy": correct / max(count, 1)}
