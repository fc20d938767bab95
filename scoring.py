"""From completions to rewards: decoding, scoring in the reward pool, and the held-out evaluation.

    handle = submit_rewards(pool, samples, decode(tok, rollout))   # returns at once: the workers score
    rewards, info = handle.result()                                 # (B,) weighted sums, failures with reasons
    record_failures(run_dir, step, info)                            # a sample to reward_failures.jsonl
    check_broken(run, step)                                         # every reward broken 3 steps in a row: stop
    metrics = evaluate(cfg, engine, tok, eval_set, eval_ids, pool, specs, generator)   # eval/accuracy, eval/reward,
                                                                                     # eval/pass@k with eval_k
    sampler = SingleTurn(engine, pool, tok)         # what train.py calls: generate, score, evaluate (multi-turn:
                                                    # engines/multiturn.py: MultiTurn has the same four methods)
"""
import math
import os

import torch

import distributed
from config import UserError
from engines.base import SamplingParams
from rewards.pool import write_reasons


def decode(tok, rollout) -> list[str]:
    """The completions as text, each cut at its own length (EOS included, padding not)."""
    C = rollout.completion_mask.shape[1]
    ids = rollout.input_ids[:, -C:]
    lengths = rollout.completion_mask.sum(-1).long()
    return [tok.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(ids, lengths)]


def submit_rewards(pool, samples: list[dict], completions: list[str], rollout=None):
    """Start scoring in the reward workers and return at once; `.result()` gives (rewards (B,), info). With the
    rollout, a reward that asks for completion_tokens gets each completion's count (rewards/pool.py: SAMPLING_ARGS)."""
    counts = None if rollout is None else rollout.completion_mask.sum(-1).long().tolist()   # (B,)
    return pool.submit([s["prompt"] for s in samples], completions,
                       [{k: v for k, v in s.items() if k != "prompt"} for s in samples], completion_tokens=counts)


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


def broken(info: dict, n: int) -> tuple[float, str | None]:
    """-> (the share of the n samples whose scoring broke, one reason). Broken: a reward raised, timed out or lost its
    worker, or an episode's environment failed; what a reward reports about the completion it judged (a wrong
    answer, a program that timed out: Score failures) is the policy's doing and does not count. The share is the
    worst reward's (or the environment's)."""
    counts = [*info.get("failures", {}).values(), info.get("metrics", {}).get("env_fail", 0.0)]
    reason = next((f"{f['reward']}: {f['reason']}" for f in info.get("failed", ()) if f["category"] != "wrong_answer"),
                  None)
    return max(counts) / max(n, 1), reason


MAX_BROKEN_STEPS = 3   # a run whose every reward (or episode) fails this many steps in a row stops


def check_broken(run, step: int):
    """Stop a run that would train on zeros: every sample of MAX_BROKEN_STEPS steps in a row (on every rank) had its
    reward or episode break, which is a bad setting or data (reward_args, a field, the environment), not learning.
    run: train.Run (broken: this step's (share, reason) per round, broken_steps: the count so far, run_dir)."""
    share = min(s for s, _ in run.broken)
    all_broken = distributed.all_sum([float(share >= 1.0)])[0] >= distributed.world()
    run.broken_steps = run.broken_steps + 1 if all_broken else 0
    if run.broken_steps >= MAX_BROKEN_STEPS:
        reason = next((r for _, r in run.broken if r), "no reason given")
        raise UserError(f"every sample's reward or episode failed for {run.broken_steps} steps in a row (step {step}: "
                        f"{' '.join(reason.split())[:200]}); stopped rather than train on zeros. Failures: "
                        f"{os.path.join(run.run_dir, 'reward_failures.jsonl')}; fix the setting, then start again in a "
                        f"new out_dir (or after rm -r {run.run_dir})")


def eval_line(row: dict) -> str:
    """The held-out numbers of an evaluation step for the console (pass@k too with eval_k)."""
    ks = sorted((k for k in row if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    return f"step {row['step']}: held-out accuracy {row['eval/accuracy']:.3f}" + \
        "".join(f", {k[5:]} {row[k]:.3f}" for k in ks)


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021), the
    chance that k samples drawn without replacement from the n hold at least one correct one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def report_ks(n: int) -> list[int]:
    """The k of pass@k worth a column for n samples: 1, 2, 4, ... up to n, and n itself."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})


def score_prompts(cfg, engine, tok, samples, prompt_ids, pool, specs, generator, n: int, sampling) -> tuple:
    """n samples of each prompt -> (rewards (P, n), correct (P, n) bool): correct = the total reward is the best."""
    rewards = [torch.zeros(0)]
    step = max(1, 256 // n)                                            # prompts per generate call
    for start in range(0, len(samples), step):
        rollout = engine.generate(prompt_ids[start:start + step], n, sampling, generator)
        rows = [s for s in samples[start:start + step] for _ in range(n)]   # a prompt's n samples are adjacent
        rewards.append(submit_rewards(pool, rows, decode(tok, rollout), rollout).result()[0])
    r = torch.cat(rewards).view(-1, n)                                 # (P, n)
    return r, r >= sum(w for _, w in specs) - 1e-6


@torch.no_grad()
def evaluate(cfg, engine, tok, samples, prompt_ids, pool, specs, generator) -> dict:
    """Held-out accuracy: the fraction of prompts whose total reward reaches its maximum (greedy by default).
    With eval_k = n > 0, also n samples per prompt at eval_k_temperature: mean@n (the mean accuracy of a sample,
    which is pass@1) and the unbiased pass@k for k = 1, 2, 4, ..., n."""
    samples, prompt_ids = distributed.share(samples), distributed.share(prompt_ids)   # each rank its part
    greedy = SamplingParams(temperature=max(cfg.eval_temperature, 1e-5),
                            top_p=cfg.top_p if cfg.eval_temperature else 1.0, max_new_tokens=cfg.max_new_tokens)
    r, correct = score_prompts(cfg, engine, tok, samples, prompt_ids, pool, specs, generator, 1, greedy)
    sums = [r.sum(), correct.sum(), len(r)]
    n = cfg.eval_k
    if n:
        sampled = SamplingParams(cfg.eval_k_temperature, cfg.top_p, cfg.max_new_tokens)
        _, correct = score_prompts(cfg, engine, tok, samples, prompt_ids, pool, specs, generator, n, sampled)
        c = correct.sum(-1).tolist()                                   # (P,) correct samples per prompt
        sums += [sum(c) / n] + [sum(pass_at(n, ci, k) for ci in c) for k in report_ks(n)]
    total, right, count, *k_sums = distributed.all_sum(sums)
    count = max(count, 1)
    out = {"eval/reward": total / count, "eval/accuracy": right / count}
    if n:
        out[f"eval/mean@{n}"] = k_sums[0] / count
        out.update({f"eval/pass@{k}": v / count for k, v in zip(report_ks(n), k_sums[1:])})
    return out


class SingleTurn:
    """Single-turn sampling for train.py: the engine writes completions, the reward pool scores them."""

    def __init__(self, engine, pool, tok):
        self.engine, self.pool, self.tok = engine, pool, tok

    def generate(self, prompt_ids: list[list[int]], rows: list[dict], n: int, sampling, generator):
        return self.engine.generate(prompt_ids, n, sampling, generator)

    def score(self, samples: list[dict], rollout):
        return submit_rewards(self.pool, samples, decode(self.tok, rollout), rollout)

    def evaluate(self, cfg, samples, prompt_ids, specs, generator) -> dict:
        return evaluate(cfg, self.engine, self.tok, samples, prompt_ids, self.pool, specs, generator)

    def close(self):
        pass   # the engine and the pool are closed by their owner (train.finish)
