"""Rollout engines, one file each, registered by name (`engine=`). The interface they share: engines/base.py.

    file           registered name
    builtin.py     builtin     plain torch + transformers; on CUDA it decodes through engines/fast_decode.py
    vllm.py        vllm        vLLM in the trainer's process (optional: requirements-vllm.txt)
    fast_decode.py (not an engine: builtin.py's CUDA decode step; decode_weights.py: how it reads the weights;
                   decode_step.py: the model step, families.py: what differs by family, moe.py: routed experts;
                   fast_turns.py: its multi-turn calls, start_episodes / decode_turn / feed / finish;
                   fast_prefill.py: its prefill, each distinct prompt once, from a CUDA graph when kept;
                   graphs.py: CUDA graph capture with the garbage collector held off)
    generic_decode.py (not an engine: builtin.py's CUDA decode for other causal LMs, over transformers' StaticCache)
    exact.py       (not an engine: exact_logprobs' trainer forward, the same bits as its decoder's; docs/exact.md;
                   exact_decode.py: that decoder, ExactDecoder, builtin.py's and multiturn.py's under exact_logprobs)
    multiturn.py   (not an engine: the multi-turn sampler train.py uses when env.name is set; docs/environments.md;
                   episodes.py: its per-episode record and the Episodes it gives)
"""
from engines import builtin, vllm  # noqa: F401  (each file registers its engine; vllm.py imports vLLM lazily)
