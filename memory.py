"""memory_budget_gib: micro_batch_size and grad_checkpointing chosen at setup from a predicted peak per stage.

    shape = Shape.of(model_config, prompt_len, cfg, world, dtype_bytes)      # numbers only: no weights loaded
    peaks = predict(shape, cfg, micro=32, ckpt=True)    # -> {"rollout": bytes, "update": bytes (, "logprobs")}
    line = apply_budget(cfg, shape, algo)               # sets cfg's two settings; the log line says what and why

Preference: the fastest setting whose every stage fits, by a rough time estimate (`seconds`): no recompute with
the largest micro-batch that fits (the whole mini-batch, then its divisors downwards), then recompute with the
largest that fits; except that recompute wins where the no-recompute setting would need so many small passes that
the host, not the GPU, bounds them (W1: 32 passes of 4 samples against 4 of 32 with recompute). The predicted
peaks and times do not depend on the budget, so a larger budget can only pick an earlier, faster setting (tested).
A micro_batch_size or grad_checkpointing set away from its default (0 = one pass, false) is the user's and is
kept; the defaults are the fastest setting, the budget's own first choice, so the budget moves off them only as
far as it needs to fit.

`predict` is the whole model, one screen: the byte terms every stage holds (weights, AdamW state, ...), and the
terms of each stage. Its three fitted constants (ACT, RECOMPUTE, DECODE_WORK) and LOGPROB_FWD come from peaks
measured on H100s; docs/memory.md says which measured figure gave each and how far every figure is off.
"""
import math
from dataclasses import dataclass

from config import UserError

GiB = 2**30
# bytes per token per layer per unit of (H + I), in bf16, that one layer keeps for backward (no recompute):
# compiled layers (compile=true) keep fewer than eager ones; peft's LoRA layers keep float32 copies of their inputs
ACT = {"compiled": 7.4, "eager": 10.0, "lora": 14.7}
RECOMPUTE = 22.0      # with recompute: the one layer being re-run and its gradients, bytes per token per (H + I)
LOGPROB_FWD = 5       # no-grad log-prob forward over the whole batch: ~5 live (B, T, I) tensors (gate, up, act, ...)
DECODE_WORK = 0.9 * GiB   # rollout: prefill activations, compiled step and graph pools, LoRA merge temporaries
# the order of settings (not their memory): a pass of few tokens is host-bound, so many small passes without
# recompute can be slower than a few large ones with it. Both constants are calibrated on W1 (docs/memory.md's
# table of constants says from which measurements)
HOST_PER_LAYER = {"compiled": 2.8e-3, "eager": 4.5e-3}   # s per decoder layer per pass to issue its kernels
FLOP_RATE = 350e12        # FLOP/s the update's matmuls reach


@dataclass
class Shape:
    """The numbers the prediction reads: the model's shape, the batch's, and what the options move."""
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    wb: int               # bytes per weight / activation element (2: bf16, 4: float32)
    rollout_batch: int    # sequences one rollout decodes on this rank
    minibatch: int        # samples per optimizer step on this rank (what micro-batches split)
    tokens: int           # prompt + completion tokens per sequence (the longest prompt)

    @staticmethod
    def of(mc, prompt_len: int, cfg, world: int, wb: int) -> "Shape":
        """From a transformers model config (Llama-shaped: q/k/v/o, gate/up/down) and the run's batch."""
        heads = mc.num_attention_heads
        batch = cfg.prompts_per_step * cfg.samples_per_prompt // world
        return Shape(mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, heads,
                     getattr(mc, "num_key_value_heads", None) or heads,
                     getattr(mc, "head_dim", None) or mc.hidden_size // heads, mc.vocab_size,
                     bool(getattr(mc, "tie_word_embeddings", False)), wb, batch,
                     cfg.algo.minibatch_size // world or batch,
                     prompt_len + (cfg.env.max_tokens if cfg.env.name else cfg.max_new_tokens))

    def linears(self) -> dict:
        """(in, out) features of each projection of one layer."""
        H, I, q, kv = self.hidden, self.inter, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
                "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}


def lora_targets(cfg, s: Shape) -> list[str]:
    return list(s.linears()) if cfg.lora.targets == "all-linear" else \
        [t.strip() for t in cfg.lora.targets.split(",") if t.strip() in s.linears()]


def terms(s: Shape, cfg, ref: bool) -> dict:
    """The bytes every stage holds: weights, trained parameters' gradients and AdamW state, decoder copies."""
    lin, L, wb = s.linears(), s.layers, s.wb
    n_params = s.vocab * s.hidden * (1 if s.tied else 2) + L * sum(i * o for i, o in lin.values())   # norms, biases: ~0
    adapted = lora_targets(cfg, s) if cfg.lora.r else []
    trained = L * cfg.lora.r * sum(sum(lin[t]) for t in adapted) if cfg.lora.r else n_params   # LoRA: A (r, in), B (out, r)
    tb = 4 if cfg.lora.r else wb                        # peft's adapters are float32; full FT trains in the model dtype
    # the fast decoder's copies (engines/decode_weights.py: refresh): q/k/v and gate/up joined, o/down if adapted
    groups = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"], ["o_proj"], ["down_proj"]]
    copied = [g for g in groups if len(g) > 1 or set(g) & set(adapted)]
    copies = 0 if cfg.decode_weights == "in_place" else L * wb * sum(lin[m][0] * lin[m][1] for g in copied for m in g)
    return {"weights": n_params * wb + (trained * tb if cfg.lora.r else 0),
            # a separate reference model (LoRA's is the base itself): resident, or visiting for its forward only
            "reference": n_params * wb if ref and not cfg.lora.r and not cfg.offload_models else 0,
            "reference_visit": n_params * wb if ref and not cfg.lora.r and cfg.offload_models else 0,
            "gradients": trained * tb,
            "adamw": 0 if cfg.offload_optimizer else 2 * trained * tb,       # exp_avg, exp_avg_sq
            "adamw_chunk": min(2 * trained * tb, GiB) if cfg.offload_optimizer else 0,   # offload.stream's chunk
            "copies": copies}


def predict(s: Shape, cfg, micro: int, ckpt: bool, ref: bool = False, logprobs: bool = False) -> dict:
    """Predicted peak allocated bytes per stage for micro-batches of `micro` samples (0 = the whole mini-batch) and
    recompute on or off. ref: a reference model's log-probs; logprobs: the log-prob stage runs at all."""
    t = terms(s, cfg, ref)
    m, T, L, H, I, wb = micro or s.minibatch, s.tokens, s.layers, s.hidden, s.inter, s.wb
    resident = t["weights"] + t["reference"] + t["adamw"]                    # on the GPU in every stage
    S = math.ceil(T / 64) * 64                                               # cache slots (fast_decode.sample)
    kv_cache = s.rollout_batch * L * 2 * s.kv_heads * s.head_dim * S * wb    # (B, kv_heads, S, D) K and V per layer
    rollout = resident + kv_cache + t["copies"] + DECODE_WORK
    lp_fwd = s.rollout_batch * T * LOGPROB_FWD * I * wb                       # (B, T, I) tensors, one layer at a time
    per_unit = (H + I) * wb / 2                                              # the constants are bf16 bytes per (H + I)
    kind = "lora" if cfg.lora.r else ("compiled" if cfg.compile else "eager")
    if ckpt:   # each layer's input (m, T, H) kept, one layer's activations re-made at a time in backward
        acts = m * T * L * H * wb + m * T * RECOMPUTE * per_unit
    else:      # every layer's activations kept for backward
        acts = m * T * L * ACT[kind] * per_unit
    backward = resident + t["gradients"] + acts
    step = t["weights"] + t["reference"] + t["gradients"] + t["adamw"] + t["adamw_chunk"]   # the optimizer step
    out = {"rollout": rollout, "update": max(backward, step)}
    if logprobs:
        out["logprobs"] = resident + t["reference_visit"] + lp_fwd
    return out


def seconds(s: Shape, micro: int, ckpt: bool, compiled: bool = False) -> float:
    """A rough update time, only to order the settings: per pass, the host's launches or the GPU's matmuls
    (forward + backward 6 N T FLOP, 8 N T with recompute), whichever is longer; passes x that."""
    m = micro or s.minibatch
    gpu = (8 if ckpt else 6) * s.layers * sum(i * o for i, o in s.linears().values()) * m * s.tokens / FLOP_RATE
    return -(-s.minibatch // m) * max(HOST_PER_LAYER["compiled" if compiled else "eager"] * s.layers, gpu)


def candidates(s: Shape, cfg, splittable: bool) -> list[tuple[int, bool]]:
    """(micro_batch_size, grad_checkpointing) settings, fastest first by `seconds` (no recompute and fewer passes
    first among equals); a value set away from its default is kept."""
    whole = s.minibatch
    sizes = [whole] + [d for d in range(whole - 1, 0, -1) if whole % d == 0] if splittable else [whole]
    sizes = [cfg.micro_batch_size] if cfg.micro_batch_size else sizes
    ckpts = [True] if cfg.grad_checkpointing else [False, True]
    return sorted([(0 if m >= whole else m, c) for c in ckpts for m in sizes], key=lambda mc: seconds(s, *mc, cfg.compile))


def gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def choose(s: Shape, cfg, ref: bool, logprobs: bool, splittable: bool) -> tuple[int, bool, dict]:
    """-> (micro_batch_size, grad_checkpointing, predicted peaks) under cfg.memory_budget_gib, or a UserError that
    names what does not fit."""
    budget, t = cfg.memory_budget_gib * GiB, terms(s, cfg, ref)
    parts = [("weights", t["weights"]), ("reference", t["reference"]), ("gradients", t["gradients"]),
             ("AdamW state", t["adamw"])]
    floor = sum(v for _, v in parts)
    if floor > budget:
        raise UserError(f"memory_budget_gib={cfg.memory_budget_gib:g} is under the static floor of {gib(floor)} GiB ("
                        + " + ".join(f"{k} {gib(v)}" for k, v in parts if v) + "): raise it, or set "
                        "offload_optimizer=true or lora.r")
    tried = [(m, c, predict(s, cfg, m, c, ref, logprobs)) for m, c in candidates(s, cfg, splittable)]
    for stage in ("rollout", "logprobs"):
        if tried[0][2].get(stage, 0) > budget:   # no update setting changes these stages
            raise UserError(f"memory_budget_gib={cfg.memory_budget_gib:g}: the {stage} stage alone is predicted at "
                            f"{gib(tried[0][2][stage])} GiB: raise it, or set decode_weights=in_place, "
                            "offload_optimizer=true or offload_models=true")
    for m, c, peaks in tried:
        if max(peaks.values()) <= budget:
            return m, c, peaks
    m, c, peaks = tried[-1]
    raise UserError(f"memory_budget_gib={cfg.memory_budget_gib:g}: the update needs {gib(peaks['update'])} GiB even "
                    f"with micro_batch_size={m or s.minibatch} grad_checkpointing={str(c).lower()}: raise it")


def apply_budget(cfg, s: Shape, algo) -> str:
    """Set cfg.micro_batch_size and cfg.grad_checkpointing from the budget; -> the log line that says what and why.
    algo: algos/common.py's Algorithm (does it need a reference, does its loss split over micro-batches)."""
    ref, splittable = algo.needs_ref(cfg.algo), algo.splittable(cfg.algo)
    updates = cfg.algo.epochs * -(-s.rollout_batch // s.minibatch)     # as train.extra_logprobs decides
    logprobs = ref or updates > 1 or cfg.replay.enabled               # does the log-prob stage run a forward
    kept = [k for k, v in (("micro_batch_size", cfg.micro_batch_size), ("grad_checkpointing", cfg.grad_checkpointing))
            if v]
    cfg.micro_batch_size, cfg.grad_checkpointing, peaks = choose(s, cfg, ref, logprobs, splittable)
    whole = f" (the whole mini-batch of {s.minibatch})" if not cfg.micro_batch_size else ""
    return (f"memory_budget_gib={cfg.memory_budget_gib:g}: micro_batch_size={cfg.micro_batch_size}{whole} "
            f"grad_checkpointing={str(cfg.grad_checkpointing).lower()}" + (f" ({', '.join(kept)} as set)" if kept else "")
            + "; predicted peak GiB: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in peaks.items())
            + f" (at {s.tokens} tokens per sequence)")
