"""The per-episode record of a multi-turn rollout (engines/multiturn.py runs the loop that fills it): what each
episode wrote and was told, turn by turn, then the batch as a Rollout (`Episodes`) and its already-known scores in
the reward pool's handle shape (`Done`).

    ep = EpisodeBatch(B)                       # MultiTurn._episodes: one per rollout
    ep.add(b, token, logp, model=True)         # a sampled token; ep.extend(b, obs_ids, [0.0] * n, model=False)
    ep.end_turn(b, reward, calls, errors)      # an environment's step; ep.stop / ep.fail end the episode
    rollout = ep.rollout(ids, mask, pad_id, n_prompts, n, name)          # -> Episodes
    returns, info = Done(rollout.returns, rollout.info).result()        # MultiTurn.score
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.base import Rollout


@dataclass
class Episodes(Rollout):
    """A Rollout plus what the environments said: returns (B,) and the per-episode record for the metrics."""
    returns: Tensor = None       # (B,) sum of each episode's step rewards
    info: dict = None            # per-episode lists (turns, tool calls, ...) and the failures
    images: dict = None          # the pictures the episodes show (vision.episode_images); {} for none


class EpisodeBatch:
    """Per-episode record while the loop runs (Python lists: B rows of a few dozen tokens each)."""

    def __init__(self, B: int):
        self.tokens, self.logps, self.is_model = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
        self.turn_rewards = [[] for _ in range(B)]   # (index of the turn's last model token, reward)
        self.state, self.active = [None] * B, [True] * B
        self.returns, self.turns, self.tool_calls, self.tool_errors = [0.0] * B, [0] * B, [0] * B, [0] * B
        self.truncated, self.success, self.failed = [False] * B, [False] * B, [None] * B   # failed: (category, reason)
        self.turn_start = [0] * B
        self.pictures, self.fresh = [[] for _ in range(B)], [[] for _ in range(B)]   # all shown; not yet fed

    def show(self, b: int, image: bytes | None):
        """Row b's tokens now hold a picture (its image pads were just added)."""
        if image is not None:
            self.pictures[b].append(image)
            self.fresh[b].append(image)

    def take_fresh(self) -> list[list]:
        """The pictures added since the last feed, per row; the decoder feeds them now."""
        fresh, self.fresh = self.fresh, [[] for _ in self.fresh]
        return fresh

    def picture_pads(self, ids: Tensor, mask: Tensor, image_id: int) -> Tensor:
        """(B, P + C) bool: the image pads that show pictures, the prompt's and the observations'; a pad the policy
        sampled is text (not one of them), a failed episode's included (its completion_mask is zeroed, not this)."""
        C = max(1, max(len(t) for t in self.tokens))
        pads = torch.zeros(len(self.tokens), C, dtype=torch.bool)
        for b, (toks, model) in enumerate(zip(self.tokens, self.is_model)):
            pads[b, :len(toks)] = torch.tensor([t == image_id and not m for t, m in zip(toks, model)],
                                               dtype=torch.bool)
        return torch.cat([(ids == image_id) & mask.bool(), pads], 1)

    def add(self, b: int, token: int, logp: float, model: bool):
        self.tokens[b].append(token)
        self.logps[b].append(logp)
        self.is_model[b].append(model)

    def extend(self, b: int, tokens: list[int], logps: list[float], model: bool):
        self.tokens[b] += tokens
        self.logps[b] += logps
        self.is_model[b] += [model] * len(tokens)

    def end_turn(self, b: int, reward: float, calls: int, errors: int):
        self.turn_rewards[b].append((len(self.tokens[b]) - 1, reward))
        self.returns[b] += reward
        self.turns[b] += 1
        self.tool_calls[b] += calls
        self.tool_errors[b] += errors

    def stop(self, b: int, truncated: bool = False, success: bool = False):
        self.active[b], self.truncated[b], self.success[b] = False, truncated, success

    def fail(self, b: int, category: str, reason: str):
        self.active[b], self.failed[b] = False, (category, reason)

    def rollout(self, ids: Tensor, mask: Tensor, pad_id: int, n_prompts: int, n: int, name: str) -> Episodes:
        B, C = len(self.tokens), max(1, max(len(t) for t in self.tokens))
        completion = torch.full((B, C), pad_id, dtype=torch.long)
        real, cmask, logps, turn_rewards = (torch.zeros(B, C) for _ in range(4))
        for b in range(B):
            k = len(self.tokens[b])
            completion[b, :k] = torch.tensor(self.tokens[b], dtype=torch.long)
            real[b, :k] = 1
            if self.failed[b] is None:   # a failed episode stays out of the loss: the environment broke
                cmask[b, :k] = torch.tensor(self.is_model[b], dtype=torch.float)
            logps[b, :k] = torch.tensor(self.logps[b])
            for i, r in self.turn_rewards[b]:
                turn_rewards[b, i] += r
        info = {"name": name, "turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "success": self.success, "failed": self.failed,
                "model_tokens": cmask.sum(-1).tolist(), "observation_tokens": (real - cmask).sum(-1).tolist()}
        return Episodes(input_ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([mask, real.long()], 1),
                        completion_mask=cmask, logprobs=logps * cmask, truncated=torch.tensor(self.truncated),
                        group_ids=torch.arange(n_prompts).repeat_interleave(n), turn_rewards=turn_rewards,
                        returns=torch.tensor(self.returns, dtype=torch.float32), info=info)


class Done:
    """The reward pool's handle shape for rewards that are already known: result() -> (rewards (B,), info)."""

    def __init__(self, returns: Tensor, episodes: dict):
        self.returns, self.episodes = returns, episodes

    def result(self):
        e, B, name = self.episodes, len(self.returns), self.episodes["name"]
        failed = [{"reward": name, "sample": i, "category": f[0], "reason": f[1]}
                  for i, f in enumerate(e["failed"]) if f is not None]
        counts = {name: {c: sum(f["category"] == c for f in failed) for c in ("error", "timeout", "signal")}}
        mean = lambda xs: sum(xs) / max(len(xs), 1)
        metrics = {
            # success, not "return at its maximum": train.py's row takes this accuracy over its own
            "accuracy": mean(e["success"]), "episode/turns": mean(e["turns"]),
            "episode/tool_calls": mean(e["tool_calls"]), "episode/tool_errors": mean(e["tool_errors"]),
            "episode/return": mean(self.returns.tolist()), "env_fail": float(len(failed)),
            **{f"env_fail/{c}": float(k) for c, k in counts[name].items()},
            # counts: summed over ranks and rounds (their names are in distributed.SUMMED), not averaged
            "tokens/in_loss": sum(e["model_tokens"]), "tokens/out_of_loss": sum(e["observation_tokens"])}
        return self.returns, {"names": [name], "failed": failed, "failure_counts": counts, "metrics": metrics,
                              "reasons": [f"{name}[{f['sample']}]: {f['reason']}" for f in failed]}
