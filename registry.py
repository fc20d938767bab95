"""The whole plugin system: one dict per kind of plugin, filled by a decorator. Imports nothing of the project.

    from registry import register, get
    @register("reward", "my_reward")
    def my_reward(prompt, completion, **fields) -> float: ...
    fn = get("reward", "my_reward")      # unknown name -> error listing the known ones

A plugin registers itself when its module is imported. The entry scripts (train.py, train_dpo.py) import the
plugin packages explicitly (`import algos, engines, envs, rewards, tasks`), so every registered name can be found
with go-to-definition and a newcomer sees every plugin module in those packages' __init__.py lists.
Kinds "env" (multi-turn environments) and "tool" (what a model may call inside an episode) live in envs/; "kernel"
(one implementation of a kernel op, named "<op>.<implementation>") in kernels/; "section" (a plugin's own config
options, named by their dotted path "algo.dapo") is filled by config.section in the plugin's file.
"""
KINDS = ("algo", "reward", "engine", "task", "env", "tool", "kernel", "section")
_REGISTRY: dict[str, dict[str, object]] = {kind: {} for kind in KINDS}


class RegistryError(KeyError):
    def __str__(self):  # KeyError would print the message with quotes around it
        return self.args[0]


def _check_kind(kind: str):
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown plugin kind {kind!r}; known kinds: {', '.join(KINDS)}")


def register(kind: str, name: str):
    _check_kind(kind)

    def deco(obj):
        if name in _REGISTRY[kind]:
            raise RegistryError(f"{kind} {name!r} is registered twice")
        _REGISTRY[kind][name] = obj
        return obj
    return deco


def get(kind: str, name: str):
    _check_kind(kind)
    if name not in _REGISTRY[kind]:
        known = ", ".join(sorted(_REGISTRY[kind])) or "(none: is its package imported?)"
        raise RegistryError(f"unknown {kind} {name!r}; known: {known}")
    return _REGISTRY[kind][name]


def names(kind: str) -> list[str]:
    _check_kind(kind)
    return sorted(_REGISTRY[kind])
