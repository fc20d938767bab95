"""Asynchronous RL (mode=async): rollout ranks only generate, trainer ranks only train, at the same time.

    torchrun --nproc_per_node=2 train.py mode=async algo.tis=token                  # rank 0 trains, rank 1 samples
    torchrun --nproc_per_node=3 train.py mode=async rollout_ranks=2 max_staleness=2 algo.tis=token
    torchrun --nproc_per_node=2 train.py mode=async max_staleness=0                 # the one-process run, exactly
    torchrun --nproc_per_node=3 train.py mode=async algo.tis=token                  # ranks 0, 1 train (FSDP2), 2 samples

train.py's main hands over to `main` here after config_checks.validate; the trainer runs train.py's own phases (setup,
extra_logprobs, add_to_buffer, update, metrics_row, log, finish, Stop), passed in as `phases` so that this file does
not import train.py (no import cycle); the rollout phase itself (engine, scoring, the experience record) is
rollout.py's. The metrics row is train.metrics_row, the synchronous loop's: a metric added there is in both modes.
docs/async.md has the layout, the staleness rule and the correction.

The logical clock (async_link.Clock), which makes a run a function of its seed and step numbers, never of wall time:
    step s trains on the samples that the weights after step w(s) = max(0, s - 1 - max_staleness) generated,
    from the prompts the trainer chose right after step w(s) (step 0 = setup).
So staleness is exactly min(s - 1, max_staleness) versions, and with max_staleness=0 every batch comes from the
weights of the step before, as in the synchronous loop. A rollout rank that is max_staleness + 1 batches ahead
waits for the weights it needs: that wait is `time/rollout_idle`.
Ranks: 0 .. T-1 train (T = world - rollout_ranks), T .. world-1 generate; rollout rank j takes prompts
j::rollout_ranks of each step and its own sampling stream (j = 0 is the one-process stream). The trainers are the
synchronous loop's ranks among themselves (distributed.py on their own group: parallel=fsdp shards over them,
replicate averages their gradients, metrics are reduced over them); each trains on whole groups rank::T of every
batch. Trainer rank 0 alone talks to the rollout ranks and hands each batch to the other trainers (a gloo
broadcast). Weights out: distributed.sync_weights yields the full tensors (under FSDP it gathers one unit at a time
among the trainers, every trainer taking part) and trainer rank 0 broadcasts each as it comes, in the order of
the names it sent at start; the trainers' own engines (evaluation only) get the weights before each evaluation.
Messages between trainer rank 0 and the rollout ranks (the process groups, their order, the timeouts, how a
dead rank is reported): async_link.py.
Checkpoints (every trainer takes part, as in the synchronous loop; trainer rank 0 writes; async_checkpoint.py): the
usual state, plus the batches in flight (`inflight.safetensors`: those generated for steps after the checkpoint's,
which the trainers drain first; their weights no longer exist), the prompts already chosen and each rollout rank's
sampling state; a resumed run hands those back to the rollout ranks, so kill -9 + resume continues exactly.
Ctrl-C / SIGTERM (train.Stop, on every rank; torchrun passes Ctrl-C on to each as SIGINT): the trainers finish the
step, write its checkpoint (exact, as a periodic one), take the batches already on their way, tell the rollout ranks
to stop (`end_rollouts`), print the resume command and exit 130; the rollout ranks hold the signal until past the
closing barrier, where the trainers meet them.
Partial rollouts (partial.budget_tokens, docs/async.md): a trajectory may span segments(cfg) iterations, at most
budget tokens in each but its last; rollout iterations then trail by lag = max_staleness - (segments - 1) steps, so
that no token is older than max_staleness versions. The open trajectories ride with each batch and in checkpoints.
A rollout rank that dies: every trainer stops at the next batch and they write a checkpoint of the last step
trained, marking `lost` the steps its in-flight iterations on older weights were to write; resumed, those are made
from that step's weights (fresher; the run differs from there on), the rest as planned; the error names the rank and
the checkpoint (async_checkpoint.died, docs/async.md "When a rollout rank dies").
Simplified: evaluation on the trainers with their own engines.
"""
import copy
import os
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from tqdm import tqdm

import async_checkpoint
import checkpoint
import distributed
import profiling
from async_checkpoint import Inflight
from async_link import Link, RolloutDied
from config import UserError
from engines.base import Rollout, SamplingParams
from models import load_model, setup_device
from rollout import (broken, build_data, check_broken, decode, evaluate, experience, make_engine, record_failures,
                     submit_rewards)
from update import update


def main(cfg, resume_from: str | None, phases) -> dict:
    """Split the ranks (config_checks.validate has checked the counts) and run this rank's part."""
    rank, world = distributed.rank(), distributed.world()
    link = Link(cfg, world)
    if rank < link.T:
        distributed.use_group(link.trainers)   # shares, sums, metrics and checkpoints: the trainer ranks only
        return train_loop(cfg, link, phases, resume_from)
    return generate_loop(cfg, link, phases, rank - link.T)


# ------------------------------------------------------------------------------------------- rollout ranks

def generate_loop(cfg, link: Link, phases, j: int) -> dict:
    """Rollout rank j: wait for the weights each iteration needs, generate its share, send it; repeat. Iteration i
    finishes step i and, with partial rollouts, writes a segment of each open later step (`advance`).
    Ctrl-C / SIGTERM here goes to the trainers with the next batch; they end the run, and this loop at their word
    (a stop message in place of the next weights: end_rollouts). -> {"stopped": ...} then, else {}."""
    torch.manual_seed(cfg.seed)
    device, dtype = setup_device(cfg)
    model, tok = load_model(cfg.model, device, dtype)
    model.requires_grad_(False)
    _, _, train_ids, _ = build_data(cfg, tok, model)
    engine = make_engine(cfg, model, tok, keep_cache=True)   # keep_cache: this GPU only generates
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1 + 1_000_003 * j)   # j = 0: the one-process stream
    params = dict(model.named_parameters())
    D = link.clock.segments - 1
    prompts: dict = {}
    opened: dict[int, dict] = {}                        # step -> its trajectories so far (partial rollouts)
    # a signal: remembered, sent with the next batch, and in force until the closing barrier has passed: one that
    # met the default handler after the last batch went (KeyboardInterrupt) would end this rank while the trainers
    # finish their step, and they would meet a closed connection at that barrier
    stop = phases.Stop()

    def on_trainer(wait):
        """A wait on trainer rank 0. Its failure after a signal is that rank leaving on the signal (during its set-up
        or train.finish, where no train.Stop holds it): this rank ends as interrupted too, not with an error."""
        try:
            return wait()
        except (RuntimeError, UserError):   # gloo's error, or async_link's line that blames trainer rank 0
            if stop.signal:
                raise KeyboardInterrupt from None   # train.py: "interrupted: nothing saved since the last checkpoint"
            raise

    def weights() -> dict:
        msg = on_trainer(lambda: link.receive_weights(params))
        if msg.get("stop"):
            return msg
        engine.load_weights(model.named_parameters())   # the built-in engine samples with these: a no-op there
        prompts.update(msg["prompts"])
        return msg

    try:
        msg = weights()                                 # the start: initial (or resumed) weights, first prompts
        if msg["states"] is not None:                   # resumed: the sampling stream where the checkpoint left it
            gen.set_state(msg["states"][j])
            opened = {int(s): state for s, state in msg["partials"][j].items()}
        for step in range(min([*prompts, *opened], default=cfg.steps + 1), cfg.steps + 1):
            t0 = time.perf_counter()
            while not msg.get("stop") and msg["t"] < link.clock.weights_for(step):   # too far ahead: wait
                msg = weights()
            if msg.get("stop"):                         # the trainers ended the run
                break
            t1 = time.perf_counter()
            for s in range(step, min(step + D, cfg.steps) + 1):   # oldest first: one generate call per step
                ids = None if s in opened else [train_ids[i] for i in prompts.pop(s)[j::link.K]]
                opened[s] = advance(engine, opened.get(s), ids, s == step, msg["version"], cfg, gen,
                                    tok.pad_token_id)
            if device.type == "cuda":
                torch.cuda.synchronize()
            checkpoint.crash_point("generate", step)    # tests: a rollout rank that dies
            done = opened.pop(step)
            link.send(step, {"rollout": {f.name: done.get(f.name) for f in fields(Rollout)},
                             "token_versions": done["versions"], "segments": done["segments"],
                             "version": int(done["version0"]), "state": gen.get_state(), "partial": dict(opened),
                             "idle_s": t1 - t0, "generate_s": time.perf_counter() - t1, "stop": stop.signal})
        on_trainer(link.flush)
        engine.close()
        on_trainer(dist.barrier)   # train.finish's (or end_rollouts'): every rank done before the group goes
    finally:
        stop.restore()
    return {"stopped": "the trainers"} if msg.get("stop") else {}


def advance(engine, state: dict | None, prompts: list | None, final: bool, version: int, cfg, gen, pad_id) -> dict:
    """One segment of one step's trajectories: new prompts (state None: n samples each) or the continuation of
    its unfinished rows (prompt + completion so far as the prompt, 1 sample each). At most partial.budget_tokens
    new tokens per trajectory, except in its last iteration (final), which runs it to max_new_tokens. -> the
    state: the Rollout's fields plus versions (B, C) (the weights' version of each token), segments (B,) and
    version0 (its first segment's version). Without partial rollouts this is one engine.generate call, unchanged."""
    M, budget = cfg.max_new_tokens, cfg.partial.budget_tokens or cfg.max_new_tokens
    if state is None:
        seg = engine.generate(prompts, cfg.samples_per_prompt,
                              SamplingParams(cfg.temperature, cfg.top_p, M if final else min(budget, M)), gen)
        state = {f.name: getattr(seg, f.name) for f in fields(seg) if getattr(seg, f.name) is not None}
        B = len(seg.input_ids)
        return {**state, "versions": torch.full(seg.completion_mask.shape, version, dtype=torch.long),
                "segments": torch.ones(B, dtype=torch.long), "version0": torch.tensor(version)}
    length = state["completion_mask"].sum(-1).long()                               # (B,)
    rows = (state["truncated"] & (length < M)).nonzero().squeeze(-1)               # cut at the budget, not at M
    if len(rows) == 0:
        return state
    n = int(length[rows].max())   # every open row of a step was cut at the same budgets: one length
    keep = state["attention_mask"][rows].bool()
    seg = engine.generate([state["input_ids"][r][k].tolist() for r, k in zip(rows.tolist(), keep)], 1,
                          SamplingParams(cfg.temperature, cfg.top_p, M - n if final else min(budget, M - n)), gen)
    return extend(state, rows, n, seg, version, pad_id)


def extend(state: dict, rows, n: int, seg: Rollout, version: int, pad_id: int) -> dict:
    """Write a continuation segment seg (r, P' + c) into rows of state, completion columns n .. n + c."""
    C, c = state["completion_mask"].shape[1], seg.completion_mask.shape[1]
    P, W = state["input_ids"].shape[1] - C, max(C, n + c)
    out = {k: torch.nn.functional.pad(v, (0, W - C), value=pad_id if k == "input_ids" else 0)
           if v.dim() == 2 else v.clone() for k, v in state.items()}   # (B, P + W) and (B, W)
    out["input_ids"][rows, P + n:P + n + c] = seg.input_ids[:, -c:]
    out["attention_mask"][rows, P + n:P + n + c] = seg.attention_mask[:, -c:]
    out["completion_mask"][rows, n:n + c] = seg.completion_mask
    out["logprobs"][rows, n:n + c] = seg.logprobs
    out["versions"][rows, n:n + c] = version
    out["truncated"][rows] = seg.truncated
    out["segments"][rows] += 1
    return out


# -------------------------------------------------------------------------------------------- trainer ranks

@dataclass
class Trainer:
    """A trainer rank's loop state: train.py's Run, the batches in flight (Inflight, which its checkpoints keep),
    and where the loop stands. The functions below take it; grouped by what they do: the loop, batch intake and
    the staleness checks, the step itself, weight publishing, checkpoints and the early end."""
    cfg: object
    link: Link
    phases: object                # train.py: setup, extra_logprobs, add_to_buffer, metrics_row, log, Stop, ...
    run: object                   # train.Run
    rank: int                     # among the trainers
    inflight: Inflight
    done: int = 0                 # the last step trained
    saved: int | None = None      # the last step whose checkpoint exists (the one resumed from counts)
    t_mark: float = 0.0           # when the last row was made (time/step)
    asked: str | None = None      # a signal a rollout rank got, which came with its batch


def train_loop(cfg, link: Link, phases, resume_from: str | None) -> dict:
    """The trainer ranks: train.py's phases on batches that arrive from the rollout ranks. Trainer rank 0 alone
    talks to them (receives the batches, hands each trainer all of them: `Link.share`; sends prompts and weights);
    every trainer trains on its share of each batch (whole groups rank::T, as the synchronous loop's ranks do),
    with parallel=fsdp or replicate among the trainers (distributed.py, on the trainer group)."""
    rank = distributed.rank()
    run = phases.setup(cfg, resume_from, rank)
    t = Trainer(cfg, link, phases, run, rank, async_checkpoint.resume(resume_from, link.K),
                done=run.first_step - 1, saved=run.first_step - 1 if resume_from else None)
    stop = phases.Stop()   # Ctrl-C / SIGTERM: finish the step, save, end the rollout ranks too, exit 130
    try:
        publish(t, t.done, resumed=bool(resume_from), start=True)   # the rollout ranks start
        bar = tqdm(range(run.first_step, cfg.steps + 1), disable=not cfg.progress, dynamic_ncols=True)
        t_run = t.t_mark = time.perf_counter()
        for step in bar:
            row = train_step(t, step)
            t.done = step
            bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row.get('eval/accuracy', float('nan')):.3f}",
                            stale=f"{row['staleness/mean']:.1f}")
            bad = run.learner.bad_updates >= cfg.max_bad_updates
            if bad or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                save(t, step)
            if bad:
                end_rollouts(t)
                raise UserError(f"{run.learner.bad_updates} updates in a row had a non-finite loss or gradient "
                                f"(last at step {step}); stopped with a checkpoint in {checkpoint_dir(t, step)}")
            stop.signal = stop.signal or t.asked
            if step < cfg.steps and stop.requested():   # every trainer stops after the same step
                bar.close()
                if t.saved != step:
                    save(t, step)                      # exact: the batches in flight are in it
                end_rollouts(t)
                return phases.stopped(run, step, stop.signal or "a signal to another rank", checkpoint_dir(t, step))
    except RolloutDied as e:   # every trainer raises it at the same point (receive_until): all can checkpoint
        raise UserError(async_checkpoint.died(t.inflight, run, phases.generators(run), link.clock, t.done, t.saved,
                                              str(e), cfg.max_staleness)) from None
    finally:
        stop.restore()
    return phases.finish(run, rank, time.perf_counter() - t_run)


# --- batch intake and the staleness checks

def receive_until(t: Trainer, step: int):
    """Every rollout rank's batches up to `step`, in step order (the order they are sent in)."""
    s = t.inflight
    while step not in s.received:
        p = min(p for p in s.pending if p not in s.received)
        msgs = t.link.share(t.link.fetch(p) if t.rank == 0 else None)
        if isinstance(msgs, str):   # trainer 0's word that the rollout ranks are gone: every trainer stops here
            raise RolloutDied(msgs)
        # only now, all K messages of step p in hand: the states stay those after the last whole step received
        s.states = [m.pop("state") for m in msgs]
        s.partials = [m.pop("partial") for m in msgs]
        t.asked = t.asked or next(filter(None, [m.pop("stop", None) for m in msgs]), None)
        s.received[p] = msgs


@dataclass
class Intake:
    """One step's batch as this trainer trains it."""
    rollout: Rollout              # this trainer's rows (whole groups), group ids from 0
    order: list                   # their prompts, in row order (each samples_per_prompt times)
    versions: torch.Tensor        # (b,) each row's first segment's weights' version
    tokens: torch.Tensor          # (B, C) every token's weights' version, the whole batch
    segments: torch.Tensor        # (B,) segments per trajectory, the whole batch
    mask: torch.Tensor            # (B, C) the whole batch's completion mask
    rows: torch.Tensor            # (b,) this trainer's rows of the whole batch


def intake(t: Trainer, step: int, msgs: list[dict]) -> Intake:
    """The rollout ranks' messages of step as one batch, checked against the clock, and this trainer's share of
    it: whole groups rank, rank + T, ... (distributed.share over the trainers)."""
    idx, K, T, n = t.inflight.pending.pop(step), t.link.K, t.link.T, t.cfg.samples_per_prompt
    whole = merge([Rollout(**m["rollout"]) for m in msgs], t.run.tok.pad_token_id)
    C = whole.completion_mask.shape[1]
    versions = torch.cat([torch.full((len(m["rollout"]["input_ids"]),), m["version"]) for m in msgs])   # (B,)
    tokens = torch.cat([torch.nn.functional.pad(m["token_versions"], (0, C - m["token_versions"].shape[1]))
                        for m in msgs])                                              # (B, C) each token's weights
    segs = torch.cat([m["segments"] for m in msgs])                                  # (B,)
    check_clock(t.link.clock, t.inflight.published, t.inflight.lost, step, versions, tokens, whole.completion_mask)
    order = [i for j in range(K) for i in idx[j::K]]   # the prompts in the rows' order
    rows = (torch.arange(t.rank, len(order), T)[:, None] * n + torch.arange(n)).view(-1)   # (B / T,)
    return Intake(take_rows(whole, rows, n), order[t.rank::T], versions[rows], tokens, segs,
                  whole.completion_mask, rows)


def merge(parts: list[Rollout], pad_id: int) -> Rollout:
    """The rollout ranks' batches as one, in rank order: prompts left-padded to the widest, completions
    right-padded to the longest, group ids renumbered. One part comes back as it is."""
    if len(parts) == 1:
        return parts[0]
    P = max(r.input_ids.shape[1] - r.completion_mask.shape[1] for r in parts)
    C = max(r.completion_mask.shape[1] for r in parts)

    def widen(x, c, value):   # (b, p + c) -> (b, P + C)
        p = x.shape[1] - c
        return torch.nn.functional.pad(x, (P - p, C - c), value=value)   # left of the prompt, right of the completion
    out, groups = {}, 0
    for r in parts:
        c = r.completion_mask.shape[1]
        pieces = {"input_ids": widen(r.input_ids, c, pad_id), "attention_mask": widen(r.attention_mask, c, 0),
                  "completion_mask": torch.nn.functional.pad(r.completion_mask, (0, C - c)),
                  "logprobs": torch.nn.functional.pad(r.logprobs, (0, C - c)), "truncated": r.truncated,
                  "group_ids": r.group_ids + groups}
        groups += int(r.group_ids.max()) + 1
        for k, v in pieces.items():
            out.setdefault(k, []).append(v)
    return Rollout(**{k: torch.cat(v) for k, v in out.items()})


def take_rows(r: Rollout, rows: torch.Tensor, n: int) -> Rollout:
    """The rows of a rollout (whole groups of n, in order), with group ids renumbered 0, 1, ..."""
    out = {f.name: None if getattr(r, f.name) is None else getattr(r, f.name)[rows] for f in fields(Rollout)}
    return Rollout(**{**out, "group_ids": torch.arange(len(rows) // n).repeat_interleave(n)})


def check_clock(clock, published: dict, lost: set, step: int, first: torch.Tensor, versions: torch.Tensor,
                mask: torch.Tensor):
    """The clock on the step's whole batch, in policy versions (a skipped update makes none: published, step t ->
    the version after it): each trajectory's first segment (first (B,)) came from the weights after
    start_weights(step), every completion token (versions, mask (B, C)) from those of an iteration that writes
    the step (weights_for(i), i = step - D .. step). A lost step's batch, made again after a resume (lost_steps),
    may be fresher, never staler: that is the only exception. Skipped where the history is not known (older
    checkpoints)."""
    v = published
    iters = [clock.weights_for(i) for i in range(max(1, step - clock.segments + 1), step + 1)]
    if any(t not in v for t in [clock.start_weights(step), *iters]):
        return
    start, tokens = v[clock.start_weights(step)], versions[mask > 0]
    if step in lost:
        ok = bool((first >= start).all() and (tokens >= start).all())
    else:
        ok = bool((first == start).all() and torch.isin(tokens, torch.tensor([v[t] for t in iters])).all())
    if not ok:   # the clock makes this impossible; a bug must not train silently
        raise RuntimeError(f"step {step}: samples of versions {sorted(set(first.tolist()))}, tokens of "
                           f"{sorted(set(tokens.tolist()))}: not the weights the clock assigns")


def check_tokens(cfg, version: int, step: int, versions: torch.Tensor, segs: torch.Tensor, mask: torch.Tensor,
                 batch, rows: torch.Tensor | None = None) -> dict:
    """The staleness bound on every completion token of the step's whole batch (version: the trainer's; versions
    (B, C): each token's weights' version, from the rollout rank; mask (B, C): the completion mask), then, with
    partial rollouts (segs (B,): each trajectory's segments), partial.old_segments=mask: only each trajectory's
    newest segment stays in the loss (m_t = 1[v_t = max_t' v_t']) of this trainer's batch, rows `rows` of the
    whole (None: all of it); the advantages are already computed. -> the partial-rollout metrics of the whole
    batch: every trainer logs the same numbers, so their mean over trainers is what one trainer would log."""
    tokens = mask > 0                                                          # (B, C)
    old = int((version - versions)[tokens].max()) if tokens.any() else 0
    if old > cfg.max_staleness:   # the clock makes this impossible; a bug must not train silently
        raise RuntimeError(f"step {step}: a token is {old} versions old (max_staleness={cfg.max_staleness})")
    if not cfg.partial.budget_tokens:
        return {}
    newest = versions.masked_fill(~tokens, -1).max(-1, keepdim=True).values   # (B, 1)
    n = tokens.sum().clamp(min=1)
    segs = segs.float()
    out = {"partial/frac": (segs > 1).float().mean().item(), "partial/segments": segs.mean().item(),
           "staleness/token_mean": ((version - versions) * tokens).sum().item() / n.item()}
    if cfg.partial.old_segments == "mask":
        keep = tokens & (versions == newest)                                   # (B, C)
        out["partial/masked_frac"] = 1 - keep.sum().item() / n.item()
        keep = keep if rows is None else keep[rows]                            # (b, C) this trainer's rows
        batch.completion_mask = batch.completion_mask * keep.to(batch.completion_mask.dtype)
    return out


# --- the step

def train_step(t: Trainer, step: int) -> dict:
    """One training step on the batch the clock assigns to it; -> its metrics row (train.metrics_row, as the
    synchronous loop's)."""
    cfg, run, phases = t.cfg, t.run, t.phases
    learner, times = run.learner, {}
    with profiling.phase(times, "wait"):             # trainer idle: this step's batch is still being generated
        receive_until(t, step)
        msgs = t.inflight.received.pop(step)
    got = intake(t, step, msgs)
    with profiling.phase(times, "logprobs"):         # scoring in the reward workers, overlapped with ...
        samples = [run.train_set[i] for i in got.order for _ in range(cfg.samples_per_prompt)]
        handle = submit_rewards(run.pool, samples, decode(run.tok, got.rollout), got.rollout, run.tok)
        extra = phases.extra_logprobs(run, got.rollout)   # ... the proximal (and reference) log-probs
    with profiling.phase(times, "reward"):
        rewards, reward_info = handle.result()
    failures = record_failures(run.run_dir, step, reward_info)
    if failures:
        tqdm.write(failures)
    run.broken = [broken(reward_info, len(rewards))]
    try:
        check_broken(run, step)                      # every reward broke for 3 steps: the run ends (every trainer)
    except UserError:
        end_rollouts(t)
        raise
    batch = experience(got.rollout, rewards, learner.version, extra, reward_info)   # (per-step rewards)
    batch.versions = got.versions
    staleness = (learner.version - got.versions).float()   # (b,) a sample is as old as its oldest token
    batch.advantages = learner.algo.advantages(batch, cfg.algo, sum_over=distributed.all_sum)
    sampled = copy.copy(batch)   # the samples as made: check_tokens may take old segments out of the loss
    partial = check_tokens(cfg, learner.version, step, got.tokens, got.segments, got.mask, batch, got.rows)
    with profiling.phase(times, "update"):
        kept = phases.add_to_buffer(run, batch)
        stats = update(learner, run.buffer, run.generator, step, len(samples))
    t0 = time.perf_counter()
    idle = publish(t, step)                          # the new weights (and next prompts) to the rollout ranks
    times["time/sync"] = time.perf_counter() - t0 - idle
    times["time/trainer_idle"] = times.pop("time/wait") + idle
    times["time/rollout"] = max(m["generate_s"] for m in msgs)         # on the rollout ranks, overlapped
    times["time/rollout_idle"] = max(m["idle_s"] for m in msgs)        # rollout ranks waiting for weights
    now = time.perf_counter()   # the period between two rows: what throughput is made of (log and eval too)
    times["time/step"], t.t_mark = now - t.t_mark, now
    mine = {**partial, "staleness/mean": staleness.mean().item(),
            "staleness/max": distributed.Max(staleness.max().item())}
    if step in t.inflight.lost:   # made after a resume from newer weights than the clock planned (lost_steps)
        mine["staleness/regenerated"] = 1.0
    row = phases.metrics_row(run, step, sampled, reward_info, {**stats, **kept}, times, times["time/step"], **mine)
    if step % cfg.eval_every == 0 or step == cfg.steps:
        # the engine's weights: FSDP's full copy (gathered), vLLM's; the built-in engine over the policy: a no-op
        run.engine.load_weights(distributed.sync_weights(learner.policy))
        row.update(evaluate(cfg, run.engine, run.tok, run.eval_set, run.eval_ids, run.pool, run.specs,
                            run.eval_gen()))
    phases.log(run, row)
    return row


# --- weight publishing

def publish(t: Trainer, step: int, resumed: bool = False, start: bool = False) -> float:
    """Choose the prompts whose first segment the weights after `step` will write (train.next_prompts, in step
    order, as the synchronous loop does), then send both; a resumed run hands the rollout ranks back their
    sampling states and open trajectories. -> seconds trainer 0 waited for the rollout ranks to join."""
    clock, s = t.link.clock, t.inflight
    s.published[step] = t.run.learner.version
    for p in clock.prompts_after(step):
        if p not in s.pending:   # on resume the checkpoint has them already
            s.pending[p] = t.phases.next_prompts(t.run, whole=True)   # every trainer: the whole list
    # their first segment's weights are step's; at start also those of older weights, not written yet: none after
    # a periodic checkpoint (received or open), the lost steps after a rollout rank died (made from step's)
    opened = set().union(*s.partials)
    todo = {p: idx for p, idx in s.pending.items() if p not in s.received and p not in opened
            and (clock.start_weights(p) <= step if start else clock.start_weights(p) == step)}
    if not start and step + 1 + clock.lag > t.cfg.steps:   # no later iteration needs them
        return 0.0
    # the full weights, whatever the trainer's engine (vLLM keeps none in this process): the policy's own, or
    # under FSDP gathered among the trainers one unit at a time (every trainer takes part in each gather);
    # their names' order once at start (under FSDP a gather of its own, once per run)
    policy = t.run.learner.policy
    names = [n for n, _ in distributed.sync_weights(policy)] if start else None
    pairs = distributed.sync_weights(policy)
    if t.rank > 0:
        for _ in pairs:   # the gathers only: trainer rank 0 alone talks to the rollout ranks
            pass
        return 0.0
    return t.link.publish(step, t.run.learner.version, todo, pairs, names,
                          *((s.states, s.partials) if resumed else ()))


# --- checkpoints and the early end

def checkpoint_dir(t: Trainer, step: int) -> str:
    return os.path.join(t.run.run_dir, "checkpoints", f"step_{step:06d}")


def save(t: Trainer, step: int):
    """The checkpoint of step, with the batches in flight (async_checkpoint.py). First the batches generated from
    weights older than step's: a resumed run could not make them again."""
    clock, s = t.link.clock, t.inflight
    in_flight = [p for p in s.pending if clock.weights_for(p) < step]
    if in_flight:
        receive_until(t, max(in_flight))
    async_checkpoint.save(s, t.run, t.phases.generators(t.run), step, t.cfg.max_staleness)
    t.saved = step


def end_rollouts(t: Trainer):
    """Before the trainers end early (a signal, or an error all of them meet at one step: rewards that all break,
    non-finite updates): take the batches the rollout ranks were given weights for (dropped: a checkpoint of a
    step trained never needs them), tell them to stop if they would wait for more weights, and meet them at
    their closing barrier: they end with nothing in flight, without an error of their own."""
    clock, s = t.link.clock, t.inflight
    coming = [p for p in s.pending if clock.weights_for(p) <= t.done]
    if coming:
        receive_until(t, max(coming))
    if t.rank == 0 and clock.weights_for(t.cfg.steps) > t.done:   # they wait for weights that will not come
        t.link.stop_rollouts()
    why = t.link.share(t.link.dead if t.rank == 0 else None)   # every trainer: whether they are still there
    if why:
        raise RolloutDied(why)
    dist.barrier()   # generate_loop's last one (the default group: every rank)
