"""The master loop: setup, then per step rollout -> score -> experience -> update -> sync -> log / eval / save.

    python train.py                                   # embedded default: GRPO on the tiny arithmetic model, CPU ok
    python train.py --help                            # every option
    python train.py algo.name=grpo algo.kl_coef=0.02 steps=100 out_dir=runs/kl
    python train.py --config configs/gsm8k.yaml model=/path/to/Qwen2.5-0.5B-Instruct
    torchrun --nproc_per_node=2 train.py              # the same script under torchrun (distributed.py)

`train_step` is the whole algorithm-independent step on one screen; each phase is a call. The set-up before the
first step (options checked, models, engine, data, resume) is run_setup.py's. Where to edit: docs/architecture.md.
Each run writes one directory (run_dir.py): config.yaml, metrics.jsonl (step 0 is the evaluation before training),
tensorboard events, curve.png, checkpoints/ and the final policy in final/.
"""
import gc
import os
import signal
import sys
import threading
import time
from dataclasses import replace

import torch
from tqdm import tqdm

import algos, engines, envs, rewards, tasks  # noqa: F401,E401  (the plugin packages: importing them registers every name)
import async_rl
import checkpoint
import distributed
import full_kl
import lora
import offload
import profiling
import registry
import run_dir
import vision
from buffer import Experience
from config import UserError, trainer_temperature
from distributed import print0
from engines import moe
from engines.base import SamplingParams
from models import completion_logprobs
from rollout import accuracy, broken, check_broken, eval_line, experience, record_failures
from update import minibatch_size, update
# the set-up: the command line's checks, then models, engine, data, pool, resume (run_setup.py); mode=async's
# trainer reaches these through this module too (async_rl.main gets it as `phases`)
from run_setup import Run, generators, log, prepare, setup


# --------------------------------------------------------------------------------------------- the phases

def next_prompts(run: Run, whole: bool = False) -> list[int]:
    """This rank's prompts for the step (whole groups; every rank draws the same list and takes its share);
    whole: the whole list (mode=async's trainers, which hand it to the rollout ranks)."""
    cfg = run.cfg
    if run.cursor + cfg.prompts_per_step > len(run.order):   # a new epoch over the training prompts
        run.order, run.cursor = torch.randperm(len(run.train_set), generator=run.generator), 0
    idx = run.order[run.cursor:run.cursor + cfg.prompts_per_step].tolist()
    run.cursor += len(idx)
    return idx if whole else distributed.share(idx)


@torch.no_grad()
def extra_logprobs(run: Run, rollout, images: dict | None = None) -> dict:
    """The trainer-side tensors the algorithm needs beside the engine's: old and reference log-probs, values.
    images: a vision batch's pictures (vision.batch_images)."""
    cfg, learner, device = run.cfg, run.learner, run.device
    ids, attn = rollout.input_ids.to(device), rollout.attention_mask.to(device)
    C, B = rollout.completion_mask.shape[1], len(rollout.input_ids)
    updates_per_step = cfg.algo.epochs * -(-B // minibatch_size(cfg, B))
    out = {}
    # the policy moves before (re)use: keep its log-probs from before the first update (the proximal policy of the
    # decoupled loss under mode=async, docs/async.md). With one update per batch the loss takes them from its own
    # forward (logp detached) at no cost, also when the samples are stale: pi_prox is the policy before the update
    # The KL in the reward is the trainer's too (verl, TRL): the engine's log-probs carry the rollout mismatch
    if updates_per_step > 1 or cfg.replay.enabled or (cfg.algo.kl_in_reward and cfg.algo.kl_coef > 0):
        old = engines.exact.completion_logprobs if cfg.exact_logprobs else completion_logprobs   # the engine's bits
        moe.set_routes(learner.policy, getattr(rollout, "routes", None))   # moe.routing_replay (arch, #32)
        out["old_logprobs"] = old(learner.policy, ids, attn, C, trainer_temperature(cfg), images)[0].cpu()
        moe.set_routes(learner.policy, None)
    if run.reference is not None:
        with offload.visit(run.reference, device, cfg.offload_models):   # on the GPU for this forward only
            if learner.algo.exact_kl(cfg.algo):   # the loss's full-vocabulary KL needs its hidden states (full_kl.py)
                out["ref_logprobs"], out["ref_hidden"] = full_kl.logprobs_and_hidden(
                    run.reference, ids, attn, C, trainer_temperature(cfg), images)
            else:
                out["ref_logprobs"] = completion_logprobs(run.reference, ids, attn, C, trainer_temperature(cfg),
                                                          images)[0].cpu()
    if learner.critic is not None:
        out["values"] = learner.critic.values(ids, attn, rollout.completion_mask.to(device)).cpu()
    return out


def add_to_buffer(run: Run, batch: Experience):
    """The rows the algorithm keeps (e.g. DAPO drops groups with no signal) go into the buffer. A rank that keeps
    none adds its rows with no loss token: it still takes part in every collective, and trains nothing."""
    algo = run.learner.algo
    kept = algo.keep(batch, run.cfg.algo) if algo.keep is not None else None
    if kept is not None:
        batch = batch.select(kept.nonzero().squeeze(-1)) if kept.any() else \
            replace(batch, completion_mask=torch.zeros_like(batch.completion_mask))
    run.buffer.add(batch)
    return {"kept_frac": kept.float().mean().item()} if kept is not None else {}


def collect(run: Run, step: int, times: dict):
    """Phases 1-3 once: this rank's share of prompts_per_step prompts, n samples each, scored, with the trainer's
    log-probs. -> (Experience without advantages, reward info)."""
    cfg = run.cfg
    with profiling.phase(times, "rollout"):           # 1. the next prompts, n samples each
        idx = next_prompts(run)
        rollout = run.sampler.generate([run.train_ids[i] for i in idx], [run.train_set[i] for i in idx],
                                       cfg.samples_per_prompt, SamplingParams(
                                           cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.top_k,
                                           cfg.logprobs_mode, rollout=True), run.sample_gen)
        checkpoint.crash_point("rollout", step)
    with profiling.phase(times, "logprobs"):          # 2. scoring starts in the reward workers, overlapped with
        samples = [run.train_set[i] for i in idx for _ in range(cfg.samples_per_prompt)]
        handle = run.sampler.score(samples, rollout)
        run.stages.for_experience()                   # (offload_models: the critic comes back to the GPU)
        images = getattr(rollout, "images", None)     # episodes carry the pictures they showed (engines/multiturn.py)
        if images is None:                            # single turn: the prompts' pictures ({}: text)
            images = vision.batch_images([run.train_ids[i] for i in idx], cfg.samples_per_prompt)
        extra = {**extra_logprobs(run, rollout, images or None), **images}   # 3. ... the log-prob (and value) forwards
    with profiling.phase(times, "reward"):            # only the part of scoring not hidden behind step 3
        rewards, reward_info = handle.result()
    failures = record_failures(run.run_dir, step, reward_info)   # a sample to reward_failures.jsonl
    run.broken.append(broken(reward_info, len(rewards)))
    if failures and distributed.rank() == 0:
        tqdm.write(failures)
    return experience(rollout, rewards, run.learner.version, extra, reward_info), reward_info


def draw(run: Run, step: int, times: dict):
    """Phases 1-3: one round (collect), or, for an algorithm that declares max_rounds > 1 (DAPO's dynamic sampling),
    more rounds of fresh prompts while fewer than prompts_per_step groups pass its `keep` on some rank.
    -> (batch, reward info, samples one round draws on this rank (what the update calls the whole batch),
    dynamic_sampling/* metrics). The batch holds every sample drawn except groups that pass `keep` beyond the
    first prompts_per_step ones, so add_to_buffer keeps exactly a full batch and the logged reward is all of it."""
    cfg, algo, n = run.cfg, run.learner.algo, run.cfg.samples_per_prompt
    batch, info = collect(run, step, times)
    max_rounds = algo.max_rounds(cfg.algo)
    if max_rounds <= 1 or algo.keep is None:
        return batch, info, len(batch), {}
    want = len(batch) // n                            # this rank's groups per step
    parts, infos, found = [batch], [info], int(algo.keep(batch, cfg.algo)[::n].sum())
    # every rank draws the same number of rounds: each rank's update must run as many passes as the others'
    while len(parts) < max_rounds and distributed.all_sum([float(found < want)])[0] > 0:
        round_times = {}
        more, more_info = collect(run, step, round_times)
        parts, infos = parts + [more], infos + [more_info]
        found += int(algo.keep(more, cfg.algo)[::n].sum())
        for k, v in round_times.items():
            times[k] += v
    whole = Experience.cat(parts, pad_id=run.tok.pad_token_id)
    whole.group_ids = torch.arange(len(whole) // n).repeat_interleave(n)   # rows are whole groups, in order
    signal = algo.keep(whole, cfg.algo)[::n]                                          # (groups,) bool
    surplus = signal & (signal.cumsum(0) > want)      # found beyond a full batch: never used
    rows = (~surplus).repeat_interleave(n).nonzero().squeeze(-1)
    batch = whole.select(rows)
    batch.group_ids = torch.arange(len(batch) // n).repeat_interleave(n)   # 0..G-1 again (group stats index by them)
    # reward metrics: means over the rounds, failure counts (reward_fail*) summed, as over ranks
    metrics = {k: sum(i["metrics"][k] for i in infos) / (1 if k.startswith(distributed.SUMMED) else len(infos))
               for k in infos[0]["metrics"]}
    # each reward's scores of the rows kept (the batch's accuracy is its verifier's)
    per_reward = {k: torch.cat([i["per_reward"][k] for i in infos])[rows] for k in info.get("per_reward", {})}
    # groups are this rank's counts: summed over ranks; every rank draws the same number of rounds (a plain mean)
    return batch, {"metrics": metrics, "per_reward": per_reward}, want * n, {
        "dynamic_sampling/rounds": len(parts), "dynamic_sampling/groups_drawn": distributed.Sum(len(parts) * want),
        "dynamic_sampling/groups_with_signal": distributed.Sum(found)}


def train_step(run: Run, step: int) -> dict:
    """One RL step; -> its metrics row (means over ranks)."""
    cfg, learner, times = run.cfg, run.learner, {}
    run.broken = []
    batch, reward_info, n_samples, rounds = draw(run, step, times)   # 1-3. rollout, scoring, log-probs
    check_broken(run, step)
    batch.advantages = learner.algo.advantages(batch, cfg.algo, sum_over=distributed.all_sum)
    if run.logger:                                    # a few samples per step for tools/view.py
        run_dir.log_trajectories(run.run_dir, step, batch, run.tok, reward_info, cfg.env.name or cfg.task)
    with profiling.phase(times, "update"):            # 4. optimizer steps over the buffer's mini-batches
        run.stages.for_update()                       # engine_sleep (offload_optimizer streams: offload.py)
        kept = add_to_buffer(run, batch)
        stats = update(learner, run.buffer, run.generator, step, n_samples)
        run.stages.after_update()
    if run.stages.notes and step == run.first_step and distributed.rank() == 0:
        tqdm.write("; ".join(run.stages.notes))       # what engine_sleep freed, or why nothing
    with profiling.phase(times, "sync"):              # 5. the new weights into the engine, in place
        run.engine.load_weights(lora.engine_weights(learner.policy) if cfg.lora.r else
                                distributed.sync_weights(learner.policy))
    row = metrics_row(run, step, batch, reward_info, {**stats, **kept}, times, **rounds)   # 6. log
    if step % cfg.eval_every == 0 or step == cfg.steps:
        row.update(run.sampler.evaluate(cfg, run.eval_set, run.eval_ids, run.specs, run.eval_gen()))
    log(run, row)
    return row


def metrics_row(run: Run, step: int, batch: Experience, reward_info: dict, stats: dict, times: dict,
                period: float | None = None, **more) -> dict:
    """The step's metrics row, reduced over ranks: the one place both modes build it (mode=async's trainers call it
    too, async_rl.train_step), so a metric added here (or to update.py's stats) is in both. A plain number is
    averaged over ranks; distributed.Sum, Max, Min or Ratio (numerator and denominator summed, then divided: a
    mean whose count differs by rank) declare another reduction. batch: the step's samples; stats: the update's
    (and add_to_buffer's) metrics; more: the mode's own; period: the seconds the step's tokens took (default: the
    sum of its time/* phases)."""
    row = {"step": step, "reward": batch.rewards.mean().item(), **accuracy(reward_info, run.cfg), **stats,
           "completion_len": batch.completion_mask.sum(-1).mean().item(),
           "truncated_frac": batch.truncated.float().mean().item(), "lr": run.learner.schedule.get_last_lr()[0],
           **reward_info["metrics"], **more, **{k: distributed.Max(v) for k, v in times.items()}}
    period = period or sum(v for k, v in times.items() if k.startswith("time/"))
    row["tokens_per_s"] = distributed.Sum(int(batch.attention_mask.sum()) / period)   # every rank's tokens
    return distributed.reduce_metrics(row)



def save(run: Run, step: int) -> str | None:
    """The whole training state at the end of a step (checkpoint.py)."""
    learner = run.learner
    return checkpoint.save(run.run_dir, run.cfg, step, learner.version, learner.policy, learner.optimizer,
                           learner.schedule, run.buffer, generators(run), run.order, run.cursor, {"start": run.start},
                           learner.critic)


def finish(run: Run, rank: int, wall: float) -> dict:
    """The final policy (final/), the plot, and the one-line summary."""
    cfg, policy = run.cfg, run.learner.policy
    run.pool.close()
    run.sampler.close()
    run.engine.close()   # before the process group goes: vLLM's shutdown destroys the default group itself
    fsdp = distributed.is_sharded(policy)
    full = distributed.full_state(policy)[0] if fsdp else None   # every rank gathers, rank 0 writes
    if full:   # a tied lm_head is one parameter under two names: save it once, as save_pretrained does
        keep = {n for n, _ in policy.named_parameters()} | {n for n, _ in policy.named_buffers()}
        full = {k: v for k, v in full.items() if k in keep}
    if rank == 0:   # LoRA: final/ is peft's adapter folder; lora.save_merged adds final/merged/
        run_dir.save_final(os.path.join(run.run_dir, "final"), policy, run.tok, full)
        vision.save_processor(policy, cfg.model, os.path.join(run.run_dir, "final"))
        if cfg.lora.r and cfg.lora.save_merged:
            lora.save_merged(policy, run.tok, os.path.join(run.run_dir, "final", "merged"))
        run_dir.save_plot(run.run_dir, run.rows)
        if offload.memory_table(run.rows):
            print(offload.memory_table(run.rows), flush=True)
        run.logger.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()   # every rank done before the group goes (gloo aborts on an early teardown)
    start = run.start["eval/accuracy"]
    end = next((r["eval/accuracy"] for r in reversed(run.rows) if "eval/accuracy" in r), start)
    ran = cfg.steps - run.first_step + 1   # this process's steps: a resumed run began at first_step
    print0(f"held-out accuracy: {start:.3f} -> {end:.3f} in {wall:.0f} s over {ran} steps; "
           f"run directory: {run.run_dir}")
    return {"start_accuracy": start, "end_accuracy": end, "run_dir": run.run_dir, "wall_s": wall}


# ------------------------------------------------------------------------------------------------- main

class Stop:
    """SIGINT / SIGTERM during the step loop: the first finishes the step, saves a checkpoint and ends the run
    with the command that resumes it; a second abandons the step at once (KeyboardInterrupt)."""

    def __init__(self):
        self.signal, self.old = None, {}
        if threading.current_thread() is threading.main_thread():   # Python runs signal handlers there only
            self.old = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        if distributed.rank() == 0:
            tqdm.write(f"{self.signal}: finishing this step, then saving a checkpoint (again to stop at once)")

    def requested(self) -> bool:   # every rank stops after the same step
        return distributed.all_sum([float(self.signal is not None)])[0] > 0

    def restore(self):
        for s, handler in self.old.items():
            signal.signal(s, handler)


def stopped(run: Run, step: int, why: str, saved: bool | str) -> dict:
    """After a signal: the step's checkpoint (unless this step saved one: every rank decides alike, since a save is
    collective under torchrun), workers closed, one line with the resume command."""
    if not saved:
        save(run, step)
    ckpt = os.path.join(run.run_dir, "checkpoints", f"step_{step:06d}")
    run.pool.close(), run.sampler.close(), run.engine.close()
    if run.logger is not None:
        run.logger.close()
    launcher = "torchrun <as before> train.py" if torch.distributed.is_initialized() else "python train.py"
    print0(f"stopped by {why} after step {step}; checkpoint {ckpt}. To continue: {launcher} resume={run.run_dir}")
    return {"stopped": why, "step": step, "run_dir": run.run_dir, "checkpoint": ckpt}



@lora.run_scoped_precision()   # lora.tf32's precision setting ends with the run
def main(argv: list[str]) -> dict:
    # memory: the CUDA allocator grows segments in place instead of caching fixed-size blocks, so less sits reserved
    # (docs/speed.md). It applies only if set before CUDA's first allocation; a PYTORCH_CUDA_ALLOC_CONF of your own wins
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg, resume_from = prepare(argv)
    rank, world = distributed.init(cfg.offload)        # (0, 1) unless launched by torchrun; see distributed.py
    if cfg.mode == "async":   # rollout ranks and trainer ranks apart (async_rl.py); it calls this file's phases
        return async_rl.main(cfg, resume_from, sys.modules[__name__])
    run = setup(cfg, resume_from, rank)
    bar = tqdm(range(run.first_step, cfg.steps + 1), disable=not cfg.progress or rank != 0, dynamic_ncols=True)
    t_run, acc, stop = time.perf_counter(), run.start["eval/accuracy"], Stop()
    try:
        for step in bar:
            prof = profiling.start() if step == cfg.profile_step else None   # profile_step: where the time goes
            row = train_step(run, step)
            if "eval/accuracy" in row:   # the bar shows the latest evaluation between evaluations
                acc = row["eval/accuracy"]
                if rank == 0:
                    tqdm.write(eval_line(row))
            bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{acc:.3f}")
            bad = run.learner.bad_updates >= cfg.max_bad_updates
            saved, saved_now = None, bad or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0)
            if saved_now:
                saved = save(run, step)   # its path on rank 0, None on the others
            if prof is not None:
                profiling.mark("log")   # logging, evaluation, checkpoint
                print0(f"profile of step {step}: {profiling.finish(prof, run.run_dir, rank, step)}")
            if bad:
                raise UserError(f"{run.learner.bad_updates} updates in a row had a non-finite loss or gradient (last "
                                f"at step {step}); stopped with a checkpoint in {saved}")
            if step < cfg.steps and stop.requested():
                bar.close()
                return stopped(run, step, stop.signal or "a signal to another rank", saved_now)
    finally:
        stop.restore()
    return finish(run, rank, time.perf_counter() - t_run)


if __name__ == "__main__":
    try:
        out = main(sys.argv[1:])
        sys.exit(130 if isinstance(out, dict) and out.get("stopped") else 0)
    except (UserError, registry.RegistryError) as e:
        distributed.fail(f"error: {e}")
    except KeyboardInterrupt:   # before the step loop (loading, the step-0 evaluation), or a second Ctrl-C
        print("interrupted: nothing saved since the last checkpoint", file=sys.stderr)
        sys.exit(130)
    finally:
        if torch.distributed.is_initialized():
            # FSDP's meshes hold the group in reference cycles. Left to the interpreter's exit, after the group
            # is gone, a rank of a CPU torchrun test run aborted there ("terminate called without an active
            # exception"), as tests/offload_worker.py did in about one run in five before the same collection
            gc.collect()
            torch.distributed.destroy_process_group()
