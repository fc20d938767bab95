"""Algorithms, one file each, registered by name as an `Algorithm`: two pure functions and what they need.

The loop calls `algo.advantages(batch, cfg)` once per rollout batch and `algo.loss(new, batch, cfg)` per
mini-batch; it never branches on an algorithm's name, only on what the algorithm declares it needs.
`new` holds the trainer's fresh tensors for the mini-batch: "logprobs" (B, C) and "entropy" (B, C), and
"values" (B, C) for algorithms that declare `needs_critic`. `loss` returns (scalar loss, metrics) whose
values are detached 0-dim tensors (or floats): the loop reads them all at once per optimizer step, since
each `.item()` per micro-batch would stall the GPU until the host caught up.

    file               registered names
    grpo.py            grpo, dr_grpo
    dapo.py            dapo
    gspo.py            gspo
    rloo.py            rloo
    reinforce_pp.py    reinforce_pp, reinforce_pp_baseline
    ppo.py             ppo                 (actor + critic, GAE)
    dpo.py             online_dpo          (and the losses train_dpo.py uses offline)
"""
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Algorithm:
    advantages: Callable        # (batch: Experience, cfg: AlgoConfig) -> (B, C) per-token advantages
    loss: Callable              # (new: dict, batch: Experience, cfg: AlgoConfig) -> (loss, metrics: dict)
    needs_ref: Callable = lambda cfg: cfg.kl_coef > 0   # does the batch need reference log-probs?
    needs_critic: bool = False  # the loop builds a critic, fills batch.values and passes new["values"]
    keep: Callable | None = None  # (batch, cfg) -> (B,) bool: rows to train on (e.g. DAPO's dynamic sampling)
    # How the loss reduces over tokens, so that micro-batches (microbatch.py) and ranks (distributed.py) can be
    # weighted to give exactly the whole mini-batch's gradient: a fixed mode, or None for cfg.loss_agg.
    loss_agg: str | None = None
    splittable: Callable = lambda cfg: True   # False: no exact split exists (pairs, mixed reductions)


from algos import grpo, dapo, gspo, rloo, reinforce_pp, ppo, dpo  # noqa: E402,F401  (each file registers itself)


def check_config(cfg):
    """Check the algorithm's named choices before any work (a typo is a one-line error, not a crash at step 1)
    and fill the defaults that depend on the rest of the config."""
    from config import UserError
    from algos.common import AGG_MODES
    for key, value, known in [("algo.loss_agg", cfg.algo.loss_agg, AGG_MODES),
                              ("algo.kl_estimator", cfg.algo.kl_estimator, ("k1", "k2", "k3")),
                              ("algo.tis", cfg.algo.tis, ("off", "token", "seq")),
                              ("algo.dpo.loss", cfg.algo.dpo.loss, dpo.LOSSES)]:
        if value not in known:
            raise UserError(f"config key '{key}' must be one of {', '.join(known)}; got {value!r}")
    cfg.algo.norm_len = cfg.algo.norm_len or cfg.max_new_tokens   # Dr. GRPO's constant: the length limit
