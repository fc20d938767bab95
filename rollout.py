"""The rollout phase: prompts -> completions -> rewards -> the experience record, and the evaluation built on it.

    python rollout.py n=16                                    # the embedded default: its held-out prompts, 16 samples
    python rollout.py model=runs/x/final task=arithmetic n=16 temperature=1.0 out_dir=runs/x/eval
    python rollout.py --config configs/gsm8k.yaml model=runs/x/final engine=vllm n=8 split=train eval_size=500

Run directly, it samples n completions of each prompt of a prompt set (split=eval, the held-out rows, by default)
with any engine, scores them in the reward pool and prints mean@n and pass@k with 95% confidence intervals
(bootstrap over prompts: `bootstrap_ci`). It writes <out_dir>/trajectories.jsonl (every sample, in the records of
run_dir.log_trajectories, plus the token lists that tools/trajectories.py reads), eval.json and config.yaml;
`python tools/view.py <out_dir>` shows the samples. Every option of train.py applies (sampling: temperature,
top_p, top_k, max_new_tokens; rewards, reward_args, accuracy_reward, engine, vllm.*); n= and split= are this
script's own.

What train.py and async_rl.py call:

    train_set, eval_set, train_ids, eval_ids = build_data(cfg, tok, model)      # the task's prompts, encoded
    engine = make_engine(cfg, model, tok)                                       # engines/<cfg.engine>.py
    sampler = make_sampler(cfg, engine, model, tok, pool)    # SingleTurn, or engines/multiturn.py's MultiTurn
    handle = submit_rewards(pool, samples, decode(tok, rollout), rollout, tok)   # returns at once
    rewards, info = handle.result()                                 # (B,) weighted sums, failures with reasons
    record_failures(run_dir, step, info); check_broken(run, step)  # reward_failures.jsonl; stop on all-broken
    batch = experience(rollout, rewards, version, extra, info)      # buffer.Experience, advantages to come
    row["accuracy"] = correct(info, accuracy_name(cfg)).float().mean()   # the verifier's verdict
    metrics = evaluate(cfg, engine, tok, eval_set, eval_ids, pool, specs, generator)   # eval/accuracy, eval/reward,
                                                                                     # eval/pass@k with eval_k
"""
import json
import math
import os
import sys
import time

import torch

import distributed
import registry
import vision
from buffer import Experience
from config import UserError, to_dict
from engines.base import SamplingParams
from engines.multiturn import MultiTurn
from models import context_length, encode_prompts
from rewards import parse_spec
from rewards.pool import write_reasons

# --------------------------------------------------------------------------------- prompts, engine, sampler


def build_data(cfg, tok, policy):
    """-> train and held-out samples and their prompt token ids; a prompt too long for the model is an error."""
    try:
        train_set, eval_set = registry.get("task", cfg.task)(getattr(cfg, cfg.task, None))
    except (ValueError, OSError) as e:   # tasks report bad settings or unreadable files this way
        raise UserError(f"task '{cfg.task}': {e}")
    if not train_set:
        raise UserError(f"task '{cfg.task}' produced an empty training set")
    eval_set = eval_set[:cfg.eval_size] if cfg.eval_size else eval_set
    encode = lambda rows: vision.encode_rows(tok, cfg.model, rows, encode_prompts)   # rows with pictures too
    try:
        train_ids, eval_ids = encode(train_set), encode(eval_set)
    except ValueError as e:   # a row's picture or its slot, or pictures for a text model (vision.encode_rows)
        raise UserError(f"task '{cfg.task}': {e}") from None
    longest = max(len(p) for p in train_ids + eval_ids)
    if longest + cfg.max_new_tokens > context_length(policy):
        raise UserError(f"a prompt of {longest} tokens + max_new_tokens={cfg.max_new_tokens} exceeds the model's "
                        f"context of {context_length(policy)} tokens")
    return train_set, eval_set, train_ids, eval_ids


def make_engine(cfg, model, tok, **extra):
    """The engine cfg.engine names, sampling with `model` (the built-in engine) or loading cfg.model (vLLM);
    extra: the caller's own keywords (train.py: sample_dtype, lag; a rollout rank: keep_cache)."""
    return registry.get("engine", cfg.engine)(model=model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                                              model_path=cfg.model, seed=cfg.seed, decode_weights=cfg.decode_weights,
                                              exact=cfg.exact_logprobs, routing_replay=cfg.moe.routing_replay,
                                              **to_dict(cfg.vllm), **extra)


def make_sampler(cfg, engine, model, tok, pool):
    """The rollout kind, chosen once: single completions scored by the reward pool, or episodes with an
    environment (and tools) when env.name is set."""
    return MultiTurn(model, tok, cfg, engine=engine) if cfg.env.name else SingleTurn(engine, pool, tok)


# ------------------------------------------------------------------------------------------------ scoring

def decode(tok, rollout) -> list[str]:
    """The completions as text, each cut at its own length (EOS included, padding not)."""
    C = rollout.completion_mask.shape[1]
    ids = rollout.input_ids[:, -C:]
    lengths = rollout.completion_mask.sum(-1).long().tolist()
    # each row as a tensor: transformers' decode type-checks a list's every id in Python (to_py_obj), a tensor in one
    # .tolist(), with the same texts (timed: docs/speed.md, "Shared-prompt prefill")
    return [tok.decode(row[:n], skip_special_tokens=True) for row, n in zip(ids, lengths)]


def submit_rewards(pool, samples: list[dict], completions: list[str], rollout=None, tok=None):
    """Start scoring in the reward workers and return at once; `.result()` gives (rewards (B,), info). With the
    rollout, a reward that asks for completion_tokens gets each completion's count (rewards/pool.py: SAMPLING_ARGS);
    with the tokenizer too, per-step rewards come back as token tensors in info["step_tensors"] (step_tensors)."""
    counts = None if rollout is None else rollout.completion_mask.sum(-1).long().tolist()   # (B,)
    handle = pool.submit([s["prompt"] for s in samples], completions,
                         [{k: v for k, v in s.items() if k != "prompt"} for s in samples], completion_tokens=counts)
    return handle if rollout is None or tok is None else StepHandle(handle, tok, rollout)


class StepHandle:
    """The pool's handle, whose result() also places per-step rewards on the completion's tokens."""

    def __init__(self, handle, tok, rollout):
        self.handle, self.tok, self.rollout = handle, tok, rollout

    def done(self) -> bool:
        return self.handle.done()

    def result(self):
        rewards, info = self.handle.result()
        if info.get("steps"):
            weights = {name: w for name, w, *_ in self.handle.pool.specs}
            info["step_tensors"] = step_tensors(info, weights, self.tok, self.rollout)
        return rewards, info


def step_tensors(info: dict, weights: dict, tok, rollout) -> dict:
    """The weighted rewards of a scored batch as per-token rewards -> {"turn_rewards": (B, C), "step_mask": (B, C)}:
    each step's score (info["steps"]) on the step's last token, the last step's and every scalar reward's on the
    completion's last token (its EOS, where token_rewards puts a scalar score); each row sums to the weighted total.
    step_mask is 1 where a step ends."""
    mask = rollout.completion_mask
    B, C = mask.shape
    ids, lengths = rollout.input_ids[:, -C:], mask.sum(-1).long().tolist()
    out, ends = torch.zeros(B, C), torch.zeros(B, C)                                          # (B, C) each
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        row = ids[i, :n].tolist()
        for name, w in weights.items():
            steps = (info.get("steps", {}).get(name) or [None] * B)[i]
            for end, score in (steps or [])[:-1]:
                t = last_token(tok, row, end)
                out[i, t] += w * score
                ends[i, t] = 1.0
            out[i, n - 1] += w * (steps[-1][1] if steps else float(info["per_reward"][name][i]))
        ends[i, n - 1] = 1.0
    return {"turn_rewards": out, "step_mask": ends}


def last_token(tok, ids: list[int], end: int) -> int:
    """The index of the token that completes the first `end` characters of the decoded completion: the smallest
    k with len(decode(ids[:k + 1])) >= end (a binary search: log2(len(ids)) decodes per step)."""
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[:mid + 1], skip_special_tokens=True)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo


def accuracy_name(cfg) -> str:
    """The reward whose verdict is accuracy (accuracy_reward; by default the task's own verifier, named first in
    rewards). A shaping reward beside it (format, a length penalty) moves the total, never the accuracy."""
    names = [r for r, _ in parse_spec(cfg.rewards)]
    name = cfg.accuracy_reward or (names[0] if names else "")
    if name not in names:
        raise UserError(f"accuracy_reward '{name}' is not one of the rewards ({', '.join(names) or 'none'}): name "
                        f"one of them, or leave it empty for the first")
    return name


def correct(info: dict, name: str) -> torch.Tensor | None:
    """(B,) bool: the verifier `name` gave the sample full marks (1); None where the scores carry no such reward
    (an environment's episodes report their own success)."""
    scores = info.get("per_reward", {}).get(name)
    return None if scores is None else scores >= 1.0 - 1e-6


def accuracy(info: dict, cfg) -> dict:
    """The metrics row's {"accuracy": share of samples the verifier gives full marks}; {} for an environment's
    episodes, whose own success comes in info["metrics"]."""
    right = correct(info, accuracy_name(cfg))
    return {} if right is None else {"accuracy": right.float().mean().item()}


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


def experience(rollout, rewards: torch.Tensor, version: int, extra: dict, info: dict | None = None) -> Experience:
    """The experience record of a scored rollout (extra: old / reference log-probs, values); advantages to come.
    info: the scoring's, whose per-step rewards (step_tensors) become turn_rewards and step_mask."""
    steps = (info or {}).get("step_tensors") or {"turn_rewards": rollout.turn_rewards}
    return Experience(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                      completion_mask=rollout.completion_mask, sample_logprobs=rollout.logprobs, rewards=rewards,
                      group_ids=rollout.group_ids, versions=torch.full_like(rewards, version, dtype=torch.long),
                      truncated=rollout.truncated, routes=getattr(rollout, "routes", None), **steps, **extra)


# ------------------------------------------------------------------------------------------------ evaluation

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


def score_prompts(cfg, engine, tok, samples, prompt_ids, pool, specs, generator, n: int, sampling,
                  keep: list | None = None, shown: list | None = None) -> tuple:
    """n samples of each prompt -> (rewards (P, n), correct (P, n) bool: the verifier's full marks).
    keep: a list that gets each generate call's (rows, rollout, rewards, info), for the trajectories;
    shown: a list that gets each sample's prompt, completion and reward (the loggers' table of completions)."""
    name, rewards, right = accuracy_name(cfg), [torch.zeros(0)], [torch.zeros(0, dtype=torch.bool)]
    step = max(1, 256 // n)                                            # prompts per generate call
    for start in range(0, len(samples), step):
        rollout = engine.generate(prompt_ids[start:start + step], n, sampling, generator)
        rows = [s for s in samples[start:start + step] for _ in range(n)]   # a prompt's n samples are adjacent
        texts = decode(tok, rollout)
        r, info = submit_rewards(pool, rows, texts, rollout).result()
        rewards.append(r)
        if shown is not None:
            shown += [{"prompt": s["prompt"], "completion": c, "reward": float(x)} for s, c, x in zip(rows, texts, r)]
        right.append(correct(info, name))
        if keep is not None:
            keep.append((rows, rollout, r, info))
    return torch.cat(rewards).view(-1, n), torch.cat(right).view(-1, n)   # (P, n) each


@torch.no_grad()
def evaluate(cfg, engine, tok, samples, prompt_ids, pool, specs, generator, shown: list | None = None) -> dict:
    """Held-out accuracy: the fraction of prompts the verifier (accuracy_reward) gives full marks (greedy by default).
    With eval_k = n > 0, also n samples per prompt at eval_k_temperature: mean@n (the mean accuracy of a sample,
    which is pass@1) and the unbiased pass@k for k = 1, 2, 4, ..., n."""
    samples, prompt_ids = distributed.share(samples), distributed.share(prompt_ids)   # each rank its part
    greedy = SamplingParams(temperature=max(cfg.eval_temperature, 1e-5),
                            top_p=cfg.top_p if cfg.eval_temperature else 1.0, max_new_tokens=cfg.max_new_tokens)
    r, right = score_prompts(cfg, engine, tok, samples, prompt_ids, pool, specs, generator, 1, greedy, shown=shown)
    sums = [r.sum(), right.sum(), len(r)]
    n = cfg.eval_k
    if n:
        sampled = SamplingParams(cfg.eval_k_temperature, cfg.top_p, cfg.max_new_tokens)
        _, right = score_prompts(cfg, engine, tok, samples, prompt_ids, pool, specs, generator, n, sampled)
        c = right.sum(-1).tolist()                                     # (P,) correct samples per prompt
        sums += [sum(c) / n] + [sum(pass_at(n, ci, k) for ci in c) for k in report_ks(n)]
    total, count_right, count, *k_sums = distributed.all_sum(sums)
    count = max(count, 1)
    out = {"eval/reward": total / count, "eval/accuracy": count_right / count}
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
        return submit_rewards(self.pool, samples, decode(self.tok, rollout), rollout, self.tok)

    def evaluate(self, cfg, samples, prompt_ids, specs, generator) -> dict:
        self.shown = []   # this rank's greedy completions, for the loggers' table (train.log)
        return evaluate(cfg, self.engine, self.tok, samples, prompt_ids, self.pool, specs, generator, self.shown)

    def close(self):
        pass   # the engine and the pool are closed by their owner (train.finish)


# ---------------------------------------------------------------------------- run directly: sample and score

def bootstrap_ci(per_prompt: torch.Tensor, seed: int, resamples: int = 2000, level: float = 0.95) -> tuple:
    """(P,) per-prompt values -> (low, high) of their mean: the percentile bootstrap over prompts (the prompts are
    the sample; a prompt's n completions are not independent draws of the set), seeded, so a rerun prints the same."""
    P = len(per_prompt)
    g = torch.Generator().manual_seed(seed)
    means = per_prompt.double()[torch.randint(P, (resamples, P), generator=g)].mean(-1)   # (resamples,)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


def summarise(rewards: torch.Tensor, right: torch.Tensor, seed: int) -> dict:
    """rewards, right: (P, n) -> {name: (value, low, high)}: mean reward, mean@n and pass@k for k = 1, 2, 4, ..., n."""
    P, n = right.shape
    c = right.sum(-1).tolist()
    cols = {"reward": rewards.mean(-1), f"mean@{n}": right.float().mean(-1)}
    cols.update({f"pass@{k}": torch.tensor([pass_at(n, ci, k) for ci in c]) for k in report_ks(n)})
    return {name: (v.double().mean().item(), *bootstrap_ci(v, seed)) for name, v in cols.items()}


def trajectory_records(tok, rows, rollout, rewards, info, task: str, first: int, n: int) -> list[dict]:
    """Every sample of one generate call as a line of trajectories.jsonl: run_dir.log_trajectories' fields (what
    tools/view.py shows; step 0, no advantage: nothing was trained) and `tokens` / `version` / `id`, what
    `tools/trajectories.py train --scored` reads. first: the running index of the call's first sample."""
    C, fails = rollout.completion_mask.shape[1], info.get("failed", [])
    out = []
    for i in range(len(rows)):
        keep = rollout.attention_mask[i].bool()
        prompt, comp = rollout.input_ids[i, :-C][keep[:-C]].tolist(), rollout.input_ids[i, -C:][keep[-C:]].tolist()
        k, mask = len(comp), rollout.completion_mask[i, :len(comp)].tolist()
        lp = [round(x, 4) for x in rollout.logprobs[i, :k].tolist()]
        out.append({"step": 0, "sample": first + i, "group": (first + i) // n, "task": task,
                    "prompt": tok.decode(prompt), "pieces": tok.batch_decode([[t] for t in comp]),
                    "mask": [int(m) for m in mask], "logprobs": lp, "cut_tokens": 0,
                    "reward": float(rewards[i]), "truncated": bool(rollout.truncated[i]),
                    "rewards": {name: float(v[i]) for name, v in info.get("per_reward", {}).items()},
                    "failures": [{"reward": str(f["reward"]), "category": str(f["category"]),
                                  "reason": str(f["reason"])[:2000]} for f in fails if f["sample"] == i],
                    "id": first + i, "version": 0,
                    "tokens": {"prompt": prompt, "completion": comp, "completion_mask": mask, "logprobs": lp}})
    return out


def split_args(argv: list[str]) -> tuple[list[str], int, str]:
    """This script's own options (n=, split=) apart from the config's; bad values are one-line errors."""
    rest, n, split = [], 16, "eval"
    for a in argv:
        key, _, value = a.partition("=")
        if a in ("-h", "--help"):   # this script's own use first; config.parse then lists every option
            print(__doc__.split("What train.py")[0])
        if key == "n":
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"n must be a whole number of samples per prompt, at least 1; got '{value}'")
            n = int(value)
        elif key == "split":
            if value not in ("eval", "train"):
                raise UserError(f"split must be eval (the held-out prompts) or train; got '{value}'")
            split = value
        else:
            rest.append(a)
    return rest, n, split


def main(argv: list[str]) -> dict:
    """Sample n completions of every prompt of the split, score them, print and write the numbers and samples."""
    import algos, engines, envs, rewards, tasks  # noqa: F401,E401  (register every plugin)
    import run_dir
    from config import fill_defaults, parse
    from config_checks import check_reward_args, validate
    from models import load_model, setup_device
    from rewards import reward_kwargs
    from rewards.pool import RewardPool
    argv, n, split = split_args(argv)
    cfg = fill_defaults(parse(argv, script="rollout.py"))
    cfg.out_dir = cfg.out_dir or os.path.join("runs", f"rollout-{time.strftime('%Y%m%d-%H%M%S')}")
    validate(cfg, 1)
    specs = parse_spec(cfg.rewards)
    reward_args = reward_kwargs(cfg, specs)
    check_reward_args(reward_args)
    name = accuracy_name(cfg)
    if cfg.env.name:
        raise UserError("rollout.py samples single-turn tasks; episodes with an environment: tools/trajectories.py "
                        "export")
    run_dir.check(cfg.out_dir, resuming=False)
    device, dtype = setup_device(cfg)
    model, tok = load_model(cfg.model, device, dtype)
    model.eval().requires_grad_(False)
    train_set, eval_set, train_ids, eval_ids = build_data(cfg, tok, model)
    samples, ids = (eval_set, eval_ids) if split == "eval" else (train_set[:cfg.eval_size or None],
                                                                 train_ids[:cfg.eval_size or None])
    if not samples:
        raise UserError(f"task '{cfg.task}' has no {split} prompts to sample (split=eval needs held-out rows)")
    engine = make_engine(cfg, model, tok)
    sampling = SamplingParams(max(cfg.temperature, 1e-5), cfg.top_p, cfg.max_new_tokens, cfg.top_k)
    gen, calls = torch.Generator(device=device).manual_seed(cfg.seed + 2), []
    t0 = time.perf_counter()
    with RewardPool([(r, w, reward_args.get(r, {})) for r, w in specs], workers=cfg.reward_workers,
                    timeout_s=cfg.reward_timeout_s) as pool, torch.no_grad():
        rewards_pn, right = score_prompts(cfg, engine, tok, samples, ids, pool, specs, gen, n, sampling, keep=calls)
    engine.close()
    out = run_dir.create(cfg, 0)
    recs, first = [], 0
    for rows, ro, r, info in calls:
        recs += trajectory_records(tok, rows, ro, r, info, cfg.task, first, n)
        first += len(rows)
    with open(os.path.join(out, "trajectories.jsonl"), "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in recs)
    stats = summarise(rewards_pn, right, cfg.seed)
    result = {"prompts": len(samples), "n": n, "split": split, "accuracy_reward": name, "temperature": cfg.temperature,
              "seconds": time.perf_counter() - t0, "ci": "95% percentile bootstrap over prompts (2000 resamples)",
              **{k: {"value": v, "low": lo, "high": hi} for k, (v, lo, hi) in stats.items()}}
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{len(samples)} {split} prompts x {n} samples of {cfg.model} at temperature {cfg.temperature:g} "
          f"(correct: {name} gives 1); 95% CI: bootstrap over prompts")
    for k, (v, lo, hi) in stats.items():
        print(f"  {k:<10} {v:.3f}  [{lo:.3f}, {hi:.3f}]")
    print(f"samples: {os.path.join(out, 'trajectories.jsonl')} (python tools/view.py {out})")
    return result


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (UserError, registry.RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
