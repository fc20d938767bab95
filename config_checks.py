"""The checks of a whole config before any work starts: every rule that refuses a bad option value or a bad
combination of options lives here, each a one-line UserError naming the problem and the valid choices.

    cfg = config.fill_defaults(config.parse(argv))
    config_checks.validate(cfg, world)      # train.py and train_dpo.py, before loading anything

The options themselves (defaults, help texts, the valid choices, key=value parsing) are in config.py, and a plugin's
own options in its file with their range rules (the section's check, applied here by section_ranges). Checks that
need files or folders stay with what reads them (run_dir.check, checkpoint.resolve_resume, models.load_model).
"""
import dataclasses
import inspect
import math
import os

import torch

import registry
from config import REPO, Config, UserError, plugin_args, sections

FP8 = ("fp8", "fp8_all")   # engine_dtype's FP8 values (engines/decode_weights.py: the fp8 routes)
MAX_EVAL_K = 1024   # eval_k samples of one prompt go through the engine together
MIN_WORKER_MB = 64  # an environment worker (Python + envs/) starts within about half of it


def validate(cfg: Config, world: int = 1):
    """Every check that spans options, before any work starts: a bad value is a one-line UserError naming the
    option and its valid choices. Plugin names (algo, engine, task) are checked against the registry, so the
    entry script imports the plugin packages first; reward names are checked where the reward pool is built."""
    check_choices(cfg)
    for key, value, ok, valid in ranges(cfg) + section_ranges(cfg):
        if not ok:
            raise UserError(f"config key '{key}' must be {valid}; got {value!r}")
    algo = registry.get("algo", cfg.algo.name)
    registry.get("engine", cfg.engine), registry.get("task", cfg.task)
    if algo.needs_groups and cfg.samples_per_prompt < 2:
        raise UserError(f"algo '{cfg.algo.name}' compares the samples of one prompt (a group baseline or a pair): "
                        f"samples_per_prompt must be >= 2; got {cfg.samples_per_prompt}")
    check_device(cfg.device)
    r = cfg.replay
    if r.enabled and (r.capacity < 1 or r.max_uses < 1 or r.max_staleness < 0 or not 0 < r.decay <= 1):
        raise UserError("config keys 'replay.capacity' and 'replay.max_uses' must be >= 1, "
                        "'replay.max_staleness' >= 0 and 'replay.decay' in (0, 1]")
    check_partial(cfg)
    check_mismatch_sources(cfg, world)
    check_fp8(cfg, world)
    if cfg.mode == "async":   # from here on, `world` counts the ranks that train
        world = validate_async(cfg, world, algo)
    # distributed: every rank must run the same number of forward/backward passes (FSDP's collectives pair up
    # across ranks), so the batch must split into equal shares
    if world > 1 and cfg.prompts_per_step % world:
        raise UserError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by the world size {world}")
    if world > 1 and cfg.algo.minibatch_size % world:
        raise UserError(f"algo.minibatch_size={cfg.algo.minibatch_size} must be divisible by the world size {world}")
    check_batch_split(cfg, world)
    check_activation_budget(cfg)
    if cfg.offload and cfg.parallel == "replicate":
        raise UserError("offload=true keeps FSDP shards in CPU memory: it needs parallel=fsdp")
    if cfg.offload and "RANK" not in os.environ:
        raise UserError("offload=true shards the policy with FSDP: launch with torchrun (--nproc_per_node=1 is fine)")
    if not 0 <= cfg.eval_k <= MAX_EVAL_K or (cfg.eval_k and not cfg.eval_k_temperature > 0):
        raise UserError(f"config keys 'eval_k' must be in 0..{MAX_EVAL_K} and 'eval_k_temperature' > 0; got "
                        f"{cfg.eval_k} and {cfg.eval_k_temperature}")
    lo = cfg.lora
    if lo.r < 0 or lo.alpha <= 0 or not 0 <= lo.dropout < 1:
        raise UserError(f"config keys 'lora.r' must be >= 0, 'lora.alpha' > 0 and 'lora.dropout' in [0, 1); got "
                        f"{lo.r}, {lo.alpha}, {lo.dropout}")
    if lo.r and (cfg.offload or (world > 1 and cfg.parallel == "fsdp")):
        raise UserError("lora.r > 0 runs in one process or under torchrun with parallel=replicate (the adapters are "
                        "small); not with FSDP sharding or offload=true")
    if cfg.offload_optimizer and cfg.offload:
        raise UserError("offload=true already keeps AdamW state in CPU memory (it steps there): drop offload_optimizer, "
                        "or use it alone (shards stay on the GPU, the step too)")
    if cfg.offload_models and (cfg.offload or (world > 1 and cfg.parallel == "fsdp")):
        raise UserError("offload_models moves whole models between CPU and GPU; with FSDP use offload=true, which "
                        "keeps every shard in CPU memory")
    if cfg.memory_budget_gib and (algo.needs_critic or cfg.engine != "builtin" or cfg.offload or cfg.mode != "sync"
                                  or (world > 1 and cfg.parallel == "fsdp")):
        raise UserError("memory_budget_gib predicts one process's (or parallel=replicate's) memory with the built-in "
                        "engine and no critic: drop it with PPO, engine=vllm, FSDP, offload=true or mode=async")
    # what the algorithm declares it needs (algos/common.py: Algorithm)
    if cfg.fused_loss and (algo.needs_critic or not algo.splittable(cfg.algo)):
        raise UserError(f"fused_loss=true needs a loss that splits over rows and no critic; algo '{cfg.algo.name}' "
                        "with these settings has not")
    if (cfg.micro_batch_size or world > 1) and not algo.splittable(cfg.algo):
        raise UserError(f"algo '{cfg.algo.name}' with these settings has no exact split over micro-batches or ranks: "
                        "use micro_batch_size=0 and one process (see its Algorithm declaration)")
    check_env(cfg)
    check_unused(cfg, algo)
    check_model(cfg.model)


def ranges(cfg: Config) -> list:
    """(option, value, in range?, the valid range) of every option whose range is bounded; validate checks them
    first. A comparison with nan is False, so nan fails every check."""
    c, a = cfg, cfg.algo
    at_least_1 = [("samples_per_prompt", c.samples_per_prompt), ("prompts_per_step", c.prompts_per_step),
                  ("max_new_tokens", c.max_new_tokens), ("steps", c.steps), ("eval_every", c.eval_every),
                  ("reward_workers", c.reward_workers), ("max_bad_updates", c.max_bad_updates),
                  ("algo.epochs", a.epochs), ("exact_check", c.exact_check)]
    # 0 keeps the meaning each help text gives it (torch's default, keep all, one pass, ...)
    at_least_0 = [("threads", c.threads, "torch's default"), ("keep_checkpoints", c.keep_checkpoints, "keep all"),
                  ("micro_batch_size", c.micro_batch_size, "the whole mini-batch in one pass"),
                  ("algo.minibatch_size", a.minibatch_size, "the whole batch"),
                  ("eval_size", c.eval_size, "every held-out prompt"), ("save_every", c.save_every, "only at the end"),
                  ("warmup_steps", c.warmup_steps, "none"), ("grad_clip", c.grad_clip, "off"),
                  ("top_k", c.top_k, "off"), ("engine_lag", c.engine_lag, "the current weights"),
                  ("eval_temperature", c.eval_temperature, "greedy"), ("memory_budget_gib", c.memory_budget_gib, "off")]
    at_least_0 += [("algo.kl_coef", a.kl_coef, "no reference model"),
                   ("algo.norm_len", a.norm_len, "max_new_tokens"), ("seed", c.seed, "seed 0"),
                   ("env.max_obs_image_bytes", c.env.max_obs_image_bytes, "text observations only")]
    env = c.env
    at_least_1 += [("env.workers", env.workers), ("env.max_turns", env.max_turns), ("env.max_tokens", env.max_tokens),
                   ("env.max_obs_chars", env.max_obs_chars)]
    positive = lambda k, v: (k, v, v > 0, "> 0")
    return [("lr", c.lr, math.isfinite(c.lr) and c.lr > 0, "a finite number > 0"),
            ("algo.clip_eps", a.clip_eps, 0 < a.clip_eps <= 1, "in (0, 1] (the ratio's lower bound is 1 - clip_eps)"),
            positive("algo.clip_eps_high", a.clip_eps_high),
            ("replay.alpha", c.replay.alpha, c.replay.alpha >= 0, ">= 0 (0 = uniform)"),
            positive("env.timeout_s", env.timeout_s),
            ("env.memory_mb", env.memory_mb, env.memory_mb >= MIN_WORKER_MB,
             f">= {MIN_WORKER_MB} (a worker's Python needs about that much address space to start)"),
            ("temperature", c.temperature, c.temperature > 0, "> 0"),
            ("top_p", c.top_p, 0 < c.top_p <= 1, "in (0, 1]"),
            ("train_temperature", c.train_temperature, c.train_temperature >= 0, ">= 0 (0 = temperature)"),
            ("algo.tis_cap", a.tis_cap, a.tis_cap >= 1, ">= 1 (the weight's truncation, or the band [1/cap, cap])"),
            ("algo.dual_clip", a.dual_clip, a.dual_clip == 0 or a.dual_clip > 1, "0 (off) or > 1 (verl's 3)"),
            ("reward_timeout_s", c.reward_timeout_s, c.reward_timeout_s > 0, "> 0 (seconds)"),
            ("weight_decay", c.weight_decay, c.weight_decay >= 0, ">= 0"),
            ("activation_budget", c.activation_budget, 0 <= c.activation_budget <= 1, "in [0, 1] (0 = recompute all)"),
            *[(k, v, v >= 1, ">= 1") for k, v in at_least_1],
            *[(k, v, v >= 0, f">= 0 (0 = {zero})") for k, v, zero in at_least_0]]


def check_activation_budget(cfg: Config):
    """activation_budget (0 = off) tunes the recompute inside compiled layers, so it needs one."""
    if cfg.activation_budget and not (cfg.grad_checkpointing and cfg.compile and cfg.compiled_recompute):
        raise UserError("activation_budget sets the recompute inside compiled layers: it needs grad_checkpointing=true "
                        "compile=true (and compiled_recompute=true); without them leave it 0")
    if cfg.activation_budget and cfg.memory_budget_gib:   # memory.py predicts the full recompute's peak only
        raise UserError("activation_budget with memory_budget_gib: the budget's peak prediction assumes "
                        "activation_budget=0; set one of them")


def check_choices(section, prefix: str = ""):
    """Every option declared with choices= (config.opt), core or a plugin's, holds one of them."""
    for f in dataclasses.fields(section):
        value, known = getattr(section, f.name), f.metadata.get("choices")
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}{f.name}.")
        elif known and value not in known:
            raise UserError(f"config key '{prefix}{f.name}' must be one of {', '.join(known)}; got {value!r}")


def section_ranges(cfg: Config) -> list:
    """The rules of each plugin's own section (its check(cfg), in the plugin's file), as ranges() gives them; a
    check may also raise its own UserError for a rule that is no range."""
    return [(f"{path}.{name}", getattr(sec, name), ok, valid) for path, sec in sections(cfg) if hasattr(sec, "check")
            for name, ok, valid in sec.check(cfg)]


def mismatch_sources(cfg: Config) -> list[str]:
    """The rollout/trainer mismatch options set away from their defaults (docs/mismatch.md)."""
    return [k for k, on in [("top_k", cfg.top_k > 0), ("logprobs_mode", cfg.logprobs_mode != "raw"),
                            ("engine_dtype", cfg.engine_dtype != "auto"), ("engine_lag", cfg.engine_lag > 0),
                            ("train_temperature", cfg.train_temperature > 0)] if on]


def check_mismatch_sources(cfg: Config, world: int):
    """The mismatch options live in the built-in engine's single-turn rollout, one process, mode=sync."""
    on = [k for k in mismatch_sources(cfg) if not (k == "engine_dtype" and cfg.engine_dtype in FP8)]   # check_fp8
    if on and (cfg.engine != "builtin" or cfg.env.name or cfg.mode != "sync" or world > 1 or cfg.lora.r):
        raise UserError(f"{', '.join(on)} (the mismatch lab's options) need engine=builtin, single-turn rollouts "
                        "(no env.name), mode=sync, one process and no LoRA")


def check_fp8(cfg: Config, world: int):
    """engine_dtype=fp8 lives in the built-in engine's fast decoder (engines/decode_weights.py), single-turn,
    mode=sync: LoRA and several processes are fine; the lab's other sources and sharded weights are not."""
    if cfg.engine_dtype not in FP8:
        return
    off = [k for k, bad in [("engine=builtin", cfg.engine != "builtin"), ("no env.name", bool(cfg.env.name)),
                            ("top_k=0", cfg.top_k > 0), ("logprobs_mode=raw", cfg.logprobs_mode != "raw"),
                            ("engine_lag=0", cfg.engine_lag > 0), ("offload=false", cfg.offload),
                            ("mode=sync", cfg.mode == "async"),
                            ("parallel=replicate", world > 1 and cfg.parallel == "fsdp")] if bad]
    if off:
        raise UserError(f"engine_dtype={cfg.engine_dtype} samples through the built-in engine's fast decoder: it "
                        f"needs {', '.join(off)}")


def check_batch_split(cfg: Config, world: int):
    """The mini-batch must split the step's batch into equal whole groups, and the micro-batch the mini-batch into
    equal pieces: a ragged split is exact (microbatch.py weights pieces) but silently changes what is asked for
    (buffer.minibatches rounds a mini-batch down to whole groups) or runs a small last piece (micro_batch_size=3)."""
    n, batch = cfg.samples_per_prompt, cfg.prompts_per_step * cfg.samples_per_prompt   # samples per step, all ranks
    mb, unit = cfg.algo.minibatch_size, cfg.samples_per_prompt * world
    if mb and (mb % unit or batch % mb):
        fits = [str(m) for m in range(unit, batch + 1, unit) if batch % m == 0]
        ranks = f" on each of {world} ranks" if world > 1 else ""
        raise UserError(f"algo.minibatch_size={mb} must split the batch of {batch} samples (prompts_per_step x "
                        f"samples_per_prompt) into whole groups of {n}{ranks}: one of {', '.join(fits)}, "
                        "or 0 (the whole batch)")
    per_rank = (mb or batch) // world   # one optimizer step's samples on one rank (update.minibatch_size)
    micro = cfg.micro_batch_size
    if micro and micro < per_rank and per_rank % micro:
        fits = [str(d) for d in range(1, per_rank) if per_rank % d == 0]
        where = " on each rank" if world > 1 else ""
        raise UserError(f"micro_batch_size={micro} must divide the mini-batch of {per_rank} samples{where}: one of "
                        f"{', '.join(fits)}, or 0 / >= {per_rank} (one pass)")


def check_model(model: str):
    """A model that names a path must be there (config.fill_defaults has looked in the repository too); 'org/name'
    is left to the hub. A name whose first folder exists here is a path as well: assets/tiny-modle is a typo,
    not a hub id, and the hub would be retried for a minute before a long error."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return
    first = path.split("/")[0]
    if path.startswith((".", "/")) or path.count("/") != 1 or os.path.isdir(first) or os.path.isdir(os.path.join(REPO, first)):
        raise UserError(f"model '{model}' is not a folder here or in the repository (a hub id looks like org/name)")


def parse_kwargs(spec: str, key: str) -> dict:
    """'a=1,b=x' -> {'a': 1, 'b': 'x'} (values read as YAML), or a UserError naming the option."""
    import yaml
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not name.strip():
            raise UserError(f"config key '{key}': entry {part!r} must look like name=value")
        try:
            out[name.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[name.strip()] = value
    return out


def check_keywords(fn, kwargs: dict, what: str, rest_takes_any: bool = False):
    """Every keyword is a parameter fn names. A **rest parameter takes any keyword only with rest_takes_any (an
    environment's `**args`); a reward's **fields is for the sample's fields and would swallow a misspelling."""
    params = inspect.signature(fn).parameters
    if rest_takes_any and any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for k in kwargs:
        if k not in named:
            raise UserError(f"{what} takes no argument '{k}'; it takes: {', '.join(named) or 'none'}")


def check_env(cfg: Config):
    """env.name: registered, its env.args are parameters of its constructor, and an environment that comes with
    its own task (same name) runs with that task, whose rows hold what its reset reads."""
    if not cfg.env.name:
        return
    env = registry.get("env", cfg.env.name)
    args = {**plugin_args(cfg, f"env.{cfg.env.name}"), **parse_kwargs(cfg.env.args, "env.args")}
    check_keywords(env, args, f"env.args: environment '{cfg.env.name}'", rest_takes_any=True)
    if cfg.env.name in registry.names("task") and cfg.task != cfg.env.name:
        raise UserError(f"env.name={cfg.env.name} plays the rows of task={cfg.env.name}; task={cfg.task} has "
                        f"other fields: use task={cfg.env.name}")


def check_reward_args(reward_args: dict[str, dict]):
    """reward_args (rewards.reward_kwargs' dict): each argument is a parameter its reward names."""
    for name, kwargs in reward_args.items():
        check_keywords(registry.get("reward", name), kwargs, f"reward_args: reward '{name}'")


def check_unused(cfg: Config, algo):
    """An option set away from its default that does nothing in this run is an error saying why: it was meant
    to change something."""
    default = Config()
    if cfg.mode == "sync":
        for key in ("rollout_ranks", "max_staleness", "async_timeout_s"):
            if getattr(cfg, key) != getattr(default, key):
                raise UserError(f"{key}={getattr(cfg, key)} applies to mode=async only (this run is mode=sync): "
                                f"drop it, or use mode=async under torchrun")
    if cfg.profile_step > cfg.steps:
        raise UserError(f"profile_step={cfg.profile_step} is past the last step (steps={cfg.steps}): nothing would be "
                        "profiled; use a step in 1..steps, or 0")
    if cfg.profile_step < 0:
        raise UserError(f"config key 'profile_step' must be >= 0 (0 = none); got {cfg.profile_step}")
    ref_model = algo.needs_ref(cfg.algo) and not cfg.lora.r   # with LoRA the reference is the base, adapters off
    if cfg.offload_models and not (ref_model or algo.needs_critic):
        raise UserError(f"offload_models=true moves the reference model and the critic, and this run has neither "
                        f"(algo '{cfg.algo.name}', algo.kl_coef={cfg.algo.kl_coef}, lora.r={cfg.lora.r}): drop it")


def default_threads(cfg: Config) -> int:
    """threads=0: one thread for a model under 100M parameters (400 MB of weight files) on the CPU, where more
    threads wait on each other (and on a busy machine's other jobs) longer than they compute; else 0, torch's
    own choice. Read from the model folder's file sizes, before anything loads."""
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if not on_cpu or not os.path.isdir(cfg.model):
        return 0
    weights = [os.path.join(cfg.model, f) for f in os.listdir(cfg.model) if f.endswith((".safetensors", ".bin"))]
    return 1 if weights and sum(map(os.path.getsize, weights)) < 400e6 else 0


def check_device(device: str):
    """device names a device torch knows, and a GPU that is there."""
    if device in ("auto", "cpu"):
        return
    try:
        d = torch.device(device)
    except RuntimeError:
        raise UserError(f"config key 'device' must be auto, cpu, cuda or cuda:N; got {device!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={device} but torch sees no CUDA GPU: use device=auto (a GPU if there is one) or cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise UserError(f"device={device} but torch sees {torch.cuda.device_count()} GPU(s) (cuda:0 .. "
                        f"cuda:{torch.cuda.device_count() - 1})")


def check_partial(cfg: Config):
    """partial.*: rollout iterations and weight versions exist only in mode=async (async_rl.py)."""
    p = cfg.partial
    if p.budget_tokens < 0:
        raise UserError(f"config key 'partial.budget_tokens' must be >= 0 (0 = off); got {p.budget_tokens}")
    if p.budget_tokens and cfg.mode != "async":
        raise UserError(f"partial.budget_tokens={p.budget_tokens} continues trajectories under newer weights, which "
                        "only mode=async has: use mode=async (torchrun) or partial.budget_tokens=0")


def validate_async(cfg: Config, world: int, algo) -> int:
    """mode=async: a rollout group and a trainer group out of the torchrun ranks (async_rl.py); -> trainer ranks."""
    if "RANK" not in os.environ:
        raise UserError("mode=async puts rollout and training on different ranks: launch with torchrun, e.g. "
                        "torchrun --nproc_per_node=2 train.py mode=async")
    if not 1 <= cfg.rollout_ranks < world:
        raise UserError(f"rollout_ranks={cfg.rollout_ranks} must be in 1..{world - 1}: the world size is {world} "
                        "and at least one rank must train")
    if cfg.max_staleness < 0:
        raise UserError(f"config key 'max_staleness' must be >= 0; got {cfg.max_staleness}")
    trainers = world - cfg.rollout_ranks
    unit = math.lcm(cfg.rollout_ranks, trainers)   # every valid prompts_per_step is a multiple of it
    for what, count in (("rollout_ranks", cfg.rollout_ranks), ("the trainer ranks", trainers)):
        if cfg.prompts_per_step % count:
            raise UserError(f"prompts_per_step={cfg.prompts_per_step} must be divisible by {what} ({count}): each "
                            f"rank takes whole groups, equal shares (world {world}, rollout_ranks={cfg.rollout_ranks})"
                            f"; valid: a multiple of {unit}, e.g. {', '.join(str(unit * i) for i in (1, 2, 4, 8))}")
    if cfg.max_staleness > 0 and not algo.behaviour_weight:
        raise UserError(f"algo '{cfg.algo.name}' cannot weight samples by the behaviour policy's log-probs: "
                        "with mode=async use max_staleness=0 or another algorithm")
    if cfg.max_staleness > 0 and cfg.algo.tis == "off":
        raise UserError("mode=async with max_staleness > 0 trains on older policies' samples: set algo.tis=token "
                        "(or seq, mask, mask_high) for the importance weight pi_prox / pi_behav (docs/async.md)")
    if cfg.offload or cfg.replay.enabled or cfg.env.name or cfg.lora.r:
        raise UserError("mode=async does not combine with offload=true, replay.enabled=true, env.name (multi-turn) or "
                        "lora.r > 0 yet")
    return world - cfg.rollout_ranks
