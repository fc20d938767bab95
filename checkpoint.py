"""Checkpoints of the whole training state, and exact resume.

    python train.py save_every=10 out_dir=runs/a                 # runs/a/checkpoints/step_000010, ... (newest 3 kept)
    python train.py resume=runs/a                                # continue from the run's newest checkpoint
    python train.py resume=runs/a/checkpoints/step_000020        # continue from that one (newer ones are removed)
    python train.py out_dir=runs/a                               # a run directory with a checkpoint resumes by itself
    python train.py resume=runs/a steps=200                      # command-line keys override the saved config

Ctrl-C (SIGINT) or SIGTERM during the steps finishes the step, saves its checkpoint and prints the resume command
(train.Stop); a second one abandons the step. A finished run (final/ written, steps reached) is refused, untouched.

One checkpoint is one directory; every file is readable without this code:
    model.safetensors      the policy's full (unsharded) state dict; tied tensors stored once (meta "aliases");
                           frozen parameters (LoRA's base) are left out: they come from `model=` again
    model_optimizer.safetensors  optimizer state tensors by "<param name>/<key>" (exp_avg, ...); hyper-parameters in meta
    critic.safetensors, critic_optimizer.safetensors   the same for PPO's critic, when the run has one
    rank_state.safetensors per-rank state under "rank<r>/": torch/CUDA RNG, the loop's generators, the data order,
                           the replay buffer's contents
    config.yaml            the resolved config (what `resume` starts from)
    meta.json              step, policy version, data cursor, LR schedule, python/numpy RNG, byte lengths of
                           metrics.jsonl and replay logs at save time, ... (`written last`); "sha256": the SHA-256
                           of every other file, and "checksum": the SHA-256 of meta.json's own other keys
It is written under `step_N.tmp/` and renamed (atomic), so a crash mid-write leaves the previous checkpoint
intact; old checkpoints are renamed to `.del` before removal for the same reason. On resume, metrics.jsonl and
the replay log are truncated to their saved lengths, so no step appears twice.
Damage after the write (a truncated copy, a full disk, an edited file) shows as a checksum that differs: resume
from a run directory skips a damaged checkpoint with a warning naming it and takes the newest intact one;
nothing on disk changes until that one has loaded (train.setup writes config.yaml after checkpoint.load).

Distributed: every rank joins the collectives (full state dicts, gathering per-rank state); rank 0 alone writes;
every rank loads the files (a shared filesystem is assumed) and keeps its own rank's part.
A different world size may resume (weights and optimizer are stored whole, the data order and cursor are
global): the model, optimizer, schedule and data position carry over exactly; a rank the checkpoint did not
have takes rank 0's RNG states with its own sampling stream re-seeded, and each rank's share of the prompts
changes with the world size, so the samples differ from an uninterrupted run. Replay buffers are per rank:
a run with one refuses to change its world size.
Kill points for tests: RL_CRASH_AT=<point>:<step> makes the process SIGKILL itself at `crash_point(point, step)`.
"""
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal

import numpy as np
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

import distributed
import offload
from config import UserError, parse, to_dict

STEP_DIR = re.compile(r"^step_(\d+)$")
# what load() reads from meta.json
META_KEYS = ("step", "version", "cursor", "world_size", "trained", "schedule", "python_rng", "numpy_rng",
             "metrics_bytes", "buffer", "extra")


def crash_point(point: str, step: int):
    """Test hook: SIGKILL this process when RL_CRASH_AT names this point and step (e.g. 'update:3')."""
    if os.environ.get("RL_CRASH_AT") == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def complete(run_dir: str, warn: bool = False) -> list[str]:
    """A run's complete checkpoint directories (meta.json written), newest first. warn: name each step folder
    without meta.json on stdout (a write in progress is a step_N.tmp folder, so this one lost its meta.json)."""
    root = os.path.join(run_dir, "checkpoints")
    steps = sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(root) if os.path.isdir(root) else []) if m)
    done = [s for s in steps if os.path.exists(os.path.join(root, f"step_{s:06d}", "meta.json"))]
    if warn and int(os.environ.get("RANK", "0")) == 0:
        for s in sorted(set(steps) - set(done), reverse=True):
            print(f"warning: checkpoint {os.path.join(root, f'step_{s:06d}')} has no meta.json (deleted?): skipped",
                  flush=True)
    return [os.path.join(root, f"step_{s:06d}") for s in reversed(done)]


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint directory of a run, or None."""
    return next(iter(complete(run_dir)), None)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def meta_checksum(meta: dict) -> str:
    """SHA-256 of meta.json's keys other than "checksum", as they read back from JSON (tuples become lists)."""
    body = json.loads(json.dumps({k: v for k, v in meta.items() if k != "checksum"}))
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def damage(ckpt: str) -> str | None:
    """Why a checkpoint directory cannot be trusted (meta.json unreadable, a file missing or not the bytes that
    were saved), or None. Checkpoints written before checksums existed pass unchecked."""
    try:
        with open(os.path.join(ckpt, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:   # ValueError: not JSON, not UTF-8
        return f"meta.json unreadable: {str(e).splitlines()[0]}"
    if not isinstance(meta, dict) or ("sha256" in meta and meta.get("checksum") != meta_checksum(meta)):
        return "meta.json does not match its checksum"
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        return f"meta.json lacks {', '.join(missing)}"
    if "sha256" not in meta:   # no checksums to compare: at least every file that load() reads is there
        if not isinstance(meta["trained"], dict):
            return "meta.json's 'trained' is not a mapping"
        needed = [f for name in meta["trained"] for f in (f"{name}.safetensors", f"{name}_optimizer.safetensors")]
        for name in needed + ["rank_state.safetensors", "config.yaml"]:
            if not os.path.exists(os.path.join(ckpt, name)):
                return f"{name} is missing"
    for name, digest in meta.get("sha256", {}).items():
        path = os.path.join(ckpt, name)
        if not os.path.exists(path):
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} does not match its checksum (truncated or changed)"
    return None


def newest_intact(run_dir: str) -> str | None:
    """The newest checkpoint of a run that passes damage(), with a warning naming each damaged newer one.
    None when the run has none; a UserError when every one is damaged."""
    bad = []
    for ckpt in complete(run_dir, warn=True):
        reason = damage(ckpt)
        if reason is None:
            if int(os.environ.get("RANK", "0")) == 0:   # called before torch.distributed starts
                for path, why in bad:
                    print(f"warning: checkpoint {path} is damaged ({why}); resuming from {os.path.basename(ckpt)} "
                          "instead (the damaged one is removed once that one has loaded)", flush=True)
            return ckpt
        bad.append((ckpt, reason))
    if bad:
        raise UserError(f"every checkpoint in {os.path.dirname(bad[0][0])} is damaged (the newest, "
                        f"{os.path.basename(bad[0][0])}: {bad[0][1]}); start afresh with another out_dir")
    return None


def resolve_resume(cfg, argv: list[str]):
    """-> (cfg, checkpoint dir or None). On resume the config is the checkpoint's, overridden by argv.
    Every checkpoint it returns has passed damage()."""
    if cfg.resume:
        path = os.path.expanduser(cfg.resume)
        if os.path.exists(os.path.join(path, "meta.json")):   # a checkpoint itself: that one, intact, or an error
            reason = damage(path)
            if reason is not None:
                raise UserError(f"checkpoint {path} is damaged ({reason}); resume=<its run directory> takes the "
                                "newest intact one")
            ckpt = path
        else:
            ckpt = newest_intact(path)
        if ckpt is None and os.path.isdir(path) and os.listdir(path):
            raise UserError(f"resume='{cfg.resume}' holds no checkpoint (the run stopped before its first save): "
                            f"start it again with another out_dir, or remove it first (rm -r {path})")
        if ckpt is None:
            raise UserError(f"resume='{cfg.resume}' is neither a checkpoint nor a run directory holding one")
    else:
        ckpt = newest_intact(cfg.out_dir) if cfg.out_dir else None
        if ckpt is None:
            return cfg, None
    ckpt = os.path.abspath(ckpt)
    run_dir = os.path.dirname(os.path.dirname(ckpt))
    if cfg.out_dir and os.path.abspath(cfg.out_dir) != run_dir:
        raise UserError(f"resume continues in the checkpoint's own run directory {run_dir}; "
                        f"out_dir={cfg.out_dir} differs (drop out_dir)")
    saved = parse(["--config", os.path.join(ckpt, "config.yaml")])
    new = parse(["--config", os.path.join(ckpt, "config.yaml"), *argv])
    new.out_dir, new.resume = run_dir, ckpt
    changed = {k: (v, to_dict(new)[k]) for k, v in to_dict(saved).items()
               if k not in ("out_dir", "resume") and to_dict(new)[k] != v}
    with open(os.path.join(ckpt, "meta.json")) as f:
        step = json.load(f)["step"]
    finished = os.path.exists(os.path.join(run_dir, "final"))
    if step > new.steps or (step == new.steps and finished):   # nothing to train: refuse before anything is written
        raise UserError(f"the run in {run_dir} has trained {step} steps{' and is finished' if finished else ''}; "
                        f"steps={new.steps} leaves nothing to train (nothing was changed). To train on: "
                        f"python train.py resume={run_dir} steps=<more than {step}>; for a new run, another out_dir")
    if int(os.environ.get("RANK", "0")) == 0:   # called before torch.distributed starts
        print(f"resuming from {ckpt}" + "".join(f"; {k}: {a} -> {b}" for k, (a, b) in changed.items()), flush=True)
    return new, ckpt


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str):
    """Remove a checkpoint directory so that a crash midway never leaves a half-deleted one under its name."""
    if os.path.exists(path):
        os.replace(path, path + ".del")
        shutil.rmtree(path + ".del")


def _clean(root: str):
    for name in os.listdir(root):   # leftovers of a crash while writing or deleting
        if name.endswith((".tmp", ".del")):
            shutil.rmtree(os.path.join(root, name))


def _dedupe(sd: dict) -> tuple[dict, dict]:
    """safetensors refuses tensors that share memory (tied embeddings): store each storage once."""
    out, aliases, seen = {}, {}, {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            aliases[k] = seen[key]
        else:
            seen[key], out[k] = k, v.contiguous()
    return out, aliases


def _rng_state(generators: dict) -> dict:
    state = {"torch": torch.get_rng_state(), **{f"gen.{k}": g.get_state() for k, g in generators.items()}}
    if torch.cuda.is_available():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def _write_trained(tmp: str, name: str, model_sd: dict, optim_sd: dict) -> dict:
    """<name>.safetensors (weights) + <name>_optimizer.safetensors (optimizer tensors); the rest goes to meta."""
    weights, aliases = _dedupe(model_sd)
    save_file(weights, os.path.join(tmp, f"{name}.safetensors"))
    tensors, scalars = {}, {}
    for pname, st in optim_sd["state"].items():
        for k, v in st.items():
            (tensors if torch.is_tensor(v) else scalars)[f"{pname}/{k}"] = v
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, f"{name}_optimizer.safetensors"))
    return {"aliases": aliases, "param_groups": optim_sd["param_groups"], "scalars": scalars}


def _frozen(model) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _trained_state(model, opts: StateDictOptions) -> dict:
    """The model's state dict without its frozen parameters (LoRA: the adapters alone; else all of it)."""
    if not _frozen(model):
        return get_model_state_dict(model, options=opts)
    # ignore_frozen_params: the base is never gathered or copied; a tied head may still come along, hence the filter
    sd = get_model_state_dict(model, options=dataclasses.replace(opts, ignore_frozen_params=True))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if k in trained}


def _read_trained(ckpt: str, name: str, model, optimizer, meta: dict):
    frozen = _frozen(model)   # frozen parameters are not in the file: a partial load, checked by hand below
    opts = StateDictOptions(full_state_dict=True, strict=not frozen)
    weights = load_file(os.path.join(ckpt, f"{name}.safetensors"))
    weights.update({k: weights[v] for k, v in meta["aliases"].items()})
    try:
        odd = sorted({n for n, p in model.named_parameters() if p.requires_grad} ^ set(weights)) if frozen else []
        if odd:
            raise KeyError(f"its trained parameters differ from this run's, e.g. {odd[0]}")
        set_model_state_dict(model, weights, options=opts)
    except (RuntimeError, KeyError) as e:
        raise UserError(f"checkpoint {ckpt} does not fit this {name}: {str(e).strip().splitlines()[0]}")
    state: dict = {}
    for key, v in {**load_file(os.path.join(ckpt, f"{name}_optimizer.safetensors")), **meta["scalars"]}.items():
        pname, k = key.rsplit("/", 1)
        state.setdefault(pname, {})[k] = v
    with offload.resident(optimizer):   # offload_optimizer: loaded as without it, in CPU memory after
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": meta["param_groups"]},
                                 options=opts)


def save(run_dir: str, cfg, step: int, version: int, policy, optimizer, schedule, buffer, generators: dict,
         order: torch.Tensor, cursor: int, extra: dict, critic=None, files: dict | None = None) -> str | None:
    """Write checkpoints/step_<step>/ (all ranks call this; rank 0 writes). Returns the directory on rank 0.
    `critic` (PPO's value model, with its own optimizer) is saved beside the policy when given. `files`:
    {name: {key: tensor}} more safetensors files of rank 0's to write inside the checkpoint (mode=async's
    batches in flight), before meta.json marks it whole."""
    rank, world = distributed.rank(), distributed.world()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with offload.resident(optimizer):   # offload_optimizer: a parked FSDP2 shard cannot be gathered
        trained = {"model": (_trained_state(policy, opts),                           # collective under FSDP
                             get_optimizer_state_dict(policy, optimizer, options=opts))}
    if critic is not None:
        with offload.resident(critic.optimizer):
            trained["critic"] = (get_model_state_dict(critic.model, options=opts),
                                 get_optimizer_state_dict(critic.model, critic.optimizer, options=opts))
    mine = {f"rng.{k}": v for k, v in _rng_state(generators).items()}
    mine["order"] = order
    buffer_meta = None
    if hasattr(buffer, "state_dict"):
        tensors, buffer_meta = buffer.state_dict()
        mine.update({f"buffer.{k}": v for k, v in tensors.items()})
    per_rank = [(mine, buffer_meta)]
    if world > 1:
        per_rank = [None] * world if rank == 0 else None
        dist.gather_object((mine, buffer_meta), per_rank, dst=0, group=distributed.group())
    out = None
    if rank == 0:
        root = os.path.join(run_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        _clean(root)
        out, tmp = os.path.join(root, f"step_{step:06d}"), os.path.join(root, f"step_{step:06d}.tmp")
        os.makedirs(tmp)
        trained_meta = {}
        for name, (model_sd, optim_sd) in trained.items():
            trained_meta[name] = _write_trained(tmp, name, model_sd, optim_sd)
            crash_point("checkpoint", step)
        save_file({f"rank{r}/{k}": v.contiguous() for r, (m, _) in enumerate(per_rank) for k, v in m.items()},
                  os.path.join(tmp, "rank_state.safetensors"))
        for name, tensors in (files or {}).items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, name))
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        metrics = os.path.join(run_dir, "metrics.jsonl")
        np_state = np.random.get_state()
        meta = {"step": step, "version": version, "cursor": cursor, "world_size": world,
                "trained": trained_meta, "schedule": schedule.state_dict(),
                "python_rng": random.getstate(), "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
                "metrics_bytes": os.path.getsize(metrics) if os.path.exists(metrics) else 0,
                "buffer": [m for _, m in per_rank], "extra": extra,
                "sha256": {name: file_sha256(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}}
        meta["checksum"] = meta_checksum(meta)
        with open(os.path.join(tmp, "meta.json"), "w") as f:   # written last: its presence marks a whole checkpoint
            json.dump(meta, f)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        _remove(out)                     # only when re-saving a step (e.g. the final save after a resume)
        os.replace(tmp, out)
        _fsync_dir(root)
        done = sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(root)) if m)
        for s in done[:-cfg.keep_checkpoints] if cfg.keep_checkpoints > 0 else []:
            _remove(os.path.join(root, f"step_{s:06d}"))
    if world > 1:
        dist.barrier(group=distributed.group())
    return out


def load(ckpt: str, policy, optimizer, schedule, buffer, generators: dict, critic=None) -> dict:
    """Restore everything save() wrote (every rank calls this). Returns step, version, order, cursor, extra, rows."""
    rank, world = distributed.rank(), distributed.world()
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    old_world = meta["world_size"]
    if old_world != world and any(b is not None for b in meta["buffer"]):
        raise UserError(f"checkpoint {ckpt} holds the replay buffers of {old_world} ranks; resume it with "
                        f"{old_world} ranks (this run has {world}): replay contents cannot be re-split")
    if old_world != world and rank == 0:
        print(f"resuming a {old_world}-rank checkpoint on {world} rank(s): weights, optimizer, schedule and data "
              "position carry over; the sampling streams and per-rank prompt shares change", flush=True)
    _read_trained(ckpt, "model", policy, optimizer, meta["trained"]["model"])
    if critic is not None:
        if "critic" not in meta["trained"]:
            raise UserError(f"checkpoint {ckpt} holds no critic, and this run's algorithm needs one")
        _read_trained(ckpt, "critic", critic.model, critic.optimizer, meta["trained"]["critic"])
    schedule.load_state_dict(meta["schedule"])

    src = rank if rank < old_world else 0                   # a rank the checkpoint lacks starts from rank 0's
    prefix = f"rank{src}/"
    mine = {k[len(prefix):]: v for k, v in load_file(os.path.join(ckpt, "rank_state.safetensors")).items()
            if k.startswith(prefix)}
    torch.set_rng_state(mine["rng.torch"])
    for k, g in generators.items():
        g.set_state(mine[f"rng.gen.{k}"])
        if src != rank and k != "data":   # the data stream is global; rank 0's sampling noise is not to be repeated
            g.manual_seed(meta["step"] * 1_000_003 + rank)
    cuda = [mine[f"rng.cuda.{i}"] for i in range(sum(k.startswith("rng.cuda.") for k in mine))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate((meta["python_rng"][0], tuple(meta["python_rng"][1]), meta["python_rng"][2]))
    n = meta["numpy_rng"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    if hasattr(buffer, "load_state_dict") and meta["buffer"][src] is not None:   # else: replay switched on now
        buffer.load_state_dict({k[7:]: v for k, v in mine.items() if k.startswith("buffer.")}, meta["buffer"][src])

    # the run continues from here: later checkpoints and logged steps belong to a future that is replayed
    run_dir = os.path.dirname(os.path.dirname(ckpt))
    if rank == 0:
        root = os.path.join(run_dir, "checkpoints")
        _clean(root)
        for m in map(STEP_DIR.match, os.listdir(root)):
            if m and int(m.group(1)) > meta["step"]:
                print(f"removing checkpoint {m.group(0)}: it is newer than the one resumed", flush=True)
                _remove(os.path.join(root, m.group(0)))
        from buffer import truncate
        truncate(os.path.join(run_dir, "metrics.jsonl"), meta["metrics_bytes"])
    if world > 1:
        dist.barrier(group=distributed.group())
    metrics = os.path.join(run_dir, "metrics.jsonl")
    with open(metrics) if os.path.exists(metrics) else open(os.devnull) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"step": meta["step"], "version": meta["version"], "order": mine["order"], "cursor": meta["cursor"],
            "extra": meta["extra"], "rows": rows}
