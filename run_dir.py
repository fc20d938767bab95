"""The run directory: what a run leaves behind, so that it can be read, plotted and reproduced.

    runs/<algo>-<time>/            (or out_dir=...)
        config.yaml                the resolved config + git commit and dirty flag
        metrics.jsonl              one JSON row per step; step 0 is the evaluation before any update
        events.out.tfevents.*      the same numbers for tensorboard, each under its metrics.jsonl key (logger=)
        wandb/                     with logger=wandb: wandb's run files (offline ones to `wandb sync`) and run_id
        curve.png                  train reward and held-out accuracy (and pass@k with eval_k)
        checkpoints/step_NNNNNN/   the whole training state (checkpoint.py)
        final/                     the trained policy + tokenizer (transformers' from_pretrained loads it)

Rank 0 alone writes (the others hold None loggers). Every file is written under a temporary name and renamed,
so a crash never leaves one half-written.
"""
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time

import yaml

from config import UserError, to_dict


def write_atomic(path: str, text: str):
    """Write to a temporary name, then rename: a crash never leaves a half-written file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def git_state() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True).stdout.strip()
    try:
        return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain"))}
    except OSError:
        return {}


def name(cfg) -> str:
    """The run directory: out_dir, or a new runs/<algo>-<time>."""
    return cfg.out_dir or os.path.join("runs", f"{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def check(run_dir: str, resuming: bool):
    """Before any work: the run directory can be written, and holds no other run's files. A directory with a
    checkpoint resumes (checkpoint.resolve_resume); any other non-empty one is refused, since a fresh run would
    overwrite its config.yaml and metrics.jsonl."""
    path = os.path.abspath(run_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"out_dir '{run_dir}' is a file, not a directory")
    existing = path
    while not os.path.exists(existing):   # the nearest existing folder is where it will be made
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"out_dir '{run_dir}' cannot be made: '{existing}' is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"out_dir '{run_dir}' is not writable (no write permission on '{existing}')")
    try:   # permissions are not all: /proc, a read-only mount or a full disk refuse even root
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=existing))
    except OSError as e:
        raise UserError(f"out_dir '{run_dir}' cannot be made in '{existing}': {e.strerror}")
    if not resuming and existing == path and os.listdir(path):
        raise UserError(f"out_dir '{run_dir}' is not empty and holds no checkpoint to resume (a run stopped before "
                        f"its first save leaves one like it): to start that run again, remove it first (rm -r "
                        f"{run_dir}), or choose a new out_dir")


def create(cfg, rank: int) -> str:
    """The run directory's path; rank 0 makes it and writes config.yaml."""
    run_dir = name(cfg)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        write_atomic(os.path.join(run_dir, "config.yaml"),
                     yaml.safe_dump({**to_dict(cfg), "git": git_state()}, sort_keys=False))
    return run_dir


class Logger:
    """metrics.jsonl, and the same rows in each sink of `sinks` ("tensorboard", "wandb": the `logger` option, a
    comma list; "" = metrics.jsonl alone). One rule for names: a metric's tag in every sink is its metrics.jsonl
    key (`reward`, `eval/accuracy`, `time/update`), so a name found in one place is found in all. An evaluation's
    sample completions (`samples`) go to each sink as a table under `eval/samples` (tensorboard: text).
    A resumed run appends to metrics.jsonl (checkpoint.load has cut it back to the checkpoint's step), purges
    tensorboard events past it, and continues the same wandb run (its id is kept in wandb/run_id), where wandb
    drops the rows of steps it has already seen; a fresh run starts each anew."""
    SINKS = ("tensorboard", "wandb")
    SHOWN = 32   # sample completions per evaluation table: enough to read, small enough for every evaluation

    @classmethod
    def check(cls, sinks: str) -> list[str]:
        """The sinks named, or a one-line UserError for an unknown one or for wandb not installed (before any work)."""
        names = [s.strip() for s in sinks.split(",") if s.strip()]
        for s in names:
            if s not in cls.SINKS:
                raise UserError(f"config key 'logger' takes a comma list of {', '.join(cls.SINKS)} ('' = metrics.jsonl "
                                f"only); got {s!r}")
        if "wandb" in names and importlib.util.find_spec("wandb") is None:
            raise UserError("logger=wandb needs the wandb package, which is not installed: pip install wandb "
                            "(or choose logger=tensorboard)")
        return names

    def __init__(self, run_dir: str, first_step: int, resume: bool, sinks: str = "tensorboard"):
        names = self.check(sinks)
        self.writer = self.wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter   # slow import: only rank 0 pays it
            self.writer = SummaryWriter(run_dir, purge_step=first_step)
        if "wandb" in names:
            self.wandb = _wandb_run(run_dir, resume)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if resume else "w")   # no stale rows

    def log(self, row: dict, samples: list[dict] | None = None):
        """One metrics row (its "step" and scalars); samples: an evaluation's completions, dicts of equal keys."""
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        step, scalars = row["step"], {k: v for k, v in row.items() if k != "step"}
        shown = (samples or [])[:self.SHOWN]
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
            if shown:
                self.writer.add_text("eval/samples", _markdown_table(shown), step)
        if self.wandb is not None:
            if shown:
                import wandb
                columns = list(shown[0])
                scalars["eval/samples"] = wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in shown])
            self.wandb.log(scalars, step=step)

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.file.close()


def _wandb_run(run_dir: str, resume: bool):
    """A wandb run under run_dir/wandb, named after the run directory, holding config.yaml (config and git state).
    Project, entity and mode come from wandb's own variables (WANDB_PROJECT, WANDB_MODE=offline, ...)."""
    import wandb
    os.makedirs(os.path.join(run_dir, "wandb"), exist_ok=True)
    id_file = os.path.join(run_dir, "wandb", "run_id")
    if resume and os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = secrets.token_hex(6)   # wandb ids: lowercase letters and digits
        write_atomic(id_file, run_id)
    config_file = os.path.join(run_dir, "config.yaml")
    config = {}
    if os.path.exists(config_file):
        with open(config_file) as f:
            config = yaml.safe_load(f)
    return wandb.init(dir=run_dir, id=run_id, resume="allow", name=os.path.basename(os.path.abspath(run_dir)),
                      config=config, settings=wandb.Settings(console="off", x_save_requirements=False))


def _markdown_table(rows: list[dict]) -> str:
    """rows as a markdown table (tensorboard's text tab renders it); cells on one line, pipes escaped."""
    cell = lambda v: str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows])


def save_final(final_dir: str, policy, tok, state_dict: dict | None = None):
    """The trained policy + tokenizer for from_pretrained, written to final.tmp and renamed: never half-written."""
    policy.save_pretrained(final_dir + ".tmp", **({"state_dict": state_dict} if state_dict else {}))
    tok.save_pretrained(final_dir + ".tmp")
    if os.path.exists(final_dir):
        shutil.rmtree(final_dir)
    os.replace(final_dir + ".tmp", final_dir)


def save_plot(run_dir: str, rows: list[dict]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [r for r in rows if "reward" in r]
    ax.plot([r["step"] for r in train], [r["reward"] for r in train], label="train reward", alpha=0.7)
    ev = [r for r in rows if "eval/accuracy" in r]
    ax.plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], "o-", label="held-out accuracy")
    for key in sorted({k for r in ev for k in r if k.startswith(("eval/pass@", "eval/mean@"))},
                      key=lambda k: (k.split("@")[0], int(k.split("@")[1]))):   # with eval_k: mean@n, pass@1..n
        ax.plot([r["step"] for r in ev if key in r], [r[key] for r in ev if key in r], ".--", label=key[5:])
    ax.set_xlabel("step"), ax.set_ylim(-0.02, 1.02), ax.grid(alpha=0.3), ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curve.png.tmp"), format="png")
    os.replace(os.path.join(run_dir, "curve.png.tmp"), os.path.join(run_dir, "curve.png"))
    plt.close(fig)


# trajectories.jsonl: a few samples per step for tools/view.py, one JSON line each, bounded in size
def log_trajectories(run_dir: str, step: int, batch, tok, info: dict, task: str, k: int = 4,
                     max_tokens: int = 2048, max_bytes: int = 64 << 20):
    """k samples of the step's batch, spread from its lowest reward to its highest (no RNG: resume stays exact):
    prompt, per-token completion text with engine (and trainer, where the loop computed them) log-probs and the
    loss mask (observations are 0), rewards by name, failure reasons, advantage. As the file fills, fewer steps
    are logged (every 2nd from 1/8 of max_bytes, every 4th from 2/8, ...), so a long run is covered to its end."""
    path = os.path.join(run_dir, "trajectories.jsonl")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size >= max_bytes or step % (1 << (8 * size // max_bytes)):
        return
    order = batch.rewards.argsort().tolist()
    picks = sorted({order[round(j * (len(order) - 1) / max(k - 1, 1))] for j in range(min(k, len(order)))})
    C, fails = batch.completion_mask.shape[1], info.get("failed", [])
    lines = []
    for i in picks:
        comp = batch.input_ids[i, -C:][batch.attention_mask[i, -C:].bool()][:max_tokens].tolist()   # real tokens
        n, model = len(comp), batch.completion_mask[i]
        r4 = lambda t: [round(x, 4) for x in t[i, :n].tolist()]                  # completion columns run left-aligned
        rec = {"step": step, "sample": i, "group": int(batch.group_ids[i]), "task": task,
               "prompt": tok.decode(batch.input_ids[i, :-C][batch.attention_mask[i, :-C].bool()].tolist()),
               "pieces": tok.batch_decode([[t] for t in comp]), "mask": [int(m) for m in model[:n].tolist()],
               "logprobs": r4(batch.sample_logprobs), "cut_tokens": int(batch.attention_mask[i, -C:].sum()) - n,
               "reward": float(batch.rewards[i]), "truncated": bool(batch.truncated[i]),
               "rewards": {name: float(v[i]) for name, v in info.get("per_reward", {}).items()},
               "failures": [{"reward": str(f.get("reward")), "category": str(f.get("category")),
                             "reason": str(f.get("reason"))[:2000]} for f in fails if f.get("sample") == i],
               "advantage": float((batch.advantages[i] * model).sum() / model.sum().clamp(min=1))}
        if batch.old_logprobs is not None:
            rec["trainer_logprobs"] = r4(batch.old_logprobs)
        if batch.turn_rewards is not None:
            rec["turn_rewards"] = r4(batch.turn_rewards)
        lines.append(json.dumps(rec))
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")
