"""Feedback from outside the loop: write multi-turn episodes out, have a person or a program score them, and train
on the scored file through the replay buffer with the off-policy correction.

    python tools/trajectories.py export --config configs/multiturn.yaml --model assets/hilo-model --n 4 \
        --out episodes.jsonl                                  # 4 episodes per task row of the first --rows rows
    # ... fill each line's "reward" (a number; null lines are skipped), by hand or by a script ...
    python tools/trajectories.py train --config configs/multiturn.yaml --model assets/hilo-model \
        --scored episodes.jsonl --out runs/scored-policy      # optimizer steps on the scored episodes, then save

A line of the file: {"id", "group", "version", "messages": [{"role", "content"}], "tokens": {"prompt",
"completion", "completion_mask", "logprobs"}, "env_return", "reward"}. The tokens are what the policy saw and
wrote (observation tokens have completion_mask 0), the log-probs those it sampled with: `train` puts them in a
ReplayBuffer as the behaviour policy's (old_logprobs), so the clipped ratio (and algo.tis, if set) corrects for
the policy having moved since; advantages come from the algorithm over each group's scored rewards.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import torch

import algos, engines, envs, rewards, tasks  # noqa: F401,E401,E402  (register every plugin)
import registry  # noqa: E402
from buffer import Experience, ReplayBuffer  # noqa: E402
from config import fill_defaults, parse  # noqa: E402
from engines.base import SamplingParams  # noqa: E402
from engines.multiturn import MultiTurn  # noqa: E402
from models import load_model  # noqa: E402
from update import Learner, update  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["export", "train"])
    p.add_argument("--config", required=True, help="the training config (env, task, algo, replay settings)")
    p.add_argument("--model", default="", help="model folder (default: the config's)")
    p.add_argument("--out", required=True, help="export: the jsonl to write; train: the folder for the policy")
    p.add_argument("--scored", default="", help="train: the scored jsonl")
    p.add_argument("--rows", type=int, default=8, help="export: task rows (from the training split)")
    p.add_argument("--n", type=int, default=4, help="export: episodes per row (a group)")
    p.add_argument("--version", type=int, default=0, help="export: the policy version to record")
    p.add_argument("--steps", type=int, default=1, help="train: passes of the update over the buffer")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_args()


def messages(tok, prompt: list[int], completion: list[int], mask: list[float]) -> list[dict]:
    """Token runs -> [user prompt, assistant, environment, assistant, ...] as text."""
    out = [{"role": "user", "content": tok.decode(prompt, skip_special_tokens=True)}]
    run, model = [], None
    for t, m in list(zip(completion, mask)) + [(None, None)]:
        if m != model and run:
            out.append({"role": "assistant" if model else "environment", "content": tok.decode(run)})
            run = []
        if t is not None:
            run.append(t)
        model = m
    return out


def export(cfg, args, model, tok):
    train_set, _ = registry.get("task", cfg.task)(getattr(cfg, cfg.task, None))
    rows = train_set[:args.rows]
    sampler = MultiTurn(model, tok, cfg)
    try:
        ro = sampler.generate([], rows, args.n, SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens),
                              torch.Generator().manual_seed(cfg.seed))
    finally:
        sampler.close()
    C = ro.completion_mask.shape[1]
    with open(args.out, "w") as f:
        for i in range(len(ro.input_ids)):
            prompt = ro.input_ids[i, :-C][ro.attention_mask[i, :-C].bool()].tolist()
            k = int(ro.attention_mask[i, -C:].sum())
            completion, mask = ro.input_ids[i, -C:][:k].tolist(), ro.completion_mask[i, :k].tolist()
            f.write(json.dumps({"id": i, "group": int(ro.group_ids[i]), "version": args.version,
                                "messages": messages(tok, prompt, completion, mask),
                                "tokens": {"prompt": prompt, "completion": completion, "completion_mask": mask,
                                           "logprobs": ro.logprobs[i, :k].tolist()},
                                "env_return": float(ro.returns[i]), "reward": None}) + "\n")
    print(f"wrote {len(ro.input_ids)} episodes of {len(rows)} rows to {args.out}; fill in each 'reward'")


def read_scored(path: str, pad_id: int) -> Experience:
    """Scored lines -> an Experience (lines without a reward are skipped); the log-probs become old_logprobs."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    lines = [x for x in lines if x.get("reward") is not None]
    if not lines:
        raise SystemExit(f"{path}: no line has a reward")
    groups = {g: i for i, g in enumerate(sorted({x["group"] for x in lines}))}
    lines.sort(key=lambda x: groups[x["group"]])   # a group's rows adjacent, as the algorithms expect
    batches = []
    for x in lines:
        t = x["tokens"]
        k = len(t["completion"])
        lp = torch.tensor([t["logprobs"]], dtype=torch.float32)
        batches.append(Experience(
            input_ids=torch.tensor([t["prompt"] + t["completion"]]), attention_mask=torch.ones(1, len(t["prompt"]) + k,
                                                                                               dtype=torch.long),
            completion_mask=torch.tensor([t["completion_mask"]], dtype=torch.float32), sample_logprobs=lp,
            rewards=torch.tensor([float(x["reward"])]), group_ids=torch.tensor([groups[x["group"]]]),
            versions=torch.tensor([x["version"]]), truncated=torch.zeros(1, dtype=torch.bool), old_logprobs=lp))
    return Experience.cat(batches, pad_id)


def train(cfg, args, model, tok):
    batch = read_scored(args.scored, tok.pad_token_id)
    algo = registry.get("algo", cfg.algo.name)
    if algo.needs_critic or algo.needs_ref(cfg.algo):
        raise SystemExit(f"algo {cfg.algo.name} needs a critic or a reference model: use one without (grpo, rloo, ...)")
    batch.advantages = algo.advantages(batch, cfg.algo)
    buffer = ReplayBuffer(cfg.replay)
    buffer.add(batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    learner = Learner(model, optimizer, schedule, algo, cfg, torch.device("cpu"), version=int(batch.versions.max()))
    model.train()
    for step in range(args.steps):
        if len(buffer) == 0:
            break
        stats = update(learner, buffer, torch.Generator().manual_seed(cfg.seed + step), step, len(batch))
        print(f"step {step}: loss {stats.get('loss', float('nan')):.4f}, ratio {stats.get('ratio', float('nan')):.4f}")
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"trained on {len(batch)} scored episodes; policy in {args.out}")


def main():
    args = parse_args()
    cfg = fill_defaults(parse(["--config", args.config, *args.overrides] + ([f"model={args.model}"] if args.model
                                                                              else [])))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tok = load_model(cfg.model, torch.device("cpu"), torch.float32)
    (export if args.command == "export" else train)(cfg, args, model, tok)


if __name__ == "__main__":
    main()
