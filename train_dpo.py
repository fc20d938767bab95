"""Offline preference training (DPO, IPO, SimPO) from a jsonl file of {prompt, chosen, rejected}.

    python train_dpo.py lr=5e-6 algo.dpo.loss=ipo          # IPO on assets/arithmetic_prefs.jsonl, tiny model (0.195 -> 0.51 held-out)
    python train_dpo.py lr=5e-6                            # DPO (the sigmoid loss): 0.195 -> 0.50
    python train_dpo.py algo.dpo.loss=simpo algo.dpo.data=my_prefs.jsonl model=/path/to/model task=...

It takes the same options as train.py (config.py): `prompts_per_step` is the number of pairs per optimizer
step, `steps`, `lr`, `eval_every` and `out_dir` mean what they mean there, and the held-out accuracy comes
from the same task and verifier. Its own options are the `algo.dpo.*` section. The run directory has the
same format (config.yaml, metrics.jsonl, curve.png, final/). Trained past its best, offline DPO overfits the pairs
and the held-out accuracy falls back (docs/recipes.md, "Offline DPO"): final/ holds the policy of the best
held-out evaluation, and the closing line names its step.

Why a separate script and not a task inside train.py: offline DPO has no rollout, no reward and no weight
sync, which are most of the loop; putting it there would make the loop branch on "has rollouts". This file
reuses the same pieces instead: the model loader, the one log-prob forward pass, the losses of
algos/dpo.py and train.py's evaluation. The loss is algos/dpo.py's `pair_loss` on chosen/rejected rows.
"""
import json
import os
import sys
import time

import torch

import algos, engines, rewards, tasks  # noqa: F401,E401  (the plugin packages: importing them registers every name)
import kernels
import registry
import run_dir as rundir
from algos.dpo import pair_loss
from config import UserError, fill_defaults, parse, repo_path
from config_checks import check_reward_args, default_threads, validate
from distributed import print0
from engines.base import left_pad
from models import completion_logprobs, encode_prompts, load_model, setup_device
from rewards import parse_spec, reward_kwargs
from rewards.pool import RewardPool
from rollout import evaluate


def read_pairs(path: str) -> list[dict]:
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise UserError(f"cannot read preference file '{path}': {e.strerror}")
    pairs = []
    for i, line in enumerate(filter(str.strip, lines), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"preference file '{path}' line {i} is not JSON")
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("prompt", "chosen", "rejected")):
            raise UserError(f"preference file '{path}' line {i} needs string fields prompt, chosen and rejected")
        pairs.append(row)
    if not pairs:
        raise UserError(f"preference file '{path}' holds no pairs")
    return pairs


def pack(tok, pairs: list[dict], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N pairs -> 2N rows (chosen first, then rejected) in the Experience layout: prompt left-padded,
    completion (+ EOS) right-padded. Returns input_ids, attention_mask (2N, P + C), completion_mask (2N, C)."""
    prompts = encode_prompts(tok, [p["prompt"] for p in pairs]) * 2
    completions = [tok(p[k], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for k in ("chosen", "rejected") for p in pairs]
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id)                                   # (2N, P)
    C = max(len(c) for c in completions)
    c_ids = torch.full((len(completions), C), tok.pad_token_id, dtype=torch.long)
    c_mask = torch.zeros(len(completions), C)
    for i, c in enumerate(completions):
        c_ids[i, :len(c)], c_mask[i, :len(c)] = torch.tensor(c), 1
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask.long()], 1)      # (2N, P + C)
    return ids.to(device), mask.to(device), c_mask.to(device)


def main(argv: list[str]) -> dict:
    cfg = fill_defaults(parse(argv, script="train_dpo.py"))
    cfg.algo.dpo.data = repo_path(cfg.algo.dpo.data)   # the embedded preference file, from any directory
    validate(cfg)
    specs = parse_spec(cfg.rewards)
    check_reward_args(reward_kwargs(cfg, specs))
    cfg.out_dir = cfg.out_dir or os.path.join("runs", f"dpo-{cfg.algo.dpo.loss}-{time.strftime('%Y%m%d-%H%M%S')}")
    rundir.check(cfg.out_dir, resuming=False)   # a used or unwritable out_dir is refused before any work
    rundir.Logger.check(cfg.logger)
    kernels.choose(**vars(cfg.kernels))
    cfg.threads = cfg.threads or default_threads(cfg)
    torch.manual_seed(cfg.seed)
    device, dtype = setup_device(cfg)
    pairs = read_pairs(cfg.algo.dpo.data)
    pool = RewardPool([(name, weight, reward_kwargs(cfg, specs).get(name, {})) for name, weight in specs],
                      workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s,   # scores the held-out evaluation
                      max_new_tokens=cfg.max_new_tokens)
    _, eval_set = registry.get("task", cfg.task)(getattr(cfg, cfg.task, None))
    eval_set = eval_set[:cfg.eval_size] if cfg.eval_size else eval_set
    policy, tok = load_model(cfg.model, device, dtype)
    reference = None
    if cfg.algo.dpo.loss != "simpo":                                   # SimPO is reference-free
        reference, _ = load_model(cfg.model, device, dtype)
        reference.eval().requires_grad_(False)
    engine = registry.get("engine", "builtin")(model=policy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    eval_ids = encode_prompts(tok, [s["prompt"] for s in eval_set])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)

    run_dir = rundir.create(cfg, rank=0)
    logger = rundir.Logger(run_dir, first_step=1, resume=False, sinks=cfg.logger)
    start = evaluate(cfg, engine, tok, eval_set, eval_ids, pool, specs, sample_gen)
    logger.log({"step": 0, **start})
    print0(f"step 0: held-out accuracy {start['eval/accuracy']:.3f}; {len(pairs)} pairs from {cfg.algo.dpo.data}")
    order, cursor, rows, t_run = torch.randperm(len(pairs), generator=generator), 0, [], time.perf_counter()
    best = (start["eval/accuracy"], 0)   # final/ keeps the policy of the best evaluation (step 0: the model as loaded)
    final = os.path.join(run_dir, "final")
    rundir.save_final(final, policy, tok)
    for step in range(1, cfg.steps + 1):
        if cursor + cfg.prompts_per_step > len(order):                  # a new epoch over the file
            order, cursor = torch.randperm(len(pairs), generator=generator), 0
        chunk = [pairs[i] for i in order[cursor:cursor + cfg.prompts_per_step].tolist()]
        cursor += len(chunk)
        ids, mask, cmask = pack(tok, chunk, device)
        C, N = cmask.shape[1], len(chunk)
        logp, _ = completion_logprobs(policy, ids, mask, C, 1.0)                            # (2N, C)
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref = completion_logprobs(reference, ids, mask, C, 1.0)[0]
        loss, m = pair_loss(logp, ref, cmask, torch.arange(N), torch.arange(N, 2 * N), cfg.algo)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip or float("inf"))
        optimizer.step()
        row = {"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(), **{k: float(v) for k, v in m.items()},
               "reward": float("nan")}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row.update(evaluate(cfg, engine, tok, eval_set, eval_ids, pool, specs, sample_gen))
            print0(f"step {step}: loss {row['loss']:.4f} pref_acc {row['pref_acc']:.2f} "
                   f"held-out accuracy {row['eval/accuracy']:.3f}")
            if row["eval/accuracy"] > best[0]:   # offline DPO overfits the pairs: the last step is rarely the best
                best = (row["eval/accuracy"], step)
                rundir.save_final(final, policy, tok)
        rows.append(row)
        logger.log(row)
    wall = time.perf_counter() - t_run
    logger.close()
    pool.close()
    rundir.save_plot(run_dir, [{"step": 0, **start}] + rows)
    end = rows[-1]["eval/accuracy"] if rows else start["eval/accuracy"]
    print0(f"held-out accuracy: {start['eval/accuracy']:.3f} -> {end:.3f} in {wall:.0f} s (best {best[0]:.3f} at step "
           f"{best[1]}: final/ holds that policy); run directory: {run_dir}")
    return {"start_accuracy": start["eval/accuracy"], "end_accuracy": end, "best_accuracy": best[0],
            "best_step": best[1], "run_dir": run_dir, "wall_s": wall}


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (UserError, registry.RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
