"""Build a tiny warm-started model for any registered task or environment: a character tokenizer over the
characters the task uses, a small Qwen2 model, and a short supervised fine-tune on reference episodes, so that RL
starts from a policy that writes well-formed turns (a random model's are all malformed: zero reward, zero signal).

    python tools/make_warm_start.py --out /tmp/ws-mul2 task=mul2                      # a task: its rows' answers
    python tools/make_warm_start.py --out /tmp/ws-hilo --config configs/multiturn.yaml --layers 3 --batch 128
    python train.py task=mul2 model=/tmp/ws-mul2                                      # then RL from it

The config (`--config FILE` and `key=value` overrides, exactly train.py's) says what to imitate:
  - env.name set: episodes of the environment's own scripted player, `scripted_turn(fields, history, rng)` on its
    class (the optional warm-start contract, envs/base.py), on the train rows of `task`; the loss covers the
    player's turns and their end-of-turn tokens, never the prompt or the observations;
  - env.name empty: one-turn episodes "prompt | answer<eos>" from the task rows' reference answer (`--answer_field`,
    default "answer": tasks/arithmetic.py, add4, mul2, files' answer_field); the loss covers the answer.
Episodes are tokenized by engines/multiturn.py's Renderer, the rollout's own: the prompt as the rollout renders a
first observation, every later observation as it renders one, each turn followed by the end-of-turn token. The
tool refuses, before training, a scripted turn longer than `max_new_tokens` or an episode longer than
`env.max_tokens` (the rollout would cut them), and characters its tokenizer cannot write back.

The vocabulary is <pad>, <eos>, <unk> and the characters seen in a sample of episodes from both splits, sorted
(`--chars` fixes them and their order). The model is tools/make_tiny_model.py's (build_model: hidden, layers,
heads, MLP from the options), its context the smallest power of two >= 64 that holds the longest prompt plus a
whole episode's budget. Training is seeded and float32 (`--threads 1` makes a rerun write the same weights): AdamW,
linear warmup over 5% of the steps, cosine decay. The tool ends by reloading what it wrote and running the held-out
rows through the real rollout (engines/multiturn.py's MultiTurn with an environment, else the built-in engine),
greedy and sampled at temperature 1: success rate, turns and truncated share (with an environment) or exact
matches with the reference answer (a task); written to <out>/make_warm_start.json.

tools/make_hilo_model.py is this tool with hilo's settings.
"""
import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import envs, tasks  # noqa: F401,E401,E402  (register the environments and tasks)
import registry  # noqa: E402
from config import UserError, fill_defaults, parse, plugin_args  # noqa: E402
from engines.base import SamplingParams  # noqa: E402
from engines.builtin import BuiltinEngine  # noqa: E402
from engines.multiturn import MultiTurn, Renderer, parse_args as env_args  # noqa: E402
from envs.base import EnvError, check_reset, check_step  # noqa: E402
from tools.make_tiny_model import build_model, build_tokenizer  # noqa: E402

SAMPLE_ROWS = 256   # rows per split whose episodes give the vocabulary, the context and the checks


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (model, tokenizer, make_warm_start.json)")
    p.add_argument("--config", default="", help="train.py's config file: task, env.*, max_new_tokens")
    p.add_argument("--answer_field", default="answer", help="without an environment: the rows' reference answer")
    p.add_argument("--chars", default="", help="the vocabulary's characters in id order ('' = those the episodes use)")
    p.add_argument("--seed", type=int, default=0, help="seed for init, episodes and evaluation")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = hidden / heads >= 32)")
    p.add_argument("--mlp", type=int, default=512, help="MLP intermediate size")
    p.add_argument("--steps", type=int, default=600, help="supervised optimizer steps")
    p.add_argument("--batch", type=int, default=64, help="episodes per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (warmup, cosine decay)")
    p.add_argument("--n_eval", type=int, default=200, help="held-out rows run through the rollout at the end (0: none)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out (refused otherwise)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, as train.py's (task=mul2 env.name=hilo)")
    args = p.parse_args(argv)
    if os.path.exists(os.path.join(args.out, "config.json")) and not args.overwrite:   # e.g. a shipped asset
        p.error(f"--out {args.out} already holds a model; pass --overwrite to replace it, or another --out")
    if args.steps < 0 or args.batch < 1 or args.n_eval < 0:
        p.error(f"--steps >= 0, --batch >= 1 and --n_eval >= 0 expected, got {args.steps}, {args.batch}, {args.n_eval}")
    if len(set(args.chars)) != len(args.chars):
        p.error(f"--chars {args.chars!r} repeats a character")
    cfg = fill_defaults(parse((["--config", args.config] if args.config else []) + args.overrides))
    return args, cfg


# ------------------------------------------------------------------------------------------ episodes as text
# An episode is [(text, is the model's)]: the first observation (the prompt), then turns and observations.

class Source:
    """Where the episodes come from: the task's rows, and the environment's scripted player or the rows' answers."""

    def __init__(self, cfg, answer_field: str):
        try:
            self.train, self.held = registry.get("task", cfg.task)(getattr(cfg, cfg.task, None))
        except (ValueError, OSError) as e:   # tasks report bad settings or unreadable files this way
            raise UserError(f"task '{cfg.task}': {e}")
        if not self.train:
            raise UserError(f"task '{cfg.task}' produced an empty training set")
        self.cfg, self.field, self.env = cfg, answer_field, None
        if cfg.env.name:
            if cfg.env.tools:
                raise UserError(f"env.tools={cfg.env.tools!r}: the warm start scripts no tool calls; "
                                "leave env.tools empty")
            self.env = registry.get("env", cfg.env.name)
            try:
                self.env_args = {**plugin_args(cfg, f"env.{cfg.env.name}"), **env_args(cfg.env.args)}
                self.env(**self.env_args)
            except (ValueError, TypeError) as e:   # a malformed entry, or a keyword the environment does not take
                raise UserError(f"env.args={cfg.env.args!r}: {e}")
            if not callable(getattr(self.env, "scripted_turn", None)):
                raise UserError(f"env '{cfg.env.name}' has no scripted player: give its class a static method "
                                "scripted_turn(fields, history, rng) -> str (envs/base.py)")
        elif answer_field not in self.train[0]:
            raise UserError(f"task '{cfg.task}' rows have no field {answer_field!r} (fields: "
                            f"{', '.join(sorted(self.train[0]))}); name the reference with --answer_field, or set "
                            "env.name to an environment with a scripted player")

    def episode(self, row: dict, rng: random.Random) -> list[tuple[str, bool]]:
        if self.env is None:
            return [(str(row["prompt"]), False), (str(row[self.field]), True)]
        env, limit = self.env(**self.env_args), self.cfg.env.max_obs_chars
        parts = [(check_reset(env.reset(row), limit), False)]
        for turn in range(self.cfg.env.max_turns):   # as the rollout: no observation after the last turn
            action = self.env.scripted_turn(row, [text for text, _ in parts], rng)
            if not isinstance(action, str):
                raise UserError(f"env '{self.cfg.env.name}': scripted_turn returned {type(action).__name__}, not str")
            parts.append((action, True))
            obs, _, done, _ = check_step(env.step(action), limit)
            if done or turn == self.cfg.env.max_turns - 1:
                return parts
            parts.append((obs, False))
        return parts


def sample(source: Source, seed: int) -> list:
    """Episodes of the first rows of both splits (their own rng: the training draws stay put): for the vocabulary,
    the context and the checks."""
    rng = random.Random(f"warm-start-sample-{seed}")
    return [source.episode(row, rng) for row in source.train[:SAMPLE_ROWS] + source.held[:SAMPLE_ROWS]]


# ------------------------------------------------------------------------------------------- episodes as ids

class Layout:
    """Episodes -> token ids as the rollout lays them out, through its own Renderer (engines/multiturn.py)."""

    def __init__(self, tok):
        self.tok, self.eos_id = tok, tok.eos_token_id
        self.renderer = Renderer(tok, tok.eos_token_id, [])
        self.seen = {}   # (part kind, text) -> ids: prompts and turns repeat across episodes

    def part(self, kind: str, text: str) -> list[int]:
        """kind "prompt" (the first observation), "turn" (the model's, then its end-of-turn token) or "observation"."""
        if (kind, text) not in self.seen:
            if len(self.seen) >= 65536:
                self.seen.clear()
            # Renderer._ids is the renderer's own text -> ids (private in engines/multiturn.py): a turn's tokens are
            # those whose decoding the rollout hands to the environment
            self.seen[kind, text] = (self.renderer.prompt(text) if kind == "prompt" else
                                     self.renderer._ids(text) + [self.eos_id] if kind == "turn" else
                                     self.renderer.observation(text, "user"))
        return self.seen[kind, text]

    def episode(self, parts) -> tuple[list[int], list[int], int]:
        """-> (ids, labels, prompt length); labels -100 except on the model's turns and their end-of-turn tokens."""
        prompt = self.part("prompt", parts[0][0])
        ids, labels = list(prompt), [-100] * len(prompt)
        for text, model in parts[1:]:
            t = self.part("turn" if model else "observation", text)
            ids += t
            labels += t if model else [-100] * len(t)
        return ids, labels, len(prompt)

    def check(self, parts, cfg, context: int):
        """Refuse what the rollout would cut or could not write: a long turn or episode, a character off the vocab."""
        ids, _, prompt = self.episode(parts)
        for text in (text for text, model in parts[1:] if model):
            n = len(self.part("turn", text))
            if n > cfg.max_new_tokens:
                raise UserError(f"the scripted turn {text!r} is {n} tokens with its end-of-turn token; the rollout "
                                f"cuts turns at max_new_tokens={cfg.max_new_tokens}: raise it")
            if self.tok.decode(self.part("turn", text), skip_special_tokens=True) != text:
                raise UserError(f"the scripted turn {text!r} does not survive the character tokenizer: a character "
                                "outside the vocabulary (--chars, or one the sampled episodes never used)")
        if cfg.env.name and len(ids) - prompt > cfg.env.max_tokens:
            raise UserError(f"a scripted episode is {len(ids) - prompt} tokens after its prompt; the rollout cuts "
                            f"episodes at env.max_tokens={cfg.env.max_tokens}: raise it")
        if len(ids) > context:
            raise UserError(f"a scripted episode of {len(ids)} tokens does not fit the model's context of {context}")

    def batch(self, episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (ids, labels), both (B, T)."""
        rows = [self.episode(parts)[:2] for parts in episodes]
        T = max(len(x) for x, _ in rows)
        ids = torch.full((len(rows), T), self.tok.pad_token_id)                     # (B, T)
        labels = torch.full((len(rows), T), -100)                                    # (B, T)
        for i, (x, y) in enumerate(rows):
            ids[i, :len(x)], labels[i, :len(y)] = torch.tensor(x), torch.tensor(y)
        return ids, labels


# ----------------------------------------------------------------------------------------- training, checking

def sft(model, next_batch, steps: int, lr: float):
    """AdamW with linear warmup over 5% of the steps and cosine decay; next_batch() -> (ids, labels) (B, T)."""
    if not steps:   # --steps 0: the untrained model (a baseline)
        return
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    # cosine in float32 (torch.cos), as the shipped warm starts were made: keeps them bit-reproducible
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + torch.cos(
        torch.tensor(torch.pi * s / steps)).item())))
    model.train()
    t0 = time.time()
    for step in range(steps):
        ids, labels = next_batch()
        loss = model(input_ids=ids, labels=labels).loss   # transformers shifts the labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"sft step {step:4d}  loss {loss.item():.4f}  {time.time() - t0:.0f}s", flush=True)


@torch.no_grad()
def evaluate(model, tok, cfg, source: Source, rows: list[dict], seed: int) -> dict:
    """Held-out rows through the real rollout, greedy and sampled at temperature 1."""
    model.eval()
    out = {}
    mt = MultiTurn(model, tok, cfg) if source.env else None
    try:
        for name, temperature in (("greedy", 1e-5), ("sampled", 1.0)):
            sampling = SamplingParams(temperature=temperature, max_new_tokens=cfg.max_new_tokens)
            gen = torch.Generator().manual_seed(seed)
            if mt:
                ro = mt.generate([], rows, 1, sampling, gen)
                out[name] = {"success": sum(ro.info["success"]) / len(rows), "turns": sum(ro.info["turns"]) / len(rows),
                             "truncated": ro.truncated.float().mean().item(),
                             "env_fail": sum(f is not None for f in ro.info["failed"])}
            else:
                layout = Layout(tok)
                ro = BuiltinEngine(model, tok.eos_token_id, tok.pad_token_id).generate(
                    [layout.part("prompt", str(r["prompt"])) for r in rows], 1, sampling, gen)
                texts = tok.batch_decode(ro.input_ids[:, -ro.completion_mask.shape[1]:], skip_special_tokens=True)
                out[name] = {"match": sum(t.strip() == str(r[source.field]) for t, r in zip(texts, rows)) / len(rows)}
    finally:
        if mt:
            mt.close()
    return out


def build(args, cfg) -> dict:
    """Everything the command line does; -> the held-out metrics ({} with --n_eval 0)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    source = Source(cfg, args.answer_field)
    name = cfg.env.name or cfg.task
    episodes = sample(source, args.seed)
    chars = args.chars or "".join(sorted({c for parts in episodes for text, _ in parts for c in text}))
    torch.manual_seed(args.seed)
    rng = random.Random(f"{name}-sft-{args.seed}")
    tok = build_tokenizer(chars)
    layout = Layout(tok)
    budget = cfg.env.max_tokens if cfg.env.name else cfg.max_new_tokens
    longest = max(len(layout.part("prompt", parts[0][0])) for parts in episodes) + budget
    context = 1 << max(6, math.ceil(math.log2(longest)))
    for parts in episodes:
        layout.check(parts, cfg, context)
    model = build_model(args, tok)
    model.config.max_position_embeddings, tok.model_max_length = context, context   # rotary needs no table
    print(f"{name}: {len(source.train)} train rows, vocab {len(tok)} ({chars!r}), context {context}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")

    def next_batch():   # the rows first, then their episodes: the draws of the shipped hilo model
        rows = [rng.choice(source.train) for _ in range(args.batch)]
        return layout.batch([source.episode(row, rng) for row in rows])
    sft(model, next_batch, args.steps, args.lr)
    return save_and_evaluate(model, tok, args, cfg, source, {"chars": chars, "context": context})


def save_and_evaluate(model, tok, args, cfg, source: Source, record: dict) -> dict:
    os.makedirs(args.out, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    # reload what was written, so the numbers belong to the files on disk
    model, tok = AutoModelForCausalLM.from_pretrained(args.out), AutoTokenizer.from_pretrained(args.out)
    rows = source.held[:args.n_eval]
    metrics = evaluate(model, tok, cfg, source, rows, args.seed) if rows else {}
    for k, v in metrics.items():
        print(f"held-out ({len(rows)} rows), {k}: "
              + "  ".join(f"{m} {x:.3f}" if isinstance(x, float) else f"{m} {x}" for m, x in v.items()))
    with open(os.path.join(args.out, "make_warm_start.json"), "w") as f:
        json.dump({"args": vars(args), "config": {"task": cfg.task, "env": vars(cfg.env),
                                                   "max_new_tokens": cfg.max_new_tokens},
                   **record, "held_out": metrics}, f, indent=1)
    return metrics


def main(argv=None):
    try:
        args, cfg = parse_args(argv)
        return build(args, cfg)
    except (UserError, registry.RegistryError, EnvError) as e:   # EnvError: the environment broke its contract
        sys.exit(f"make_warm_start: {e}")


if __name__ == "__main__":
    main()
