"""The built-in engine: plain torch + transformers with a KV cache, on CPU and GPU (engines/base.py: the interface).

On one device it samples with the policy's own parameters, so weight sync costs nothing. On CUDA, for
Llama-shaped models, it hands the decode to engines/fast_decode.py (static KV cache, CUDA graph); elsewhere it
runs the portable loop below, a token at a time through transformers' own cache.
"""
import inspect

import torch

from engines.base import Rollout, SamplingParams, left_pad, make_rollout, top_p_filter
from engines.fast_decode import FastDecoder, supported
from models import position_ids
from registry import register


# transformers renamed the KV-cache argument (`past_key_values` -> `cache`) around 5.2x; accept both
def _cache_kw(model) -> str:
    model = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft's forward takes **kwargs
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


@register("engine", "builtin")
class BuiltinEngine:
    """Sampling with transformers' KV cache, batched over all prompts x n samples."""

    def __init__(self, model, eos_id: int, pad_id: int, fast: bool | None = None, keep_cache: bool = False, **_):
        self.model = model          # the policy itself on one device: sync is free
        self.eos_id, self.pad_id = eos_id, pad_id
        # speed: static KV cache + CUDA graph (engines/fast_decode.py); None = on CUDA for the model types it supports
        self.fast = fast
        self.keep_cache = keep_cache   # a GPU that only generates (mode=async) keeps its cache and graphs between calls
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
            self.decoder = self.decoder or FastDecoder(model, keep_cache=self.keep_cache)
            completion, alive, logprobs, done = self.decoder.sample(ids, mask, sampling, self.eos_id, self.pad_id,
                                                                    generator)
            model.train(was_training)
            return make_rollout(ids, mask, completion, alive.float(), logprobs, done, len(prompts), n)
        # layers compiled for training (compile=true) would recompile at every new cache length: run them eagerly
        with torch.compiler.set_stance("force_eager"):
            return self._plain_loop(model, ids, mask, B, device, sampling, generator, len(prompts), n, was_training)

    def _plain_loop(self, model, ids, mask, B, device, sampling, generator, n_prompts, n, was_training) -> Rollout:
        """The portable loop (CPU, or models engines/fast_decode.py does not cover): transformers' KV cache, a token a step."""
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
        if hasattr(self.model, "peft_config"):   # LoRA: the policy itself, adapters included; the fast decoder
            return                               # merges them at each rollout (lazy merged tensors stay unmade)
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
