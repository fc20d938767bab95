"""Algorithms, one file each, registered by name as an `Algorithm` (algos/common.py): two pure functions and
what they need.

The loop calls `algo.advantages(batch, cfg, sum_over=...)` once per rollout batch and `algo.loss(new, batch, cfg)` per
mini-batch; it never branches on an algorithm's name, only on what the algorithm declares it needs.
`new` holds the trainer's fresh tensors for the mini-batch: "logprobs" (B, C) and "entropy" (B, C), and
"values" (B, C) for algorithms that declare `needs_critic`. `sum_over` sums a list of numbers over every
process holding part of the batch (under torchrun; the identity in one process): statistics over the whole
batch use it, so algorithms never import the distributed layer. `loss` returns (scalar loss, metrics) whose
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
from algos import grpo, dapo, gspo, rloo, reinforce_pp, ppo, dpo  # noqa: F401  (each file registers itself)
from algos import distill  # noqa: F401  (on-policy distillation: algos/distill.py)
