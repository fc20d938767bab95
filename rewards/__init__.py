"""Reward plugins: plain functions `(prompt, completion, **sample_fields) -> float`, registered by name.

Pick them in the config as `rewards=name[:weight],name[:weight]`; the total reward is the weighted sum.
Each module below registers its functions on import; a new reward family is one new file plus one line here
(and a line in this table: tests/test_core.py checks that it names every registered reward).

    file              registered names
    code.py           reward code: runs the completion's program against the row's tests (in sandbox.py)
    format.py         reward format: partial credit for the <think>...</think><answer>...</answer> layout
    k12.py            reward k12: normalised string or numeric match with the row's answer
    math.py           reward math: the final answer equals the row's (math-verify)
    reward_model.py   reward reward_model: a learned sequence-classification model (batched, on a thread)
    judge.py          reward judge: an LLM reads a rubric and scores the completion (batched; docs/rewards.md)
    prm.py            reward prm: a process reward model scores each step (a list per sample; batched)
    vision.py         reward vision: answers to picture questions (counts, option letters; tasks/shapes.py)
    pool.py           (runs them in killable worker processes, overlapped with the trainer's forwards)
    (the embedded task's verifier, reward arithmetic, lives with its task in tasks/arithmetic.py)

A reward that declares `completion_tokens` or `max_new_tokens` in its signature gets them from the pool
(rewards/pool.py: SAMPLING_ARGS), e.g. a length penalty. A reward's own options are a dataclass in its file under
`@config.section("reward.<name>", ...)`: each field reaches the reward as a keyword argument (reward_kwargs).
"""
from config import plugin_args
from registry import RegistryError
from rewards import code, format, k12, math, reward_model, vision  # noqa: F401  (each registers its rewards)
from rewards import judge  # noqa: F401  (the generative judge: rewards/judge.py)
from rewards import prm  # noqa: F401  (the process reward model: rewards/prm.py)


def parse_spec(spec: str) -> list[tuple[str, float]]:
    """'a:1.0,b:0.5' -> [('a', 1.0), ('b', 0.5)]; a missing weight means 1.0."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        try:
            out.append((name.strip(), float(weight) if weight else 1.0))
        except ValueError:
            raise RegistryError(f"reward weight in {part!r} is not a number")
    if not out:
        raise RegistryError("no reward given: set rewards=name[:weight],...")
    return out


def parse_reward_args(spec: str, rewards: list[tuple[str, float]]) -> dict[str, dict]:
    """'code.wall_s=5,reward_model.path=/x' -> {'code': {'wall_s': 5}, 'reward_model': {'path': '/x'}}."""
    import yaml
    out: dict[str, dict] = {}
    names = {name for name, _ in rewards}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, value = part.partition("=")
        name, dot, arg = key.partition(".")
        if not (eq and dot and arg):
            raise RegistryError(f"reward_args entry {part!r} must look like reward.arg=value")
        if name not in names:
            raise RegistryError(f"reward_args names reward {name!r}, which is not in rewards ({', '.join(sorted(names))})")
        out.setdefault(name, {})[arg] = yaml.safe_load(value)
    return out


def reward_kwargs(cfg, rewards: list[tuple[str, float]]) -> dict[str, dict]:
    """Each reward's keyword arguments: its own section reward.<name> (where its file declares one), then
    cfg.reward_args over it."""
    given = parse_reward_args(cfg.reward_args, rewards)
    return {name: {**plugin_args(cfg, f"reward.{name}"), **given.get(name, {})} for name, _ in rewards}
