"""The multi-turn half of the fast decoder (engines/fast_decode.py: FastDecoder takes these methods as a mixin):
episodes continue in the same static cache, turn after turn, with no re-prefill of the history. engines/multiturn.py
drives the turns:

    dec.start_episodes(prompts, room, N, sampling, eos_id, pad_id, generator)   # allocate the cache, prefill
    toks, written, logps, still = dec.decode_turn(writing, left)               # one assistant turn, on the device
    dec.feed(chunks)                     # each row's end-of-turn token and observation, into the same cache
    dec.finish()                                                                # free the cache

The turn's step (`_decode_turn`) is the single-turn step with rows that wait: their slot stays masked and their
position held, so the CUDA graph that FastDecoder._capture records for it replays for every turn. What the mixin
reads of its host class: the model, the static state (`_state`, with turns=True), `refresh`, `_capture`,
`_forward` / `_step` / `_sample`, `check_every`, `keep_cache`, `compact_always`, `release` and `record_routes`.
"""
import torch
from torch import Tensor

from engines.base import sample_tokens


class Turns:
    """FastDecoder's multi-turn calls (a mixin: the state they touch is FastDecoder's)."""

    @torch.no_grad()
    def start_episodes(self, prompts: list[list[int]], room: list[int], N: int, sampling, eos_id: int, pad_id: int,
                       generator: torch.Generator | None = None):
        """Allocate the cache for B episodes (prompt b plus room[b] more tokens each, N per turn at most) and
        prefill the prompts. Then decode_turn() and feed() alternate; finish() frees the cache."""
        B, device = len(prompts), next(self.model.parameters()).device
        if self.record_routes:
            raise ValueError("moe.routing_replay does not cover multi-turn episodes yet (env.name): turn it off")
        R = max(len(p) + r for p, r in zip(prompts, room))
        # + N: a turn decodes at shared slots after the longest row; + 1: the spare slot padding writes to
        S = -(-(R + N + 1) // 64) * 64
        self.eos_id, self.pad_id, self.N, self.generator = eos_id, pad_id, N, generator
        self.sampling, graph_sampling = sampling, sampling.top_p >= 1.0     # as in sample()
        st = self.turns = self._state(B, S, N, graph_sampling, device, next(self.model.parameters()).dtype, turns=True)
        self.refresh()
        if self.use_graph and st["graph"] is None:
            self._capture(st)
        st["key_ok"].zero_()
        st["pos"].zero_()
        st["inv_t"].fill_(1.0 / sampling.temperature)
        self.slot = 0          # the next free cache slot, shared by all rows: known on the host, so no sync per turn
        self.feed(prompts)

    def _compact(self, st: dict):
        """Move each row's visible slots to the front, in order (attention does not care where a key sits): then
        a row's slot is its position, and the holes its waits left (pad columns) are free again."""
        ok = st["key_ok"][:, 0, 0]                                                  # (B, S)
        order = torch.sort((~ok).to(torch.uint8), dim=1, stable=True).indices      # (B, S) visible slots first
        at = order[:, None, :, None]
        for cache in st["k"] + st["v"]:                                             # (B, nkv, S, D) each
            cache.copy_(cache.gather(2, at.expand_as(cache)))
        ok.copy_(ok.gather(1, order))
        st["kpos"].copy_(st["kpos"].gather(1, order))

    @torch.no_grad()
    def feed(self, chunks: list[list[int]], split=None):
        """Append each row's chunk of tokens ([] for a row that waits) after its last real token, all rows in one
        forward (no re-prefill of the history); keeps the logits after each row's last token for the next turn.
        The chunks go at shared slots after every row's last one (slot and position differ: attention does not
        care where a key sits, rotary takes the position); the cache is compacted only when the next turn would
        not fit (measured: docs/benchmarks.md, W4)."""
        st, lap = self.turns, (split.lap if split is not None else lambda name: None)
        B, S, device = st["key_ok"].shape[0], st["key_ok"].shape[-1], st["pos"].device
        W = max(1, max(len(c) for c in chunks))
        if self.slot + W + self.N + 1 > S or self.compact_always:
            self._compact(st)
            self.slot = int(st["pos"].max())                                        # one sync, only here
            lap("compaction")
        # left-padded: the last column is every fed row's last token; a pad query sees only its own slot
        ids = torch.tensor([[self.pad_id] * (W - len(c)) + c for c in chunks], dtype=torch.long).to(device)  # (B, W)
        n = torch.tensor([[len(c)] for c in chunks], dtype=torch.long).to(device)  # (B, 1)
        col = torch.arange(W, device=device)                                        # (W,)
        real = col >= W - n                                                         # (B, W)
        start = st["pos"].clone()                                                   # (B, 1) real tokens so far
        pos = start + (real.cumsum(-1) - 1).clamp(min=0)                            # (B, W)
        slots = (self.slot + col).expand(B, W)                                      # (B, W)
        at = torch.arange(S, device=device)
        first = self.slot + W - n                                                   # (B, 1) first new real slot
        chunk = (at >= first[:, :, None]) & (at <= slots[:, :, None]) & real[:, :, None]   # (B, W, S) causal
        key_ok = st["key_ok"][:, 0] | chunk | (at == slots[:, :, None])           # (B, W, S)
        self.logits = self._forward(ids, pos, slots, key_ok[:, None], st["k"], st["v"], st["cos"], st["sin"],
                                    st["kpos"])
        st["key_ok"][:, 0, 0] |= (at >= first) & (at < self.slot + W)
        st["pos"] += n
        self.slot += W
        lap("feed")

    def _decode_turn(self, st: dict):
        """The multi-turn decode step: forward each writing row's last token; rows that wait forward padding
        that stays invisible and do not advance their position. Then (graph_sampling) sample the next token."""
        gen = st["gen"]
        st["key_ok"].index_copy_(3, st["slot"], gen.view(-1, 1, 1, 1))
        logits = self._step(st["tok"], st["pos"], st["slot"], st["key_ok"], st["k"], st["v"], st["cos"], st["sin"],
                            st["kpos"])
        st["pos"] += gen[:, None]
        st["slot"] += 1
        if st["graph_sampling"]:
            self._take_turn(st, *self._sample(logits, st))
        return logits

    def _take_turn(self, st: dict, tok: Tensor, logp: Tensor):
        """Write column t for the writing rows; a row stops at its end-of-turn token or its budget. On the device."""
        gen = st["gen"]
        tok = torch.where(gen, tok, self.pad_id)                                    # (B,)
        st["completion"].index_copy_(1, st["t"], tok[:, None])
        st["alive"].index_copy_(1, st["t"], gen[:, None])
        st["logprobs"].index_copy_(1, st["t"], torch.where(gen, logp, 0.0)[:, None])
        gen &= (tok != self.eos_id) & (st["t"] + 1 < st["left"])
        st["tok"].copy_(tok[:, None])
        st["t"] += 1

    @torch.no_grad()
    def decode_turn(self, writing: list[bool], left: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One assistant turn for the rows that write (left[b]: tokens row b may still write). -> on the CPU:
        tokens (B, N), written (B, N) bool, their log-probs (B, N), still (B,) bool: rows stopped by N alone."""
        st, N, sampling = self.turns, self.N, self.sampling
        first, S = self.slot, st["key_ok"].shape[-1]
        if first + N >= S:
            raise RuntimeError(f"fast_decode: the turn would pass the cache's {S} slots (at {first} + {N})")
        st["slot"].fill_(first)                                  # shared slots after every row's last token
        st["gen"].copy_(torch.tensor(writing))
        st["left"].copy_(torch.tensor(left))
        st["t"].zero_()
        if st["graph_sampling"]:                                 # the kernel's noise: new for every turn
            where = self.generator.device if self.generator is not None else "cpu"
            st["seed"].fill_(int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator, device=where)))
        st["completion"].fill_(self.pad_id)
        st["alive"].zero_()
        st["logprobs"].zero_()
        logits = self.logits
        for t in range(N):
            if t:
                if t % self.check_every == 0 and not bool(st["gen"].any()):   # one host sync per check_every
                    break
                self.slot += 1                                   # this step writes slot first + t - 1
                if st["graph"] is not None:
                    st["graph"].replay()
                    logits = st["logits"]
                else:
                    logits = self._decode_turn(st)
            if t == 0 and st["graph_sampling"]:                  # the first token: from the fed chunk's logits
                self._take_turn(st, *self._sample(logits, st))
            elif not st["graph_sampling"]:
                self._take_turn(st, *sample_tokens(logits, sampling, self.generator))
        return st["completion"].cpu(), st["alive"].cpu(), st["logprobs"].cpu(), st["gen"].cpu()

    def finish(self):
        """The episodes are over: free the cache unless keep_cache."""
        self.turns, self.logits = None, None
        if not self.keep_cache:
            self.release()
