"""Environments for multi-turn rollouts (kind "env"), one file each, and the tools a model may call (kind "tool").

    file        registered names
    base.py     (the contract: reset / step, and the checks every result goes through)
    tools.py    tool calculator, tool python (runs in rewards/sandbox.py); parsers tag and hermes
    pool.py     (killable worker processes that run the steps, each in its own PID namespace)
    wire.py     (what the workers send back: capped JSON, checked field by field)
    hilo.py     env hilo and task hilo: find a secret code from higher/lower feedback (the embedded example)
    shapes_pair.py  env shapes_pair: two pictures in a row, the second as an observation (task=shapes, a VLM)

How to write one: docs/environments.md. Nothing here imports torch: the workers start in a fraction of a second.
"""
from envs import hilo, shapes_pair, tools  # noqa: F401  (each file registers its environments, tasks and tools)
