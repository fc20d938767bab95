"""A run's set-up, everything before the first step: the command line checked (`prepare`), then `setup` builds the
`Run` the step loop works on: policy (`build_models`), reference or distillation teacher, critic, engine, data,
reward pool, optimizer, run directory, and either the step-0 evaluation or the state of the checkpoint it resumes.

train.py calls `prepare` and `setup` (so does mode=async's trainer, through train.py: async_rl.py); the step loop
itself is train.py's. Where to edit what is built for a run: here; what a step does with it: train.py's `train_step`.
"""
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch._functorch.config  # noqa: F401  (activation_memory_budget, set below for compile=true)

import checkpoint
import distributed
import engines
import full_kl
import kernels
import lora
import memory
import offload
import registry
import run_dir
import vision
from buffer import make_buffer
from config import Config, UserError, fill_defaults, parse
from config_checks import check_reward_args, default_threads, validate
from critic import Critic
from distributed import print0
from engines import moe
from engines.builtin import keep_cache
from models import load_model, setup_device
from rewards import parse_spec, reward_kwargs
from rewards.pool import RewardPool
from rollout import accuracy_name, build_data, make_engine, make_sampler
from update import Learner

def prepare(argv: list[str]) -> tuple[Config, str | None]:
    """Every check of the command line before any work: -> (config, checkpoint to resume or None). Bad input is a
    one-line UserError (or RegistryError) from here; nothing is loaded or written."""
    cfg, resume_from = checkpoint.resolve_resume(parse(argv), argv)   # resume=<dir>, or out_dir holds a checkpoint
    cfg = fill_defaults(cfg)
    cfg.out_dir = run_dir.name(cfg)                    # checked before torchrun's ranks meet, so before any makes it
    run_dir.check(cfg.out_dir, resuming=resume_from is not None)
    # every cross-option check before the ranks meet: a bad value ends each rank alone, with no collective hanging
    run_dir.Logger.check(cfg.logger)                   # logger=wandb without wandb installed: refused now
    world = int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1
    validate(cfg, world)
    try:   # a VLM of a layout vision.py does not know, or a path its family does not take yet
        vision.check_config(cfg, world)
    except ValueError as e:
        raise UserError(str(e)) from None
    engines.exact.check_config(cfg)                    # exact_logprobs=true where exactness cannot hold: refused now
    engines.vllm.check_config(cfg)                     # engine=vllm with a VLM where vLLM cannot take pictures
    full_kl.check_config(cfg, registry.get("algo", cfg.algo.name))   # the exact KL where it cannot run yet
    kernels.choose(**vars(cfg.kernels))                # the implementation of each kernel op (kernels/__init__.py)
    check_reward_args(reward_kwargs(cfg, parse_spec(cfg.rewards)))
    accuracy_name(cfg)                                 # accuracy_reward names one of the rewards
    cfg.threads = cfg.threads or default_threads(cfg)   # threads=0: chosen from the model's size
    return cfg, resume_from


@dataclass
class Run:
    """Everything setup() builds for the step loop."""
    cfg: Config
    run_dir: str
    device: torch.device
    learner: Learner                 # policy (+ critic), optimizer, schedule, algorithm: update.py
    reference: torch.nn.Module | None
    engine: object                   # engines/base.py: Engine
    sampler: object                  # generate + score + evaluate: rollout.SingleTurn, or engines/multiturn.py (env.name)
    pool: RewardPool
    specs: list                      # [(reward name, weight)]
    tok: object
    train_set: list[dict]
    eval_set: list[dict]
    train_ids: list[list[int]]
    eval_ids: list[list[int]]
    buffer: object                   # buffer.py: OnPolicyBuffer or ReplayBuffer
    generator: torch.Generator       # data order and mini-batch shuffles (CPU)
    sample_gen: torch.Generator      # token sampling: one stream per rank (rank 0's is the one-process stream)
    order: torch.Tensor = None       # this epoch's prompt order, and the next prompt's place in it
    cursor: int = 0
    first_step: int = 1
    start: dict = None               # the step-0 evaluation
    rows: list = None                # metrics rows so far (step 0 first)
    logger: run_dir.Logger | None = None   # rank 0 only
    stages: offload.Stages = None    # per-stage memory moves (offload_* options, engine_sleep)
    broken: list = None              # this step's rounds: (share of samples whose scoring broke, a reason)
    broken_steps: int = 0            # steps in a row on which every sample's scoring broke

    def eval_gen(self) -> torch.Generator:   # evaluation samples from its own stream: training's never shifts
        return torch.Generator(device=self.device).manual_seed(self.cfg.seed + 2)



def build_models(cfg: Config, device, dtype, fsdp: bool):
    """-> policy (trained), tokenizer, the model the engine samples with, reference (or None), critic (or None)."""
    policy, tok = load_model(cfg.model, device, dtype)
    engine_model = policy   # one process (or replicate): the engine samples with the policy's own parameters
    if fsdp:   # float32 master weights, sharded; the engine keeps the full copy in `dtype` loaded above
        policy = distributed.shard(load_model(cfg.model, torch.device("cpu"), torch.float32)[0], device, dtype,
                                   cfg.offload)
    policy.train()
    try:   # a VLM's encoder stays frozen unless asked; a VLM of an unknown layout (a hub id prepare could not read)
        vision.freeze_tower(policy, cfg.vision.train_tower)
    except ValueError as e:
        raise UserError(str(e)) from None
    # memory: with compile, the recompute happens inside each compiled layer's backward (the partitioner saves
    # what activation_budget allows: at 0 the least it can), so no Python re-runs the forward (docs/speed.md)
    in_compile = cfg.compile and cfg.compiled_recompute
    if cfg.grad_checkpointing and not in_compile:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:   # speed: per layer, so one compiled graph serves every layer (they share code and shapes)
        base = getattr(policy, policy.base_model_prefix, None)
        layers = getattr(getattr(base, "language_model", base), "layers", None)   # a VLM's: its language model's
        if layers is None:
            raise UserError("compile=true needs a model with <base>.layers (decoder layers)")
        keep = cfg.activation_budget if cfg.grad_checkpointing and in_compile else 1.0
        torch._functorch.config.activation_memory_budget = keep
        for layer in layers:
            layer.compile()
    if cfg.lora.r:   # peft adapters inside the layers set up above; the engine samples with the adapted policy
        policy = engine_model = lora.wrap(policy, cfg.lora, cfg.model)
        print0(lora.describe(policy))
        if device.type == "cuda" and cfg.lora.tf32:   # speed: peft's float32 adapter GEMMs off the FMA units
            torch.set_float32_matmul_precision("high")
    else:
        lora.wrap(policy, cfg.lora, cfg.model)   # refuses a model that already carries an adapter
    return policy, tok, engine_model


def memory_plan(cfg: Config, dtype, algo) -> str:
    """memory_budget_gib: the model's shape from its config and the longest prompt from the task, before any weight
    is loaded (the task's prompts are read twice); sets micro_batch_size and grad_checkpointing (memory.py)."""
    from transformers import AutoConfig, AutoTokenizer
    try:
        mc, tok = AutoConfig.from_pretrained(cfg.model), AutoTokenizer.from_pretrained(cfg.model)
    except (OSError, ValueError) as e:
        raise UserError(f"memory_budget_gib: cannot read model '{cfg.model}': {str(e).strip().splitlines()[0]}")
    prompt_len = max(map(len, build_data(cfg, tok, SimpleNamespace(config=mc))[2]))
    return memory.apply_budget(cfg, memory.Shape.of(mc, prompt_len, cfg, distributed.world(), dtype.itemsize), algo)


def setup(cfg: Config, resume_from: str | None, rank: int) -> Run:
    """Models, engine, data, reward pool and run directory; then the step-0 evaluation, or the resumed state."""
    torch.manual_seed(cfg.seed)
    device, dtype = setup_device(cfg)
    algo = registry.get("algo", cfg.algo.name)
    if cfg.memory_budget_gib:   # micro_batch_size and grad_checkpointing from each stage's predicted peak (memory.py)
        print0(memory_plan(cfg, dtype, algo))
    specs = parse_spec(cfg.rewards)
    reward_args = reward_kwargs(cfg, specs)
    pool = RewardPool([(name, weight, reward_args.get(name, {})) for name, weight in specs],
                      workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s,   # unknown reward -> error here
                      max_new_tokens=cfg.max_new_tokens)
    fsdp = (distributed.world() > 1 and cfg.parallel == "fsdp") or cfg.offload
    policy, tok, engine_model = build_models(cfg, device, dtype, fsdp)
    moe.setup_replay(cfg, policy)   # moe.routing_replay (arch, #32): refused for dense models; hooks the routers
    train_set, eval_set, train_ids, eval_ids = build_data(cfg, tok, policy)
    reference = None
    teacher = cfg.algo.distill.teacher   # on-policy distillation: the teacher's forward is the reference's (algos/distill.py)
    if algo.needs_ref(cfg.algo) and cfg.lora.r and not teacher:   # the base itself, adapters off: no second copy (lora.py)
        reference = lora.AdaptersOff(policy)
    elif algo.needs_ref(cfg.algo):   # offload_models: it lives in CPU memory and visits the GPU (offload.py)
        reference, _ = load_model(teacher or cfg.model, torch.device("cpu") if cfg.offload_models else device, dtype)
        reference = offload.pin(reference) if cfg.offload_models else reference
        reference.eval().requires_grad_(False)
        reference = distributed.shard(reference, device, dtype, cfg.offload) if fsdp else reference
    if algo.exact_kl(cfg.algo):   # the loss's full-vocabulary KL reads both heads (full_kl.py)
        full_kl.check_models(policy, reference)
    critic = Critic(cfg, device, dtype, fsdp) if algo.needs_critic else None   # PPO's value model
    engine = make_engine(cfg, engine_model, tok, sample_dtype=cfg.engine_dtype, lag=cfg.engine_lag,   # docs/mismatch.md
                         keep_cache=keep_cache(cfg, engine_model, train_ids + eval_ids, device))
    sampler = make_sampler(cfg, engine, engine_model, tok, pool)   # single completions, or episodes (env.name)
    # speed: fused AdamW (one kernel for all parameters) on GPU; offloaded shards step on the CPU with the default
    # only what trains (LoRA: the adapters); the optimizer state and checkpoints hold nothing of the frozen base
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda" and not cfg.offload)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    run = Run(cfg=cfg, run_dir=cfg.out_dir, device=device,
              learner=Learner(policy, optimizer, schedule, algo, cfg, device, critic,
                              reference if algo.exact_kl(cfg.algo) else None), reference=reference,
              engine=engine, sampler=sampler, pool=pool, specs=specs, tok=tok, train_set=train_set, eval_set=eval_set,
              train_ids=train_ids, eval_ids=eval_ids, buffer=None,
              generator=torch.Generator().manual_seed(cfg.seed),
              sample_gen=torch.Generator(device=device).manual_seed(cfg.seed + 1 + 1_000_003 * rank))
    run.stages = offload.Stages(cfg, device, run.learner, engine)
    if offload.cpu_note(cfg, device):
        print0(offload.cpu_note(cfg, device))
    try:
        run.buffer = make_buffer(cfg, run.run_dir, resume=bool(resume_from))
    except ValueError as e:
        raise UserError(str(e))
    if resume_from:   # exact resume: weights, optimizer, schedule, buffer, RNGs, data position, logs (checkpoint.py)
        s = checkpoint.load(resume_from, policy, optimizer, schedule, run.buffer, generators(run), critic)
        run.first_step, run.learner.version, run.order, run.cursor = s["step"] + 1, s["version"], s["order"], s["cursor"]
        run.start, run.rows = s["extra"]["start"], s["rows"]
        engine.load_weights(lora.engine_weights(policy) if cfg.lora.r else distributed.sync_weights(policy))
    else:
        run.start = sampler.evaluate(cfg, eval_set, eval_ids, specs, run.eval_gen())
        print0(f"step 0: held-out accuracy {run.start['eval/accuracy']:.3f} (reward {run.start['eval/reward']:.3f})")
        run.order, run.cursor, run.rows = torch.randperm(len(train_set), generator=run.generator), 0, []
    run_dir.create(cfg, rank)   # config.yaml only now: a checkpoint that fails to load leaves the run as it was
    if rank == 0:
        run.logger = run_dir.Logger(run.run_dir, run.first_step, resume=bool(resume_from), sinks=cfg.logger)
    if not resume_from:   # step 0 is a row like the others: every curve starts before the first update
        log(run, {"step": 0, **run.start})
    return run


def generators(run: Run) -> dict:
    return {"data": run.generator, "sample": run.sample_gen}


def log(run: Run, row: dict):
    run.rows.append(row)
    shown, run.sampler.shown = getattr(run.sampler, "shown", None), None   # the last evaluation's completions, once
    if run.logger is not None:
        run.logger.log(row, shown)
