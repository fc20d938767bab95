"""Build the project's tiny model from scratch: a character tokenizer, a small Qwen2 model, and a short
supervised warm start on the arithmetic task (tasks/arithmetic.py), so that RL starts from a non-trivial policy.

    python tools/make_tiny_model.py                      # writes assets/tiny-model/ (~2-3 minutes on 2 idle CPU cores)
    python tools/make_tiny_model.py --out /tmp/tm --teacher_accuracy 0.5 --threads 1

The result loads with `AutoModelForCausalLM.from_pretrained(out)` / `AutoTokenizer.from_pretrained(out)`
and is what `python train.py` uses by default. The script ends by printing the held-out accuracy
(greedy and sampled at temperature 1.0) and pass@8 of what it wrote.

Why a sloppy teacher: the supervised data come from a teacher that writes the correct sum with
probability `teacher_accuracy` and otherwise the sum with every carry forgotten (058+067 -> "5100"
rather than "5210": 8+7 -> 5, 5+6 -> 1, 0+0 -> 0, no carry out), decided once per example. The
warm-started model thus knows how to add but, like a base model with a bad habit, mostly does not:
on problems that need a carry (83% of 3-digit sums)
its greedy answer is the carry-less one and a sample at temperature 1.0 is right about
`teacher_accuracy` of the time, while pass@8 is high. That is the situation in which RL with a
verifier is known to work (samples of one prompt disagree, so GRPO's group advantages carry signal),
and it leaves plenty of room: accuracy rises when the policy learns to prefer the carrying answer.
The SFT problems come from the train side of tasks/arithmetic.py's split only; held-out problems are never seen.

Shape: Qwen2ForCausalLM, hidden 128, 4 heads of 32 (vLLM's CPU attention needs head_dim >= 32), MLP 512,
2 layers, tied embeddings, vocab 15 (10 digits, '+', '=', <pad>, <eos>, <unk>): 0.53 M parameters,
2.1 MB of float32 safetensors. Supervised training spends its first ~400 steps learning the format
(loss ~1.45: digits at chance) before it learns to read the operand digits (loss falls to ~0.3);
`--steps` must leave room for both.
"""
import argparse
import json
import os
import sys
import random
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root: tools/ import the project
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from tasks.arithmetic import ArithmeticConfig  # noqa: E402
from engines.base import SamplingParams  # noqa: E402
from engines.builtin import BuiltinEngine  # noqa: E402
from tasks.arithmetic import CHARS, EOS_TEXT, PAD_TEXT, arithmetic_task, make_sample, sample_problems  # noqa: E402

UNK_TEXT = "<unk>"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="assets/tiny-model", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed for init, SFT data and eval sampling")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads (head_dim = hidden / heads >= 32)")
    p.add_argument("--mlp", type=int, default=512, help="MLP intermediate size")
    p.add_argument("--steps", type=int, default=1200, help="SFT optimizer steps")
    p.add_argument("--batch", type=int, default=256, help="SFT sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (linear warmup, cosine decay)")
    p.add_argument("--teacher_accuracy", type=float, default=0.25,
                   help="probability that an SFT target is the correct sum rather than the carry-less one")
    p.add_argument("--digits", type=int, default=ArithmeticConfig.digits, help="operand digits (as tasks/arithmetic.py)")
    p.add_argument("--n_eval", type=int, default=ArithmeticConfig.n_eval, help="held-out problems to evaluate")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = torch's default; 1 is fastest on a CPU shared with other jobs)")
    return checked_warm_start_args(p)


def checked_warm_start_args(p: argparse.ArgumentParser):
    """p's arguments, with the warm start's (--teacher_accuracy, --steps, --batch) refused out of range."""
    args = p.parse_args()
    if not 0.0 <= args.teacher_accuracy <= 1.0:
        p.error(f"--teacher_accuracy must be in [0, 1], got {args.teacher_accuracy}")
    if args.steps < 1 or args.batch < 1:
        p.error(f"--steps and --batch must be >= 1, got {args.steps} and {args.batch}")
    return args


def build_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """One token per character of chars, plus <pad>, <eos>, <unk>; decode concatenates without spaces.
    tools/make_ladder.py passes CHARS + more: the base characters keep their ids."""
    vocab = {PAD_TEXT: 0, EOS_TEXT: 1, UNK_TEXT: 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TEXT))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")   # every character alone
    tok.decoder = decoders.Fuse()                                                # "5","1","0" -> "510"
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TEXT, eos_token=EOS_TEXT,
                                   unk_token=UNK_TEXT, padding_side="left", model_max_length=64)


def build_model(args, tokenizer):
    if args.hidden % args.heads or args.hidden // args.heads < 32:
        raise ValueError(f"hidden {args.hidden} / heads {args.heads} must divide into head_dim >= 32")
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=64, tie_word_embeddings=True,
                      bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def carryless_answer(a: int, b: int, digits: int) -> str:
    """The answer with every carry forgotten, in the task's format (units first, digits + 1 wide)."""
    return "".join(str((a // 10**i % 10 + b // 10**i % 10) % 10) for i in range(digits)) + "0"


def sft_batch(problems, tokenizer, digits: int, teacher_accuracy: float, rng: random.Random):
    """Right-padded (ids, labels), both (B, T); labels are -100 on prompt and padding (loss on answers only)."""
    rows = []
    for a, b in problems:
        sample = make_sample(a, b, digits)             # the task's own format
        answer = sample["answer"] if rng.random() < teacher_accuracy else carryless_answer(a, b, digits)
        p = tokenizer.encode(sample["prompt"])
        c = tokenizer.encode(answer) + [tokenizer.eos_token_id]
        rows.append((p + c, [-100] * len(p) + c))
    T = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), T), tokenizer.pad_token_id)                    # (B, T)
    labels = torch.full((len(rows), T), -100)                                    # (B, T)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels


def warm_start(model, steps: int, lr: float, log_every: int, loss_at):
    """The supervised warm start of both tiny models (tools/make_tiny_vlm.py's too): AdamW (betas 0.9, 0.98, no weight
    decay), a linear warmup over the first 5% of the steps then a cosine decay, gradients clipped at norm 1.
    loss_at(step) -> the loss of that step's batch (it draws the batch)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    # cosine computed in float32 (torch.cos), as when assets/tiny-model was made: keeps it bit-reproducible
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + torch.cos(
        torch.tensor(torch.pi * s / steps)).item())))
    model.train()
    t0 = time.time()
    for step in range(steps):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"sft step {step:4d}  loss {loss.item():.4f}  {time.time() - t0:.0f}s", flush=True)


def sft(model, tokenizer, args):
    rng = random.Random(f"sft-{args.seed}")
    # a pool of distinct problems (each seen ~4 times), drawn from the train side of tasks/arithmetic.py's split only
    problems = sample_problems(args.steps * args.batch // 4, args.digits, False, ArithmeticConfig.heldout_percent, rng)

    def loss_at(step):
        batch = [problems[rng.randrange(len(problems))] for _ in range(args.batch)]
        ids, labels = sft_batch(batch, tokenizer, args.digits, args.teacher_accuracy, rng)
        return model(input_ids=ids, labels=labels).loss   # transformers shifts labels internally
    warm_start(model, args.steps, args.lr, 100, loss_at)


@torch.no_grad()
def evaluate(model, tokenizer, samples, seed: int, n: int = 8, max_new_tokens: int = 8) -> dict:
    """Held-out greedy accuracy, sampled accuracy at temperature 1.0 (mean over n samples) and pass@n."""
    model.eval()
    enc = tokenizer([s["prompt"] for s in samples], return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    greedy = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    engine = BuiltinEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = [tokenizer.encode(s["prompt"]) for s in samples]
    ro = engine.generate(prompts, n=n, sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens),
                         generator=torch.Generator().manual_seed(seed))
    C = ro.completion_mask.shape[1]
    texts = tokenizer.batch_decode(ro.input_ids[:, -C:], skip_special_tokens=True)
    answers = [t.strip() for t in texts]
    correct = torch.tensor([t == samples[i // n]["answer"] for i, t in enumerate(answers)]).view(-1, n)
    # the teacher's bad habit, on problems where it differs from the true answer
    digits = len(samples[0]["answer"]) - 1
    sloppy = [(t == carryless_answer(*map(int, samples[i // n]["prompt"][:-1].split("+")), digits))
              for i, t in enumerate(answers) if not correct.view(-1)[i]]
    return {"greedy": sum(g.strip() == s["answer"] for g, s in zip(greedy, samples)) / len(samples),
            "sampled": correct.float().mean().item(), f"pass@{n}": correct.any(1).float().mean().item(),
            "sampled_carryless": sum(sloppy) / len(answers)}


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(args, tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, vocab {len(tokenizer)}")
    t0 = time.time()
    sft(model, tokenizer, args)
    print(f"sft done in {time.time() - t0:.0f}s")
    os.makedirs(args.out, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # reload what was written, so the printed numbers belong to the files on disk
    model = AutoModelForCausalLM.from_pretrained(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    _, held_out = arithmetic_task(ArithmeticConfig(digits=args.digits, n_eval=args.n_eval))
    metrics = evaluate(model, tokenizer, held_out, args.seed)
    print(f"held-out ({len(held_out)} problems): greedy {metrics['greedy']:.3f}  "
          f"sampled@T=1.0 {metrics['sampled']:.3f}  pass@8 {metrics['pass@8']:.3f}  "
          f"(samples with carries forgotten: {metrics['sampled_carryless']:.3f})")
    with open(os.path.join(args.out, "make_tiny_model.json"), "w") as f:
        json.dump({"args": vars(args), "held_out": metrics}, f, indent=1)


if __name__ == "__main__":
    main()
