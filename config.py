"""The one typed config. Every default and every help text lives in these dataclasses.

    python train.py --help                                  # every option with its help
    python train.py --config configs/x.yaml steps=50 algo.kl_coef=0.01

A YAML file and `key=value` overrides (dotted for nested sections) map onto `Config`; an unknown key
or a value of the wrong type is a one-line error that names the key. The checks that span options (ranges,
combinations, the world size) are in config_checks.py: `config_checks.validate(cfg, world)` after parsing.
"""
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field

import yaml

import registry

# the valid values of the options that name a choice (the algorithms, engines, tasks and rewards: the registry)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_MODES = ("off", "token", "seq", "mask", "mask_high")
LOGPROBS_MODES = ("raw", "processed")
DPO_LOSSES = ("sigmoid", "ipo", "simpo")
PARALLEL_MODES = ("fsdp", "replicate")
DTYPES = ("auto", "float32", "bfloat16")
DECODE_WEIGHTS = ("fused", "in_place")   # engines/decode_weights.py WEIGHTS
REPLAY_PRIORITIES = ("uniform", "advantage", "recency")
MODES = ("sync", "async")
PARTIAL_OLD = ("weight", "mask")


class UserError(Exception):
    """Bad input from the user: train.py prints it as one line and exits non-zero."""


REPO = os.path.dirname(os.path.abspath(__file__))
INT_LIMIT = 2 ** 62   # far past any real count; larger ints break len() and tensor sizes far from the option


def repo_path(path: str) -> str:
    """A relative path that is not there from the working directory but is in the repository (the embedded
    assets and configs: assets/tiny-model, configs/x.yaml) -> its absolute path there; any other path as given."""
    if path and not os.path.isabs(path) and not os.path.exists(path) and os.path.exists(os.path.join(REPO, path)):
        return os.path.join(REPO, path)
    return path


class _UniqueKeys(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue   # PyYAML's own construct_mapping refuses it with its message
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text):
    """yaml.safe_load, but a key twice in one mapping is an error (text: str or bytes, read as UTF-8/16)."""
    return yaml.load(text, Loader=_UniqueKeys)


def opt(default, help: str, registered: str = ""):
    """A config field with its help text. Sections (dataclass defaults) get a fresh instance per Config.
    `registered`: the registry kind the option names ("algo", "task", ...); --help lists that kind's names as they
    are registered, so a new plugin shows up there without an edit here."""
    meta = {"help": help, "registered": registered}
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


def help_of(f: dataclasses.Field) -> str:
    """A field's help text, with the names registered under its kind (once the plugin packages are imported)."""
    text, kind = f.metadata.get("help", ""), f.metadata.get("registered")
    names = registry.names(kind) if kind else []
    return f"{text}; registered: {', '.join(names)}" if names else text


@dataclass
class ArithmeticConfig:
    digits: int = opt(3, "operands are uniform integers in [0, 10**digits)")
    n_train: int = opt(20000, "distinct training problems (RL prompts)")
    n_eval: int = opt(500, "distinct held-out problems for evaluation")
    heldout_percent: int = opt(10, "percent of all problems reserved for held-out (stable hash)")
    seed: int = opt(0, "seed for drawing the train and held-out samples")


@dataclass
class DataFilesConfig:
    train_path: str = opt("", ".jsonl/.json/.parquet file, glob, or datasets.save_to_disk folder")
    eval_path: str = opt("", "held-out prompts, same kinds ('' = hold out eval_size train rows)")
    split: str = opt("train", "split of a DatasetDict folder used for training")
    eval_split: str = opt("test", "split of a DatasetDict folder used for evaluation")
    eval_size: int = opt(200, "rows held out from train when there is no eval_path")
    prompt_field: str = opt("question", "column holding the prompt text")
    answer_field: str = opt("answer", "column given to rewards as 'answer' ('' = none)")
    answer_regex: str = opt("", "keep the first group of this regex in the answer, e.g. '####\\s*(.+)'")
    fields: str = opt("", "extra sample fields for rewards: 'name:column,name:column'")
    prompt_template: str = opt("{prompt}", "Python format string; {prompt} is the prompt column")
    system_prompt: str = opt("", "system message when a chat template is applied")
    chat_template: str = opt("", "model/tokenizer folder whose chat template renders prompts ('' = none)")
    max_prompt_chars: int = opt(0, "drop rendered prompts longer than this (0 = no limit)")
    max_prompt_tokens: int = opt(0, "drop prompts longer than this in tokens (needs chat_template)")
    dedupe: bool = opt(True, "drop repeated prompts and train prompts that are also eval prompts")
    seed: int = opt(0, "shuffle seed")
    limit: int = opt(0, "keep at most this many training prompts (0 = all)")


@dataclass
class ReplayConfig:
    enabled: bool = opt(False, "keep experiences across steps, reuse them (off = on-policy)")
    capacity: int = opt(1024, "samples held; the oldest are evicted first (FIFO)")
    max_uses: int = opt(4, "a sample is retired after this many mini-batches")
    max_staleness: int = opt(4, "evict samples generated more than this many policy "
                                                            "versions ago")
    priority: str = opt("uniform", "sampling weight: uniform, advantage (|A|^alpha) or "
                                                                "recency (decay^age)")
    alpha: float = opt(1.0, "exponent on |advantage| for priority=advantage")
    decay: float = opt(0.5, "weight per policy version of age for priority=recency")
    log: bool = opt(True, "append every experience to <out_dir>/replay.jsonl")


@dataclass
class PartialConfig:
    budget_tokens: int = opt(0, "mode=async: new tokens per trajectory per rollout iteration; an unfinished one is "
                                "kept and continued next iteration under newer weights (0 = off, docs/async.md)")
    old_segments: str = opt("weight", "a partial trajectory's segments older than its last: weight (importance "
                                      "weight from each token's own behaviour log-prob) or mask (out of the loss)")


@dataclass
class EnvConfig:
    name: str = opt("", "multi-turn environment, by registered name (see envs/); '' = single-turn rollouts", "env")
    args: str = opt("", "keyword arguments for the environment: 'max_guesses=4,digit_reward=0.1'")
    tools: str = opt("", "tools the model may call, by registered name: 'calculator,python' (see envs/tools.py)", "tool")
    parser: str = opt("tag", "how tool calls are written: tag (<calculator>2+3</calculator>) or hermes "
                             "(<tool_call>{json}</tool_call>, the Qwen/Hermes chat-template convention)")
    max_turns: int = opt(4, "assistant turns per episode at most (tool calls count as turns)")
    max_tokens: int = opt(64, "completion budget per episode: model + observation tokens; past it the "
                              "episode is cut and flagged truncated (max_new_tokens is the budget per turn)")
    workers: int = opt(2, "environment worker processes (env steps and tools run there, killable)")
    timeout_s: float = opt(10.0, "per-step time limit; a step past it ends the episode as a recorded failure")
    max_obs_chars: int = opt(4000, "an observation longer than this ends the episode as a recorded failure")
    memory_mb: int = opt(2048, "address-space limit of each environment worker process")


@dataclass
class HiloConfig:
    digits: int = opt(3, "length of the secret code (each digit 0-9)")
    n_eval: int = opt(100, "held-out secret codes for evaluation")
    heldout_percent: int = opt(10, "percent of all codes reserved for held-out (stable hash)")
    seed: int = opt(0, "seed for drawing the codes")


@dataclass
class PPOConfig:
    gamma: float = opt(1.0, "discount of the per-token return")
    gae_lambda: float = opt(0.95, "GAE lambda: 1 = Monte-Carlo return minus value, 0 = one-step TD")
    vf_coef: float = opt(0.5, "weight of the value loss")
    value_clip: float = opt(0.2, "clip of the new value around the rollout value (0 = off)")
    whiten: bool = opt(True, "normalise advantages to mean 0, std 1 over each mini-batch's tokens (needs the "
                             "mini-batch in one pass: false for micro_batch_size > 0 or torchrun)")
    critic_lr: float = opt(1e-4, "AdamW learning rate of the critic (its own optimizer)")


@dataclass
class DPOConfig:
    loss: str = opt("sigmoid", "preference loss: sigmoid (DPO), ipo, or simpo (reference-free, length-normalised)")
    beta: float = opt(0.1, "DPO/IPO inverse temperature; SimPO's reward scale")
    simpo_gamma: float = opt(0.5, "SimPO's target margin")
    data: str = opt("assets/arithmetic_prefs.jsonl", "preference file for offline DPO (train_dpo.py): jsonl of "
                                                   "{prompt, chosen, rejected}")


@dataclass
class DAPOConfig:
    clip_eps_high: float = opt(0.28, "clip-higher: the ratio may rise to 1 + this (the low side uses algo.clip_eps)")
    overlong_buffer: int = opt(2, "soft overlong penalty starts this many tokens before max_new_tokens (0 = off)")
    overlong_penalty: float = opt(1.0, "penalty at max_new_tokens; falls linearly to 0 over the buffer")
    dynamic_sampling: bool = opt(True, "train only on groups whose rewards differ (equal ones carry no signal), "
                                       "sampling more prompts until prompts_per_step such groups are found")
    max_rounds: int = opt(3, "dynamic sampling's rollout rounds per step at most (each of prompts_per_step prompts); "
                             "a step that runs out trains on the groups it found")


@dataclass
class GSPOConfig:
    clip_eps: float = opt(3e-4, "lower clip of the sequence-level (length-normalised) ratio")
    clip_eps_high: float = opt(4e-4, "upper clip of the sequence-level ratio")


@dataclass
class DistillConfig:
    teacher: str = opt("", "teacher model folder, loaded in the reference model's place ('' = no teacher: GRPO)")
    coef: float = opt(1.0, "weight of the per-token advantage log p_teacher - log p_student")
    task_coef: float = opt(1.0, "weight of GRPO's group advantage of the task reward (0 = pure distillation)")


@dataclass
class AlgoConfig:
    name: str = opt("grpo", "algorithm, by registered name (see algos/ and README's table)", "algo")
    clip_eps: float = opt(0.2, "PPO-style ratio clip: ratio is kept in [1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: float = opt(0.2, "upper clip (DAPO's clip-higher uses a larger value than clip_eps)")
    dual_clip: float = opt(0.0, "dual-clip PPO: with a negative advantage the loss stops growing once the ratio "
                                "passes this (> 1; verl's default is 3; 0 = off; the token-level clipped losses)")
    kl_coef: float = opt(0.0, "weight of the KL penalty to the reference model (0 = no reference model)")
    kl_estimator: str = opt("k3", "KL estimator: k1, k2 or k3 (Schulman's approximations)")
    kl_in_reward: bool = opt(False, "put the KL penalty in the reward (per token, no gradient) instead of the loss")
    loss_agg: str = opt("token-mean", "loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, "
                                      "seq-mean-token-sum-norm")
    norm_len: int = opt(0, "constant divisor of seq-mean-token-sum-norm (0 = max_new_tokens)")
    max_new_tokens: int = opt(0, "not an option: copied from max_new_tokens at start (algorithms see only this section)")
    scale_rewards: bool = opt(True, "divide group-centred rewards by the group's std (GRPO); off = Dr. GRPO style")
    tis: str = opt("off", "importance sampling against rollout/train log-prob mismatch: off, token or seq (the "
                          "weight pi_train / pi_sample truncated at tis_cap), mask (a token whose weight leaves "
                          "[1/tis_cap, tis_cap] gets no loss, the others their full weight; docs/mismatch.md), "
                          "mask_high (only weights above tis_cap: AReaL's decoupled loss, docs/async.md)")
    tis_cap: float = opt(2.0, "truncation of the importance weight pi_train / pi_sample (tis=mask: the band's edge)")
    epochs: int = opt(1, "passes over each rollout batch (PPO epochs); >1 reuses samples off-policy")
    minibatch_size: int = opt(0, "samples per optimizer step; 0 = the whole rollout batch (one step, on-policy)")
    ppo: PPOConfig = opt(PPOConfig(), "PPO (algo.name=ppo): critic and GAE")
    dpo: DPOConfig = opt(DPOConfig(), "DPO family (algo.name=online_dpo, and train_dpo.py)")
    dapo: DAPOConfig = opt(DAPOConfig(), "DAPO (algo.name=dapo)")
    gspo: GSPOConfig = opt(GSPOConfig(), "GSPO (algo.name=gspo)")
    distill: DistillConfig = opt(DistillConfig(), "on-policy distillation (algo.name=distill; docs/distill.md)")


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = opt(0.4, "GPU memory share for vLLM (weights + KV cache); the trainer shares the card")
    kv_cache_memory_bytes: int = opt(0, "KV cache size in bytes; 0 = 1 GiB on CPU, gpu_memory_utilization on GPU")
    max_model_len: int = opt(0, "context length for vLLM; 0 = the model's")
    enforce_eager: bool = opt(True, "no CUDA graphs / torch.compile: fast start")
    sleep_level: int = opt(1, "vLLM sleep level on GPU: 1 = weights to CPU, 2 = discard (sync after wake)")


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
class MoEConfig:   # engines/moe.py (arch helper, #32): move beside it as @section("moe") once sections land
    routing_replay: bool = opt(False, "R3: the rollout records each token's experts per MoE layer and the trainer's "
                                      "forwards reuse them (gating weights from the trainer's router over those "
                                      "experts), so training log-probs follow the sampled routing; MoE models, "
                                      "engine=builtin (engines/moe.py, docs/architectures.md)")


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
    vllm: VLLMConfig = opt(VLLMConfig(), "settings of engine=vllm")
    algo: AlgoConfig = opt(AlgoConfig(), "algorithm settings")
    arithmetic: ArithmeticConfig = opt(ArithmeticConfig(), "settings of the embedded arithmetic task")
    files: DataFilesConfig = opt(DataFilesConfig(), "settings of the file-based task (task=files: jsonl, parquet, HF folder)")
    reward_args: str = opt("", "keyword arguments for reward plugins: 'code.wall_s=5,reward_model.path=/x'")
    reward_workers: int = opt(2, "reward worker processes (rewards run there, overlapped with the log-prob forwards)")
    reward_timeout_s: float = opt(30.0, "per-call reward time limit; a call past it scores 0 with a recorded reason")
    replay: ReplayConfig = opt(ReplayConfig(), "replay buffer (off by default: on-policy)")
    env: EnvConfig = opt(EnvConfig(), "multi-turn episodes with an environment and tools (off by default)")
    hilo: HiloConfig = opt(HiloConfig(), "settings of the embedded multi-turn task (task=hilo, env.name=hilo)")
    lora: LoRAConfig = opt(LoRAConfig(), "LoRA adapters through peft (lora.r > 0; lora.py)")
    vision: VisionConfig = opt(VisionConfig(), "vision-language models and image tasks (vision.py, docs/vision.md)")
    moe: MoEConfig = opt(MoEConfig(), "mixture-of-experts models (engines/moe.py)")
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
                                    "renormalised distribution actually sampled from, as vLLM's processed_logprobs)")
    engine_dtype: str = opt("auto", "dtype the rollout engine samples in: auto (the trainer's) or float32 / bfloat16 "
                                    "(a copy of the policy in that dtype, synced after each step)")
    engine_lag: int = opt(0, "the engine samples with the weights of this many RL steps ago (a stale policy; "
                             "0 = the current ones; a resumed run starts the lag afresh)")
    exact_logprobs: bool = opt(False, "engine and trainer compute a sampled token's log-prob through one batch-"
                                      "invariant forward (engines/exact.py): logprob_mismatch exactly 0 (docs/exact.md)")
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
    dtype: str = opt("auto", "model dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16")
    threads: int = opt(0, "torch CPU threads (0 = chosen from the model: 1 for a model under 100M parameters on the "
                          "CPU, where more threads mostly wait on each other on a busy machine; else torch's default)")
    parallel: str = opt("fsdp", "under torchrun, how ranks hold the policy: fsdp (sharded with FSDP2: memory "
                                "first) or replicate (each rank the whole model, gradients averaged by one "
                                "all-reduce per optimizer step: speed first, for models that fit one GPU)")
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
                                       "are 12 GiB at a 7B LoRA, docs/lora.md)")
    # asynchronous RL (async_rl.py, docs/async.md)
    mode: str = opt("sync", "sync: every rank generates and trains in turn; async (torchrun): the last rollout_ranks "
                            "ranks only generate, the others only train, overlapped (docs/async.md)")
    rollout_ranks: int = opt(1, "mode=async: how many ranks only generate (the last ones); the rest train")
    max_staleness: int = opt(1, "mode=async: step s trains on samples of the policy after step s-1-max_staleness "
                                "(0 = the synchronous run exactly; >0 needs algo.tis for the correction)")
    async_timeout_s: float = opt(600.0, "mode=async: a rank waiting longer than this on another (a weight "
                                        "broadcast, a batch) ends the run naming the rank it waited for")
    partial: PartialConfig = opt(PartialConfig(), "mode=async: partial rollouts (Kimi k1.5 style)")
    progress: bool = opt(True, "show a progress bar")
    profile_step: int = opt(0, "run this step under torch.profiler (0 = none): each rank writes profile-rankR.txt "
                               "(wall vs GPU kernel time per phase, top kernels) and the trace, see profiling.py")


def _type_name(t) -> str:
    return getattr(t, "__name__", str(t))


def _convert(key: str, value, t):
    """Coerce a YAML/CLI value to the field type t, or raise a UserError naming the key."""
    if t is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif t is int and not isinstance(value, bool):
        try:
            if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
                if abs(int(value)) >= INT_LIMIT:
                    raise UserError(f"config key '{key}' must be below 2**62 in size; got {value!r}")
                return int(value)
        except ValueError:
            pass
    elif t is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif t is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise UserError(f"config key '{key}' expects {_type_name(t)}, got {value!r}")


def apply(cfg, updates: dict, prefix: str = ""):
    """Set (possibly nested) values from a dict onto the dataclass cfg, checking keys and types."""
    hints = typing.get_type_hints(type(cfg))
    for key, value in updates.items():
        name = f"{prefix}{key}"
        if key not in hints:
            raise UserError(f"unknown config key '{name}' (see python train.py --help)")
        t = hints[key]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise UserError(f"config key '{name}' is a section; set its fields, e.g. {name}.<field>=...")
            apply(getattr(cfg, key), value, prefix=f"{name}.")
        else:
            setattr(cfg, key, _convert(name, value, t))
    return cfg


def _nest(dotted: str, value) -> dict:
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = _merge(a.get(k, {}), v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return a


def help_text(cfg=None, prefix: str = "", script: str = "train.py") -> str:
    cfg = cfg or Config()
    lines = [] if prefix else [f"usage: python {script} [--config FILE.yaml] [key=value ...]", "", "options:"]
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"  [{prefix}{f.name}]  {help_of(f)}")
            lines.append(help_text(value, prefix=f"{prefix}{f.name}.").rstrip("\n"))
        else:
            lines.append(f"  {prefix}{f.name}={value!r:<22} ({_type_name(hints[f.name])}) {help_of(f)}")
    return "\n".join(lines) + "\n"


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's message in one line: what is wrong, and where (1-based line and column)."""
    if isinstance(e, yaml.reader.ReaderError):   # bytes that are no text, or control characters
        return f"not {e.encoding or 'Unicode'} text ({e.reason} at character {e.position + 1})"
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}"


def _field_type(dotted: str):
    """The type of the option a dotted key names, or None (an unknown key: apply() reports it)."""
    t = Config
    for part in dotted.split("."):
        hints = typing.get_type_hints(t) if dataclasses.is_dataclass(t) else {}
        if part not in hints:
            return None
        t = hints[part]
    return t


def _cli_value(key: str, text: str):
    """A key=value's value, read as YAML (so steps=10 is an int and algo={...} a section). A text option keeps
    the text as typed unless YAML reads a string from it (quotes removed): YAML would turn
    files.prompt_template={prompt} into a mapping, system_prompt=yes into a bool."""
    if not text:
        return ""
    try:
        value = load_yaml(text)
    except yaml.YAMLError as e:
        if _field_type(key) is str:
            return text
        raise UserError(f"config key '{key}': {text!r} is not valid YAML: {_yaml_problem(e)}")
    return text if _field_type(key) is str and not isinstance(value, str) else value


def parse(argv: list[str], script: str = "train.py") -> Config:
    """argv -> Config. Order: defaults < YAML file < key=value overrides. Call config_checks.validate() before
    using it. `script` names the entry script in --help."""
    updates: dict = {}
    args = list(argv)
    while args:
        a = args.pop(0)
        if a in ("-h", "--help"):
            print(help_text(script=script))
            sys.exit(0)
        if a == "--config" or a.startswith("--config="):
            path = repo_path(a.split("=", 1)[1] if "=" in a else (args.pop(0) if args else ""))
            try:
                with open(path, "rb") as f:   # bytes: PyYAML reports a bad encoding as a YAMLError with its place
                    loaded = load_yaml(f) or {}
            except OSError as e:
                raise UserError(f"cannot read config file '{path}': {e.strerror}")
            except yaml.YAMLError as e:
                raise UserError(f"config file '{path}' is not valid YAML: {_yaml_problem(e)}")
            if not isinstance(loaded, dict):
                raise UserError(f"config file '{path}' must hold a mapping of keys to values")
            updates = _merge(updates, loaded)
        elif "=" in a and not a.startswith("-"):
            key, value = a.split("=", 1)
            updates = _merge(updates, _nest(key, _cli_value(key, value)))
        else:
            raise UserError(f"unexpected argument '{a}': use key=value or --config FILE (see --help)")
    return apply(Config(), updates)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def fill_defaults(cfg: Config) -> Config:
    """The defaults that depend on other options, filled once after parsing."""
    cfg.algo.norm_len = cfg.algo.norm_len or cfg.max_new_tokens   # Dr. GRPO's constant: the length limit
    cfg.algo.max_new_tokens = cfg.max_new_tokens                  # the limit itself (DAPO's overlong penalty)
    cfg.model, cfg.algo.dpo.data = repo_path(cfg.model), repo_path(cfg.algo.dpo.data)   # from any directory
    return cfg


def trainer_temperature(cfg: Config) -> float:
    """The temperature of every trainer-side log-prob (policy, old, reference): the sampling one unless the
    train_temperature mismatch is switched on."""
    return cfg.train_temperature or cfg.temperature
