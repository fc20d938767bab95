"""mode=async's transport: the logical clock, the process groups and the messages between trainer rank 0 and the
rollout ranks. async_rl.py runs the two loops over it (the trainer ranks' Trainer, the rollout ranks'
generate_loop); docs/async.md has the layout.

Who talks to whom, over which group (Link; every rank creates every group, in the same order):
    trainers (the default backend): the trainer ranks among themselves (distributed.use_group: FSDP, sums, metrics);
    trainer_objs (gloo): trainer rank 0 hands each batch to the other trainers (`share`);
    control (gloo) and weights (the default backend: NCCL on GPU, gloo on CPU): trainer rank 0 -> the rollout ranks;
    data (gloo): the rollout ranks -> trainer rank 0.
Trainer rank 0 alone talks to the rollout ranks.
Messages, made in the same order on both sides, so nothing can deadlock:
    trainer -> rollout ranks, at start and after each step t whose weights a later step needs (`publish`):
        control (a gloo broadcast: t, version, the prompts of step t + 1 + max_staleness, on resume the sampling
        states), then the weights, one broadcast per parameter (NCCL on GPU, gloo on CPU), straight into the
        rollout rank's model: weights change only between rollouts (at rollout boundaries);
    rollout rank -> trainer rank 0, after each batch (`send`): a non-blocking gloo send of the rollout, its
        weights' version, the sampling state after it and the rank's timings; the trainer takes them in order.
Timeouts: every group has async_timeout_s (config); gloo's blocking recv waits forever whatever that is, so `receive`
waits on an irecv with it.
A dead rank is reported, not waited for: `_guard` turns a collective's error or timeout into one line naming the
rank, RolloutDied for a rollout rank (the trainers answer it with a checkpoint: async_checkpoint.died) or
UserError for a trainer rank. Trainer rank 0 remembers a rollout rank's failure (`dead`: `attempt`, `fetch`)
instead of raising mid-step and hands it to the other trainers in place of the next batch (`share`), so every
trainer stops at one point. Signals (Ctrl-C, SIGTERM) are train.Stop's on every rank: async_rl.end_rollouts ends
the rollout ranks with a stop message (`stop_rollouts`) in place of the next weights.
"""
import io
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from config import UserError


class RolloutDied(UserError):
    """A rollout rank died or hangs: the trainers end with a checkpoint."""


@dataclass
class Clock:
    """Which weights generate which step: a function of step numbers only. Iteration i of a rollout rank finishes
    step i's trajectories; with partial rollouts it also writes the first segments of steps i+1 .. i+segments-1."""
    staleness: int
    steps: int
    segments: int = 1   # iterations a trajectory may span (partial rollouts; 1 = off)

    @property
    def lag(self) -> int:
        """How many steps a rollout iteration's weights trail the trainer: the staleness left after the segments."""
        return self.staleness - (self.segments - 1)

    def weights_for(self, step: int) -> int:
        """The trainer step whose weights run iteration `step` (0: the initial weights)."""
        return max(0, step - 1 - self.lag)

    def start_weights(self, step: int) -> int:
        """The weights of step's first segment (iteration step - segments + 1): its oldest tokens' version."""
        return max(0, step - 1 - self.staleness)

    def prompts_after(self, t: int) -> list[int]:
        """The steps whose prompts the trainer chooses right after step t (t = 0: at start): the first
        max_staleness + 1 steps at start, then each step's prompts as soon as its first segment's weights exist."""
        new = range(1, self.staleness + 2) if t == 0 else [t + 1 + self.staleness]
        return [s for s in new if s <= self.steps]


def segments(cfg) -> int:
    """Iterations a trajectory may span: enough budgets to reach max_new_tokens, but at most max_staleness + 1, so
    that its oldest token is never older than max_staleness versions when it is trained (docs/async.md)."""
    B = cfg.partial.budget_tokens
    return min(-(-cfg.max_new_tokens // B), cfg.max_staleness + 1) if B > 0 else 1


class Link:
    """The process groups and the two kinds of message between the trainer and the rollout ranks."""

    def __init__(self, cfg, world: int):
        self.cfg, self.K = cfg, cfg.rollout_ranks
        self.T = world - self.K
        self.clock = Clock(cfg.max_staleness, cfg.steps, segments(cfg))
        timeout = self.timeout = timedelta(seconds=cfg.async_timeout_s)
        rollout = list(range(self.T, world))
        # every rank creates every group, in the same order (torch.distributed's rule)
        self.trainers = dist.new_group(list(range(self.T)), timeout=timeout)
        self.trainer_objs = dist.new_group(list(range(self.T)), backend="gloo", timeout=timeout)   # batches 0 -> others
        self.weights = dist.new_group([0] + rollout, timeout=timeout)   # the default backend: NCCL on GPUs
        self.control = dist.new_group([0] + rollout, backend="gloo", timeout=timeout)
        self.data = dist.new_group([0] + rollout, backend="gloo", timeout=timeout)
        self.sends = deque()            # rollout rank: sends in flight (their tensors must stay alive)
        self.names: list[str] = []      # rollout rank: the parameters in the order trainer 0 sends them
        self.dead: str | None = None    # trainer 0: why the rollout ranks can no longer be reached (RolloutDied)

    # --- trainer -> rollout ranks
    def publish(self, t: int, version: int, prompts: dict, weights, names: list | None = None,
                states: list | None = None, partials: list | None = None) -> float:
        """Trainer rank 0: control, then the weights after step t, broadcast one tensor at a time as `weights`
        yields (name, full tensor) pairs (distributed.sync_weights: under FSDP each unit is gathered among the
        trainers as it comes, so no full copy is made for the broadcast). `names` (at start): their order, which
        the rollout ranks keep. -> seconds spent waiting for the rollout ranks to be ready (the broadcast of the
        control returns when all of them have joined it)."""
        t0 = time.perf_counter()
        msg = [{"t": t, "version": version, "prompts": prompts, "names": names, "states": states,
                "partials": partials}]
        self.attempt(lambda: dist.broadcast_object_list(msg, src=0, group=self.control))
        idle = time.perf_counter() - t0
        cuda = False
        for _, p in weights:   # every pair, even after a failure: under FSDP each is a gather the other trainers are in
            self.attempt(lambda: dist.broadcast(p.detach(), src=0, group=self.weights))
            cuda = p.is_cuda
        if cuda:
            torch.cuda.synchronize()   # so that time/sync measures the transfer (NCCL returns at once), not its launch
        return idle

    def attempt(self, fn):
        """Trainer 0: one broadcast to the rollout ranks, unless they are known to be gone. A failure is remembered
        (self.dead), not raised: the caller goes on (the FSDP gathers) and every trainer stops at the next batch."""
        if self.dead is None:
            try:
                self._guard(fn, "a weight broadcast")
            except RolloutDied as e:
                self.dead = str(e)

    def stop_rollouts(self):
        """Trainer 0: the control message that ends the rollout ranks' loop, in place of the next weights."""
        self.attempt(lambda: dist.broadcast_object_list([{"stop": True}], src=0, group=self.control))

    def receive_weights(self, params: dict) -> dict:
        """Rollout rank: the control message, then each parameter in place, in the order trainer 0 sends them
        (none after a stop message)."""
        msg = [None]
        self._guard(lambda: dist.broadcast_object_list(msg, src=0, group=self.control), "the next weights",
                    who="trainer rank 0")
        if msg[0].get("stop"):
            return msg[0]
        self.names = msg[0]["names"] or self.names
        for name in self.names:
            dist.broadcast(params[name].data, src=0, group=self.weights)
        return msg[0]

    # --- rollout ranks -> trainer
    def send(self, step: int, payload: dict):
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        works = [dist.isend(size, dst=0, group=self.data, tag=2 * step),
                 dist.isend(data, dst=0, group=self.data, tag=2 * step + 1)]
        self.sends.append((works, size, data))
        while len(self.sends) > self.cfg.max_staleness + 2:   # the trainer takes them in order: the oldest is done
            self.sends.popleft()[0][1].wait()

    def flush(self):
        for works, _, _ in self.sends:
            for w in works:
                w.wait()
        self.sends.clear()

    def receive(self, step: int, src: int) -> dict:
        size = torch.zeros(1, dtype=torch.long)
        what = f"step {step}'s batch"
        # irecv + wait(timeout): gloo's blocking recv waits forever, whatever the group's timeout
        wait = lambda t, tag: dist.irecv(t, src=src, group=self.data, tag=tag).wait(self.timeout)   # noqa: E731
        self._guard(lambda: wait(size, 2 * step), what, src)
        data = torch.empty(int(size), dtype=torch.uint8)
        self._guard(lambda: wait(data, 2 * step + 1), what, src)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    def fetch(self, step: int) -> list | str:
        """Trainer 0: every rollout rank's message of `step`, in rank order, or why they cannot come (self.dead):
        that goes to the other trainers in place of the batch (share), so that every trainer stops at this point."""
        if self.dead is None:
            try:
                return [self.receive(step, self.T + j) for j in range(self.K)]
            except RolloutDied as e:
                self.dead = str(e)
        return self.dead

    def share(self, msgs: list | str | None) -> list | str:
        """Trainer rank 0's messages from the rollout ranks, to every trainer rank (one gloo broadcast)."""
        if self.T == 1:
            return msgs
        box = [msgs]
        who = "trainer rank 0" if dist.get_rank() else f"a trainer rank (1..{self.T - 1})"   # the one to blame
        self._guard(lambda: dist.broadcast_object_list(box, src=0, group=self.trainer_objs), "a batch's copy", who=who)
        return box[0]

    def _guard(self, fn, what: str, src: int | None = None, who: str | None = None):
        """A rank that died or hangs ends the run with its rank named, not a hang (collective timeouts): rollout
        rank src, any rollout rank (src None): RolloutDied, which the trainers answer with a checkpoint; or `who`
        (a trainer rank): UserError."""
        try:
            return fn()
        except RuntimeError as e:   # gloo's and NCCL's errors and timeouts
            src = self.T if src is None and self.K == 1 else src   # a broadcast to one rollout rank: that one
            name = who or (f"rollout rank {src}" if src is not None else
                           f"a rollout rank ({self.T}..{self.T + self.K - 1})")
            raise (UserError if who else RolloutDied)(
                f"{name} did not answer {what} (died, or slower than async_timeout_s={self.cfg.async_timeout_s:g}): "
                f"{str(e).strip().splitlines()[0][:200]}")
