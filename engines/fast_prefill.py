"""The prefill half of the fast decoder (engines/fast_decode.py: FastDecoder takes these methods as a mixin, as it
takes engines/fast_turns.py's): every prompt token forwarded at once into the static cache before the decode.

- Shared prompts: GRPO's n samples of a prompt are equal rows (engines/builtin.py repeats each prompt n times), so
  each distinct row is forwarded once and its cache slots, slot positions, MoE routes and logits are copied to the
  rows that share it (`distinct_rows`, `_prefill_body`; FAST_DECODE_SHARED_PREFILL=0: every row).
- From a CUDA graph: a decoder that keeps its state between rollouts replays the prefill per (distinct rows, padded
  length) shape (`_replay_prefill`; FAST_DECODE_GRAPH_PREFILL=0: eager). Measured: docs/speed.md, "Shared-prompt
  prefill" and "The prefill from a CUDA graph".
What the mixin reads of its host class: the model, `_forward`, `use_graph`, `keep_cache`, `prefill_failed`,
`prefill_graph_eager` and a state from `_state` (its cache, kpos, key_ok, pos, routes, rotary tables).
"""
import os
import sys

import torch
from torch import Tensor

from engines.families import mrope_rotation
from engines.graphs import capture

def shared_prefill() -> bool:
    """Prefill each distinct prompt row once (_prefill); FAST_DECODE_SHARED_PREFILL=0 forwards every row, as before.
    On by default: measured faster in W1's loop and W6's rollout (docs/speed.md, "Shared-prompt prefill").
    Read at each rollout, so a tool can alternate it between rollouts of one decoder."""
    return os.environ.get("FAST_DECODE_SHARED_PREFILL", "1") == "1"


def shared_reads() -> bool:
    """After a shared prefill, the decode attention reads each prompt's slots from one of its rows (the state's src,
    shared; kernels/decode_attention.py: share), so the L2 cache serves its other rows; FAST_DECODE_SHARED_READS=0:
    each row reads its own copy, as before. Read when the prefill runs (a graphed prefill: when it is captured)."""
    return os.environ.get("FAST_DECODE_SHARED_READS", "1") == "1"


def graph_prefill() -> bool:
    """Replay the text prefill from a CUDA graph (_prefill) when the decoder keeps its state;
    FAST_DECODE_GRAPH_PREFILL=0 prefills eagerly, as before. On by default: measured faster in W1's loop and W6's
    rollout (docs/speed.md, "The prefill from a CUDA graph"). Read at each rollout, like shared_prefill."""
    return os.environ.get("FAST_DECODE_GRAPH_PREFILL", "1") == "1"


PREFILL_GRAPHS = 2   # prefill graphs kept per decode state, like _state's bound: one shape and the next
# the most tokens (distinct rows x padded length) a graphed prefill forwards, larger ones eager: a graph pays where
# launching kernels bounds the prefill (few distinct rows), not where the GPU does, and its private pool keeps the
# prefill's activations reserved between rollouts (measured: docs/speed.md, "The prefill from a CUDA graph")
PREFILL_GRAPH_TOKENS = 4096


def distinct_rows(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """GRPO's n samples of a prompt are equal rows of ids and mask (engines/builtin.py repeats each prompt n times).
    ids, mask (B, P) -> (ids, mask) of the U distinct rows (U, P) each and each row's distinct row (B,), or None
    when no two rows are equal (nothing to share). One host sync: torch.unique must know U."""
    P = ids.shape[1]
    rows, inverse = torch.unique(torch.cat([ids, mask.to(ids.dtype)], 1), dim=0, return_inverse=True)   # (U, 2P), (B,)
    if rows.shape[0] == ids.shape[0]:
        return None
    return rows[:, :P], rows[:, P:].to(mask.dtype), inverse


class Prefill:
    """FastDecoder's prefill (a mixin: the state it fills is FastDecoder's)."""
    SHARES_PREFILL = True              # FAST_DECODE_SHARED_PREFILL applies (_prefill); not to GenericDecoder's cache
    GRAPHS_PREFILL = True              # FAST_DECODE_GRAPH_PREFILL applies (_graphs_prefill); GenericDecoder: eager

    def _graphs_prefill(self, embeds: Tensor | None, positions: Tensor | None) -> bool:
        """May this rollout's prefill replay a CUDA graph (_prefill: up to PREFILL_GRAPH_TOKENS)? Only when the state
        is kept (keep_cache: a graph captured for one rollout would cost more than the eager prefill it replaces), on
        CUDA with graphs, for a text prompt (pictures keep the eager prefill: their embeddings' shape is the
        picture's), and not after a failed capture."""
        return (self.GRAPHS_PREFILL and graph_prefill() and (self.use_graph or self.prefill_graph_eager)
                and self.keep_cache and embeds is None and positions is None and not self.prefill_failed)

    def _prefill(self, st: dict, ids: Tensor, mask: Tensor, embeds: Tensor | None,
                 positions: Tensor | None) -> Tensor:
        """Forward all prompt tokens at once into st's cache (causal within the prompt, padding keys hidden) and
        set the decode's key mask and positions; -> the last token's logits (B, V). embeds, positions: sample's.
        With the shared prefill (shared_prefill) each distinct prompt row is forwarded once into the first U rows of
        the cache, then its first P slots (K/V, slot positions, recorded routes) and logits are copied to every row that
        shares it: GRPO's n samples per prompt make the prefill n times smaller. Prompts with pictures (embeds,
        positions) keep the per-row prefill: their rows are equal only if their pictures are too, which ids do not
        show. Multi-turn episodes (engines/fast_turns.py) prefill through feed(), not here: per row as before.
        With the graphed prefill (_graphs_prefill) all of this after finding the distinct rows is one graph replay."""
        share = self.SHARES_PREFILL and embeds is None and positions is None and shared_prefill()
        found = distinct_rows(ids, mask) if share else None
        u_ids, u_mask, inverse = (ids, mask, None) if found is None else found
        if self._graphs_prefill(embeds, positions) and u_ids.numel() <= PREFILL_GRAPH_TOKENS:
            logits = self._replay_prefill(st, u_ids, u_mask, inverse, mask)
            if logits is not None:
                return logits
        return self._prefill_body(st, u_ids, u_mask, inverse, mask, embeds, positions)

    def _prefill_body(self, st: dict, u_ids: Tensor, u_mask: Tensor, inverse: Tensor | None, mask: Tensor,
                      embeds: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """_prefill's work on its rows: u_ids, u_mask (U, P) forwarded into the first U rows of the cache, then (inverse
        (B,): each row's distinct row, None when U = B rows are all forwarded) fanned out to the B rows; the key mask
        and positions from mask (B, P); -> logits (B, V). Device work only (no host sync): a graph can hold it."""
        (B, P), S = mask.shape, st["key_ok"].shape[-1]
        for r in st["routes"] or []:
            r.fill_(-1)
        if inverse is None:
            logits = self._prefill_rows(st, u_ids, u_mask, embeds, positions)
        else:
            logits = self._prefill_rows(st, u_ids, u_mask, None, None).index_select(0, inverse)   # (B, V)
            U = u_ids.shape[0]
            spread = lambda t: t[:, :P].copy_(t[:U, :P].index_select(0, inverse))   # slots dim 1 of (B, S, ...)
            for t in st["k"] + st["v"]:                                            # (B, nkv, S, D)
                t[:, :, :P].copy_(t[:U, :, :P].index_select(0, inverse))
            spread(st["kpos"])                                                     # (B, S)
            for r in st["routes"] or []:                                           # (B, S, k)
                spread(r)
        if inverse is None or not shared_reads():
            st["shared"].zero_()
        else:   # the decode reads a prompt's P slots from its first row: its rows' copies are equal
            rows = torch.arange(B, device=inverse.device)
            first = torch.full_like(rows[:U], B).scatter_reduce_(0, inverse, rows, "amin")   # (U,)
            st["src"].copy_(first[inverse])                                        # (B,)
            st["shared"].fill_(P)
        real = torch.zeros(B, S, dtype=torch.bool, device=mask.device)
        real[:, :P] = mask.bool()
        st["key_ok"].copy_(real[:, None, None])
        # the decode's positions go on from one past each row's largest (M-RoPE: past the picture's grid, not its
        # token count); the text step's plain rotary is M-RoPE's for text, whose three positions are equal
        st["pos"].copy_(mask.sum(-1, keepdim=True) if positions is None
                        else positions.reshape(-1, B, P).amax(dim=(0, 2))[:, None] + 1)
        return logits

    def _replay_prefill(self, st: dict, u_ids: Tensor, u_mask: Tensor, inverse: Tensor | None,
                        mask: Tensor) -> Tensor | None:
        """_prefill_body from a CUDA graph of this state, one per (U, P, shared) shape (PREFILL_GRAPHS kept): at 16
        distinct rows the eager prefill is bound by launching 24 layers of small kernels (docs/speed.md). The inputs
        are copied into the graph's own buffers, the outputs (cache rows, kpos, key_ok, pos, routes) are st's own
        buffers, the logits the graph's. A new shape costs one eager warm-up (whose result is thrown away) and a
        capture, then a replay; a failed capture (e.g. a host sync in some prefill path) prints one line and leaves
        the eager prefill for the rest of the run (None: the caller prefills eagerly)."""
        graphs = st.setdefault("prefills", {})
        key = (*u_ids.shape, inverse is not None)
        g = graphs.get(key)
        if g is None:
            if len(graphs) >= PREFILL_GRAPHS:
                graphs.pop(next(iter(graphs)))
            g = {"ids": u_ids.clone(), "u_mask": u_mask.clone(), "mask": mask.clone(),
                 "inverse": None if inverse is None else inverse.clone()}
            if not self.use_graph:                # prefill_graph_eager (tests): each replay runs the body on g's
                g["logits"] = None
                g["replay"] = lambda: g.update(logits=self._prefill_body(st, g["ids"], g["u_mask"], g["inverse"],
                                                                         g["mask"]))
            else:
                try:
                    s = torch.cuda.Stream()      # warm up on a side stream (cuBLAS handles, sdpa's choice), as _record
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        self._prefill_body(st, g["ids"], g["u_mask"], g["inverse"], g["mask"])
                    torch.cuda.current_stream().wait_stream(s)
                    graph = torch.cuda.CUDAGraph()
                    with capture(graph):
                        g["logits"] = self._prefill_body(st, g["ids"], g["u_mask"], g["inverse"], g["mask"])
                    g["replay"] = graph.replay
                except Exception as e:
                    print(f"fast_decode: capturing the prefill failed ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); the eager prefill from now on", file=sys.stderr)
                    self.prefill_failed = True
                    torch.cuda.synchronize()
                    return None
            graphs[key] = g
        for name, t in (("ids", u_ids), ("u_mask", u_mask), ("mask", mask), ("inverse", inverse)):
            if t is not None:
                g[name].copy_(t)
        g["replay"]()
        return g["logits"]

    def _prefill_rows(self, st: dict, ids: Tensor, mask: Tensor, embeds: Tensor | None,
                      positions: Tensor | None) -> Tensor:
        """The prefill's forward of ids, mask (n, P) into the first n rows of st's cache (n = B, or U distinct
        rows); -> the last token's logits (n, V)."""
        (n, P), S = ids.shape, st["key_ok"].shape[-1]
        slots = torch.arange(S, device=ids.device)
        causal = slots[None, :P, None] >= slots[None, None, :]                  # (1, P, S): key j <= query i
        real = torch.zeros(n, S, dtype=torch.bool, device=ids.device)
        real[:, :P] = mask.bool()
        key_ok = (causal & real[:, None]) | (slots[:P, None] == slots[None])[None]  # a pad query sees itself: no nan
        # eager: compiling it (dynamic shapes) costs far more on the first call than it saves per rollout
        # (measured: docs/speed.md, "Third session")
        pos = (mask.cumsum(-1) - 1).clamp(min=0) if positions is None else positions   # (n, P) or (3, n, P)
        cos, sin, rows = st["cos"], st["sin"], pos
        if pos.dim() == 3:   # M-RoPE: a rotary row per prompt token (n * P rows), each token reading its own
            cos, sin = (t.reshape(1, n * P, -1) for t in mrope_rotation(self.model, pos, st["cos"].dtype))
            rows = torch.arange(n * P, device=ids.device).view(n, P)
        head = lambda ts: ts if n == st["kpos"].shape[0] else [t[:n] for t in ts]   # the first n rows: views
        return self._forward(ids, rows, slots[:P], key_ok[:, None], head(st["k"]), head(st["v"]), cos, sin,
                             head([st["kpos"]])[0], None if st["routes"] is None else head(st["routes"]),
                             **({} if embeds is None else {"embeds": embeds}))   # generic: ids only
