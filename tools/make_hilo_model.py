"""Build the tiny model of the embedded multi-turn task (envs/hilo.py): a character tokenizer, a small Qwen2
model, and a supervised warm start on episodes of a sloppy player, so that RL starts from a policy that knows
the game's format but not its winning strategy.

    python tools/make_hilo_model.py                      # writes assets/hilo-model/ (a few minutes on 2 CPU cores)
    python tools/make_hilo_model.py --out /tmp/hm --steps 300 --threads 1

The sloppy player guesses each digit uniformly inside the range the feedback so far leaves for it (a
consistent but aimless player): it wins ~15% of 4-guess episodes, while guessing the middle of each range wins
all of them. The model imitates the player's guesses (the loss covers the guesses and their end-of-turn token,
never the prompt or the feedback) on episodes of training codes only (envs/hilo.py's split); RL then has to
find that the middle wins. The script ends by playing the held-out codes greedily and printing the win rate
and how often a guess leaves the feedback's ranges.

Shape: Qwen2ForCausalLM, hidden 128, 4 heads of 32, MLP 512, 3 layers (two would have to find each digit's
range from every earlier guess and answer in one more hop), tied embeddings, vocab 17 (10 digits, < > = ?,
<pad>, <eos>, <unk>), context 64 (a 4-guess episode of 3 digits is 26 tokens).
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from config import HiloConfig  # noqa: E402
from envs.hilo import feedback, hilo_task  # noqa: E402

CHARS, PAD, EOS, UNK = "0123456789<>=?", "<pad>", "<eos>", "<unk>"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="assets/hilo-model", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed for init, episodes and evaluation")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=3, help="transformer layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--mlp", type=int, default=512, help="MLP intermediate size")
    p.add_argument("--steps", type=int, default=600, help="supervised optimizer steps")
    p.add_argument("--batch", type=int, default=128, help="episodes per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (warmup, cosine decay)")
    p.add_argument("--max_guesses", type=int, default=4, help="guesses per episode (as envs/hilo.py)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    return p.parse_args()


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {PAD: 0, EOS: 1, UNK: 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")   # one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", model_max_length=64)


def sloppy_episode(secret: str, max_guesses: int, rng: random.Random) -> list[tuple[str, bool]]:
    """[(text, is the model's)] of one episode: prompt, then guess / feedback turns until won or out of guesses."""
    lo, hi = [0] * len(secret), [9] * len(secret)
    parts = [("?", False)]
    for turn in range(max_guesses):
        guess = "".join(str(rng.randint(a, b)) for a, b in zip(lo, hi))
        parts.append((guess, True))
        if guess == secret or turn == max_guesses - 1:
            break
        fb = feedback(secret, guess)
        parts.append((fb, False))
        for i, (f, g) in enumerate(zip(fb, guess)):
            lo[i], hi[i] = (int(g) + 1, hi[i]) if f == ">" else (lo[i], int(g) - 1) if f == "<" else (int(g), int(g))
    return parts


def batch(secrets, tok, max_guesses, rng):
    """Right-padded (ids, labels) (B, T); labels are -100 except on guesses and their end-of-turn token."""
    rows = []
    for s in secrets:
        ids, labels = [], []
        for text, model in sloppy_episode(s, max_guesses, rng):
            t = tok.encode(text) + ([tok.eos_token_id] if model else [])
            ids += t
            labels += t if model else [-100] * len(t)
        rows.append((ids, labels))
    T = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), T), tok.pad_token_id)
    labels = torch.full((len(rows), T), -100)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels


@torch.no_grad()
def play(model, tok, secrets, max_guesses) -> dict:
    """Greedy episodes (full forward per token: a few dozen tokens) -> win rate and out-of-range guess digits."""
    model.eval()
    seqs, lo, hi = [tok.encode("?") for _ in secrets], [[0] * 3 for _ in secrets], [[9] * 3 for _ in secrets]
    won, outside, digits = [False] * len(secrets), 0, 0
    for turn in range(max_guesses):
        live = [i for i in range(len(secrets)) if not won[i]]
        if not live:
            break
        guesses = {i: "" for i in live}
        for _ in range(len(secrets[0]) + 1):
            ids = torch.tensor([seqs[i] for i in live])                     # equal lengths: same turns so far
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1).tolist()
            for i, t in zip(live, nxt):
                seqs[i].append(t)
                guesses[i] += tok.decode([t], skip_special_tokens=True)
        for i in live:
            g, s = guesses[i], secrets[i]
            if g == s:
                won[i] = True
                continue
            if len(g) == len(s) and g.isdigit():
                for j, c in enumerate(g):
                    outside, digits = outside + (not lo[i][j] <= int(c) <= hi[i][j]), digits + 1
                    lo[i][j], hi[i][j] = ((int(c) + 1, hi[i][j]) if s[j] > c else (lo[i][j], int(c) - 1) if s[j] < c
                                          else (int(c), int(c)))
            seqs[i] += tok.encode(feedback(s, g.ljust(len(s), "0")[:len(s)]))
    return {"win": sum(won) / len(won), "outside_range": outside / max(digits, 1)}


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(f"hilo-sft-{args.seed}")
    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=tok.eos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    train, held = hilo_task(HiloConfig())
    train_codes, held_codes = [r["secret"] for r in train], [r["secret"] for r in held]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + torch.cos(
        torch.tensor(torch.pi * s / args.steps)).item())))
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        ids, labels = batch([rng.choice(train_codes) for _ in range(args.batch)], tok, args.max_guesses, rng)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"sft step {step:4d}  loss {loss.item():.4f}  {time.time() - t0:.0f}s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    model, tok = AutoModelForCausalLM.from_pretrained(args.out), AutoTokenizer.from_pretrained(args.out)
    metrics = play(model, tok, held_codes, args.max_guesses)
    print(f"held-out ({len(held_codes)} codes), greedy: win {metrics['win']:.3f}, guess digits outside the "
          f"feedback's range {metrics['outside_range']:.3f}")
    with open(os.path.join(args.out, "make_hilo_model.json"), "w") as f:
        json.dump({"args": vars(args), "held_out": metrics}, f, indent=1)


if __name__ == "__main__":
    main()
