"""Rollout engines: prompts -> n sampled completions with their per-token sampling log-probs.

Every engine offers the same four calls (the loop never asks which engine it has):
    generate(prompts: list[list[int]], n, sampling) -> Rollout   # prompts are token ids
    load_weights(named_tensors)                                  # in place, no disk
    sleep() / wake()                                             # free / restore memory between stages

`builtin` is plain torch + transformers with a KV cache; it runs on CPU and GPU. On one device it
uses the policy's own parameters, so weight sync costs nothing.
"""
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from fast_decode import FastDecoder, supported
from registry import register

# transformers renamed the KV-cache argument (`past_key_values` -> `cache`) around 5.2x; accept both
def _cache_kw(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16


@dataclass
class Rollout:
    input_ids: Tensor        # (B, P + C) prompt left-padded to P, completion right-padded to C
    attention_mask: Tensor   # (B, P + C)
    completion_mask: Tensor  # (B, C) 1 up to and including EOS
    logprobs: Tensor         # (B, C) log-prob of each sampled token under softmax(logits / temperature)
    truncated: Tensor        # (B,) bool: no EOS within max_new_tokens
    group_ids: Tensor        # (B,) index of the prompt each sample answers; samples of a prompt are adjacent


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


def position_ids(attention_mask: Tensor) -> Tensor:
    # left padding shifts where a sequence starts; positions count real tokens only
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Set logits outside the smallest set with cumulative probability >= top_p to -inf. (B, V)"""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum - sorted_logits.softmax(-1) >= top_p     # keep the token that crosses top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def logprob_mismatch(sample_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean and max |engine log-prob - trainer log-prob| over the completion tokens in mask. All (B, C).

    Take trainer_logprobs from the weights the engine sampled with (before any optimizer step on this
    batch): then any difference is numerics or a broken sync, not learning.
    """
    m = mask.bool()
    diff = (sample_logprobs.float() - trainer_logprobs.detach().float().to(sample_logprobs.device)).abs()[m]
    if diff.numel() == 0:
        return {"logprob_mismatch/mean": 0.0, "logprob_mismatch/max": 0.0}
    return {"logprob_mismatch/mean": diff.mean().item(), "logprob_mismatch/max": diff.max().item()}


def make_rollout(ids: Tensor, mask: Tensor, completion: Tensor, cmask: Tensor, logprobs: Tensor, done: Tensor,
                 n_prompts: int, n: int) -> Rollout:
    """Prompt ids/mask (B, P) + completion, cmask, logprobs (B, C) + done (B,) -> a Rollout on the CPU."""
    P = ids.shape[1]
    input_ids = torch.cat([ids, completion], 1)                                   # (B, P + C)
    attention_mask = torch.cat([mask[:, :P], cmask.long()], 1)
    return Rollout(input_ids.cpu(), attention_mask.cpu(), cmask.cpu(), logprobs.cpu(), (~done).cpu(),
                   torch.arange(n_prompts).repeat_interleave(n))


@register("engine", "builtin")
class BuiltinEngine:
    """Sampling with transformers' KV cache, batched over all prompts x n samples."""

    def __init__(self, model, eos_id: int, pad_id: int, fast: bool | None = None, **_):
        self.model = model          # the policy itself on one device: sync is free
        self.eos_id, self.pad_id = eos_id, pad_id
        # speed: static KV cache + CUDA graph (fast_decode.py); None = on CUDA for the model types it supports
        self.fast = fast
        self.decoder = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        model, device = self.model, next(self.model.parameters()).device
        was_training = model.training
        model.eval()
        ids, mask = left_pad([p for p in prompts for _ in range(n)], self.pad_id)  # (B, P)
        ids, mask = ids.to(device), mask.to(device)
        B = ids.shape[0]
        if self.fast or (self.fast is None and device.type == "cuda" and supported(model)):
            self.decoder = self.decoder or FastDecoder(model)
            completion, alive, logprobs, done = self.decoder.sample(ids, mask, sampling, self.eos_id, self.pad_id,
                                                                    generator)
            model.train(was_training)
            return make_rollout(ids, mask, completion, alive.float(), logprobs, done, len(prompts), n)
        # layers compiled for training (compile=true) would recompile at every new cache length: run them eagerly
        with torch.compiler.set_stance("force_eager"):
            return self._plain_loop(model, ids, mask, B, device, sampling, generator, len(prompts), n, was_training)

    def _plain_loop(self, model, ids, mask, B, device, sampling, generator, n_prompts, n, was_training) -> Rollout:
        """The portable loop (CPU, or models fast_decode.py does not cover): transformers' KV cache, a token a step."""
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True)
        cache_kw = _cache_kw(model)
        cache, logits = _cache_of(out), out.logits[:, -1]                        # (B, V)
        next_pos = mask.sum(-1, keepdim=True)                                    # (B, 1)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        tokens, logps, alive = [], [], []
        for _ in range(sampling.max_new_tokens):
            scaled = logits.float() / sampling.temperature                       # (B, V)
            logp_all = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(top_p_filter(scaled, sampling.top_p), dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)   # (B,)
            tok = torch.where(done, self.pad_id, tok)
            alive.append(~done)
            tokens.append(tok)
            logps.append(logp_all.gather(-1, tok[:, None]).squeeze(-1))
            done = done | (tok == self.eos_id)
            if bool(done.all()):
                break
            mask = torch.cat([mask, alive[-1].long()[:, None]], dim=1)                 # EOS itself is real
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                        use_cache=True, **{cache_kw: cache})
            cache, logits, next_pos = _cache_of(out), out.logits[:, -1], next_pos + 1
        model.train(was_training)
        cmask = torch.stack(alive, 1).float()                                    # (B, C)
        return make_rollout(ids, mask, torch.stack(tokens, 1), cmask, torch.stack(logps, 1) * cmask, done,
                            n_prompts, n)

    def load_weights(self, named_tensors):
        """Copy weights in place. A no-op for tensors that already are the engine's own parameters."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in named_tensors:
                if params[name].data_ptr() != t.data_ptr():
                    params[name].copy_(t)

    def sleep(self) -> str:
        # the KV cache lives only inside generate(); the weights are the policy's: nothing to free
        return "builtin engine: nothing to free (weights shared with the policy, KV cache freed after each generate)"

    def wake(self) -> str:
        return "builtin engine: nothing to restore"

    def close(self):
        pass
