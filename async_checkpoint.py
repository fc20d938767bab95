"""mode=async's checkpoints: the trainers' usual state (checkpoint.py) plus what is in flight, so that kill -9 +
resume continues exactly (docs/async.md, "Checkpoints").

    inflight.safetensors   the batches received for steps after the checkpoint's (`batch/<step>/<rank>/<field>`,
                           `msg/...` for per-token versions and segments), each rollout rank's sampling state
                           (`gen/<rank>`) and its open trajectories (`partial/<rank>/<step>/<field>`)
    meta.json extra.async  the prompts already chosen (pending), the received messages' other fields, the lost steps,
                           the policy versions published, and why the run stopped (None: a periodic checkpoint)

`Inflight` is that state as the trainers hold it between steps (async_rl.py fills it); `save` writes it beside
the usual checkpoint, `resume` reads it back. After the rollout ranks died, `lost_steps` names the steps whose
batches died with them (made again on resume, from newer weights) and `died` writes the checkpoint that can be kept.
"""
import json
import os
from dataclasses import dataclass, field, fields

import torch
from safetensors.torch import load_file

import checkpoint
from async_link import Clock
from config import UserError
from engines.base import Rollout

INFLIGHT = "inflight.safetensors"


@dataclass
class Inflight:
    """What the trainers hold between steps besides the policy: the batches chosen, made and not yet trained."""
    K: int                                                  # rollout ranks
    pending: dict = field(default_factory=dict)             # step -> its prompts (all of them), chosen, not yet trained
    received: dict = field(default_factory=dict)            # step -> the rollout ranks' messages, not yet trained
    states: list = None                                     # each rollout rank's sampling state after its last batch
    partials: list = None                                   # ... and its open trajectories then (partial rollouts)
    lost: set = field(default_factory=set)                  # steps whose batch died with a rollout rank (lost_steps)
    published: dict = field(default_factory=dict)           # step t -> the policy version after it (check_clock)

    def __post_init__(self):
        self.states = self.states or [None] * self.K
        self.partials = self.partials or [{}] * self.K


def lost_steps(s: Inflight, clock: Clock, t: int) -> set[int]:
    """After step t, with the rollout ranks gone: the steps a segment of which the clock gave to a rollout iteration
    on weights older than t's that had not been received (iteration i finishes step i and writes segments of
    i+1 .. i+D). Those weights no longer exist; a resumed run makes these batches from t's."""
    D = clock.segments - 1
    gone = [i for i in s.pending if i not in s.received and clock.weights_for(i) < t]
    return {j for i in gone for j in range(i, i + D + 1) if j in s.pending}


def save(s: Inflight, run, generators: dict, step: int, max_staleness: int, stopped: str | None = None):
    """The checkpoint of step (run: train.Run), with s beside it; `stopped`: why the rollout ranks are gone (the
    caller has marked their lost steps). The caller has received every batch made from weights older than step's:
    a resumed run could not make those again. -> checkpoint.save's path (trainer rank 0)."""
    learner = run.learner
    tensors = {f"gen/{j}": st for j, st in enumerate(s.states)}
    meta = {"pending": {str(p): idx for p, idx in s.pending.items()}, "received": {},
            "partial": [sorted(p) for p in s.partials],   # each rollout rank's open steps
            "lost": sorted(p for p in s.lost if p in s.pending), "stopped": stopped,
            # the versions the pending steps' weights had (check_clock): no pending step's are older than these
            "published": {str(t): v for t, v in s.published.items() if t >= step - max_staleness - 1}}
    tensors.update({f"partial/{j}/{p}/{k}": v for j, part in enumerate(s.partials) for p, st in part.items()
                    for k, v in st.items()})
    for p, msgs in s.received.items():
        meta["received"][str(p)] = [{k: v for k, v in m.items() if k != "rollout" and not torch.is_tensor(v)}
                                    for m in msgs]
        tensors.update({f"batch/{p}/{j}/{k}": v for j, m in enumerate(msgs) for k, v in m["rollout"].items()
                        if v is not None})   # optional Rollout fields (turn_rewards) stay None
        tensors.update({f"msg/{p}/{j}/{k}": v for j, m in enumerate(msgs) for k, v in m.items()
                        if torch.is_tensor(v)})   # token_versions, segments
    return checkpoint.save(run.run_dir, run.cfg, step, learner.version, learner.policy, learner.optimizer,
                           learner.schedule, run.buffer, generators, run.order, run.cursor,
                           {"start": run.start, "async": meta}, learner.critic, files={INFLIGHT: tensors})


def resume(ckpt: str | None, K: int) -> Inflight:
    """The state in flight of checkpoint ckpt (None: a new run's, empty)."""
    if not ckpt:
        return Inflight(K)
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)["extra"].get("async")
    if meta is None:
        raise UserError(f"checkpoint {ckpt} was written by a mode=sync run: resume it with mode=sync")
    tensors = load_file(os.path.join(ckpt, INFLIGHT))
    s = Inflight(K, pending={int(p): idx for p, idx in meta["pending"].items()}, lost=set(meta.get("lost", [])),
                 published={int(t): v for t, v in meta.get("published", {}).items()},
                 states=[tensors[f"gen/{j}"] for j in range(K)])
    s.partials = [{p: {k.split("/")[3]: v for k, v in tensors.items() if k.startswith(f"partial/{j}/{p}/")}
                   for p in steps} for j, steps in enumerate(meta.get("partial", [[]] * K))]
    for p, msgs in meta["received"].items():
        s.received[int(p)] = [reload(m, tensors, f"{p}/{j}") for j, m in enumerate(msgs)]
    return s


def reload(m: dict, tensors: dict, key: str) -> dict:
    """One saved rollout-rank message. A checkpoint from before partial rollouts has no per-token versions: its
    batches were written in one piece, by m["version"]."""
    rollout = {f.name: tensors.get(f"batch/{key}/{f.name}") for f in fields(Rollout)}
    cm = rollout["completion_mask"]
    return {**m, "rollout": rollout,
            "token_versions": tensors.get(f"msg/{key}/token_versions", torch.full(cm.shape, m["version"])),
            "segments": tensors.get(f"msg/{key}/segments", torch.ones(len(cm), dtype=torch.long))}


def died(s: Inflight, run, generators: dict, clock: Clock, done: int, saved: int | None, why: str,
         max_staleness: int) -> str:
    """The rollout ranks are gone: a checkpoint of the last step trained (done; unless it exists: saved, a periodic
    one or the one resumed from), with what can be kept. -> the run's last line: why, where, what was lost."""
    path = os.path.join(run.run_dir, "checkpoints", f"step_{done:06d}")
    if any(st is None for st in s.states):   # a new run that no batch reached: a fresh start is this run
        return (f"{why}; no batch had arrived and no step was trained: nothing to keep (start again in a new "
                f"out_dir, or after removing {run.run_dir})")
    if saved != done:   # kept: the whole steps received, with the states and open trajectories after them
        s.lost |= lost_steps(s, clock, done)
        save(s, run, generators, done, max_staleness, stopped=why)
    lost = sorted(p for p in s.lost if p in s.pending)
    what = f"step {lost[0]}'s batch" if len(lost) == 1 else f"the batches of steps {', '.join(map(str, lost))}"
    return (f"{why}; step {done}'s state is in {path}" + (f" ({what} lost: resumed, made again from step {done}'s "
            f"weights, docs/async.md)" if lost else " (nothing in flight was lost: resuming is exact)"))
