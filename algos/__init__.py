"""Algorithms, one file each, registered by name as an `Algorithm`: two pure functions and what they need.

The loop calls `algo.advantages(batch, cfg)` once per rollout batch and `algo.loss(new, batch, cfg)` per
mini-batch; it never branches on an algorithm's name. `new` holds the trainer's fresh tensors for the
mini-batch: "logprobs" (B, C) and "entropy" (B, C) (and "values" (B, C) for algorithms with a critic).
"""
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Algorithm:
    advantages: Callable        # (batch: Experience, cfg: AlgoConfig) -> (B, C) per-token advantages
    loss: Callable              # (new: dict, batch: Experience, cfg: AlgoConfig) -> (loss, metrics: dict)
    needs_ref: Callable = lambda cfg: cfg.kl_coef > 0   # does the batch need reference log-probs?


from algos import grpo  # noqa: E402,F401  (each algorithm file registers itself on import)
