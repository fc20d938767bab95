"""Multi-turn rollouts: the policy writes a turn, the environment answers, the policy continues from its KV cache.

    python train.py --config configs/multiturn.yaml           # env.name=hilo: the embedded multi-turn task
    sampler = MultiTurn(model, tok, cfg, engine=engine)       # train.py builds it in setup when env.name is set
    rollout = sampler.generate(prompt_ids, rows, n, sampling, generator)     # an Episodes (a Rollout)
    rewards, info = sampler.score(samples, rollout).result()                # episode returns, metrics, failures

One batched loop over every episode (B = prompts x n), a turn at a time (what each episode wrote and was told is kept
in engines/episodes.py's EpisodeBatch, which gives the Episodes at the end):
  1. reset each environment (in envs/pool.py's workers); its first observation, through the chat template if the
     tokenizer has one (with the tools' schemas), is the prompt; prefill the prompts (left-padded);
  2. decode a token at a time until each episode's turn ends (the end-of-turn token = EOS) or hits max_new_tokens;
     rows whose turn ended wait (a pad column, masked out of attention) while the others go on;
  3. step every environment whose turn ended (tool calls run instead, envs/tools.py); episodes that are done,
     failed or out of budget stop;
  4. feed each continuing row its pending end-of-turn token + observation tokens as one chunk (right-padded,
     pad columns masked) into the same KV cache: no re-prefill of the history; back to 2.
The cache thus has holes (pad columns); positions count real tokens only, so each row's computation is exactly
that of its compact sequence, which is what the Rollout holds: completion = [turn 1 | observation 1 | turn 2 |
...], completion_mask 1 on model tokens only (the loss mask), logprobs on those only, attention_mask 1 on both.
Budgets: max_turns, max_new_tokens per turn, env.max_tokens per episode and the model's context; an episode
past one is cut and flagged truncated, never an error. An environment step that raises, hangs, returns the
wrong type or a huge observation ends its episode as a recorded failure (reward_failures.jsonl, env_fail/*
metrics) and that episode gets no loss (its completion_mask is zeroed): the environment broke, not the policy.
Two decoders run this loop. The portable one (_Decoder: transformers' cache, a token a step) on CPU and for
models the fast path does not cover; on CUDA, for the models engines/fast_decode.py supports, its FastDecoder
(preallocated per-layer caches, the CUDA-graphed decode step): a whole turn runs on the device with one host
sync per check_every tokens (decode_turn), rows whose turn ended wait masked, and each observation chunk is
written into the same cache at shared slots after the last one used (feed; it compacts the cache, reusing the
waits' holes, only when the next turn would not fit). Both keep positions = real-token counts, so either's log-probs are the trainer's.
With engine=vllm, engines/vllm.py's VLLMTurns stands in for FastDecoder (same calls, same loop): each turn
submits the episodes' whole histories as token-id prompts and vLLM's prefix cache serves the KV already computed.
Rows that finished their turn early idle until the batch's longest turn ends.
Pictures (a vision-language policy, docs/vision.md): an observation may be {"text": "...<image>...", "image": bytes}
(reset's too). The renderer puts the picture's image tokens in the slot (the processor's count), the portable
decoder runs the encoder once per picture of a chunk and feeds the embeddings into the cache, positions continuing
the row's count (M-RoPE included), and the Episodes carry the batch's pictures (`images`: vision.episode_images)
for the trainer's forwards. Episodes of a VLM take the portable loop: FastDecoder.feed takes token ids only.
"""
import contextlib

import torch
from torch import Tensor

import distributed
import vision
from config import UserError, plugin_args
from engines.base import SamplingParams, left_pad, top_p_filter
from engines.builtin import _cache_kw, _cache_of
from engines.episodes import Done, EpisodeBatch, Episodes
from engines.exact_decode import ExactDecoder
from engines.fast_decode import OFF, FastDecoder, supported
from envs.base import IMAGE, EnvError, check_image
from envs.pool import EnvPool
from envs.tools import check_tools
from models import context_length, position_ids
from registry import get


class Renderer:
    """Text -> token ids for prompts and observations: through the chat template when the tokenizer has one
    (the observation as a user or tool message, plus the template's text around it), else the plain text.
    What an environment wrote is tokenised as text, never as special tokens (split_special_tokens): an
    observation "<eos><pad>" (or a fetched web page) cannot end a turn or inject control tokens; only the
    template's own text around it is read with its special tokens. A picture (bytes) goes where the text's <image>
    slot is, as the ids picture(bytes) gives (a vision-language policy's image tokens; None: a text policy)."""

    def __init__(self, tok, eos_id: int, tool_schemas: list, picture=None):
        self.tok, self.eos_id, self.schemas, self.picture = tok, eos_id, tool_schemas or None, picture
        self.chat = bool(getattr(tok, "chat_template", None))
        self.frames = {}   # role -> (text before, text after) the observation
        self.seen = {}     # (text, role) -> ids

    def _ids(self, text: str) -> list[int]:
        """The template's text: its special tokens are meant."""
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def _text_ids(self, text: str) -> list[int]:
        """An environment's text: special-token strings in it are plain characters."""
        return self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []

    def _content_ids(self, text: str, image: bytes | None) -> list[int]:
        """An environment's text; with a picture, its one <image> slot replaced by the picture's ids."""
        if image is None:
            return self._text_ids(text)
        if self.picture is None:
            raise ValueError("an observation with a picture, but the policy is a text model")
        before, _, after = text.partition(IMAGE)
        return self._text_ids(before) + self.picture(image) + self._text_ids(after)

    def prompt(self, text: str, image: bytes | None = None) -> list[int]:
        if not self.chat:
            return self._content_ids(text, image)
        marker = "\x00PROMPT\x00"
        framed = self.tok.apply_chat_template([{"role": "user", "content": marker}], tools=self.schemas,
                                              add_generation_prompt=True, tokenize=False)
        head, _, rest = framed.partition(marker)
        return self._ids(head) + self._content_ids(text, image) + self._ids(rest)

    def observation(self, text: str, role: str, image: bytes | None = None) -> list[int]:
        """The ids of an observation; environments repeat theirs ("higher", "lower"): those are tokenized once
        (not those with a picture: the cache would hold the pictures)."""
        if image is not None:
            return self._observation(text, role, image)
        key = (text, role)
        if key not in self.seen:
            if len(self.seen) >= 4096:
                self.seen.clear()
            self.seen[key] = self._observation(text, role)
        return list(self.seen[key])

    def _observation(self, text: str, role: str, image: bytes | None = None) -> list[int]:
        if not self.chat:
            return self._content_ids(text, image)
        if role not in self.frames:   # render a dummy exchange with and without the message; keep the difference
            apply = lambda msgs, gen: self.tok.apply_chat_template(msgs, tools=self.schemas, tokenize=False,
                                                                   add_generation_prompt=gen)
            base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
            before, marker = apply(base, False), "\x00OBS\x00"
            after = apply(base + [{"role": role, "content": marker}], True)
            if not after.startswith(before):
                raise ValueError(f"the chat template does not extend a conversation by a {role} message")
            # the model's turn ended at its end-of-turn token: what the template writes after it ("\n") comes first
            eot = self.tok.decode([self.eos_id])
            tail = before[before.rfind(eot) + len(eot):] if eot and eot in before else ""
            head, _, rest = after[len(before):].partition(marker)
            self.frames[role] = (tail + head, rest)
        head, rest = self.frames[role]
        return self._ids(head) + self._content_ids(text, image) + self._ids(rest)


class MultiTurn:
    """The sampler train.py uses when env.name is set: generate (episodes), score (their returns), evaluate."""

    def __init__(self, model, tok, cfg, fast: bool | None = None, cut_turns: bool = False, engine=None):
        """fast: the GPU fast path (engines/fast_decode.py); None = on CUDA for the models it supports.
        cut_turns: a turn that reaches max_new_tokens without its end-of-turn token ends the turn (the environment
        answers the text so far) rather than the episode; W4 (tools/bench_w4.py) uses it for fixed work.
        engine: train.py's engine; with engine=vllm its turns() writes the turns (engines/vllm.py: VLLMTurns)."""
        self.model, self.tok, self.cfg, self.env = model, tok, cfg, cfg.env
        self.fast, self.cut_turns, self.decoder = fast, cut_turns, None
        self.split = OFF   # tools/bench_w4.py sets an engines.fast_decode.Split(device, on=True) to time the phases of a rollout
        if cfg.engine == "vllm":   # the fast path's loop, with vLLM writing the turns
            if engine is None:
                raise UserError(f"env.name={cfg.env.name} with engine=vllm needs the vllm engine passed in (engine=)")
            self.fast, self.decoder = True, engine.turns()
        elif cfg.engine != "builtin":
            raise UserError(f"env.name={cfg.env.name} runs episodes on engine=builtin or engine=vllm, not {cfg.engine}")
        tools = [t for t in (s.strip() for s in cfg.env.tools.split(",")) if t]
        try:
            check_tools(tools, cfg.env.parser)                   # unknown tool or parser: the known ones
            args = {**plugin_args(cfg, f"env.{cfg.env.name}"), **parse_args(cfg.env.args)}   # env.args over its section
        except ValueError as e:
            raise UserError(str(e))
        env_cls = get("env", cfg.env.name)                       # unknown environment: the known ones
        self.name = f"env:{cfg.env.name}"
        self.eos_id, self.pad_id = tok.eos_token_id, tok.pad_token_id
        # a vision-language policy reads pictures in observations, on the portable loop only (FastDecoder.feed and
        # vLLM's turns take token ids): refused here, before any work, where a fast path is asked for
        self.processor, self.by_size, self.image_id = None, {}, None
        if vision.tower(model) is not None:
            if self.fast or cfg.exact_logprobs or cfg.engine == "vllm":
                raise UserError("episodes of a vision-language policy run on the portable loop only (pictures in "
                                "observations are fed as embeddings; the fast path's feed takes token ids): drop "
                                "exact_logprobs / engine=vllm")
            self.fast, self.processor = False, vision.image_processor(cfg.model)
            self.image_id = vision.base_model(model).config.image_token_id
        self.render = Renderer(tok, self.eos_id, [get("tool", t).schema for t in tools],
                               self._picture_ids if self.processor is not None else None)
        spec = {"name": cfg.env.name, "args": args, "tools": tools, "parser": cfg.env.parser,
                "max_obs_chars": cfg.env.max_obs_chars, "memory_mb": cfg.env.memory_mb,
                # a text policy takes no picture: the workers refuse them (and the replies stay as small as before)
                "max_obs_image_bytes": cfg.env.max_obs_image_bytes if self.processor is not None else 0,
                "modules": [env_cls.__module__]}   # the workers import the environment's own module
        self.pool = EnvPool(spec, cfg.env.workers, cfg.env.timeout_s)

    def close(self):
        self.pool.close()

    def _picture_ids(self, image: bytes) -> list[int]:
        """A picture's image tokens (the processor decides how many: vision.image_tokens), special tokens meant."""
        return self.render._ids(vision.image_tokens(self.processor, image, self.by_size))

    def _images(self, pictures: list[list], mask: Tensor) -> dict | None:
        """The picture fields of rows' pictures (bytes) on the image pads mask (B, T) marks; None: no picture."""
        if self.processor is None:
            return None
        return vision.episode_images(self.processor, pictures, mask) or None

    # ------------------------------------------------------------------------------------------ the rollout
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], rows: list[dict], n: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> Episodes:
        """n episodes per row (adjacent); prompt_ids are unused: the environments' first observations are the prompts."""
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        fast = self.fast or (self.fast is None and device.type == "cuda" and supported(model))
        if self.cfg.exact_logprobs:   # the exact decoder takes the fast path's calls (engines/exact.py)
            fast, self.decoder = True, self.decoder or ExactDecoder(model)
        if fast:
            self.decoder = self.decoder or FastDecoder(model, weights=self.cfg.decode_weights)
        try:   # layers compiled for training (compile=true) would recompile at every new cache length
            with contextlib.nullcontext() if fast else torch.compiler.set_stance("force_eager"):
                return self._episodes([r for r in rows for _ in range(n)], len(rows), n, sampling, generator, fast)
        finally:
            model.train(was_training)

    def _episodes(self, rows, n_prompts, n, sampling, generator, fast: bool) -> Episodes:
        B, cfg, split = len(rows), self.env, self.split
        ep = EpisodeBatch(B)
        split.lap("host")
        resets = self.pool.run([("reset", r) for r in rows])
        split.lap("env")
        prompts = []
        for b, res in enumerate(resets):
            got = self._tokenise(ep, b, res[2], "user", "reset") if res[0] == "ok" else None
            if got is not None:
                ep.state[b] = res[1]
                prompts.append(got[0])
                ep.show(b, got[1])
                continue
            if res[0] != "ok":   # the episode is over before it began; its row still needs a prompt
                ep.fail(b, res[1], f"reset: {res[2]}")
            prompts.append(self.render.prompt(str(rows[b].get("prompt", ""))))
        ids, mask = left_pad(prompts, self.pad_id)                                     # (B, P)
        context = context_length(self.model)
        room = [min(cfg.max_tokens, context - len(p)) for p in prompts]              # completion tokens allowed
        if fast:
            dec = self.decoder
            dec.start_episodes(prompts, room, self.cfg.max_new_tokens, sampling, self.eos_id, self.pad_id, generator)
            split.lap("prefill")
        else:   # the prompts' image pads are all pictures: an environment's text cannot write one (Renderer)
            dec = _Decoder(self.model, ids, mask, self.pad_id,
                           self._images(ep.take_fresh(), (ids == self.image_id) & mask.bool()))
        try:
            pending = [[] for _ in range(B)]
            for turn in range(cfg.max_turns):
                ended = (self._fast_turn if fast else self._turn)(dec, ep, pending, room, sampling, generator)  # 2.
                self._step(ep, ended, room, pending, last_turn=turn == cfg.max_turns - 1)  # 3. the environments
                if not any(ep.active):
                    break
                chunks = [p if a else [] for p, a in zip(pending, ep.active)]
                split.lap("host")
                dec.feed(chunks, split) if fast else dec.feed(chunks, self._chunk_images(ep, chunks))   # 4.
                pending = [[] for _ in range(B)]
        finally:
            if fast:
                dec.finish()
        out = ep.rollout(ids, mask, self.pad_id, n_prompts, n, self.name)
        out.images = {} if self.processor is None else \
            vision.episode_images(self.processor, ep.pictures, ep.picture_pads(ids, mask, self.image_id))
        split.lap("host")
        return out

    def _chunk_images(self, ep, chunks: list[list[int]]) -> dict | None:
        """The pictures of a chunk about to be fed: each row's new ones, on the chunk's image pads that are not the
        policy's (a chunk is the tail of the row's tokens: its pending token and the observation)."""
        fresh = ep.take_fresh()
        if not any(fresh):
            return None
        L = max(len(c) for c in chunks)
        mask = torch.zeros(len(chunks), L, dtype=torch.bool)
        for b, c in enumerate(chunks):
            if c:
                tail = zip(ep.tokens[b][-len(c):], ep.is_model[b][-len(c):])
                mask[b, :len(c)] = torch.tensor([t == self.image_id and not m for t, m in tail])
        return self._images(fresh, mask)

    def _turn(self, dec, ep, pending, room, sampling, generator) -> list[int]:
        """Decode until every active row's turn ends; -> the rows whose turn ended with the end-of-turn token."""
        gen = torch.tensor(ep.active)                                                  # (B,) rows writing
        ep.turn_start = [len(t) for t in ep.tokens]
        ended = []
        for _ in range(self.cfg.max_new_tokens):
            scaled = dec.logits.float() / sampling.temperature                       # (B, V)
            logp_all = torch.log_softmax(scaled, dim=-1)
            probs = torch.softmax(top_p_filter(scaled, sampling.top_p), dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1).cpu()   # (B,)
            logp = logp_all.gather(-1, tok[:, None].to(logp_all.device)).squeeze(-1).cpu()   # (B,)
            chunk = [[] for _ in range(len(gen))]
            for b in gen.nonzero().flatten().tolist():
                t = int(tok[b])
                ep.add(b, t, float(logp[b]), model=True)
                chunk[b] = [t]
                if t == self.eos_id:
                    gen[b] = False
                    ended.append(b)
                elif len(ep.tokens[b]) >= room[b]:   # out of budget inside a turn: cut
                    gen[b] = False
                    ep.stop(b, truncated=True)
            if not gen.any():
                for b, c in enumerate(chunk):
                    pending[b] = c
                return ended
            dec.feed(chunk)
        for b in gen.nonzero().flatten().tolist():   # no end-of-turn within max_new_tokens: the episode is cut
            if self.cut_turns:                       # (or only the turn: its last token is already in the cache)
                ended.append(b)
            else:
                ep.stop(b, truncated=True)
        return ended

    def _fast_turn(self, dec, ep, pending, room, sampling, generator) -> list[int]:
        """_turn on the fast path: the whole turn runs on the device (engines/fast_decode.py: decode_turn), then the
        rows' tokens come back at once. A row's last token (its end-of-turn) is not in the cache yet: it is pending."""
        B = len(ep.tokens)
        ep.turn_start = [len(t) for t in ep.tokens]
        self.split.lap("host")
        toks, written, logps, still = dec.decode_turn(ep.active, [room[b] - len(ep.tokens[b]) for b in range(B)])
        self.split.lap("decode_turn")
        ended, n = [], written.sum(-1).tolist()           # a row writes columns 0 .. n - 1, then stops
        toks, logps, still = toks.tolist(), logps.tolist(), still.tolist()
        for b in (b for b in range(B) if ep.active[b]):
            row = toks[b][:n[b]]
            ep.extend(b, row, logps[b][:n[b]], model=True)
            if row[-1] == self.eos_id or (still[b] and self.cut_turns):
                ended.append(b)
                pending[b] = [row[-1]]
            else:   # out of the episode's budget, or of max_new_tokens
                ep.stop(b, truncated=True)
        return ended

    def _step(self, ep, ended: list[int], room, pending, last_turn: bool):
        """Step the environments of the rows whose turn ended; append each observation to the row's pending tokens."""
        # one batch_decode: one call into the tokenizer for the whole batch, not one per row
        actions = self.tok.batch_decode([ep.tokens[b][ep.turn_start[b]:] for b in ended], skip_special_tokens=True)
        self.split.lap("host")
        results = self.pool.run([("step", ep.state[b], a) for b, a in zip(ended, actions)])
        self.split.lap("env")
        for b, res in zip(ended, results):
            if res[0] != "ok":
                ep.fail(b, res[1], res[2])
                continue
            _, state, obs, reward, done, info, role, calls, errors = res
            ep.state[b] = state
            ep.end_turn(b, reward, calls, errors)
            if done:
                ep.stop(b, success=bool(info.get("success", ep.returns[b] > 0)))
                continue
            got = ([], None) if last_turn else self._tokenise(ep, b, obs, role, "step")
            if got is None:
                continue
            obs_ids, image = got
            if last_turn or len(ep.tokens[b]) + len(obs_ids) >= room[b]:   # no room for another turn: cut
                ep.stop(b, truncated=True)
                continue
            ep.extend(b, obs_ids, [0.0] * len(obs_ids), model=False)
            ep.show(b, image)
            pending[b] = pending[b] + obs_ids

    def _tokenise(self, ep, b: int, obs, role: str, what: str) -> tuple[list[int], bytes | None] | None:
        """An environment's observation -> (ids, its picture or None) (the prompt after reset, else an observation);
        None, with episode b failed, where it is refused: what an environment says must never end the run. A picture
        is checked again here (the worker that checked it runs the environment's code) before Pillow decodes it."""
        text, image = (obs.get("text"), obs.get("image")) if type(obs) is dict else (obs, None)
        if type(text) is not str:   # envs/wire.py lets only str through: this guards a change there
            ep.fail(b, "error", f"{what}: an observation of type {type(text).__name__}")
            return None
        try:
            if image is not None:
                image = check_image(image, what, self.env.max_obs_image_bytes)
                if text.count(IMAGE) != 1:
                    raise EnvError(f"{what} returned a picture whose text holds {text.count(IMAGE)} {IMAGE} slots")
            ids = self.render.prompt(text, image) if what == "reset" else self.render.observation(text, role, image)
            return ids, image
        except Exception as e:  # noqa: BLE001  a tokenizer's or processor's error on environment data costs the episode
            ep.fail(b, "error", f"{what}: the observation could not be tokenised ({type(e).__name__}: {e})"[:300])
            return None

    # ------------------------------------------------------------------------------ scoring and evaluation
    def score(self, samples: list[dict], rollout: Episodes):
        """The environments already scored: a handle whose result() is (returns (B,), info) like the reward pool's."""
        return Done(rollout.returns, rollout.info)

    @torch.no_grad()
    def evaluate(self, cfg, samples, prompt_ids, specs, generator) -> dict:
        """Held-out success rate (info["success"] of each episode's last step), greedy by default."""
        sampling = SamplingParams(temperature=max(cfg.eval_temperature, 1e-5),
                                  top_p=cfg.top_p if cfg.eval_temperature else 1.0, max_new_tokens=cfg.max_new_tokens)
        samples = distributed.share(samples)
        returns, success = [], []
        for start in range(0, len(samples), 256):
            ro = self.generate([], samples[start:start + 256], 1, sampling, generator)
            returns += ro.returns.tolist()
            success += ro.info["success"]
        total, correct, count = distributed.all_sum([sum(returns), sum(success), len(returns)])
        return {"eval/reward": total / max(count, 1), "eval/accuracy": correct / max(count, 1)}


class _Decoder:
    """The policy with its transformers KV cache; feed() appends a chunk of tokens per row (ragged, right-padded).
    images (a VLM's pictures in the prompt or a chunk, vision.episode_images): their image pads take the encoder's
    features and positions (vision.positions: M-RoPE where the model uses it), each row's count continuing from one
    past its largest position so far."""

    def __init__(self, model, ids: Tensor, mask: Tensor, pad_id: int, images: dict | None = None):
        self.model, self.pad_id, self.device = model, pad_id, next(model.parameters()).device
        self.cache_kw = _cache_kw(model)
        self.mask = mask.to(self.device)                                              # (B, K) grows with the cache
        ids = ids.to(self.device)
        pos = position_ids(self.mask) if images is None else vision.positions(model, ids, self.mask, images)
        out = model(**_first(model, ids, images), attention_mask=self.mask, position_ids=pos, use_cache=True)
        self.cache, self.logits = _cache_of(out), out.logits[:, -1]                  # (B, V)
        self.next_pos = self.mask.sum(-1)                                            # (B,) real tokens so far
        if images is not None:                      # M-RoPE: one past the row's largest position
            self.next_pos = torch.where(self.next_pos > 0, _past(pos, ids), 0)

    def feed(self, chunks: list[list[int]], images: dict | None = None):
        """Rows with tokens get logits after their last one; rows without keep theirs (they are not read)."""
        B, L = len(chunks), max(1, max(len(c) for c in chunks))
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        real = torch.zeros((B, L), dtype=torch.long)
        for b, c in enumerate(chunks):
            ids[b, :len(c)], real[b, :len(c)] = torch.tensor(c, dtype=torch.long), 1
        ids, real = ids.to(self.device), real.to(self.device)                      # (B, L)
        pos = self.next_pos[:, None] + (real.cumsum(-1) - 1).clamp(min=0)            # (B, L) pads repeat a position
        if images is not None:   # the chunk's pictures: their positions (M-RoPE) from the row's count on
            pos = vision.positions(self.model, ids, real, images, start=self.next_pos)   # (B, L) or (3, B, L)
        self.mask = torch.cat([self.mask, real], 1)                                  # (B, K + L)
        out = self.model(**_first(self.model, ids, images), attention_mask=self.mask, position_ids=pos,
                         use_cache=True, **{self.cache_kw: self.cache})
        self.cache = _cache_of(out)
        lengths = real.sum(-1)                                                       # (B,)
        last = (lengths - 1).clamp(min=0)
        fresh = out.logits[torch.arange(B, device=self.device), last]                # (B, V)
        self.logits = torch.where((lengths > 0)[:, None], fresh, self.logits)
        self.next_pos = self.next_pos + lengths if images is None else \
            torch.where(lengths > 0, _past(pos, ids), self.next_pos)


def _first(model, ids: Tensor, images: dict | None) -> dict:
    """A forward's input: the ids, or with pictures their embeddings (vision.embed: the encoder once per picture)."""
    return dict(input_ids=ids) if images is None else dict(inputs_embeds=vision.embed(model, ids, images))


def _past(pos: Tensor, ids: Tensor) -> Tensor:
    """(B, L) or (3, B, L) positions -> (B,) one past each row's largest (pads repeat a position, never pass it)."""
    return pos.reshape(-1, *ids.shape).amax(dim=(0, 2)) + 1


def parse_args(spec: str) -> dict:
    """'max_guesses=4,digit_reward=0.1' -> {'max_guesses': 4, 'digit_reward': 0.1} (values read as YAML)."""
    import yaml
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"env.args entry {part!r} must look like name=value")
        out[key.strip()] = yaml.safe_load(value)
    return out
