"""The master loop: rollout -> reward -> (reference log-probs) -> advantages -> update -> sync -> log.

    python train.py                                   # embedded default: GRPO on the tiny arithmetic model, CPU ok
    python train.py --help                            # every option
    python train.py algo.name=grpo algo.kl_coef=0.02 steps=100 out_dir=runs/kl
    python train.py --config configs/gsm8k.yaml model=/path/to/Qwen2.5-0.5B-Instruct
    torchrun --nproc_per_node=1 train.py              # same script under torchrun

Each run writes one directory (README.md, "Run directory"): config.yaml, metrics.jsonl, tensorboard
events, curve.png and the final policy in final/ (loadable with transformers' from_pretrained).
"""
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch._functorch.config  # noqa: F401  (activation_memory_budget, set below for compile=true)
from tqdm import tqdm

import checkpoint
import distributed
import profiling
import registry
from algos import check_config
from buffer import Experience
from config import Config, UserError, parse, to_dict
from critic import Critic
from microbatch import micro_batches, split_weight
from models import completion_logprobs, completion_loss, context_length, encode_prompts, load_model
from replay import make_buffer
from rewards import parse_reward_args, parse_spec
from rewards.pool import RewardPool
from rollout import SamplingParams


def print0(*a, **kw):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*a, **kw, flush=True)


def setup_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device == "auto":
        device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.dtype)
    if dtype is None:
        raise UserError(f"config key 'dtype' must be auto, float32 or bfloat16, got {cfg.dtype!r}")
    return device, dtype


def write_atomic(path: str, text: str):
    """Write to a temporary name, then rename: a crash never leaves a half-written file."""
    tmp = path + ".tmp"
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(tmp, path)


def git_state() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True).stdout.strip()
    try:
        return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain"))}
    except OSError:
        return {}


def submit_rewards(pool, samples: list[dict], completions: list[str]):
    """Start scoring in the reward workers and return at once; `.result()` gives (rewards (B,), info)."""
    return pool.submit([s["prompt"] for s in samples], completions,
                       [{k: v for k, v in s.items() if k != "prompt"} for s in samples])


def decode(tok, rollout) -> list[str]:
    C = rollout.completion_mask.shape[1]
    ids = rollout.input_ids[:, -C:]
    lengths = rollout.completion_mask.sum(-1).long()
    return [tok.decode(row[:n].tolist(), skip_special_tokens=True) for row, n in zip(ids, lengths)]


@torch.no_grad()
def evaluate(cfg, engine, tok, samples, prompt_ids, pool, specs, generator) -> dict:
    """Held-out accuracy: the fraction of prompts whose total reward reaches its maximum (greedy by default)."""
    sampling = SamplingParams(temperature=max(cfg.eval_temperature, 1e-5), top_p=cfg.top_p if cfg.eval_temperature else 1.0,
                              max_new_tokens=cfg.max_new_tokens)
    samples, prompt_ids = distributed.share(samples), distributed.share(prompt_ids)   # dist: each rank its part
    rewards = [torch.zeros(0)]
    for start in range(0, len(samples), 256):
        rollout = engine.generate(prompt_ids[start:start + 256], 1, sampling, generator)
        rewards.append(submit_rewards(pool, samples[start:start + 256], decode(tok, rollout)).result()[0])
    r = torch.cat(rewards)
    best = sum(w for _, w in specs)
    total, correct, count = distributed.all_sum([r.sum(), (r >= best - 1e-6).sum(), len(r)])
    return {"eval/reward": total / max(count, 1), "eval/accuracy": correct / max(count, 1)}


def save_final(final_dir: str, policy, tok, state_dict: dict | None = None):
    """The trained policy + tokenizer for from_pretrained, written to final.tmp and renamed: never half-written."""
    import shutil
    policy.save_pretrained(final_dir + ".tmp", **({"state_dict": state_dict} if state_dict else {}))
    tok.save_pretrained(final_dir + ".tmp")
    if os.path.exists(final_dir):
        shutil.rmtree(final_dir)
    os.replace(final_dir + ".tmp", final_dir)


def save_plot(run_dir: str, rows: list[dict]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["reward"] for r in rows], label="train reward", alpha=0.7)
    ev = [r for r in rows if "eval/accuracy" in r]
    ax.plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], "o-", label="held-out accuracy")
    ax.set_xlabel("step"), ax.set_ylim(-0.02, 1.02), ax.grid(alpha=0.3), ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curve.png.tmp"), format="png")
    os.replace(os.path.join(run_dir, "curve.png.tmp"), os.path.join(run_dir, "curve.png"))
    plt.close(fig)


def fused_policy_loss(policy, micro, C: int, cfg, algo, loss_agg: str):
    """algo.loss of the micro-batch through models.completion_loss: the kernel hands it rows at a time, and each
    piece's loss is weighted as micro-batching weights pieces, so the sum is the micro-batch's loss."""
    metrics = {}

    def loss_fn(rows: slice, logp, entropy):
        piece = micro.select(rows)
        loss, m = algo.loss({"logprobs": logp, "entropy": entropy}, piece, cfg.algo)
        w = split_weight(piece, micro, loss_agg, cfg.algo.norm_len)
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + w * v
        return loss * w
    loss, logp, _ = completion_loss(policy, micro.input_ids, micro.attention_mask, C, cfg.temperature, loss_fn)
    return loss, logp, metrics


def main(argv: list[str]) -> dict:
    # memory: the CUDA allocator grows its segments in place instead of caching fixed-size blocks, so less sits
    # reserved but unused (W1 on an H100: peak reserved 5.4 GiB against 6.1, allocated the same). It applies only
    # if set before CUDA's first allocation in this process; a PYTORCH_CUDA_ALLOC_CONF of the user's own wins
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg, resume_from = checkpoint.resolve_resume(parse(argv), argv)   # resume=<dir>, or out_dir holds a checkpoint
    rank, world = distributed.init(cfg.offload)        # (0, 1) unless launched by torchrun; see distributed.py
    if world > 1 and distributed.check(cfg.prompts_per_step, cfg.algo.minibatch_size):
        raise UserError(distributed.check(cfg.prompts_per_step, cfg.algo.minibatch_size))
    if cfg.parallel not in ("fsdp", "replicate"):
        raise UserError(f"parallel must be 'fsdp' or 'replicate', got '{cfg.parallel}'")
    if cfg.offload and cfg.parallel == "replicate":
        raise UserError("offload=true keeps FSDP shards in CPU memory: it needs parallel=fsdp")
    if cfg.offload and not torch.distributed.is_initialized():
        raise UserError("offload=true shards the policy with FSDP: launch with torchrun (--nproc_per_node=1 is fine)")
    torch.manual_seed(cfg.seed)
    device, dtype = setup_device(cfg)
    algo = registry.get("algo", cfg.algo.name)
    check_config(cfg)                                    # algorithm choices are known names; fills defaults
    loss_agg = algo.loss_agg or cfg.algo.loss_agg        # weights micro-batches and ranks (microbatch.py)
    if cfg.fused_loss and (algo.needs_critic or not algo.splittable(cfg.algo)):
        raise UserError(f"fused_loss=true needs a loss that splits over rows and no critic; algo '{cfg.algo.name}' "
                        "with these settings has not")
    if (cfg.micro_batch_size or world > 1) and not algo.splittable(cfg.algo):
        raise UserError(f"algo '{cfg.algo.name}' with these settings has no exact split over micro-batches or ranks: "
                        "use micro_batch_size=0 and one process (see its Algorithm declaration)")
    specs = parse_spec(cfg.rewards)
    reward_args = parse_reward_args(cfg.reward_args, specs)
    pool = RewardPool([(name, weight, reward_args.get(name, {})) for name, weight in specs],
                      workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s)   # unknown reward -> error here

    # --- data ---
    task_fn = registry.get("task", cfg.task)
    try:
        train_set, eval_set = task_fn(getattr(cfg, cfg.task, None))
    except (ValueError, OSError) as e:   # tasks report bad settings or unreadable files this way
        raise UserError(f"task '{cfg.task}': {e}")
    if not train_set:
        raise UserError(f"task '{cfg.task}' produced an empty training set")
    eval_set = eval_set[:cfg.eval_size] if cfg.eval_size else eval_set

    # --- models and engine ---
    policy, tok = load_model(cfg.model, device, dtype)
    engine_model = policy   # one process (or replicate): the engine samples with the policy's own parameters
    fsdp = (world > 1 and cfg.parallel == "fsdp") or cfg.offload
    if fsdp:   # dist: float32 master weights, sharded; the engine keeps the full copy in `dtype` loaded above
        policy = distributed.shard(load_model(cfg.model, torch.device("cpu"), torch.float32)[0], device, dtype,
                                   cfg.offload)
    policy.train()
    # memory: with compile, the recompute happens inside each compiled layer's backward (the partitioner saves
    # the least it can: activation_memory_budget 0), so no Python re-runs the forward; W1 on an H100: 0.090 s
    # per micro-batch of 32 x 320 against 0.115 s with transformers' checkpoint wrapper, the same values
    in_compile = cfg.compile and cfg.compiled_recompute
    if cfg.grad_checkpointing and not in_compile:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:   # speed: per layer, so one compiled graph serves every layer (they share code and shapes)
        layers = getattr(getattr(policy, policy.base_model_prefix, None), "layers", None)
        if layers is None:
            raise UserError("compile=true needs a model with <base>.layers (decoder layers)")
        torch._functorch.config.activation_memory_budget = 0.0 if cfg.grad_checkpointing and in_compile else 1.0
        for layer in layers:
            layer.compile()
    train_ids = encode_prompts(tok, [s["prompt"] for s in train_set], [bool(s.get("chat_rendered")) for s in train_set])
    eval_ids = encode_prompts(tok, [s["prompt"] for s in eval_set], [bool(s.get("chat_rendered")) for s in eval_set])
    longest = max(len(p) for p in train_ids + eval_ids)
    if longest + cfg.max_new_tokens > context_length(policy):
        raise UserError(f"a prompt of {longest} tokens + max_new_tokens={cfg.max_new_tokens} exceeds the model's "
                        f"context of {context_length(policy)} tokens")
    reference = None
    if algo.needs_ref(cfg.algo):
        reference, _ = load_model(cfg.model, device, dtype)
        reference.eval().requires_grad_(False)
        reference = distributed.shard(reference, device, dtype, cfg.offload) if fsdp else reference
    critic = Critic(cfg, device, dtype, fsdp) if algo.needs_critic else None   # critic: PPO's value model
    trained = [policy] + ([critic.model] if critic is not None else [])   # what the update's backward reaches
    engine = registry.get("engine", cfg.engine)(model=engine_model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                                                 model_path=cfg.model, seed=cfg.seed, **to_dict(cfg.vllm))
    # speed: fused AdamW (one kernel for all parameters) on GPU; offloaded shards step on the CPU with the default
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda" and not cfg.offload)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    generator = torch.Generator().manual_seed(cfg.seed)   # data order and mini-batch shuffles (CPU)
    # token sampling: one stream per rank (rank 0's is the one-process stream)
    sample_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1 + 1_000_003 * rank)

    # --- run directory ---
    run_dir = cfg.out_dir or os.path.join("runs", f"{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if rank == 0:   # dist: rank 0 alone writes the run directory
        os.makedirs(run_dir, exist_ok=True)
        import yaml
        write_atomic(os.path.join(run_dir, "config.yaml"),
                     yaml.safe_dump({**to_dict(cfg), "git": git_state()}, sort_keys=False))
    from torch.utils.tensorboard import SummaryWriter
    try:
        buffer = make_buffer(cfg, run_dir, resume=bool(resume_from))
    except ValueError as e:
        raise UserError(str(e))
    # evaluation samples from its own generator: it never shifts the training RNG streams
    eval_gen = lambda: torch.Generator(device=device).manual_seed(cfg.seed + 2)
    rows: list[dict] = []
    first_step, version, bad_updates = 1, 0, 0      # version: optimizer updates applied so far, in RL steps
    if resume_from:   # --- exact resume: weights, optimizer, schedule, buffer, RNGs, data position, logs ---
        s = checkpoint.load(resume_from, policy, optimizer, schedule, buffer, {"data": generator, "sample": sample_gen},
                            critic)
        first_step, version, order, cursor, start, rows = s["step"] + 1, s["version"], s["order"], s["cursor"], \
            s["extra"]["start"], s["rows"]
        engine.load_weights(distributed.sync_weights(policy))
    else:
        start = evaluate(cfg, engine, tok, eval_set, eval_ids, pool, specs, eval_gen())
        print0(f"step 0: held-out accuracy {start['eval/accuracy']:.3f} (reward {start['eval/reward']:.3f})")
        order, cursor = torch.randperm(len(train_set), generator=generator), 0
    writer = metrics_file = None
    if rank == 0:
        writer = SummaryWriter(run_dir, purge_step=first_step)   # purge: a resumed run overwrites later events
        metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if resume_from else "w")   # no stale rows
    bar = tqdm(range(first_step, cfg.steps + 1), disable=not cfg.progress or int(os.environ.get("RANK", "0")) != 0,
               dynamic_ncols=True)
    t_run = time.perf_counter()
    for step in bar:
        times, t0 = {}, time.perf_counter()
        prof = profiling.start() if step == cfg.profile_step else None   # profile_step: where the time goes
        # 1. rollout: the next prompts, n samples each
        if cursor + cfg.prompts_per_step > len(order):
            order, cursor = torch.randperm(len(train_set), generator=generator), 0
        idx = order[cursor:cursor + cfg.prompts_per_step].tolist()
        cursor += len(idx)
        idx = distributed.share(idx)   # dist: this rank's prompts (whole groups)
        rollout = engine.generate([train_ids[i] for i in idx], cfg.samples_per_prompt, sampling, sample_gen)
        checkpoint.crash_point("rollout", step)
        times["time/rollout"] = time.perf_counter() - t0
        profiling.mark("rollout")

        # 2. score in the reward workers, overlapped with the log-prob forwards of step 3
        t0 = time.perf_counter()
        samples = [train_set[i] for i in idx for _ in range(cfg.samples_per_prompt)]
        reward_handle = submit_rewards(pool, samples, decode(tok, rollout))

        # 3. the extra log-probs the algorithm needs, then the experience batch
        mb_size = cfg.algo.minibatch_size // world or len(samples)   # dist: minibatch_size is global
        updates_per_step = cfg.algo.epochs * math.ceil(len(samples) / mb_size)
        ids, attn = rollout.input_ids.to(device), rollout.attention_mask.to(device)
        C = rollout.completion_mask.shape[1]
        old_logprobs = ref_logprobs = None
        with torch.no_grad():
            if updates_per_step > 1 or cfg.replay.enabled:   # the policy moves before (re)use: keep these log-probs
                old_logprobs = completion_logprobs(policy, ids, attn, C, cfg.temperature)[0].cpu()
            if reference is not None:
                ref_logprobs = completion_logprobs(reference, ids, attn, C, cfg.temperature)[0].cpu()
            values = None if critic is None else critic.values(ids, attn, rollout.completion_mask.to(device)).cpu()  # critic
        times["time/logprobs"] = time.perf_counter() - t0
        profiling.mark("logprobs")
        t0 = time.perf_counter()
        rewards, reward_info = reward_handle.result()
        times["time/reward"] = time.perf_counter() - t0     # only the part not hidden behind step 3
        profiling.mark("reward")
        if reward_info["reasons"]:
            tqdm.write(f"step {step}: {len(reward_info['reasons'])} reward failures, e.g. {reward_info['reasons'][0]}")
        batch = Experience(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                           completion_mask=rollout.completion_mask, sample_logprobs=rollout.logprobs,
                           rewards=rewards, group_ids=rollout.group_ids,
                           versions=torch.full_like(rewards, version, dtype=torch.long), truncated=rollout.truncated,
                           old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values)
        batch.advantages = algo.advantages(batch, cfg.algo)

        # 4. update
        t0 = time.perf_counter()
        kept = algo.keep(batch, cfg.algo) if algo.keep is not None else None   # e.g. DAPO's dynamic sampling
        buffer.add(batch.select(kept.nonzero().squeeze(-1)) if kept is not None and kept.any() else batch)
        stats: dict[str, list[float]] = {}
        skipped, applied = 0, 0
        mis_sum, mis_max, mis_n, first_mb = 0.0, 0.0, 0.0, True   # engine-vs-trainer log-prob gap, see below
        for mb in buffer.minibatches(mb_size, cfg.algo.epochs, generator, group_size=cfg.samples_per_prompt):
            scale = distributed.loss_scale(mb.completion_mask, loss_agg)   # dist: global-batch loss
            optimizer.zero_grad(set_to_none=True)
            if critic is not None:                                                       # critic: fresh gradients
                critic.optimizer.zero_grad(set_to_none=True)
            m = {}
            # gradient accumulation over length-bucketed micro-batches (microbatch.py); size 0 = one pass
            for micro, weight in distributed.accumulate(   # dist: one gradient reduce-scatter per mini-batch
                    trained, micro_batches(mb, cfg.micro_batch_size, loss_agg, cfg.algo.norm_len), cfg.offload):
                micro = micro.to(device)
                C = micro.completion_mask.shape[1]
                if cfg.fused_loss:   # speed: the loss's gradient is taken in the kernel, rows at a time
                    loss, logp, mm = fused_policy_loss(policy, micro, C, cfg, algo, loss_agg)
                else:
                    logp, entropy = completion_logprobs(policy, micro.input_ids, micro.attention_mask, C, cfg.temperature)
                    new = {"logprobs": logp, "entropy": entropy}
                    if critic is not None:                                               # critic: trained by the loss
                        new["values"] = critic.values(micro.input_ids, micro.attention_mask, micro.completion_mask,
                                                      grad=True)
                    loss, mm = algo.loss(new, micro, cfg.algo)
                (loss * (weight * scale)).backward()
                if first_mb:   # before any update, on fresh samples: the gap is numerics or a broken sync
                    fresh = micro.completion_mask * (micro.versions == version).float()[:, None]   # (b, c)
                    gap = (logp.detach().float() - micro.sample_logprobs).abs() * fresh
                    m["_mis_sum"], m["_mis_n"] = m.get("_mis_sum", 0.0) + gap.sum(), m.get("_mis_n", 0.0) + fresh.sum()
                    top = gap.max() if gap.numel() else gap.new_zeros(())
                    m["_mis_max"] = torch.maximum(m["_mis_max"], top) if "_mis_max" in m else top
                # tensors: no host sync per micro-batch. x scale (dist: this rank's share of the global batch, as
                # for the loss), so that the plain mean over ranks in reduce_metrics is the global batch's mean
                for k, v in {**mm, "loss": loss.detach()}.items():
                    m[k] = m.get(k, 0.0) + weight * scale * v
            distributed.average_gradients(policy)   # dist, parallel=replicate: one all-reduce (FSDP: a no-op)
            if critic is not None:
                distributed.average_gradients(critic.model)   # dist, parallel=replicate: as the policy's
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip or float("inf"))
            # every metric of this mini-batch to the host in one transfer (one sync per optimizer step)
            m = dict(zip(m, torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                                         for v in m.values()]).tolist()))
            if first_mb:
                mis_sum, mis_n, mis_max = m.pop("_mis_sum"), m.pop("_mis_n"), m.pop("_mis_max")
            first_mb = False
            for k, v in {**m, "grad_norm": distributed.grad_norm_value(grad_norm)}.items():
                stats.setdefault(k, []).append(v)
            finite = torch.tensor(float(math.isfinite(stats["loss"][-1]) and math.isfinite(stats["grad_norm"][-1])),
                                  device=device)
            if torch.distributed.is_initialized():   # every rank must skip together or its shard drifts
                torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
            if not finite.item():   # skip this update, keep the run
                bad_updates, skipped = bad_updates + 1, skipped + 1
                print0(f"step {step}: non-finite loss or gradient, update skipped ({bad_updates} in a row)")
                if bad_updates >= cfg.max_bad_updates:
                    break
                continue
            optimizer.step()
            schedule.step()
            if critic is not None:                                                       # critic: its own optimizer
                stats.setdefault("critic_grad_norm", []).append(critic.step())
            bad_updates, applied = 0, applied + 1
            checkpoint.crash_point("update", step)
        buffer.end_step()
        optimizer.zero_grad(set_to_none=True)   # memory: the gradients are not needed while the engine samples
        version += applied > 0          # a new policy exists only if some update went through
        times["time/update"] = time.perf_counter() - t0
        profiling.mark("update")

        # 5. sync the new weights into the engine, in place
        t0 = time.perf_counter()
        engine.load_weights(distributed.sync_weights(policy))   # dist: gathers the shards one unit at a time
        times["time/sync"] = time.perf_counter() - t0
        profiling.mark("sync")

        # 6. log
        n_tokens = int(batch.attention_mask.sum())
        mis_sum, mis_n = distributed.all_sum([mis_sum, mis_n])   # dist: the gap's mean over every rank's tokens
        row = {"step": step, "reward": rewards.mean().item(),
               "accuracy": (rewards >= sum(w for _, w in specs) - 1e-6).float().mean().item(),
               **{k: sum(v) / len(v) for k, v in stats.items()},
               **({"kept_frac": kept.float().mean().item()} if kept is not None else {}),
               "logprob_mismatch/mean": mis_sum / max(mis_n, 1.0), "logprob_mismatch/max": mis_max,
               "completion_len": batch.completion_mask.sum(-1).mean().item(),
               "truncated_frac": batch.truncated.float().mean().item(),
               "lr": schedule.get_last_lr()[0], "skipped_updates": skipped, **reward_info["metrics"], **times}
        row["tokens_per_s"] = n_tokens / sum(times.values())
        row = distributed.reduce_metrics(row)   # dist: means over ranks (tokens_per_s: the sum)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row.update(evaluate(cfg, engine, tok, eval_set, eval_ids, pool, specs, eval_gen()))
        rows.append(row)
        if rank == 0:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            for k, v in row.items():
                if k != "step":
                    writer.add_scalar(k if "/" in k else f"train/{k}", v, step)
        bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row.get('eval/accuracy', float('nan')):.3f}")

        # 7. checkpoint: the whole state, at the end of a step (checkpoint.py)
        stop = bad_updates >= cfg.max_bad_updates
        if stop or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            saved = checkpoint.save(run_dir, cfg, step, version, policy, optimizer, schedule, buffer,
                                    {"data": generator, "sample": sample_gen}, order, cursor, {"start": start}, critic)
        if prof is not None:
            profiling.mark("log")   # logging, evaluation, checkpoint
            print0(f"profile of step {step}: {profiling.finish(prof, run_dir, rank, step)}")
        if stop:
            raise UserError(f"{bad_updates} updates in a row had a non-finite loss or gradient (last at step {step}); "
                            f"stopped with a checkpoint in {saved}")

    wall = time.perf_counter() - t_run
    pool.close()
    engine.close()   # before the process group goes: vLLM's shutdown destroys the default group itself
    final_dir = os.path.join(run_dir, "final")
    full = distributed.full_state(policy)[0] if fsdp else None   # dist: every rank gathers, rank 0 writes
    if full:   # a tied lm_head is one parameter under two names: save it once, as save_pretrained does
        keep = {n for n, _ in policy.named_parameters()} | {n for n, _ in policy.named_buffers()}
        full = {k: v for k, v in full.items() if k in keep}
    if rank == 0:
        save_final(final_dir, policy, tok, full)
        save_plot(run_dir, [{"step": 0, "reward": float("nan"), **start}] + rows)
        writer.close()
        metrics_file.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()   # every rank done before the group goes (gloo aborts on an early teardown)
    end = rows[-1]["eval/accuracy"] if rows else start["eval/accuracy"]
    print0(f"held-out accuracy: {start['eval/accuracy']:.3f} -> {end:.3f} in {wall:.0f} s over {cfg.steps} steps; "
           f"run directory: {run_dir}")
    return {"start_accuracy": start["eval/accuracy"], "end_accuracy": end, "run_dir": run_dir, "wall_s": wall}


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (UserError, registry.RegistryError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
