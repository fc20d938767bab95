"""The rollout -> update contract (`Experience`) and the on-policy buffer.

Layout of one experience batch of B samples (the same layout TRL and verl use):
    input_ids = [ prompt, left-padded to P | completion, right-padded to C ]     (B, T = P + C)
Completion tokens run up to and including EOS; everything after is padding (completion_mask = 0).
Everything an algorithm needs travels in this dataclass; nothing else does.
"""
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor


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
    values: Tensor | None = None         # (B, C) critic values at each completion position
    advantages: Tensor | None = None     # (B, C) per-token advantages (sequence-level ones broadcast)
    returns: Tensor | None = None        # (B, C) value targets (critic algorithms)

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
        """Sub-batch of the rows in idx (B',), e.g. a mini-batch."""
        return self._map(lambda t: t[idx])

    @staticmethod
    def cat(batches: list["Experience"], pad_id: int = 0) -> "Experience":
        """Concatenate batches whose prompt/completion widths may differ (re-pads to the widest)."""
        P = max(b.prompt_len for b in batches)
        C = max(b.completion_mask.shape[1] for b in batches)
        out = {}
        for f in fields(Experience):
            parts = [getattr(b, f.name) for b in batches]
            if any(p is None for p in parts):
                continue
            if f.name in ("input_ids", "attention_mask"):
                pad = pad_id if f.name == "input_ids" else 0
                parts = [_pad_prompt_and_completion(p, b.prompt_len, P, C, pad) for p, b in zip(parts, batches)]
            elif parts[0].dim() == 2:
                parts = [torch.nn.functional.pad(p, (0, C - p.shape[1])) for p in parts]
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
