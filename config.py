"""The one typed config: the core options here, each plugin's own options in its own file. Every default and every
help text lives in these dataclasses.

    python train.py --help                                  # every option with its help
    python train.py --config configs/x.yaml steps=50 algo.kl_coef=0.01

A YAML file and `key=value` overrides (dotted for nested sections) map onto `Config`; an unknown key
or a value of the wrong type is a one-line error that names the key. The checks that span options (ranges,
combinations, the world size) are in config_checks.py: `config_checks.validate(cfg, world)` after parsing.

A plugin (algorithm, task, reward, environment) declares its options beside its code with `@section`
(algos/dapo.py: `algo.dapo.*`); importing the plugin adds the section to this tree, so the tree is whole once the
entry script has imported the plugin packages, as the registry is. A choice option lists its valid values once,
in `opt(..., choices=)`; config_checks.validate checks every such option of the tree. How the tree is read and
printed (YAML, key=value, --help, the sections added in place) is config_tree.py's.
"""
import dataclasses
from dataclasses import dataclass

import config_tree
import registry
# the option tree's machinery (config_tree.py), under the names every file imports it by from here
from config_tree import (REPO, UserError, add_field, apply, load_yaml, opt, plugin_args, repo_path,  # noqa: F401
                         sections, to_dict)

# a choice shared with the code that implements it (algos/common.py aggregates by it)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
DTYPES = ("auto", "float32", "bfloat16")


def section(path: str, help: str):
    """Class decorator: a plugin's own options, declared in the plugin's file, become the section `path` of the
    one tree (a field of the core section that `path` names the parent of: "algo.dapo" -> AlgoConfig.dapo,
    "arithmetic" -> Config.arithmetic, "reward.x" -> a reward's keyword arguments, "env.x" -> an environment's).

        @section("algo.dapo", "DAPO (algo.name=dapo)")
        @dataclass
        class DAPOConfig:
            overlong_buffer: int = opt(2, "...")
            def check(self, cfg) -> list:        # optional: (field, in range?, the valid range) rules
                return [("overlong_buffer", self.overlong_buffer >= 0, ">= 0")]

    --help, YAML, key=value and to_dict then see it as any core option; config_checks.validate applies its
    choices and its check(cfg) before any work. The path is registered (kind "section"): declared twice is an error."""
    parent_path, _, name = path.rpartition(".")

    def deco(cls):
        parent = config_tree.field_type(Config, parent_path) if parent_path else Config
        if not (dataclasses.is_dataclass(parent) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"section {path!r}: a dataclass inside a section of the tree (got {parent_path!r})")
        if name in {f.name for f in dataclasses.fields(parent)} and path not in registry.names("section"):
            raise registry.RegistryError(f"section {path!r} is a core option already (config.py)")
        registry.register("section", path)(cls)    # a second declaration of the path raises here
        add_field(parent, name, cls, opt(cls(), help))
        return cls
    return deco


@dataclass
class ReplayConfig:
    enabled: bool = opt(False, "keep experiences across steps, reuse them (off = on-policy)")
    capacity: int = opt(1024, "samples held; the oldest are evicted first (FIFO)")
    max_uses: int = opt(4, "a sample is retired after this many mini-batches")
    max_staleness: int = opt(4, "evict samples generated more than this many policy "
                                                            "versions ago")
    priority: str = opt("uniform", "sampling weight: uniform, advantage (|A|^alpha) or "
                                                                "recency (decay^age)",
                        choices=("uniform", "advantage", "recency"))
    alpha: float = opt(1.0, "exponent on |advantage| for priority=advantage")
    decay: float = opt(0.5, "weight per policy version of age for priority=recency")
    log: bool = opt(True, "append every experience to <out_dir>/replay.jsonl")


@dataclass
class PartialConfig:
    budget_tokens: int = opt(0, "mode=async: new tokens per trajectory per rollout iteration; an unfinished one is "
                                "kept and continued next iteration under newer weights (0 = off, docs/async.md)")
    old_segments: str = opt("weight", "a partial trajectory's segments older than its last: weight (importance "
                                      "weight from each token's own behaviour log-prob) or mask (out of the loss)",
                            choices=("weight", "mask"))


@dataclass
class EnvConfig:
    name: str = opt("", "multi-turn environment, by registered name (see envs/); '' = single-turn rollouts", "env")
    args: str = opt("", "keyword arguments for the environment: 'max_guesses=4,digit_reward=0.1' (over those of "
                        "its own section env.<name>, where its file declares one)")
    tools: str = opt("", "tools the model may call, by registered name: 'calculator,python' (see envs/tools.py)", "tool")
    parser: str = opt("tag", "how tool calls are written: tag (<calculator>2+3</calculator>) or hermes "
                             "(<tool_call>{json}</tool_call>, the Qwen/Hermes chat-template convention)")
    max_turns: int = opt(4, "assistant turns per episode at most (tool calls count as turns)")
    max_tokens: int = opt(64, "completion budget per episode: model + observation tokens; past it the "
                              "episode is cut and flagged truncated (max_new_tokens is the budget per turn)")
    workers: int = opt(2, "environment worker processes (env steps and tools run there, killable)")
    timeout_s: float = opt(10.0, "per-step time limit; a step past it ends the episode as a recorded failure")
    max_obs_chars: int = opt(4000, "an observation longer than this ends the episode as a recorded failure")
    max_obs_image_bytes: int = opt(1 << 20, "a picture in an observation (PNG/JPEG bytes, vision policies) larger "
                                            "than this ends the episode as a recorded failure; 0 = text only")
    memory_mb: int = opt(2048, "address-space limit of each environment worker process")


@dataclass
class AlgoConfig:
    name: str = opt("grpo", "algorithm, by registered name (see algos/ and README's table)", "algo")
    clip_eps: float = opt(0.2, "PPO-style ratio clip: ratio is kept in [1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: float = opt(0.2, "upper clip (DAPO's clip-higher uses a larger value than clip_eps)")
    dual_clip: float = opt(0.0, "dual-clip PPO: with a negative advantage the loss stops growing once the ratio "
                                "passes this (> 1; verl's default is 3; 0 = off; the token-level clipped losses)")
    kl_coef: float = opt(0.0, "weight of the KL penalty to the reference model (0 = no reference model)")
    kl_estimator: str = opt("k3", "KL estimator: k1, k2 or k3 (Schulman's approximations) or exact (the whole "
                                  "vocabulary's KL in the loss: full_kl.py)", choices=("k1", "k2", "k3", "exact"))
    kl_in_reward: bool = opt(False, "put the KL penalty in the reward (per token, no gradient) instead of the loss")
    loss_agg: str = opt("token-mean", "loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, "
                                      "seq-mean-token-sum-norm", choices=AGG_MODES)
    norm_len: int = opt(0, "constant divisor of seq-mean-token-sum-norm (0 = max_new_tokens)")
    max_new_tokens: int = opt(0, "not an option: copied from max_new_tokens at start (algorithms see only this section)")
    scale_rewards: bool = opt(True, "divide group-centred rewards by the group's std (GRPO); off = Dr. GRPO style")
    step_rewards: str = opt("sum", "per-step rewards in grpo/dr_grpo: sum (one score per sample) or per_step (each "
                                   "step normalised over its group, summed from the token's step on; docs/rewards.md)",
                            choices=("sum", "per_step"))
    tis: str = opt("off", "importance sampling against rollout/train log-prob mismatch: off, token or seq (the "
                          "weight pi_train / pi_sample truncated at tis_cap), mask (a token whose weight leaves "
                          "[1/tis_cap, tis_cap] gets no loss, the others their full weight; docs/mismatch.md), "
                          "mask_high (only weights above tis_cap: AReaL's decoupled loss, docs/async.md)",
                   choices=("off", "token", "seq", "mask", "mask_high"))
    tis_cap: float = opt(2.0, "truncation of the importance weight pi_train / pi_sample (tis=mask: the band's edge)")
    epochs: int = opt(1, "passes over each rollout batch (PPO epochs); >1 reuses samples off-policy")
    minibatch_size: int = opt(0, "samples per optimizer step; 0 = the whole rollout batch (one step, on-policy)")
    # each algorithm's own options follow, declared in its file: algos/ppo.py's @section("algo.ppo", ...)


@dataclass
class RewardSections:
    """reward.<name>: the options of a reward that declares them in its own file (@section("reward.<name>", ...));
    each field is a keyword argument of that reward, as `reward_args` sets one (which wins over it)."""


@dataclass
class LoRAConfig:
    r: int = opt(0, "LoRA rank: 0 = full fine-tuning; > 0 trains only peft LoRA adapters (lora.py), the frozen base "
                    "is the reference model; adapters usually want a higher lr (e.g. 1e-3)")
    alpha: float = opt(32.0, "LoRA scale numerator: the update is B A * alpha / r")
    dropout: float = opt(0.0, "dropout on the adapters' input while training")
    targets: str = opt("all-linear", "modules to adapt: all-linear (every Linear but lm_head) or a comma list of "
                                     "module names, e.g. q_proj,v_proj")
    save_merged: bool = opt(False, "final/merged/ also gets the merged model (a plain transformers folder)")
    tf32: bool = opt(True, "on a GPU, run the adapters' float32 products on TF32 tensor cores (10-bit mantissa, "
                           "finer than the bf16 base's 7); false: full float32 (W6: ~0.5 s more per update)")


@dataclass
class KernelsConfig:   # one option per op of kernels/__init__.py (OPS); the names are checked by kernels.choose
    logprob: str = opt("auto", "log-probs and entropies from logits (models whose lm_head is not a plain Linear): "
                               "auto (Triton on CUDA, else torch) or a registered implementation "
                               "(kernels/__init__.py: triton, torch, liger)")
    linear_logprob: str = opt("auto", "log-probs and entropies from hidden states and the lm_head: auto or a "
                                      "registered implementation")
    logprob_loss: str = opt("auto", "fused_loss=true's log-prob + loss gradient: auto or a registered implementation")
    sample: str = opt("auto", "the fast decoder's token sampler: auto or a registered implementation")
    decode_attention: str = opt("auto", "the fast decoder's attention: auto or a registered implementation")


@dataclass
class VisionConfig:
    train_tower: bool = opt(False, "vision-language models: train the vision encoder too (default: frozen; vision.py)")


@dataclass
class Config:
    # what to train
    model: str = opt("assets/tiny-model", "local folder or hub id of a transformers causal LM")
    task: str = opt("arithmetic", "prompt source, by registered name; its settings are the section of that name",
                    "task")
    rewards: str = opt("arithmetic", "reward plugins with weights: 'name[:weight],name[:weight]'", "reward")
    accuracy_reward: str = opt("", "the verifier behind accuracy and pass@k: a sample is correct when this reward "
                                   "gives it 1 ('' = the task's own reward, the first in rewards)")
    engine: str = opt("builtin", "rollout engine, by registered name (vllm: pip install -r requirements-vllm.txt)",
                      "engine")
    algo: AlgoConfig = opt(AlgoConfig(), "algorithm settings")
    reward_args: str = opt("", "keyword arguments for reward plugins: 'code.wall_s=5,reward_model.path=/x'")
    reward: RewardSections = opt(RewardSections(), "the rewards' own options (each reward's file declares its "
                                                   "section reward.<name>)")
    reward_workers: int = opt(2, "reward worker processes (rewards run there, overlapped with the log-prob forwards)")
    reward_timeout_s: float = opt(30.0, "per-call reward time limit; a call past it scores 0 with a recorded reason")
    replay: ReplayConfig = opt(ReplayConfig(), "replay buffer (off by default: on-policy)")
    env: EnvConfig = opt(EnvConfig(), "multi-turn episodes with an environment and tools (off by default)")
    lora: LoRAConfig = opt(LoRAConfig(), "LoRA adapters through peft (lora.r > 0; lora.py)")
    vision: VisionConfig = opt(VisionConfig(), "vision-language models and image tasks (vision.py, docs/vision.md)")
    # how long and how big
    steps: int = opt(60, "RL steps (one step = rollout + score + update + sync)")
    prompts_per_step: int = opt(32, "prompts sampled per step")
    samples_per_prompt: int = opt(8, "completions per prompt (the GRPO group size)")
    max_new_tokens: int = opt(8, "completion length limit")
    temperature: float = opt(1.0, "sampling temperature for rollouts (log-probs are taken at this temperature)")
    top_p: float = opt(1.0, "nucleus sampling for rollouts")
    # sources of rollout/trainer mismatch, each off by default (the mismatch lab: docs/mismatch.md, engine=builtin)
    top_k: int = opt(0, "sample each rollout token from the k most likely only (0 = off)")
    logprobs_mode: str = opt("raw", "rollout log-probs the engine reports: raw (the whole distribution at "
                                    "temperature, before top_p / top_k) or processed (of the truncated, "
                                    "renormalised distribution actually sampled from, as vLLM's processed_logprobs)",
                             choices=("raw", "processed"))
    engine_dtype: str = opt("auto", "dtype the rollout engine samples in: auto (the trainer's) or float32 / bfloat16 "
                                    "(a copy of the policy in that dtype, synced after each step), or fp8 (FP8 "
                                    "copies of the large decode GEMM weights, per-channel scaled; algo.tis defaults "
                                    "to token; fp8_all: every GEMM and the head; docs/mismatch.md)",
                            choices=DTYPES + ("fp8", "fp8_all"))
    engine_lag: int = opt(0, "the engine samples with the weights of this many RL steps ago (a stale policy; "
                             "0 = the current ones; a resumed run starts the lag afresh)")
    exact_logprobs: bool = opt(False, "engine and trainer compute a sampled token's log-prob through one batch-"
                                      "invariant forward (engines/exact.py): logprob_mismatch exactly 0 (docs/exact.md)")
    exact_check: int = opt(8, "exact_logprobs: sequences of the first micro-batch per step (per rank) that the exact "
                              "pass recomputes to measure logprob_mismatch while the loss reads the engine's log-probs "
                              "(>= 1; docs/exact.md)")
    train_temperature: float = opt(0.0, "temperature of the trainer's log-probs (0 = temperature, the sampling one); "
                                        "another value is a deliberate temperature mismatch")
    # optimisation
    lr: float = opt(1e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max global grad norm (0 = off)")
    max_bad_updates: int = opt(5, "stop (with a checkpoint) after this many updates in a row with a non-finite "
                                  "loss or gradient; each one is skipped")
    warmup_steps: int = opt(0, "linear LR warm-up steps")
    micro_batch_size: int = opt(0, "samples per forward/backward; gradients accumulate up to the mini-batch "
                                   "(bounds memory; 0 = the whole mini-batch in one pass)")
    grad_checkpointing: bool = opt(False, "recompute activations in backward (less memory, ~30% more update time)")
    memory_budget_gib: float = opt(0.0, "GPU memory for this process in GiB: at setup, micro_batch_size and "
                                        "grad_checkpointing are chosen from each stage's predicted peak (memory.py, "
                                        "docs/memory.md; a value of theirs set away from its default is kept); 0 = off")
    fused_loss: bool = opt(False, "take the policy loss's gradient inside the log-prob kernel (kernels/"
                                  "logprob_loss.py): one lm_head matmul fewer per update; not with a critic")
    kernels: KernelsConfig = opt(KernelsConfig(), "the implementation of each kernel op (an unknown name lists them)")
    pack: bool = opt(False, "padding-free update: each micro-batch's real tokens as one sequence, positions restarting "
                            "per sample (flash-attn where installed, else FlexAttention on a GPU; docs/packing.md)")
    compile: bool = opt(False, "torch.compile each decoder layer for training (fewer kernel launches and saved "
                               "activations; the first step pays the compile; under torchrun the layers "
                               "inside FSDP2's units are compiled, its gather hooks run eagerly)")
    compiled_recompute: bool = opt(True, "with grad_checkpointing and compile: recompute inside each compiled "
                                         "layer's backward (fewer host calls, same values); false: transformers' "
                                         "checkpoint wrapper around the compiled layers")
    activation_budget: float = opt(0.0, "with grad_checkpointing and compile: the share of each layer's saved "
                                        "activations its compiled backward keeps rather than recomputes (torch's "
                                        "activation_memory_budget: it keeps those dearest to recompute per byte); 0 = "
                                        "recompute all it can, 1 = as compile without checkpointing (docs/speed.md)")
    # evaluation, logging, saving
    eval_every: int = opt(10, "held-out evaluation every N steps (and at start and end)")
    eval_size: int = opt(200, "held-out prompts per evaluation (0 = all)")
    eval_temperature: float = opt(0.0, "temperature for held-out evaluation (0 = greedy)")
    eval_k: int = opt(0, "also sample this many completions per held-out prompt: eval/mean@k and the unbiased "
                         "eval/pass@k for k = 1, 2, 4, ... (0 = off)")
    eval_k_temperature: float = opt(1.0, "sampling temperature of the eval_k samples")
    logger: str = opt("tensorboard", "where the metrics rows go besides metrics.jsonl, a comma list: tensorboard, "
                                     "wandb (pip install wandb; WANDB_PROJECT, WANDB_MODE=offline as wandb reads "
                                     "them); '' = metrics.jsonl only")
    save_every: int = opt(0, "save a checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = opt(3, "keep the newest N checkpoints in <out_dir>/checkpoints (0 = all)")
    resume: str = opt("", "continue from a checkpoint dir, or a run dir's newest one (so does an out_dir holding one)")
    out_dir: str = opt("", "run directory (default: runs/<algo>-<time>)")
    seed: int = opt(0, "seed for data order, sampling and init")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = opt("auto", "model dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16", choices=DTYPES)
    threads: int = opt(0, "torch CPU threads (0 = chosen from the model: 1 for a model under 100M parameters on the "
                          "CPU, where more threads mostly wait on each other on a busy machine; else torch's default)")
    parallel: str = opt("fsdp", "under torchrun, how ranks hold the policy: fsdp (sharded with FSDP2: memory "
                                "first) or replicate (each rank the whole model, gradients averaged by one "
                                "all-reduce per optimizer step: speed first, for models that fit one GPU)",
                        choices=("fsdp", "replicate"))
    offload: bool = opt(False, "keep FSDP shards, gradients and AdamW state in CPU memory (torchrun only; "
                               "see distributed.py)")
    # per-stage memory (offload.py): each moves something out of GPU memory while a stage does not need it
    offload_models: bool = opt(False, "keep the reference model (and PPO's critic) in CPU memory; each comes to the "
                                      "GPU only for its own forward (the critic: values + update)")
    offload_optimizer: bool = opt(False, "AdamW state in CPU memory; each optimizer step brings it to the GPU ~1 GiB "
                                         "at a time (offload.py; also under FSDP2)")
    engine_sleep: bool = opt(False, "engine.sleep() before each update and wake() after it (vLLM on GPU frees its "
                                    "KV cache and weights; elsewhere a note says nothing was freed)")
    decode_weights: str = opt("fused", "how the built-in engine's GPU decoder reads the weights: fused (q/k/v and "
                                       "gate/up concatenated, LoRA merged, per rollout: fastest) or in_place (no "
                                       "copy: one GEMM per projection, LoRA as its low-rank product; the copies "
                                       "are 12 GiB at a 7B LoRA, docs/lora.md)", choices=("fused", "in_place"))
    engine_keep_cache: str = opt("auto", "the built-in engine's GPU decoder keeps its KV cache, fused weights and "
                                         "CUDA graph between the loop's rollouts (no re-capture per step) instead of "
                                         "freeing them for the update: true, false, or auto (keep when they are at "
                                         "most 5% of the GPU's memory and no offload option, engine_sleep or "
                                         "memory_budget_gib is set; engines/builtin.py: keep_cache); mode=async's "
                                         "rollout ranks always keep", choices=("auto", "true", "false"))
    # asynchronous RL (async_rl.py, docs/async.md)
    mode: str = opt("sync", "sync: every rank generates and trains in turn; async (torchrun): the last rollout_ranks "
                            "ranks only generate, the others only train, overlapped (docs/async.md)",
                    choices=("sync", "async"))
    rollout_ranks: int = opt(1, "mode=async: how many ranks only generate (the last ones); the rest train")
    max_staleness: int = opt(1, "mode=async: step s trains on samples of the policy after step s-1-max_staleness "
                                "(0 = the synchronous run exactly; >0 needs algo.tis for the correction)")
    async_timeout_s: float = opt(600.0, "mode=async: a rank waiting longer than this on another (a weight "
                                        "broadcast, a batch) ends the run naming the rank it waited for")
    partial: PartialConfig = opt(PartialConfig(), "mode=async: partial rollouts (Kimi k1.5 style)")
    progress: bool = opt(True, "show a progress bar")
    profile_step: int = opt(0, "run this step under torch.profiler (0 = none): each rank writes profile-rankR.txt "
                               "(wall vs GPU kernel time per phase, top kernels) and the trace, see profiling.py")


def parse(argv: list[str], script: str = "train.py") -> Config:
    """argv -> Config. Order: defaults < YAML file < key=value overrides. Call config_checks.validate() before
    using it. `script` names the entry script in --help."""
    cfg = config_tree.parse(Config, argv, script)
    if cfg.engine_dtype in ("fp8", "fp8_all"):   # FP8 sampling defaults algo.tis to token; an algo.tis given wins
        cfg = config_tree.parse(Config, ["algo.tis=token", *argv], script)
    return cfg


def help_text(cfg=None, prefix: str = "", script: str = "train.py") -> str:
    return config_tree.help_text(cfg or Config(), prefix, script)


def fill_defaults(cfg: Config) -> Config:
    """The defaults that depend on other options, filled once after parsing."""
    cfg.algo.norm_len = cfg.algo.norm_len or cfg.max_new_tokens   # Dr. GRPO's constant: the length limit
    cfg.algo.max_new_tokens = cfg.max_new_tokens                  # the limit itself (DAPO's overlong penalty)
    cfg.model = repo_path(cfg.model)                              # the embedded model, from any directory
    return cfg


def trainer_temperature(cfg: Config) -> float:
    """The temperature of every trainer-side log-prob (policy, old, reference): the sampling one unless the
    train_temperature mismatch is switched on."""
    return cfg.train_temperature or cfg.temperature
