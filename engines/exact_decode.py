"""The built-in engine's decoder under exact_logprobs (docs/exact.md): `ExactDecoder` samples with the exact forward
of engines/exact.py, so every sampled token's log-prob is the trainer's bits. On CUDA each decode step (forward,
head, the row kernel's sampling and the bookkeeping) replays from one CUDA graph; `sample` draws one token per row
(the multi-turn loop and the prefill's first token)."""
import torch
from torch import Tensor

from engines.exact import Exact, exact_of, inv_temperature, on_gpu, token_logprobs
from engines.graphs import capture
from kernels.exact_sample import exact_row_logprobs
from models import position_ids

CHECK_EVERY = 16   # decode steps between the host's looks at whether every row is done (each look waits for the GPU)


def seed_of(generator, device) -> Tensor:
    """(1,) int64 on device: a Philox seed for `exact_row_logprobs`, drawn from generator (None: the default one)."""
    at = generator.device if generator is not None else device
    return torch.randint(0, 2 ** 62, (1,), generator=generator, device=at).to(device)


def sample(ex: Exact, logits: Tensor, temperature: float, generator) -> tuple[Tensor, Tensor]:
    """Logits (B, V) -> sampled tokens (B,) and their exact log-probs (B,) (the trainer's bits). On a GPU the row
    kernel the trainer's head calls (`completion_logprobs`); on a CPU `rowwise` log-softmax and multinomial."""
    if on_gpu(logits):
        dev = logits.device
        tok, logp, _ = exact_row_logprobs(logits, inv_temperature(temperature, dev), seed=seed_of(generator, dev),
                                          step=torch.zeros(1, dtype=torch.long, device=dev))
        return tok, logp
    lp = token_logprobs(logits, temperature)                                          # (B, V)
    tok = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(-1)             # (B,)
    return tok, lp.gather(-1, tok[:, None]).squeeze(-1)


class ExactDecoder:
    """The built-in engine's decoder under exact_logprobs: FastDecoder's calls (sample; start_episodes, feed,
    decode_turn, finish for engines/multiturn.py) over the exact forward. On CUDA the single-turn decode step
    (forward, logits, sampling and recording one token per row: `_decode`) is a CUDA graph: the same kernels as
    eager, launched at once, with no host sync between steps."""

    def __init__(self, model, use_graph: bool | None = None):
        self.ex = exact_of(model)
        # routed experts pick their tokens on the host (nonzero), which a CUDA graph cannot hold: those decode eagerly
        graphable = self._device().type == "cuda" and not any(s.moe for s in self.ex.arch.layers)
        self.use_graph = graphable if use_graph is None else use_graph
        self.states: dict[tuple[int, int], dict] = {}        # (B, S) -> cache, static inputs, graph, logits

    def _device(self):
        return self.ex.model.model.embed_tokens.weight.device

    def _dtype(self):
        return self.ex.model.model.embed_tokens.weight.dtype

    def _state(self, B: int, S: int) -> dict:
        if (B, S) not in self.states:
            if len(self.states) >= 2:             # bound memory: e.g. one training and one evaluation shape
                self.states.pop(next(iter(self.states)))
            dev = self._device()
            z = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=dev)
            st = {"cache": self.ex.new_cache(B, S, dev, self._dtype()), "graph": None,
                  "tok": z(B), "pos": z(B), "rows": torch.arange(B, device=dev), "done": z(B, dtype=torch.bool),
                  # the sampler's inputs, device tensors the graph reads: seed, step (= the output column), 1 / T
                  "seed": z(1), "step": z(1), "inv_t": z(1, dtype=torch.float32), "eos": z(1), "pad": z(1),
                  # outputs, a column per step: S >= the prompt + new tokens
                  "toks": z(B, S), "logps": z(B, S, dtype=torch.float32), "alive": z(B, S, dtype=torch.bool)}
            if self.use_graph:
                self._capture(st)
            self.states[B, S] = st
        return self.states[B, S]

    def _record(self, st: dict, logits: Tensor, generator=None):
        """Sample each row's next token from logits (B, V) and record it, its log-prob and whether the row was
        still writing at column st["step"]; device tensors only on a GPU, so the CUDA graph holds it."""
        if on_gpu(logits):
            tok, logp, _ = exact_row_logprobs(logits, st["inv_t"], seed=st["seed"], step=st["step"])
        else:
            tok, logp = sample(self.ex, logits, st["temperature"], generator)
        done, col = st["done"], st["step"]
        tok = torch.where(done, st["pad"], tok)                                        # (B,)
        st["alive"].index_copy_(1, col, (~done)[:, None])
        st["toks"].index_copy_(1, col, tok[:, None])
        st["logps"].index_copy_(1, col, torch.where(done, 0.0, logp)[:, None])
        done |= tok == st["eos"]
        st["tok"].copy_(tok)
        st["step"] += 1

    def _decode(self, st: dict, generator=None):
        """One step: forward st["tok"] (B,) at st["pos"] into the cache, then sample and record the next token."""
        logits = self.ex.logits(self.ex.forward(st["tok"], st["rows"], st["pos"], st["cache"], inplace=True))
        st["pos"] += 1
        self._record(st, logits, generator)

    def _capture(self, st: dict):
        # warm up on a side stream (cuBLAS handles, the rotary tables, the kernels' compilation), then record one
        # step; the warm-up writes slot 0 of each row, which every prefill writes again, and sample() resets the rest
        st["temperature"] = 1.0
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._decode(st)
        torch.cuda.current_stream().wait_stream(s)
        st["graph"] = torch.cuda.CUDAGraph()
        with capture(st["graph"]):
            self._decode(st)

    @torch.no_grad()
    def sample(self, ids: Tensor, mask: Tensor, sampling, eos_id: int, pad_id: int, generator=None):
        """As FastDecoder.sample: (B, P) left-padded prompts -> completion, alive, logprobs (B, C), done (B,).
        The host looks at whether every row is done every CHECK_EVERY steps only (each look waits for the GPU);
        columns past the last row's end are cut off, so the result is the same as looking at every step."""
        B, P = ids.shape
        N = sampling.max_new_tokens
        st = self._state(B, -(-(P + N) // 64) * 64)      # rounded up: prompts of similar length share a graph
        rows, cols = mask.bool().nonzero(as_tuple=True)
        pos = position_ids(mask)
        h = self.ex.forward(ids[rows, cols], rows, pos[rows, cols], st["cache"], inplace=True)   # (n, H)
        logits = self.ex.logits(h[cols == P - 1])         # left padding: each row's last prompt token, in row order
        st["pos"].copy_(mask.sum(-1))                     # (B,) each row's next position
        st["done"].zero_()
        st["step"].zero_()
        st["alive"].zero_()                               # columns this call will not reach read as not writing
        if on_gpu(logits):
            st["seed"].copy_(seed_of(generator, ids.device))
        st["inv_t"].fill_(1.0 / sampling.temperature)
        st["eos"].fill_(eos_id)
        st["pad"].fill_(pad_id)
        st["temperature"] = sampling.temperature
        self._record(st, logits, generator)
        for t in range(1, N):
            if (t - 1) % CHECK_EVERY == 0 and bool(st["done"].all()):
                break
            if st["graph"] is not None:
                st["graph"].replay()
            else:
                self._decode(st, generator)
        n = int(st["alive"][:, :N].any(0).sum())          # columns up to the step where the last row ended
        return (st["toks"][:, :n].clone(), st["alive"][:, :n].clone(), st["logps"][:, :n].clone(),
                st["done"].clone())

    # --- multi-turn (engines/multiturn.py's fast loop) ------------------------------------------------
    @torch.no_grad()
    def start_episodes(self, prompts: list[list[int]], room: list[int], N: int, sampling, eos_id: int, pad_id: int,
                       generator=None):
        B = len(prompts)
        self.dev = self._device()
        S = max(len(p) + r for p, r in zip(prompts, room)) + N + 1
        self.cache = self.ex.new_cache(B, S, self.dev, self._dtype())
        self.N, self.sampling, self.generator, self.eos_id, self.pad_id = N, sampling, generator, eos_id, pad_id
        self.pos = torch.zeros(B, dtype=torch.long, device=self.dev)                  # (B,) real tokens so far
        self.last = torch.zeros(B, self.ex.model.config.hidden_size, device=self.dev, dtype=self._dtype())
        self.feed(prompts)

    @torch.no_grad()
    def feed(self, chunks: list[list[int]], split=None):
        """Append each row's chunk ([]: the row waits) at its next positions; keep each fed row's last state."""
        lens = torch.tensor([len(c) for c in chunks], device=self.dev)
        if not int(lens.sum()):
            return
        rows = torch.repeat_interleave(torch.arange(len(chunks), device=self.dev), lens)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.dev)
        start = torch.cumsum(lens, 0) - lens                                          # (B,) offset of each chunk
        pos = self.pos[rows] + torch.arange(len(ids), device=self.dev) - start[rows]
        h = self.ex.forward(ids, rows, pos, self.cache, inplace=True)                 # (n, H)
        fed = lens > 0
        self.last[fed] = h[(start + lens - 1)[fed]]
        self.pos += lens

    @torch.no_grad()
    def decode_turn(self, writing: list[bool], left: list[int]):
        """As FastDecoder.decode_turn -> on the CPU: tokens (B, N), written (B, N), log-probs (B, N), still (B,)."""
        B, N = len(writing), self.N
        gen = torch.tensor(writing, device=self.dev)
        left = torch.tensor(left, device=self.dev)
        toks = torch.full((B, N), self.pad_id, dtype=torch.long)
        written = torch.zeros(B, N, dtype=torch.bool)
        logps = torch.zeros(B, N)
        for t in range(N):
            if not bool(gen.any()):
                break
            rows = gen.nonzero().flatten()
            tok, logp = sample(self.ex, self.ex.logits(self.last[rows]), self.sampling.temperature, self.generator)
            toks[rows.cpu(), t], written[rows.cpu(), t], logps[rows.cpu(), t] = tok.cpu(), True, logp.float().cpu()
            go = (tok != self.eos_id) & (t + 1 < left[rows])
            gen[rows] = go
            if t + 1 < N and bool(go.any()):   # the stopping token stays pending: multiturn feeds it next
                self.feed([[int(toks[b, t])] if bool(gen[b]) else [] for b in range(B)])
        return toks, written, logps, gen.cpu()

    def finish(self):
        self.cache = None
