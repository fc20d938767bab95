"""Asynchronous RL (mode=async): rollout ranks only generate, trainer ranks only train, at the same time.

    torchrun --nproc_per_node=2 train.py mode=async algo.tis=token                  # rank 0 trains, rank 1 samples
    torchrun --nproc_per_node=3 train.py mode=async rollout_ranks=2 max_staleness=2 algo.tis=token
    torchrun --nproc_per_node=2 train.py mode=async max_staleness=0                 # the one-process run, exactly
    torchrun --nproc_per_node=3 train.py mode=async algo.tis=token                  # ranks 0, 1 train (FSDP2), 2 samples

train.py's main hands over to `main` here after config_checks.validate; the trainer runs train.py's own phases (setup,
extra_logprobs, add_to_buffer, update, finish), passed in as `phases` so that this file does not
import train.py (no import cycle); the rollout phase itself (engine, scoring, the experience record) is rollout.py's.
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
Checkpoints (every trainer takes part, as in the synchronous loop; trainer rank 0 writes): the usual state, plus
the batches in flight (`inflight.safetensors`: those generated for steps after the checkpoint's, which the
trainers drain first; their weights no longer exist), the
prompts already chosen and each rollout rank's sampling state; a resumed run hands those back to the rollout
ranks, so kill -9 + resume continues exactly.
Partial rollouts (partial.budget_tokens, docs/async.md): a trajectory may span segments(cfg) iterations, at most
budget tokens in each but its last; rollout iterations then trail by lag = max_staleness - (segments - 1) steps, so
that no token is older than max_staleness versions. The open trajectories ride with each batch and in checkpoints.
A rollout rank that dies (or SIGTERM, torchrun's teardown): every trainer stops at the next batch and they write a
checkpoint of the last step trained, marking `lost` the steps its in-flight iterations on older weights were to
write; resumed, those are made from that step's weights (fresher; the run differs from there on), the rest as
planned; the error names the rank and the checkpoint (Trainer.stop, docs/async.md "When a rollout rank dies").
Simplified: evaluation on the trainers with their own engines.
"""
import json
import os
import signal
import time
from dataclasses import fields

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tqdm import tqdm

import checkpoint
import distributed
import profiling
from async_link import Link, RolloutDied
from config import UserError
from engines.base import Rollout, SamplingParams
from models import load_model, setup_device
from rollout import accuracy, build_data, decode, evaluate, experience, make_engine, record_failures, submit_rewards
from update import update

INFLIGHT = "inflight.safetensors"


def main(cfg, resume_from: str | None, phases) -> dict:
    """Split the ranks (config_checks.validate has checked the counts) and run this rank's part."""
    rank, world = distributed.rank(), distributed.world()
    link = Link(cfg, world)
    if rank < link.T:
        distributed.use_group(link.trainers)   # shares, sums, metrics and checkpoints: the trainer ranks only
        return Trainer(cfg, link, phases).run(resume_from)
    generate_loop(cfg, link, phases, rank - link.T)
    return {}


# ------------------------------------------------------------------------------------------- rollout ranks

def generate_loop(cfg, link: Link, phases, j: int):
    """Rollout rank j: wait for the weights each iteration needs, generate its share, send it; repeat. Iteration i
    finishes step i and, with partial rollouts, writes a segment of each open later step (`advance`)."""
    torch.manual_seed(cfg.seed)
    device, dtype = setup_device(cfg)
    model, tok = load_model(cfg.model, device, dtype)
    model.requires_grad_(False)
    _, _, train_ids, _ = build_data(cfg, tok, model)
    engine = make_engine(cfg, model, tok, keep_cache=True)   # keep_cache: this GPU only generates
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1 + 1_000_003 * j)   # j = 0: the one-process stream
    params = dict(model.named_parameters())
    D = link.clock.segments - 1

    def weights() -> dict:
        msg = link.receive_weights(params)
        engine.load_weights(model.named_parameters())   # the built-in engine samples with these: a no-op there
        prompts.update(msg["prompts"])
        return msg

    prompts: dict = {}
    opened: dict[int, dict] = {}                        # step -> its trajectories so far (partial rollouts)
    msg = weights()                                     # the start: initial (or resumed) weights, first prompts
    if msg["states"] is not None:                       # resumed: the sampling stream where the checkpoint left it
        gen.set_state(msg["states"][j])
        opened = {int(s): state for s, state in msg["partials"][j].items()}
    for step in range(min([*prompts, *opened], default=cfg.steps + 1), cfg.steps + 1):
        t0 = time.perf_counter()
        while msg["t"] < link.clock.weights_for(step):  # too far ahead: wait for newer weights
            msg = weights()
        t1 = time.perf_counter()
        for s in range(step, min(step + D, cfg.steps) + 1):   # oldest first: one generate call per step
            ids = None if s in opened else [train_ids[i] for i in prompts.pop(s)[j::link.K]]
            opened[s] = advance(engine, opened.get(s), ids, s == step, msg["version"], cfg, gen, tok.pad_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        checkpoint.crash_point("generate", step)        # tests: a rollout rank that dies
        done = opened.pop(step)
        link.send(step, {"rollout": {f.name: done.get(f.name) for f in fields(Rollout)},
                         "token_versions": done["versions"], "segments": done["segments"],
                         "version": int(done["version0"]), "state": gen.get_state(), "partial": dict(opened),
                         "idle_s": t1 - t0, "generate_s": time.perf_counter() - t1})
    link.flush()
    engine.close()
    dist.barrier()   # train.finish's: every rank done before the group goes


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


# -------------------------------------------------------------------------------------------- trainer rank

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


class Trainer:
    """The trainer ranks: train.py's phases on batches that arrive from the rollout ranks. Trainer rank 0 alone
    talks to them (receives the batches, hands each trainer all of them: `Link.share`; sends prompts and weights);
    every trainer trains on its share of each batch (whole groups rank::T, as the synchronous loop's ranks do),
    with parallel=fsdp or replicate among the trainers (distributed.py, on the trainer group)."""

    def __init__(self, cfg, link: Link, phases):
        self.cfg, self.link, self.phases = cfg, link, phases
        self.pending: dict[int, list[int]] = {}     # step -> its prompts (all of them), chosen, not yet trained
        self.received: dict[int, list[dict]] = {}   # step -> the rollout ranks' messages, not yet trained
        self.states: list = [None] * link.K          # each rollout rank's sampling state after its last batch
        self.partials: list = [{}] * link.K          # ... and its open trajectories then (partial rollouts)
        self.lost: set[int] = set()                  # steps whose batch died with a rollout rank (lost_steps)
        self.published: dict[int, int] = {}          # step t -> the policy version after it (check_clock)

    def run(self, resume_from: str | None) -> dict:
        cfg, phases = self.cfg, self.phases
        self.rank = distributed.rank()               # among the trainers
        run = self.r = phases.setup(cfg, resume_from, self.rank)
        self.resume(resume_from)
        # the last step trained, and the last one whose checkpoint exists (the one resumed from counts)
        self.done = run.first_step - 1
        self.saved = self.done if resume_from else None
        signal.signal(signal.SIGTERM, self.link.on_signal)   # torchrun's teardown: stop with a checkpoint (Link)
        try:
            self.publish(self.done, resumed=bool(resume_from), start=True)   # the rollout ranks start
            bar = tqdm(range(run.first_step, cfg.steps + 1), disable=not cfg.progress, dynamic_ncols=True)
            t_run = self.t_mark = time.perf_counter()
            for step in bar:
                row = self.step(step)
                self.done = step
                bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row.get('eval/accuracy', float('nan')):.3f}",
                                stale=f"{row['staleness/mean']:.1f}")
                stop = run.learner.bad_updates >= cfg.max_bad_updates
                if stop or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                    saved, self.saved = self.save(step), step
                if stop:
                    raise UserError(f"{run.learner.bad_updates} updates in a row had a non-finite loss or gradient "
                                    f"(last at step {step}); stopped with a checkpoint in {saved}")
        except RolloutDied as e:   # every trainer raises it at the same point (receive_until): all can checkpoint
            raise UserError(self.stop(str(e))) from None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # trained and saved: nothing left to stop for
        return phases.finish(run, self.rank, time.perf_counter() - t_run)

    def stop(self, why: str) -> str:
        """The rollout ranks are gone: a checkpoint of the last step trained (unless it exists: a periodic one, or
        the one resumed from), with what can be kept. -> the run's last line: why, where, what was lost."""
        t = self.done
        path = os.path.join(self.r.run_dir, "checkpoints", f"step_{t:06d}")
        if any(s is None for s in self.states):   # a new run that no batch reached: a fresh start is this run
            return (f"{why}; no batch had arrived and no step was trained: nothing to keep (start again in a new "
                    f"out_dir, or after removing {self.r.run_dir})")
        if self.saved != t:
            self.save(t, stopped=why)
        lost = sorted(s for s in self.lost if s in self.pending)
        what = f"step {lost[0]}'s batch" if len(lost) == 1 else f"the batches of steps {', '.join(map(str, lost))}"
        return (f"{why}; step {t}'s state is in {path}" + (f" ({what} lost: resumed, made again from step {t}'s "
                f"weights, docs/async.md)" if lost else " (nothing in flight was lost: resuming is exact)"))

    def lost_steps(self, t: int) -> set[int]:
        """After step t, with the rollout ranks gone: the steps a segment of which the clock gave to a rollout
        iteration on weights older than t's that had not been received (iteration i finishes step i and writes
        segments of i+1 .. i+D). Those weights no longer exist; a resumed run makes these batches from t's."""
        clock, D = self.link.clock, self.link.clock.segments - 1
        gone = [i for i in self.pending if i not in self.received and clock.weights_for(i) < t]
        return {s for i in gone for s in range(i, i + D + 1) if s in self.pending}

    def publish(self, t: int, resumed: bool = False, start: bool = False) -> float:
        """Choose the prompts whose first segment the weights after step t will write (train.next_prompts, in
        step order, as the synchronous loop does), then send both; a resumed run hands the rollout ranks back
        their sampling states and open trajectories."""
        clock = self.link.clock
        self.published[t] = self.r.learner.version
        for s in clock.prompts_after(t):
            if s not in self.pending:   # on resume the checkpoint has them already
                self.pending[s] = self.phases.next_prompts(self.r, whole=True)   # every trainer: the whole list
        # their first segment's weights are t's; at start also those of older weights, not written yet: none after a
        # periodic checkpoint (received or open), the lost steps after a rollout rank died (made from t's: lost_steps)
        opened = set().union(*self.partials)
        todo = {s: idx for s, idx in self.pending.items() if s not in self.received and s not in opened
                and (clock.start_weights(s) <= t if start else clock.start_weights(s) == t)}
        if not start and t + 1 + clock.lag > self.cfg.steps:   # no later iteration needs them
            return 0.0
        # the full weights, whatever the trainer's engine (vLLM keeps none in this process): the policy's own, or
        # under FSDP gathered among the trainers one unit at a time (every trainer takes part in each gather);
        # their names' order once at start (under FSDP a gather of its own, once per run)
        policy = self.r.learner.policy
        names = [n for n, _ in distributed.sync_weights(policy)] if start else None
        pairs = distributed.sync_weights(policy)
        if self.rank > 0:
            for _ in pairs:   # the gathers only: trainer rank 0 alone talks to the rollout ranks
                pass
            return 0.0
        return self.link.publish(t, self.r.learner.version, todo, pairs, names,
                                 *((self.states, self.partials) if resumed else ()))

    def receive_until(self, step: int):
        """Every rollout rank's batches up to `step`, in step order (the order they are sent in)."""
        while step not in self.received:
            s = min(s for s in self.pending if s not in self.received)
            msgs = self.link.share(self.link.fetch(s) if self.rank == 0 else None)
            if isinstance(msgs, str):   # trainer 0's word that the rollout ranks are gone: every trainer stops here
                raise RolloutDied(msgs)
            # only now, all K messages of step s in hand: the states stay those after the last whole step received
            self.states = [m.pop("state") for m in msgs]
            self.partials = [m.pop("partial") for m in msgs]
            self.received[s] = msgs

    def take(self, step: int) -> list[dict]:
        self.receive_until(step)
        return self.received.pop(step)

    def step(self, step: int) -> dict:
        """One training step on the batch the clock assigns to it; -> its metrics row."""
        cfg, run, phases = self.cfg, self.r, self.phases
        learner, times = run.learner, {}
        with profiling.phase(times, "wait"):             # trainer idle: this step's batch is still being generated
            msgs = self.take(step)
        idx, K, T, n = self.pending.pop(step), self.link.K, self.link.T, cfg.samples_per_prompt
        whole = merge([Rollout(**m["rollout"]) for m in msgs], run.tok.pad_token_id)
        C = whole.completion_mask.shape[1]
        versions = torch.cat([torch.full((len(m["rollout"]["input_ids"]),), m["version"]) for m in msgs])   # (B,)
        tokens_v = torch.cat([torch.nn.functional.pad(m["token_versions"], (0, C - m["token_versions"].shape[1]))
                              for m in msgs])                                        # (B, C) each token's weights
        segs = torch.cat([m["segments"] for m in msgs])                              # (B,)
        self.check_clock(step, versions, tokens_v, whole.completion_mask)
        order = [i for j in range(K) for i in idx[j::K]]   # the prompts in the rows' order
        # this trainer's share: whole groups rank, rank + T, ... (distributed.share over the trainers)
        rows = (torch.arange(self.rank, len(order), T)[:, None] * n + torch.arange(n)).view(-1)   # (B / T,)
        rollout, versions = take_rows(whole, rows, n), versions[rows]
        order = order[self.rank::T]
        with profiling.phase(times, "logprobs"):         # scoring in the reward workers, overlapped with ...
            samples = [run.train_set[i] for i in order for _ in range(cfg.samples_per_prompt)]
            handle = submit_rewards(run.pool, samples, decode(run.tok, rollout), rollout, run.tok)
            extra = phases.extra_logprobs(run, rollout)  # ... the proximal (and reference) log-probs
        with profiling.phase(times, "reward"):
            rewards, reward_info = handle.result()
        failures = record_failures(run.run_dir, step, reward_info)
        if failures:
            tqdm.write(failures)
        batch = experience(rollout, rewards, learner.version, extra, reward_info)   # (per-step rewards)
        batch.versions = versions
        staleness = (learner.version - versions).float()   # (B,) a sample is as old as its oldest token
        batch.advantages = learner.algo.advantages(batch, cfg.algo, sum_over=distributed.all_sum)
        # every token's version (the whole batch's: metrics as one trainer would log them); old_segments=mask masks
        partial = self.check_tokens(step, tokens_v, segs, whole.completion_mask, batch, rows)
        with profiling.phase(times, "update"):
            kept = phases.add_to_buffer(run, batch)
            stats = update(learner, run.buffer, run.generator, step, len(samples))
        t0 = time.perf_counter()
        idle = self.publish(step)                        # the new weights (and next prompts) to the rollout ranks
        times["time/sync"] = time.perf_counter() - t0 - idle
        times["time/trainer_idle"] = times.pop("time/wait") + idle
        row = {"step": step, "reward": rewards.mean().item(), **accuracy(reward_info, cfg), **stats, **kept,
               "completion_len": rollout.completion_mask.sum(-1).mean().item(), **partial,
               "truncated_frac": batch.truncated.float().mean().item(), "lr": learner.schedule.get_last_lr()[0],
               **reward_info["metrics"], "staleness/mean": staleness.mean().item(),
               "staleness/max": staleness.max().item(), **times,
               "time/rollout": max(m["generate_s"] for m in msgs),        # on the rollout ranks, overlapped
               "time/rollout_idle": max(m["idle_s"] for m in msgs)}       # rollout ranks waiting for weights
        now = time.perf_counter()   # the period between two rows: what throughput is made of (log and eval too)
        row["time/step"], self.t_mark = now - self.t_mark, now
        row["tokens_per_s"] = int(batch.attention_mask.sum()) / row["time/step"]
        if step in self.lost:   # made after a resume from newer weights than the clock planned (lost_steps)
            row["staleness/regenerated"] = 1.0
        row = distributed.reduce_metrics(row)            # over the trainers: means (tokens_per_s: the sum)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            # the engine's weights: FSDP's full copy (gathered), vLLM's; the built-in engine over the policy: a no-op
            run.engine.load_weights(distributed.sync_weights(learner.policy))
            row.update(evaluate(cfg, run.engine, run.tok, run.eval_set, run.eval_ids, run.pool, run.specs,
                                run.eval_gen()))
        phases.log(run, row)
        return row

    def check_clock(self, step: int, first: torch.Tensor, versions: torch.Tensor, mask: torch.Tensor):
        """The clock on the step's whole batch, in policy versions (a skipped update makes none: self.published):
        each trajectory's first segment (first (B,)) came from the weights after start_weights(step), every
        completion token (versions, mask (B, C)) from those of an iteration that writes the step (weights_for(i),
        i = step - D .. step). A lost step's batch, made again after a resume (lost_steps), may be fresher, never
        staler: that is the only exception. Skipped where the history is not known (older checkpoints)."""
        clock, v = self.link.clock, self.published
        iters = [clock.weights_for(i) for i in range(max(1, step - clock.segments + 1), step + 1)]
        if any(t not in v for t in [clock.start_weights(step), *iters]):
            return
        start, tokens = v[clock.start_weights(step)], versions[mask > 0]
        if step in self.lost:
            ok = bool((first >= start).all() and (tokens >= start).all())
        else:
            ok = bool((first == start).all() and torch.isin(tokens, torch.tensor([v[t] for t in iters])).all())
        if not ok:   # the clock makes this impossible; a bug must not train silently
            raise RuntimeError(f"step {step}: samples of versions {sorted(set(first.tolist()))}, tokens of "
                               f"{sorted(set(tokens.tolist()))}: not the weights the clock assigns")

    def check_tokens(self, step: int, versions: torch.Tensor, segs: torch.Tensor, mask: torch.Tensor, batch,
                     rows: torch.Tensor | None = None) -> dict:
        """The staleness bound on every completion token of the step's whole batch (versions (B, C): its weights'
        version, from the rollout rank; mask (B, C): the completion mask), then, with partial rollouts (segs (B,):
        each trajectory's segments), partial.old_segments=mask: only each trajectory's newest segment stays in the
        loss (m_t = 1[v_t = max_t' v_t']) of this trainer's batch, rows `rows` of the whole (None: all of it);
        the advantages are already computed. -> the partial-rollout metrics of the whole batch: every trainer
        logs the same numbers, so their mean over trainers is what one trainer would log (token means included)."""
        cfg = self.cfg
        tokens = mask > 0                                                          # (B, C)
        old = int((self.r.learner.version - versions)[tokens].max()) if tokens.any() else 0
        if old > cfg.max_staleness:   # the clock makes this impossible; a bug must not train silently
            raise RuntimeError(f"step {step}: a token is {old} versions old (max_staleness={cfg.max_staleness})")
        if not cfg.partial.budget_tokens:
            return {}
        newest = versions.masked_fill(~tokens, -1).max(-1, keepdim=True).values   # (B, 1)
        n = tokens.sum().clamp(min=1)
        segs = segs.float()
        out = {"partial/frac": (segs > 1).float().mean().item(), "partial/segments": segs.mean().item(),
               "staleness/token_mean": ((self.r.learner.version - versions) * tokens).sum().item() / n.item()}
        if cfg.partial.old_segments == "mask":
            keep = tokens & (versions == newest)                                   # (B, C)
            out["partial/masked_frac"] = 1 - keep.sum().item() / n.item()
            keep = keep if rows is None else keep[rows]                            # (b, C) this trainer's rows
            batch.completion_mask = batch.completion_mask * keep.to(batch.completion_mask.dtype)
        return out

    # --- checkpoints: the batches in flight travel with the trainer's state
    def save(self, step: int, stopped: str | None = None) -> str | None:
        """The checkpoint of step; `stopped`: the rollout ranks are gone (why), what they had in flight too."""
        run, learner, clock = self.r, self.r.learner, self.link.clock
        if stopped is None:
            # the batches generated from weights older than this step's: a resumed run could not make them again
            in_flight = [s for s in self.pending if clock.weights_for(s) < step]
            if in_flight:
                self.receive_until(max(in_flight))
        else:   # they cannot come: kept are the whole steps received, with the states and open trajectories after them
            self.lost |= self.lost_steps(step)
        tensors = {f"gen/{j}": s for j, s in enumerate(self.states)}
        meta = {"pending": {str(s): idx for s, idx in self.pending.items()}, "received": {},
                "partial": [sorted(p) for p in self.partials],   # each rollout rank's open steps
                "lost": sorted(s for s in self.lost if s in self.pending), "stopped": stopped,
                # the versions the pending steps' weights had (check_clock): no pending step's are older than these
                "published": {str(t): v for t, v in self.published.items() if t >= step - self.cfg.max_staleness - 1}}
        tensors.update({f"partial/{j}/{s}/{k}": v for j, p in enumerate(self.partials) for s, st in p.items()
                        for k, v in st.items()})
        for s, msgs in self.received.items():
            meta["received"][str(s)] = [{k: v for k, v in m.items() if k != "rollout" and not torch.is_tensor(v)}
                                        for m in msgs]
            tensors.update({f"batch/{s}/{j}/{k}": v for j, m in enumerate(msgs) for k, v in m["rollout"].items()
                            if v is not None})   # optional Rollout fields (turn_rewards) stay None
            tensors.update({f"msg/{s}/{j}/{k}": v for j, m in enumerate(msgs) for k, v in m.items()
                            if torch.is_tensor(v)})   # token_versions, segments
        return checkpoint.save(run.run_dir, run.cfg, step, learner.version, learner.policy, learner.optimizer,
                               learner.schedule, run.buffer, self.phases.generators(run), run.order, run.cursor,
                               {"start": run.start, "async": meta}, learner.critic, files={INFLIGHT: tensors})

    def resume(self, ckpt: str | None):
        if not ckpt:
            return
        with open(os.path.join(ckpt, "meta.json")) as f:
            meta = json.load(f)["extra"].get("async")
        if meta is None:
            raise UserError(f"checkpoint {ckpt} was written by a mode=sync run: resume it with mode=sync")
        tensors = load_file(os.path.join(ckpt, INFLIGHT))
        self.pending = {int(s): idx for s, idx in meta["pending"].items()}
        self.lost = set(meta.get("lost", []))
        self.published = {int(t): v for t, v in meta.get("published", {}).items()}
        self.states = [tensors[f"gen/{j}"] for j in range(self.link.K)]
        self.partials = [{s: {k.split("/")[3]: v for k, v in tensors.items() if k.startswith(f"partial/{j}/{s}/")}
                          for s in steps} for j, steps in enumerate(meta.get("partial", [[]] * self.link.K))]
        for s, msgs in meta["received"].items():
            self.received[int(s)] = [self.reload(m, tensors, f"{s}/{j}") for j, m in enumerate(msgs)]

    @staticmethod
    def reload(m: dict, tensors: dict, key: str) -> dict:
        """One saved rollout-rank message. A checkpoint from before partial rollouts has no per-token versions:
        its batches were written in one piece, by m["version"]."""
        rollout = {f.name: tensors.get(f"batch/{key}/{f.name}") for f in fields(Rollout)}
        cm = rollout["completion_mask"]
        return {**m, "rollout": rollout,
                "token_versions": tensors.get(f"msg/{key}/token_versions", torch.full(cm.shape, m["version"])),
                "segments": tensors.get(f"msg/{key}/segments", torch.ones(len(cm), dtype=torch.long))}
