"""The rollout -> update contract (`Experience`), the on-policy buffer and the replay buffer.

Layout of one experience batch of B samples (the same layout TRL and verl use):
    input_ids = [ prompt, left-padded to P | completion, right-padded to C ]     (B, T = P + C)
Completion tokens run up to and including EOS; everything after is padding (completion_mask = 0). In a multi-turn
episode the completion also holds the environment's observation tokens between the turns: attention_mask 1,
completion_mask 0 (in the context, out of the loss), and sample_logprobs 0 there.
A vision batch (vision.py) also holds one row of pixels per distinct picture, not per sample: `image_index` names
each sample's picture, so the n samples of a prompt share one; `select` and `cat` keep the two consistent. An
episode batch (engines/multiturn.py) may show several pictures per row (the prompt's and the observations'):
`image_index` is then (B, K), -1 after a row's last, and `image_mask` marks the image pads that show them.
Everything an algorithm needs travels in this dataclass; nothing else does.
"""
import json
import os
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from config import ReplayConfig

IMAGE_FIELDS = ("pixel_values", "image_grid_thw")   # indexed by picture, not by row (vision.py)
PICTURE_FIELDS = (*IMAGE_FIELDS, "image_index", "image_mask")   # a batch's pictures: all or none of them


@dataclass
class Experience:
    input_ids: Tensor          # (B, T) long
    attention_mask: Tensor     # (B, T) 1 on real tokens (prompt and completion), 0 on padding
    completion_mask: Tensor    # (B, C) float, 1 on completion tokens up to and including EOS
    sample_logprobs: Tensor    # (B, C) log-probs of the sampled tokens under the rollout engine
    rewards: Tensor            # (B,) float, scalar reward per sample
    group_ids: Tensor          # (B,) long, index of the prompt the sample answers (a GRPO group)
    versions: Tensor           # (B,) long, policy version that generated the sample
    truncated: Tensor          # (B,) bool, hit max_new_tokens without EOS
    old_logprobs: Tensor | None = None   # (B, C) trainer log-probs before this round of updates
    ref_logprobs: Tensor | None = None   # (B, C) reference-model log-probs
    ref_hidden: Tensor | None = None     # (B, C, Ht) its last hidden states (full_kl.py: the full-vocabulary KL)
    values: Tensor | None = None         # (B, C) critic values at each completion position
    advantages: Tensor | None = None     # (B, C) per-token advantages (sequence-level ones broadcast)
    returns: Tensor | None = None        # (B, C) value targets (critic algorithms)
    # multi-turn episodes (engines/multiturn.py): the completion holds model and observation tokens (completion_mask
    # is 1 on the model's only); each turn's reward sits on its last model token and the row sums to `rewards`.
    # Per-step (process) rewards (rollout.py: step_tensors) use it the same way, each step's on its last token
    turn_rewards: Tensor | None = None   # (B, C)
    step_mask: Tensor | None = None      # (B, C) float, 1 on each step's last token (per-step rewards only)
    # vision tasks (vision.py): the pictures of the batch, each once; their image pads sit in the prompt (episodes:
    # in observations too, where image_mask says)
    pixel_values: Tensor | None = None   # (U, N, D) float, a picture's patches (padded to the widest picture);
                                         # a LLaVA's: (U, 3, H, W), every picture at the processor's size
    image_grid_thw: Tensor | None = None # (U, 3) long, its patch grid (t, h, w): N real patches = t * h * w; None
                                         # for a family without a grid (LLaVA)
    image_index: Tensor | None = None    # (B,) long, which picture row b shows; episodes: (B, K), -1 = none
    image_mask: Tensor | None = None     # (B, T) bool, episodes: the image pads that show a picture (the sampled
                                         # ones are text); None: the prompt's image pads
    # moe.routing_replay (engines/moe.py): each token's experts per MoE layer in the rollout, -1 = none recorded
    routes: Tensor | None = None         # (B, T, L, k) int16

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.completion_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> "Experience":
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})

    def to(self, device) -> "Experience":
        return self._map(lambda t: t.to(device))

    def select(self, idx: Tensor) -> "Experience":
        """Sub-batch of the rows in idx (B',), e.g. a mini-batch; it keeps only the pictures its rows show."""
        rows = replace(self, **{f.name: getattr(self, f.name)[idx] for f in fields(self)
                                if getattr(self, f.name) is not None and f.name not in IMAGE_FIELDS})
        if self.image_index is None:
            return rows
        shown = rows.image_index >= 0                                                    # (B',) or (B', K)
        used, inverse = rows.image_index[shown].unique(return_inverse=True)              # (U',)
        rows.image_index = torch.full_like(rows.image_index, -1).masked_scatter(shown, inverse)
        for f in IMAGE_FIELDS:   # a LLaVA's table has no grid (vision.py: each family's fields)
            if getattr(self, f) is not None:
                setattr(rows, f, getattr(self, f)[used])
        return rows

    def images(self) -> dict | None:
        """The image fields as vision.embed takes them; None for a text batch."""
        return None if self.image_index is None else {k: getattr(self, k) for k in PICTURE_FIELDS}

    def no_pictures_like(self, other: "Experience") -> "Experience":
        """This batch (none of its rows shows a picture) with the empty picture fields of other's layout, so that
        `cat` can join it to batches with pictures (an episode batch where no environment sent one)."""
        episodes = other.image_mask is not None
        return replace(self, **{f: getattr(other, f)[:0] for f in IMAGE_FIELDS if getattr(other, f) is not None},
                       image_index=torch.full((len(self), 1) if episodes else (len(self),), -1, dtype=torch.long),
                       image_mask=torch.zeros_like(self.input_ids, dtype=torch.bool) if episodes else None)

    @staticmethod
    def cat(batches: list["Experience"], pad_id: int = 0) -> "Experience":
        """Concatenate batches whose prompt/completion widths may differ (re-pads to the widest)."""
        P = max(b.prompt_len for b in batches)
        C = max(b.completion_mask.shape[1] for b in batches)
        like = next((b for b in batches if b.image_index is not None), None)
        if like is not None:   # batches without pictures join with an empty table
            batches = [b if b.image_index is not None else b.no_pictures_like(like) for b in batches]
            if len({(b.image_index.dim(), b.image_mask is None) for b in batches}) > 1:
                raise ValueError("single-turn and episode batches lay their pictures out differently: not joined")
        out = {}
        for f in fields(Experience):
            parts = [getattr(b, f.name) for b in batches]
            if any(p is None for p in parts):
                continue
            if f.name in ("input_ids", "attention_mask", "image_mask"):
                pad = pad_id if f.name == "input_ids" else 0
                parts = [_pad_prompt_and_completion(p, b.prompt_len, P, C, pad) for p, b in zip(parts, batches)]
            elif f.name == "routes":        # re-padded as input_ids, with -1 (route freely)
                parts = [_pad_prompt_and_completion(p.permute(0, 2, 3, 1).flatten(0, 2), b.prompt_len, P, C, -1)
                         .view(*p.shape[:1], *p.shape[2:], P + C).permute(0, 3, 1, 2) for p, b in zip(parts, batches)]
            elif f.name == "image_index":   # into the concatenated picture table; -1 stays none
                offsets = torch.tensor([0] + [len(b.pixel_values) for b in batches]).cumsum(0)
                K = max(p.shape[1] for p in parts) if parts[0].dim() == 2 else 0
                parts = [torch.where(p >= 0, p + o, -1) for p, o in zip(parts, offsets.tolist())]
                parts = [torch.nn.functional.pad(p, (0, K - p.shape[1]), value=-1) for p in parts] if K else parts
            elif f.name == "pixel_values" and parts[0].dim() == 3:  # patch rows: pad every picture to the most
                N = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, 0, 0, N - p.shape[1])) for p in parts]
            elif parts[0].dim() >= 2 and f.name not in IMAGE_FIELDS:   # per completion token: (B, C) or (B, C, H)
                parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, C - p.shape[1])) for p in parts]
            out[f.name] = torch.cat(parts)
        return Experience(**out)


def _pad_prompt_and_completion(x: Tensor, p: int, P: int, C: int, value) -> Tensor:
    # prompt part padded on the left to P, completion part on the right to C
    prompt, completion = x[:, :p], x[:, p:]
    prompt = torch.nn.functional.pad(prompt, (P - p, 0), value=value)
    completion = torch.nn.functional.pad(completion, (0, C - completion.shape[1]), value=value)
    return torch.cat([prompt, completion], dim=1)


class OnPolicyBuffer:
    """Holds the experiences of the current step and yields shuffled mini-batches.

    `ppo_epochs` passes over the batch reuse the same samples (the PPO-style inner loop); with one
    epoch and one mini-batch the update is purely on-policy.
    """

    def __init__(self):
        self.batches: list[Experience] = []

    def add(self, batch: Experience):
        self.batches.append(batch)

    def __len__(self):
        return sum(len(b) for b in self.batches)

    def minibatches(self, size: int, epochs: int, generator: torch.Generator, group_size: int = 1):
        """Yield mini-batches of `size` samples; whole groups stay together (group_size samples each)."""
        data = Experience.cat(self.batches)
        n_groups = len(data) // group_size
        per_mb = max(1, size // group_size)
        for _ in range(epochs):
            order = torch.randperm(n_groups, generator=generator)
            for start in range(0, n_groups, per_mb):
                groups = order[start:start + per_mb]                                 # (g,)
                rows = (groups[:, None] * group_size + torch.arange(group_size)).flatten()  # (g * group_size,)
                yield data.select(rows)

    def clear(self):
        self.batches.clear()

    def end_step(self):
        """The loop calls this after each update phase: on-policy samples serve their own step only."""
        self.clear()


# ------------------------------------------------------------------------------------ replay buffer
# The replay buffer: experiences kept across steps and reused, with their own on-disk log.
#
#     python train.py replay.enabled=true replay.capacity=1024 replay.max_uses=4 replay.max_staleness=2 \
#         replay.priority=advantage                     # off by default: the loop is on-policy
#
# What it does, in the order the loop sees it:
#   add(batch)        appends the new samples (and writes them to `replay.jsonl` at once, so a crash loses
#                     at most the step in flight), then evicts: samples older than `max_staleness` policy
#                     versions first, then the oldest ones (FIFO) beyond `capacity`.
#   minibatches(...)  yields as many mini-batches as the on-policy update would make from the new batch, each
#                     drawn without replacement from the whole buffer with probability proportional to a
#                     priority (uniform, |advantage| or recency). Every draw counts as one use of a sample.
#   end_step()        retires samples used `max_uses` times.
# Reused samples are off-policy: the loss's importance ratio uses `old_logprobs`, the log-probs of the
# policy that generated them (the loop computes them at insertion whenever the replay buffer is on).
#
# The log is JSON lines, one sample per line, readable without this code: `uid`, then every tensor field
# of `Experience` as a list (the padded row; masks say what is real). `read_log` rebuilds an Experience from it.
# Checkpoints hold the buffer itself (`state_dict`: safetensors-ready tensors) and the log's length, and
# `load_state_dict` truncates the log to that length, so a resumed run never logs a sample twice.

# how each Experience field is typed when read back from JSON (everything else is float32)
_DTYPES = {"input_ids": torch.long, "attention_mask": torch.long, "group_ids": torch.long, "versions": torch.long,
           "truncated": torch.bool}


def make_buffer(cfg, run_dir: str, resume: bool = False):
    """The loop's buffer: on-policy unless replay.enabled. A fresh run starts a fresh log; a resumed one appends.
    (config_checks.validate has checked the replay options.)"""
    rc = cfg.replay
    if not rc.enabled:
        return OnPolicyBuffer()
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
        # pictures stay out of the log (it is one line per sample); a sample's picture is its prompt's
        cols = {f.name: getattr(batch, f.name).tolist() for f in fields(batch) if getattr(batch, f.name) is not None
                and f.name not in PICTURE_FIELDS}
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
