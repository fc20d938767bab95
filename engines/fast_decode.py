"""Fast path of the built-in engine: a static KV cache and a CUDA-graphed decode step.

engines/builtin.py's BuiltinEngine calls `FastDecoder(model).sample(...)` on CUDA for the decoder families
engines/families.py describes (qwen2, llama, qwen3, mistral, phi3, olmo2, gemma3_text, smollm3, qwen3_moe, and the
text decoder of a Qwen2-VL or Qwen2.5-VL, whose prompts' pictures come in the prefill as embeddings: the prefill,
engines/fast_prefill.py;
the step itself: engines/decode_step.py); other causal LMs take engines/generic_decode.py. Tests run this same code
on CPU (no graph, no compile) and check that it samples the portable loop's tokens and that its sampling
log-probs equal teacher-forced ones (tests/test_fast_decode.py, tests/test_architectures.py).

    dec = FastDecoder(model)                              # the policy itself: reads its parameters in place
                                                          # (q/k/v and gate/up are re-fused per call, see refresh)
    completion, alive, logprobs, done = dec.sample(ids, mask, sampling, eos_id, pad_id, generator)
    # multi-turn (engines/multiturn.py; the methods: engines/fast_turns.py): start_episodes (prefill), then
    # decode_turn / feed (an observation chunk into the same cache) per turn, then finish

What makes it fast, and why this route:
- The decode step is written by hand over the model's own modules (embedding, norms, projections, MLP,
  rotary table) with a preallocated (B, kv_heads, S, head_dim) cache per layer and a key mask over its S
  slots. Fixed shapes let one CUDA graph replay the whole step (24 layers are ~1000 small kernels: launched
  one by one they cost more than the math). transformers' StaticCache was the other route; its cache API
  differs between the transformers on the CPU (5.24) and GPU (5.17) machines.
- Decode attention is kernels/decode_attention.py (`attention="kernel"`, the default): one kernel applies the
  rotary embedding, writes the new K/V into the cache and attends, reading each sequence's cache only up to
  the current slot, which the graph passes as a device tensor. sdpa with a mask (`attention="sdpa"`) reads all
  S slots of every sequence and needs separate rotary and cache-write kernels around it, so it is slower
  (measured: docs/kernels.md, "Decode attention"); `"matmul"` is the hand-written third way. The prefill
  uses sdpa.
- Each layer's projections run as four GEMM groups that share an input (q/k/v, gate/up, o, down), over weights
  re-read before each rollout (`refresh`): fused copies (q/k/v and gate/up concatenated, LoRA merged: 4 GEMMs per
  layer per token) or, `weights="in_place"` (config decode_weights, for models whose copies do not fit), the
  policy's own storage packed with its adapters' A (8 GEMMs with LoRA on every projection). How, and why:
  engines/decode_weights.py.
- On CUDA the step is also `torch.compile`d (fuses the norms, rotary and softmax into a few kernels) before
  capture. The graph holds the parameters' addresses, and the optimizer updates them in place, so weight sync
  stays free and the graph stays valid across training steps.
- Sampling runs on the GPU with no host sync per token; whether every sequence has stopped is checked only
  every `check_every` tokens. The bookkeeping after the sampler (`advance`) is compiled too: a few fused
  kernels in the graph instead of ~14 one-element ones (docs/kernels.md, "What a W1 decode step spends").
"""
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor

import engines.decode_weights as decode_weights   # its PACK switch: read when a decoder is built (tests, tools set it)
from config_tree import UserError
from engines.base import sample_tokens
from engines.decode_step import Step, attend  # noqa: F401  (attend: the "matmul" attention, imported from here before)
from engines.decode_weights import WEIGHTS, groups, pack_layers
from engines.families import FAMILIES as SUPPORTED, arch_of, rotary_tables, text_decoder
from engines.fast_prefill import Prefill
from engines.graphs import capture
from engines.fast_turns import Turns
from engines.moe import triton_experts, use_grouped
from kernels import sample_token


def base_of(model):
    """The transformers model under a peft wrapper (the hand-written step reads its modules), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def plain_or_lora(m) -> bool:
    """A plain nn.Linear, or a peft LoRA layer over one (refresh merges its adapters)."""
    return type(m) is torch.nn.Linear or (type(getattr(m, "base_layer", None)) is torch.nn.Linear
                                          and hasattr(m, "get_delta_weight"))


def why_not(model) -> str | None:
    """Why the hand-written step cannot decode this model (then the engine takes engines/generic_decode.py), or None.
    Beyond its family (engines/families.py: arch_of), every projection must be a plain nn.Linear (or LoRA over
    one) holding plain tensors: other adapters or sharded parameters (FSDP's DTensors) would be bypassed.
    A Qwen2-VL is judged by its text decoder (families.text_decoder)."""
    model = text_decoder(base_of(model))
    arch, why = arch_of(model)
    if arch is None:
        return why
    if not all(plain_or_lora(m) for layer in model.model.layers for group in groups(layer) for m in group):
        return "a projection that is neither nn.Linear nor LoRA over one"
    if not all(type(p.data) is torch.Tensor for p in model.parameters()):
        return "parameters that are not plain tensors (sharded?)"
    return None


def supported(model) -> bool:
    """Does the hand-written step cover this model (why_not says why not)?"""
    return why_not(model) is None


class Clock:
    """FAST_DECODE_TIMES=1 prints where a rollout's time goes (setup: buffers and weights' re-read, capture, prefill,
    decode, finish; engines/builtin.py adds its padding and the copy to the host) to stderr; the synchronisations it
    needs cost a little, so it is off otherwise."""
    def __init__(self, device):
        self.on, self.device = os.environ.get("FAST_DECODE_TIMES") == "1", device
        self.t = self.now() if self.on else 0.0

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str):
        if self.on:
            t, self.t = self.t, self.now()
            print(f"fast_decode: {name} {self.t - t:.4f} s", file=sys.stderr, flush=True)


class Split(Clock):
    """Where a multi-turn rollout's time goes, by phase (tools/bench_w4.py's W4 split): lap(name) adds the time since
    the last lap to times[name], after a device synchronisation. Off (no syncs, no clock) unless the caller asks."""
    def __init__(self, device, on: bool = False):
        self.on, self.device, self.times = on, device, {}
        self.t = self.now() if on else 0.0

    def lap(self, name: str):
        if self.on:
            t, self.t = self.t, self.now()
            self.times[name] = self.times.get(name, 0.0) + self.t - t


OFF = Split(torch.device("cpu"))


# kernel variants the decode graph uses, set before a rollout (tests, tools/decode_kernel_bench.py) or from the
# environment: flash-decoding splits of the attention kernel (1: one program per (sequence, KV head)), and the
# sampler ("cdf" or "gumbel", kernels.sample_token). The defaults are the variants that were faster on a GPU
# (their timings: docs/kernels.md); the others stay selectable for comparison
ATTENTION_SPLITS = int(os.environ.get("FAST_DECODE_SPLITS", "1"))
SAMPLER = os.environ.get("FAST_DECODE_SAMPLER", "cdf")
# compile the step's bookkeeping after the sampler (`advance`: the sampled column's writes, the stop flags, the
# next position and slot) with the step: a dozen one-element kernels become a few; "0" leaves them eager
COMPILE_ADVANCE = os.environ.get("FAST_DECODE_COMPILE_ADVANCE", "1") == "1"


# a graphed prefill left-pads its prompts to a multiple of this: a new (distinct rows, padded length) shape costs a
# warm-up and a capture, so varying prompt lengths must fall into few shapes. 64 is the cache length's rounding (S):
# no extra decode state; <= 63 pad columns a row, unfelt by a launch-bound prefill (W1: docs/speed.md)
PREFILL_BUCKET = 64


def advance(tok: Tensor, logp: Tensor, done: Tensor, completion: Tensor, alive: Tensor, logprobs: Tensor,
            t: Tensor, feed: Tensor, pos: Tensor | None, slot: Tensor | None, pad_id: int, eos_id: int):
    """After sampling tok, logp (B,): write column t of completion / alive / logprobs (B, N) (rows already done
    get padding), mark rows that sampled EOS done, feed the token to the next step (B, 1), advance t and (unless
    None) pos (B, 1) and slot (1,). All in place on the device."""
    tok = torch.where(done, pad_id, tok)                                 # (B,)
    completion.index_copy_(1, t, tok[:, None])
    alive.index_copy_(1, t, ~done[:, None])
    logprobs.index_copy_(1, t, torch.where(done, 0.0, logp)[:, None])
    done |= tok == eos_id
    feed.copy_(tok[:, None])
    t += 1
    if pos is not None:
        pos += 1
        slot += 1


class FastDecoder(Step, Turns, Prefill):
    _advance = staticmethod(advance)   # the bookkeeping after sampling; __init__ compiles it with the step

    def __init__(self, model, use_graph: bool | None = None, compile: bool | None = None, check_every: int = 16,
                 attention: str = "kernel", keep_cache: bool = False, weights: str = "fused",
                 record_routes: bool = False):
        if attention not in ("matmul", "sdpa", "kernel"):
            raise ValueError(f"attention must be 'matmul', 'sdpa' or 'kernel', got {attention!r}")
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        self.model = model = text_decoder(base_of(model))   # a VLM: its text decoder (the prefill gets the pictures)
        self.attention, self.keep_cache, self.weights = attention, keep_cache, weights
        device = next(model.parameters()).device
        self.use_graph = device.type == "cuda" if use_graph is None else use_graph
        self.compile = self.use_graph if compile is None else compile
        self.check_every = check_every
        self.states: dict[tuple[int, int], dict] = {}   # (B, S) -> cache, static buffers, graph
        self.fused: list[tuple] = []                     # per layer: the (ws, b, A, B, R) of qkv, gate_up, o, down
        # per layer, per group: its Pack or None; in_place re-packs the model's storage here, once per decoder
        self.arch, why = arch_of(model)           # what each layer needs (engines/families.py)
        if self.arch is None:
            raise ValueError(f"the fast decoder does not cover this model: {why}")
        self.packs = pack_layers(model.model.layers) if weights == "in_place" and decode_weights.PACK else None
        moe = [layer.mlp for layer, s in zip(model.model.layers, self.arch.layers) if s.moe]
        x = torch.empty(1, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype)
        # the experts' GEMMs: kernels/moe_experts.py where it runs (a decode step's few pairs; engines/moe.py gives
        # a prefill's many to the grouped GEMM), else torch's grouped GEMM, else the dense form
        self.moe_grouped = bool(moe) and ("triton" if triton_experts(x, moe[0]) else
                                          use_grouped(x, moe[0].experts.gate_up_proj, moe[0].experts.down_proj))
        c = model.config
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self._step = torch.compile(self._forward, dynamic=False, fullgraph=True) if self.compile else self._forward
        if self.compile and COMPILE_ADVANCE:
            self._advance = torch.compile(advance, dynamic=False, fullgraph=True)
        self.compact_always = False   # tests: take feed's compaction route every time
        # routing replay (engines/moe.py): each token's experts per MoE layer, kept by sample() as last_routes
        self.record_routes, self.last_routes = record_routes and any(s.moe for s in self.arch.layers), None
        self.captured = False   # once warm, a re-capture needs 1 warm-up step, not 3 (measured: docs/speed.md)
        self.prefill_failed = False   # a prefill's capture failed: the eager prefill from then on (_replay_prefill)
        self.prefill_graph_eager = False   # tests on the CPU: the graphed prefill's buckets and buffers, run eagerly

    def _top_k(self) -> int:
        mlp = next(layer.mlp for layer, s in zip(self.model.model.layers, self.arch.layers) if s.moe)
        return getattr(mlp.gate, "top_k", None) or mlp.top_k

    @property
    def splits(self) -> int:       # read at each step: tools set ATTENTION_SPLITS between rollouts
        return ATTENTION_SPLITS

    def refresh(self):
        """Re-read the weights the step applies (engines/decode_weights.py: refresh) before each rollout, into the
        same buffers (captured graphs stay valid): the optimizer moved them since the last call."""
        self.fused = decode_weights.refresh(self.model.model.layers, self.fused, self.packs, self.weights,
                                            self.model.lm_head)

    def _state(self, B: int, S: int, N: int, graph_sampling: bool, device, dtype, turns: bool = False) -> dict:
        """Cache and static buffers for batch B, S cache slots and N new tokens (a graph reads and writes only
        these, so each replay sees the current token, position and sampling step); turns: the multi-turn step's."""
        key = (B, S, N, graph_sampling, turns)
        if key not in self.states:
            if len(self.states) >= 2:             # bound memory: e.g. one training and one evaluation shape
                self.states.pop(next(iter(self.states)))
            zeros = lambda *shape, dtype=dtype: torch.zeros(*shape, device=device, dtype=dtype)
            self.states[key] = {
                **self._cache(B, S, device, dtype),
                "kpos": zeros(B, S, dtype=torch.long),         # each slot's position (sliding windows)
                "tok": zeros(B, 1, dtype=torch.long),          # decode input, fed per token
                "pos": zeros(B, 1, dtype=torch.long),          # its position (real tokens before it)
                "slot": zeros(1, dtype=torch.long),            # its cache slot
                "key_ok": zeros(B, 1, 1, S, dtype=torch.bool),
                # each row's prompt slots are read from row src's copy below slot `shared` (engines/fast_prefill.py)
                "src": torch.arange(B, device=device), "shared": zeros(1, dtype=torch.long),
                # sampling state, advanced inside the graph when graph_sampling (kernels/sample.py)
                "t": zeros(1, dtype=torch.long),               # the completion column being sampled
                "inv_t": zeros(1, dtype=torch.float32), "seed": zeros(1, dtype=torch.long),
                "completion": zeros(B, N, dtype=torch.long), "alive": zeros(B, N, dtype=torch.bool),
                "logprobs": zeros(B, N, dtype=torch.float32), "done": zeros(B, dtype=torch.bool),
                # multi-turn: which rows still write this turn, and how many tokens each may still write
                "gen": zeros(B, dtype=torch.bool), "left": zeros(B, dtype=torch.long), "turns": turns,
                # routing replay: per MoE layer, each slot's experts (B, S, k); -1 where nothing was forwarded
                "routes": [zeros(B, S, self._top_k(), dtype=torch.int16) for s in self.arch.layers if s.moe]
                if getattr(self, "record_routes", False) else None,
                "graph_sampling": graph_sampling, "graph": None, "logits": None}
        return self.states[key]

    def _cache(self, B: int, S: int, device, dtype) -> dict:
        """The KV cache (k, v: per layer (B, nkv, S, D)) and the rotary tables (cos, sin: (R, S, D)) of a state."""
        zeros = lambda: torch.zeros(B, self.n_kv, S, self.head_dim, device=device, dtype=dtype)
        cos, sin = rotary_tables(self.model, self.arch.rope_kinds, S, self.head_dim, device, dtype)
        return {"k": [zeros() for _ in self.model.model.layers], "v": [zeros() for _ in self.model.model.layers],
                "cos": cos, "sin": sin}

    def release(self):
        """Free the KV caches, fused weights and graphs (~1 GB for a 0.5B model at 128 x 320): the update
        that follows a rollout gets that memory. The next call re-allocates and re-captures (tens of ms)."""
        self.states.clear()
        self.fused = []

    def _decode(self, st: dict):
        """One decode step from the static buffers: forward the last sampled token, then (graph_sampling)
        sample the next one. Everything it touches is a buffer in st, so a graph of it replays correctly."""
        st["key_ok"].index_fill_(3, st["slot"], True)                       # the new token's slot is visible
        logits = self._step(st["tok"], st["pos"], st["slot"], st["key_ok"], st["k"], st["v"], st["cos"], st["sin"],
                            st["kpos"], st["routes"], (st["src"], st["shared"]) if self.SHARES_PREFILL else None)
        if st["graph_sampling"]:
            tok, logp = self._sample(logits, st)
            self._advance(tok, logp, st["done"], st["completion"], st["alive"], st["logprobs"], st["t"], st["tok"],
                          st["pos"], st["slot"], self.pad_id, self.eos_id)
        else:
            st["pos"] += 1
            st["slot"] += 1
        return logits

    def _sample(self, logits: Tensor, st: dict) -> tuple[Tensor, Tensor]:
        """(B, V) logits -> sampled tokens (B,) and their log-probs (B,) at temperature 1 / st["inv_t"]."""
        return sample_token(logits, st["inv_t"], st["seed"], st["t"], method=SAMPLER)

    def _take(self, st: dict, tok: Tensor, logp: Tensor):
        """Write the sampled column t (rows already done get padding), then advance t. All on the device."""
        advance(tok, logp, st["done"], st["completion"], st["alive"], st["logprobs"], st["t"], st["tok"], None, None,
                self.pad_id, self.eos_id)

    @staticmethod
    def _rewind(st: dict):
        # slot, position and column 0 are valid for any prompt length and any N >= 1
        for name in ("slot", "pos", "t"):
            st[name].zero_()

    def _capture(self, st: dict):
        """Record st's decode step as a CUDA graph; if the compiled step fails, once more with the uncompiled one
        (a compiler that fails on this machine costs speed, never the run). A failure of that one too is raised
        naming both errors: the compiled step's is usually the cause, and the retry's may only echo it."""
        named = lambda e: f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        try:
            self._record(st)
        except UserError:   # bad settings (FAST_DECODE_ATTN): the uncompiled step would fail the same way
            raise
        except Exception as e:
            if self._step == self._forward and self._advance is advance:   # already uncompiled (bound methods
                raise                                                       # are equal, never identical)
            print(f"fast_decode: torch.compile failed ({named(e)}); capturing the uncompiled step", file=sys.stderr)
            self._step, self._advance = self._forward, advance
            try:
                self._record(st)
            except Exception as again:
                raise RuntimeError(f"fast_decode: capturing the decode step failed compiled ({named(e)}) and "
                                   f"uncompiled ({named(again)})") from e

    def _record(self, st: dict):
        # warm up on a side stream (compiles, creates cuBLAS handles), then record one step; replays re-run it.
        # The warm-up steps write garbage into the buffers; sample() resets them all before the real decode.
        decode = self._decode_turn if st["turns"] else self._decode
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(1 if self.captured else 3):
                self._rewind(st)
                decode(st)
        torch.cuda.current_stream().wait_stream(s)
        self._rewind(st)
        st["graph"] = torch.cuda.CUDAGraph()
        with capture(st["graph"]):
            st["logits"] = decode(st)
        self.captured = True

    # --- sampling -------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, ids: Tensor, mask: Tensor, sampling, eos_id: int, pad_id: int,
               generator: torch.Generator | None = None, embeds: Tensor | None = None,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """ids, mask (B, P) left-padded prompts on the model's device -> completion (B, C) long,
        alive (B, C) bool (1 up to and including EOS), logprobs (B, C) float, done (B,) bool.
        Prompts with pictures (engines/builtin.py): embeds (B, P, H) the prefill's input embeddings (vision.embed),
        positions (B, P) or M-RoPE's (3, B, P) (vision.positions); the decode after them is text only."""
        B, P0 = ids.shape
        N = sampling.max_new_tokens
        if self._graphs_prefill(embeds, positions):   # pad to the bucket (PREFILL_BUCKET): few prefill shapes
            lead = -P0 % PREFILL_BUCKET                # the extra left padding; hidden from every key like the rest
            ids, mask = F.pad(ids, (lead, 0), value=pad_id), F.pad(mask, (lead, 0), value=0)
        P = ids.shape[1]
        S = -(-(P + N) // 64) * 64          # round up so that prompts of similar length reuse one graph
        dtype = next(self.model.parameters()).dtype
        self.eos_id, self.pad_id = eos_id, pad_id
        # top_p = 1: the Gumbel kernel samples inside the graph (one kernel, no host work per token);
        # top_p < 1 needs a sort per token: the graph stops at the logits and torch samples eagerly
        graph_sampling = sampling.top_p >= 1.0
        clock = Clock(ids.device)
        st = self._state(B, S, N, graph_sampling, ids.device, dtype)
        self.refresh()                       # the optimizer moved the weights since the last call
        clock.lap("setup")                   # the state's buffers (when new) and the weights' re-read
        if self.use_graph and st["graph"] is None:
            self._capture(st)
        clock.lap("capture")

        logits = self._prefill(st, ids, mask, embeds, positions)
        st["slot"].fill_(P)
        st["t"].zero_()
        st["inv_t"].fill_(1.0 / sampling.temperature)
        if graph_sampling:   # the kernel's noise comes from this seed: drawn from the caller's generator, so runs
            where = generator.device if generator is not None else "cpu"   # repeat exactly; eager sampling draws
            seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=where)   # as the loop
            # a seed drawn on the GPU (train.py's generator) is copied there: reading it on the host (int) would make
            # the host wait for the prefill before it queues the decode
            if seed.device.type == "cpu":
                st["seed"].fill_(int(seed))
            else:
                st["seed"].copy_(seed)
        st["completion"].fill_(pad_id)
        st["alive"].zero_()
        st["logprobs"].zero_()
        st["done"].zero_()
        clock.lap("prefill")
        for t in range(N):
            if t:                            # forward the token sampled last (and, graph_sampling, sample the next)
                if t % self.check_every == 0 and bool(st["done"].all()):   # one host sync per check_every tokens
                    break
                if st["graph"] is not None:
                    st["graph"].replay()
                    logits = st["logits"]
                else:
                    logits = self._decode(st)
            if t == 0 and graph_sampling:    # the first token comes from the prefill's logits
                self._take(st, *self._sample(logits, st))
            elif not graph_sampling:
                self._take(st, *sample_tokens(logits, sampling, generator))
        alive = st["alive"]
        C = int(alive.any(0).sum())          # columns up to the last live token (one sync)
        clock.lap("decode")
        out = (st["completion"][:, :C], alive[:, :C], st["logprobs"][:, :C], st["done"])
        if st["routes"] is not None:   # (B, P + C, L, k): column j holds the experts of input_ids' column j
            self.last_routes = torch.stack([r[:, P - P0:P + C] for r in st["routes"]], 2).cpu()   # not the bucket's pad
        if not self.keep_cache:
            self.release()                   # the views above keep only these small buffers alive
        else:
            out = tuple(t.clone() for t in out)   # the next call overwrites kept buffers
        clock.lap("finish")
        return out
