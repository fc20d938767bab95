"""The engine interface, written as code, and the types every engine shares.

An engine turns prompts into sampled completions with their per-token sampling log-probs. The loop calls only
what `Engine` lists, so a new engine is one file in engines/ that registers a class with these methods:

    engine = get("engine", cfg.engine)(model=policy, eos_id=, pad_id=, model_path=, seed=, **engine_options)
    rollout = engine.generate(prompts, n, SamplingParams(...), generator)   # prompts: token-id lists
    engine.load_weights(named_tensors)      # in place, no disk (after each optimizer step)
    engine.sleep(); engine.wake()           # free / restore memory between stages; each returns what it did
    engine.close()
"""
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    top_k: int = 0                 # sample from the k most likely tokens only (0 = all)
    logprobs_mode: str = "raw"     # raw: log-probs of softmax(logits / T); processed: of the top-k / top-p truncated,
                                   # renormalised distribution the token was drawn from (vLLM's processed_logprobs)
    rollout: bool = False          # a training rollout: an engine's deliberate mismatch (a dtype copy, stale weights:
                                   # docs/mismatch.md) applies; evaluation samples with the current weights


@dataclass
class Rollout:
    input_ids: Tensor        # (B, P + C) prompt left-padded to P, completion right-padded to C
    attention_mask: Tensor   # (B, P + C)
    completion_mask: Tensor  # (B, C) 1 up to and including EOS
    logprobs: Tensor         # (B, C) log-prob of each sampled token under softmax(logits / temperature)
    truncated: Tensor        # (B,) bool: no EOS within max_new_tokens
    group_ids: Tensor        # (B,) index of the prompt each sample answers; samples of a prompt are adjacent
    # multi-turn (engines/multiturn.py): the completion holds model and observation tokens, completion_mask and
    # logprobs cover the model's only, attention_mask all of them; each turn's reward sits on its last model token
    turn_rewards: Tensor | None = None   # (B, C)
    # routing replay (engines/moe.py, moe.routing_replay): each token's experts per MoE layer, -1 where the engine
    # never forwarded the token (the last sampled one)
    routes: Tensor | None = None         # (B, P + C, L, k) int16


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token lists -> (ids, mask), both (B, P), padded on the left so every prompt ends at column P-1."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, P - len(s):] = torch.tensor(s)
            mask[i, P - len(s):] = 1
    return ids, mask


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Set logits outside the smallest set with cumulative probability >= top_p to -inf. (B, V)"""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum - sorted_logits.softmax(-1) >= top_p     # keep the token that crosses top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Set logits below each row's k-th largest to -inf (B, V); k = 0 keeps all (ties with the k-th stay)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[:, -1:]                                  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def sample_tokens(logits: Tensor, sampling: SamplingParams, generator=None) -> tuple[Tensor, Tensor]:
    """Logits (B, V) -> sampled tokens (B,) and their log-probs (B,): temperature, then top-k, then top-p (vLLM's
    order); the log-prob is the raw or the processed one as sampling.logprobs_mode says."""
    scaled = logits.float() / sampling.temperature                               # (B, V)
    kept = top_p_filter(top_k_filter(scaled, sampling.top_k), sampling.top_p)    # (B, V) -inf outside
    tok = torch.multinomial(torch.softmax(kept, dim=-1), 1, generator=generator).squeeze(-1)   # (B,)
    logp_all = torch.log_softmax(kept if sampling.logprobs_mode == "processed" else scaled, dim=-1)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)


def make_rollout(ids: Tensor, mask: Tensor, completion: Tensor, cmask: Tensor, logprobs: Tensor, done: Tensor,
                 n_prompts: int, n: int) -> Rollout:
    """Prompt ids/mask (B, P) + completion, cmask, logprobs (B, C) + done (B,) -> a Rollout on the CPU."""
    P = ids.shape[1]
    input_ids = torch.cat([ids, completion], 1)                                   # (B, P + C)
    attention_mask = torch.cat([mask[:, :P], cmask.long()], 1)
    return Rollout(input_ids.cpu(), attention_mask.cpu(), cmask.cpu(), logprobs.cpu(), (~done).cpu(),
                   torch.arange(n_prompts).repeat_interleave(n))




class Engine(Protocol):
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        """n samples per prompt; samples of one prompt are adjacent rows (group_ids)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]):
        """Copy the trainer's weights into the engine in place."""

    def sleep(self) -> str:
        """Free what memory the engine can between rollouts; say what was freed (or why nothing was)."""

    def wake(self) -> str:
        """Undo sleep() before the next generate()."""

    def close(self):
        """Release everything (before the process group goes)."""
