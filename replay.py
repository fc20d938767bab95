"""The replay buffer: experiences kept across steps and reused, with their own on-disk log.

    python train.py replay.enabled=true replay.capacity=1024 replay.max_uses=4 replay.max_staleness=2 \
        replay.priority=advantage                     # off by default: the loop is on-policy

What it does, in the order the loop sees it:
  add(batch)        appends the new samples (and writes them to `replay.jsonl` at once, so a crash loses
                    at most the step in flight), then evicts: samples older than `max_staleness` policy
                    versions first, then the oldest ones (FIFO) beyond `capacity`.
  minibatches(...)  yields as many mini-batches as the on-policy update would make from the new batch, each
                    drawn without replacement from the whole buffer with probability proportional to a
                    priority (uniform, |advantage| or recency). Every draw counts as one use of a sample.
  end_step()        retires samples used `max_uses` times.
Reused samples are off-policy: the loss's importance ratio uses `old_logprobs`, the log-probs of the
policy that generated them (the loop computes them at insertion whenever the replay buffer is on).

The log is JSON lines, one sample per line, readable without this code: `uid`, then every tensor field
of `Experience` as a list (the padded row; masks say what is real). `read_log` rebuilds an Experience from it.
Checkpoints hold the buffer itself (`state_dict`: safetensors-ready tensors) and the log's length, and
`load_state_dict` truncates the log to that length, so a resumed run never logs a sample twice.
"""
import json
import os
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from buffer import Experience, OnPolicyBuffer

PRIORITIES = ("uniform", "advantage", "recency")
# how each Experience field is typed when read back from JSON (everything else is float32)
_DTYPES = {"input_ids": torch.long, "attention_mask": torch.long, "group_ids": torch.long, "versions": torch.long,
           "truncated": torch.bool}


@dataclass
class ReplayConfig:
    enabled: bool = field(default=False, metadata={"help": "keep experiences across steps, reuse them (off = on-policy)"})
    capacity: int = field(default=1024, metadata={"help": "samples held; the oldest are evicted first (FIFO)"})
    max_uses: int = field(default=4, metadata={"help": "a sample is retired after this many mini-batches"})
    max_staleness: int = field(default=4, metadata={"help": "evict samples generated more than this many policy "
                                                            "versions ago"})
    priority: str = field(default="uniform", metadata={"help": "sampling weight: uniform, advantage (|A|^alpha) or "
                                                                "recency (decay^age)"})
    alpha: float = field(default=1.0, metadata={"help": "exponent on |advantage| for priority=advantage"})
    decay: float = field(default=0.5, metadata={"help": "weight per policy version of age for priority=recency"})
    log: bool = field(default=True, metadata={"help": "append every experience to <out_dir>/replay.jsonl"})


def make_buffer(cfg, run_dir: str, resume: bool = False):
    """The loop's buffer: on-policy unless replay.enabled. A fresh run starts a fresh log; a resumed one appends."""
    rc = cfg.replay
    if not rc.enabled:
        return OnPolicyBuffer()
    if rc.priority not in PRIORITIES:
        raise ValueError(f"config key 'replay.priority' must be one of {', '.join(PRIORITIES)}, got {rc.priority!r}")
    if rc.capacity < 1 or rc.max_uses < 1 or rc.max_staleness < 0 or not 0 < rc.decay <= 1:
        raise ValueError("config keys 'replay.capacity' and 'replay.max_uses' must be >= 1, "
                         "'replay.max_staleness' >= 0 and 'replay.decay' in (0, 1]")
    rank = int(os.environ.get("RANK", "0"))   # each rank keeps (and logs) the samples it generated
    name = "replay.jsonl" if rank == 0 else f"replay.rank{rank}.jsonl"
    if rc.log:
        os.makedirs(run_dir, exist_ok=True)   # rank 0 makes it too; another rank may get here first
    return ReplayBuffer(rc, os.path.join(run_dir, name) if rc.log else None, resume)


class ReplayBuffer:
    def __init__(self, cfg: ReplayConfig, log_path: str | None = None, append: bool = True):
        self.cfg, self.log_path = cfg, log_path
        self.data: Experience | None = None    # all held samples, oldest first (N rows)
        self.uid = torch.zeros(0, dtype=torch.long)    # (N,) insertion number of each sample
        self.uses = torch.zeros(0, dtype=torch.long)   # (N,) mini-batches each sample has been in
        self.next_uid = 0
        self.version = 0                       # newest policy version seen (of the newest batch)
        self.n_new = 0                         # samples in the newest batch: they set the number of mini-batches
        self._log = open(log_path, "a" if append else "w") if log_path else None

    def __len__(self) -> int:
        return 0 if self.data is None else len(self.data)

    def add(self, batch: Experience):
        n = len(batch)
        uid = torch.arange(self.next_uid, self.next_uid + n)
        self.next_uid, self.n_new = self.next_uid + n, n
        if self._log is not None:
            self._append_log(batch, uid)
        self.version = max(self.version, int(batch.versions.max()))
        self.data = batch if self.data is None else Experience.cat([self.data, batch])
        self.uid, self.uses = torch.cat([self.uid, uid]), torch.cat([self.uses, torch.zeros(n, dtype=torch.long)])
        keep = self.data.versions >= self.version - self.cfg.max_staleness               # (N,) staleness limit
        keep &= torch.arange(len(keep)).flip(0) < self.cfg.capacity    # FIFO: the newest `capacity` rows stay
        self._keep(keep)

    def priorities(self) -> Tensor:
        """(N,) unnormalised sampling weights."""
        if self.cfg.priority == "advantage":
            adv = (self.data.advantages.abs() * self.data.completion_mask).sum(-1) \
                / self.data.completion_mask.sum(-1).clamp(min=1)                        # (N,) mean |A| per sample
            return (adv + 1e-6) ** self.cfg.alpha       # + eps: zero-advantage samples stay reachable
        if self.cfg.priority == "recency":
            return self.cfg.decay ** (self.version - self.data.versions).float()
        return torch.ones(len(self))

    def minibatches(self, size: int, epochs: int, generator: torch.Generator, group_size: int = 1):
        """Yield epochs * ceil(new / size) mini-batches of up to `size` samples drawn by priority.

        `group_size` is accepted for the on-policy interface; advantages are already computed per group at
        insertion, so replayed samples need not travel with their group.
        """
        for _ in range(epochs * -(-self.n_new // size)):
            k = min(size, len(self))
            rows = torch.multinomial(self.priorities(), k, replacement=False, generator=generator)   # (k,)
            self.uses[rows] += 1
            yield self.data.select(rows)

    def end_step(self):
        self._keep(self.uses < self.cfg.max_uses)

    def _keep(self, keep: Tensor):
        self.data, self.uid, self.uses = self.data.select(keep.nonzero().squeeze(1)), self.uid[keep], self.uses[keep]

    # --- persistence ---
    def _append_log(self, batch: Experience, uid: Tensor):
        cols = {f.name: getattr(batch, f.name).tolist() for f in fields(batch) if getattr(batch, f.name) is not None}
        lines = [json.dumps({"uid": int(u), **{k: v[i] for k, v in cols.items()}}) for i, u in enumerate(uid)]
        self._log.write("\n".join(lines) + "\n")    # one write per step; fsync so a crash keeps it
        self._log.flush()
        os.fsync(self._log.fileno())

    def state_dict(self) -> tuple[dict[str, Tensor], dict]:
        """(tensors, meta): everything needed to continue exactly, tensors ready for safetensors."""
        tensors = {"uid": self.uid, "uses": self.uses}
        if self.data is not None:
            tensors.update({f"data.{f.name}": getattr(self.data, f.name).contiguous() for f in fields(self.data)
                            if getattr(self.data, f.name) is not None})
        log_bytes = self._log.tell() if self._log is not None else 0
        return tensors, {"next_uid": self.next_uid, "version": self.version, "n_new": self.n_new,
                         "log_bytes": log_bytes}

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict):
        self.uid, self.uses = tensors["uid"], tensors["uses"]
        data = {k[5:]: v for k, v in tensors.items() if k.startswith("data.")}
        self.data = Experience(**data) if data else None
        self.next_uid, self.version, self.n_new = meta["next_uid"], meta["version"], meta["n_new"]
        if self._log is not None:   # drop what was logged after the checkpoint: the resumed run logs it again
            self._log.close()
            truncate(self.log_path, meta["log_bytes"])
            self._log = open(self.log_path, "a")


def truncate(path: str, nbytes: int):
    """Cut a file back to nbytes. One metadata operation, idempotent: a crash here is undone by re-running it."""
    if os.path.exists(path) and os.path.getsize(path) > nbytes:
        os.truncate(path, nbytes)


def read_log(path: str) -> tuple[Tensor, Experience]:
    """replay.jsonl -> (uid (N,), Experience of its N samples). Rows of different widths are re-padded."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    uid = torch.tensor([r.pop("uid") for r in rows], dtype=torch.long)
    batches = [Experience(**{k: torch.tensor([v], dtype=_DTYPES.get(k, torch.float32)) for k, v in r.items()})
               for r in rows]
    return uid, Experience.cat(batches)
