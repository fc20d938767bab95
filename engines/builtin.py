"""The built-in engine: plain torch + transformers with a KV cache, on CPU and GPU (engines/base.py: the interface).

On one device it samples with the policy's own parameters, so weight sync costs nothing. On CUDA it hands the
decode to engines/fast_decode.py (static KV cache, CUDA graph, a hand-written step for the families in
engines/families.py) or, for any other causal LM, to engines/generic_decode.py (the model's own forward over a
StaticCache, graphed); on the CPU it runs the portable loop below, a token at a time through transformers' own
cache (fast=True takes the fast paths there too, eagerly). Prompts with pictures (vision.py) take the fast step
where it covers the VLM's text decoder (Qwen2-VL, Qwen2.5-VL: the prefill gets the pictures' embeddings and
M-RoPE positions, the decode is text), else the portable loop.

`sample_dtype="fp8"` (engine_dtype=fp8) samples training rollouts with FP8 copies of the large decode weights, the
policy itself otherwise (engines/decode_weights.py; evaluation keeps the policy's dtype). Two deliberate
mismatches for the mismatch lab (docs/mismatch.md), both off by default: `sample_dtype` (a copy of
the policy in another dtype, e.g. a bf16 engine beside an fp32 trainer) and `lag` (the copy gets each synced set
of weights `lag` syncs late: a stale policy). They apply to training rollouts only (SamplingParams.rollout);
evaluation samples with the policy itself. The copy always runs the portable loop.
"""
import copy
import inspect
import math
import sys
from collections import deque

import torch

import distributed
import memory
from engines.base import Rollout, SamplingParams, left_pad, make_rollout, sample_tokens
from engines.exact_decode import ExactDecoder
from engines.fast_decode import Clock, FastDecoder, supported, why_not
from engines.generic_decode import GenericDecoder
from engines.moe import Recorder
from kernels.fp8 import check_device as check_fp8
from registry import register
import vision


# transformers renamed the KV-cache argument (`past_key_values` -> `cache`) around 5.2x; accept both
def _cache_kw(model) -> str:
    model = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft's forward takes **kwargs
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


# engine_keep_cache=auto keeps the decoder's state when it is at most this share of the GPU's memory. Every rollout
# allocates the state anyway; keeping it adds it to the update's peak only. So 5%: only an update already within 5%
# of the card could be pushed over by it (a run that close should set memory_budget_gib, under which auto never
# keeps, as the budget's plan counts the update without it). A 0.5B model's state is kept, a 7B LoRA's fused copies
# are not (what each weighs: docs/speed.md, "Shared-prompt prefill")
KEEP_SHARE = 0.05


def state_bytes(cfg, model, prompt_ids: list[list[int]], world: int) -> int:
    """What the fast decoder keeps between rollouts when it keeps its cache (engines/fast_decode.py: _state and
    refresh): per kept shape (the training rollout's, the largest evaluation call's) the K/V cache, L x 2 x
    (B, kv_heads, S, D), the (B, V) logits and sampling buffers in its graph's pool (counted as 2 float32 copies),
    and once the fused copies of q/k/v and gate/up (LoRA: every adapted group; memory.terms' rule)."""
    mc = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    wb = next(model.parameters()).element_size()
    s = memory.Shape.of(mc, max(map(len, prompt_ids), default=1), cfg, world, wb)
    S = math.ceil(s.tokens / 64) * 64                                       # cache slots (fast_decode.sample)
    # rows per evaluation call (rollout.score_prompts: 256 // n prompts of n samples each)
    evals = [min(256 // n * n, (cfg.eval_size or 256) * n) for n in {1, cfg.eval_k or 1}]
    rows = [s.rollout_batch, max(evals)]
    per_row = s.layers * 2 * s.kv_heads * s.head_dim * S * wb + 2 * 4 * s.vocab
    return sum(rows) * per_row + memory.terms(s, cfg, ref=False)["copies"]


def keep_cache(cfg, model, prompt_ids: list[list[int]], device) -> bool:
    """engine_keep_cache -> does the built-in engine's decoder keep its state between rollouts (config.py:
    engine_keep_cache)? auto: on a GPU, with no option that asks for memory between stages (offload*, engine_sleep) and
    no memory_budget_gib, when state_bytes is at most KEEP_SHARE of the card; the decision is printed."""
    if cfg.engine_keep_cache != "auto":
        return cfg.engine_keep_cache == "true"
    freeing = [k for k in ("offload", "offload_models", "offload_optimizer", "engine_sleep", "memory_budget_gib")
               if getattr(cfg, k)]
    if device.type != "cuda" or freeing or cfg.engine != "builtin":
        return False
    need = state_bytes(cfg, model, prompt_ids, distributed.world())
    card = torch.cuda.get_device_properties(device).total_memory
    keep = need <= KEEP_SHARE * card
    what = "kept between rollouts" if keep else f"freed after each rollout (over {KEEP_SHARE:.0%})"
    distributed.print0(f"engine_keep_cache=auto: the decoder's state is ~{need / 2**30:.1f} GiB, {need / card:.1%} of "
                       f"the GPU: {what}")
    return keep


@register("engine", "builtin")
class BuiltinEngine:
    """Sampling with transformers' KV cache, batched over all prompts x n samples."""

    def __init__(self, model, eos_id: int, pad_id: int, fast: bool | None = None, keep_cache: bool = False,
                 sample_dtype: str = "auto", lag: int = 0, decode_weights: str = "fused", exact: bool = False,
                 routing_replay: bool = False, **_):
        self.model = model          # the policy itself on one device: sync is free
        # engine_dtype=fp8: training rollouts through a fast decoder with FP8 copies of the large GEMM weights
        # (engines/decode_weights.py: the fp8 routes), on the CPU its eager twin; the policy is not copied
        self.fp8 = sample_dtype if sample_dtype in ("fp8", "fp8_all") else None
        if self.fp8:
            check_fp8(next(model.parameters()).device)
            if why_not(model):
                raise ValueError(f"engine_dtype={sample_dtype} needs a model the fast decoder covers: {why_not(model)}")
            sample_dtype = "auto"
        self.fp8_decoder = None
        dtype = next(model.parameters()).dtype if sample_dtype == "auto" else getattr(torch, sample_dtype)
        # the mismatch lab: training rollouts sample with a copy in another dtype and/or with stale weights
        self.rollout_model = model
        if dtype != next(model.parameters()).dtype or lag:
            self.rollout_model = copy.deepcopy(model).to(dtype).requires_grad_(False)
        self.lag, self.waiting = lag, deque()   # synced weights not yet in the copy, oldest first
        self.eos_id, self.pad_id = eos_id, pad_id
        # speed: static KV cache + CUDA graph (engines/fast_decode.py, generic_decode.py); None = on CUDA
        self.fast = fast
        self.keep_cache = keep_cache   # a GPU that only generates (mode=async) keeps its cache and graphs between calls
        self.decode_weights = decode_weights   # fused or in_place (engines/decode_weights.py: refresh)
        self.decoder = None
        self.exact = exact     # exact_logprobs: engines/exact.py decodes (the trainer's bits, docs/exact.md)
        # moe.routing_replay: each rollout records its tokens' experts (Rollout.routes; engines/moe.py)
        self.routing_replay = routing_replay

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        model = self.rollout_model if sampling.rollout else self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        clock = Clock(device)   # FAST_DECODE_TIMES=1: the host's work around the decoder too
        # each prompt padded once on the host, its n rows made on the device (the same tensors): padding all B rows
        # in Python was most of a rollout's host padding (docs/speed.md, "Shared-prompt prefill")
        ids, mask = left_pad(prompts, self.pad_id)                                # (G, P)
        ids, mask = ids.to(device).repeat_interleave(n, 0), mask.to(device).repeat_interleave(n, 0)   # (B, P)
        clock.lap("pad")
        B = ids.shape[0]
        images = vision.batch_images(prompts, n) or None   # pictures: the prefill encodes them (vision.py)
        plain = (model is not self.model or sampling.top_k > 0 or sampling.logprobs_mode != "raw"   # the lab's options
                 or (images is not None and not supported(model)))   # the fast step's prefill takes Qwen2-VL's
        if self.routing_replay and (self.exact or images is not None):
            raise ValueError("moe.routing_replay covers the fast and the portable decode, not exact_logprobs or "
                             "pictures: turn one of them off")
        if self.exact:
            if images is not None:
                raise ValueError("exact_logprobs does not cover prompts with pictures yet (docs/exact.md)")
            self.decoder = self.decoder or ExactDecoder(model)
            completion, alive, logprobs, done = self.decoder.sample(ids, mask, sampling, self.eos_id, self.pad_id,
                                                                    generator)
            model.train(was_training)
            return make_rollout(ids, mask, completion, alive.float(), logprobs, done, len(prompts), n)
        if self.fp8 and sampling.rollout and images is not None:
            raise ValueError(f"engine_dtype={self.fp8} does not cover prompts with pictures yet: use engine_dtype=auto")
        if self.fp8 and sampling.rollout and not plain:   # the FP8 rollout (engine_dtype=fp8)
            self.fp8_decoder = self.fp8_decoder or FastDecoder(model, keep_cache=self.keep_cache, weights=self.fp8)
            completion, alive, logprobs, done = self.fp8_decoder.sample(ids, mask, sampling, self.eos_id,
                                                                        self.pad_id, generator)
            clock.lap("decoder")
            model.train(was_training)
            out = make_rollout(ids, mask, completion, alive.float(), logprobs, done, len(prompts), n)
            clock.lap("to host")
            return out
        if not plain and (self.fast or (self.fast is None and device.type == "cuda")):
            self.decoder = self.decoder or self._decoder(model)
            # pictures: the prefill's embeddings (the encoder once per picture) and positions; the decode is text
            pictures = {} if images is None else dict(embeds=vision.embed(model, ids, images),
                                                      positions=vision.positions(model, ids, mask, images))
            try:
                # the generic decoder runs the model's own layers: compiled for training, they would recompile
                with torch.compiler.set_stance("force_eager" if type(self.decoder) is GenericDecoder else "default"):
                    completion, alive, logprobs, done = self.decoder.sample(ids, mask, sampling, self.eos_id,
                                                                            self.pad_id, generator, **pictures)
            except Exception as e:
                if type(self.decoder) is not GenericDecoder or self.fast or self.routing_replay:
                    raise
                # a model whose forward does not take a StaticCache: the portable loop, from now on
                print(f"builtin engine: the generic decoder failed ({type(e).__name__}: {str(e)[:200]}); "
                      "using the portable loop", file=sys.stderr)
                self.fast, self.decoder = False, None
                return self.generate(prompts, n, sampling, generator)
            clock.lap("decoder")
            model.train(was_training)
            out = make_rollout(ids, mask, completion, alive.float(), logprobs, done, len(prompts), n)
            out.routes = self.decoder.last_routes if self.routing_replay else None
            clock.lap("to host")
            return out
        # layers compiled for training (compile=true) would recompile at every new cache length: run them eagerly
        with torch.compiler.set_stance("force_eager"):
            return self._plain_loop(model, ids, mask, B, device, sampling, generator, len(prompts), n, was_training,
                                    images)

    def _decoder(self, model):
        """The hand-written step where engines/families.py covers the model, else the generic graphed one."""
        if supported(model):
            return FastDecoder(model, keep_cache=self.keep_cache, weights=self.decode_weights,
                               record_routes=self.routing_replay)
        if self.routing_replay:
            raise ValueError("moe.routing_replay: this model takes the generic decode path, which does not record "
                             "routes; turn moe.routing_replay off")
        return GenericDecoder(model, keep_cache=self.keep_cache)

    def _plain_loop(self, model, ids, mask, B, device, sampling, generator, n_prompts, n, was_training,
                    images=None) -> Rollout:
        """The portable loop (CPU, or models engines/fast_decode.py does not cover): transformers' KV cache, a token a step.
        The prefill places the pictures (vision.embed: once per prompt); the decode is text."""
        first = dict(input_ids=ids) if images is None else dict(inputs_embeds=vision.embed(model, ids, images))
        pos = vision.positions(model, ids, mask, images)          # (B, T); (3, B, T) for M-RoPE (vision.py)
        recorder = Recorder(model) if self.routing_replay else None     # each forward's experts (engines/moe.py)
        try:
            return self._loop(model, first, pos, ids, mask, B, device, sampling, generator, n_prompts, n,
                              was_training, recorder)
        finally:
            if recorder is not None:
                recorder.close()

    def _loop(self, model, first, pos, ids, mask, B, device, sampling, generator, n_prompts, n, was_training,
              recorder) -> Rollout:
        """_plain_loop's decode from its prefill inputs and positions pos; recorder (routing replay) sees every
        forward's experts."""
        out = model(**first, attention_mask=mask, position_ids=pos, use_cache=True)
        cache_kw = _cache_kw(model)
        cache, logits = _cache_of(out), out.logits[:, -1]                        # (B, V)
        next_pos = pos.reshape(-1, *mask.shape).amax(dim=(0, 2))[:, None] + 1  # (B, 1): one past the largest
        done = torch.zeros(B, dtype=torch.bool, device=device)
        tokens, logps, alive = [], [], []
        for _ in range(sampling.max_new_tokens):
            tok, logp = sample_tokens(logits, sampling, generator)               # (B,) each
            tok = torch.where(done, self.pad_id, tok)
            alive.append(~done)
            tokens.append(tok)
            logps.append(torch.where(done, 0.0, logp))   # a finished row's pad may lie outside top-k: -inf
            done = done | (tok == self.eos_id)
            if bool(done.all()):
                break
            mask = torch.cat([mask, alive[-1].long()[:, None]], dim=1)                 # EOS itself is real
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                        use_cache=True, **{cache_kw: cache})
            cache, logits, next_pos = _cache_of(out), out.logits[:, -1], next_pos + 1
        model.train(was_training)
        cmask = torch.stack(alive, 1).float()                                    # (B, C)
        rollout = make_rollout(ids, mask, torch.stack(tokens, 1), cmask, torch.stack(logps, 1) * cmask, done,
                               n_prompts, n)
        if recorder is not None:
            rollout.routes = recorder.routes(B, rollout.input_ids.shape[1])        # (B, P + C, L, k)
        return rollout

    def load_weights(self, named_tensors):
        """Copy weights in place. A no-op for tensors that already are the engine's own parameters."""
        if hasattr(self.model, "peft_config"):   # LoRA: the policy itself, adapters included; the fast decoder
            return                               # merges them at each rollout (lazy merged tensors stay unmade)
        if self.lag:   # a stale policy: these weights reach the copy only after `lag` more syncs
            self.waiting.append([(name, t.detach().clone()) for name, t in named_tensors])
            if len(self.waiting) <= self.lag:
                return
            named_tensors = self.waiting.popleft()
        params = dict(self.rollout_model.named_parameters())
        with torch.no_grad():
            for name, t in named_tensors:
                if params[name].data_ptr() != t.data_ptr():
                    params[name].copy_(t)

    def sleep(self) -> str:
        # the weights are the policy's; a decoder that keeps its state (engine_keep_cache) frees it here and
        # re-captures at the next rollout; otherwise the KV cache lives only inside generate(): nothing to free
        kept = [d for d in (self.decoder, self.fp8_decoder) if isinstance(d, FastDecoder) and d.states]
        for d in kept:
            d.release()
        if kept:
            return "builtin engine: freed the decoder's kept KV cache, fused weights and graph (engine_keep_cache)"
        return "builtin engine: nothing to free (weights shared with the policy, KV cache freed after each generate)"

    def wake(self) -> str:
        return "builtin engine: nothing to restore"

    def close(self):
        pass
