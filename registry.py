"""The whole plugin system: one dict per kind of plugin, filled by a decorator.

    from registry import register, get
    @register("reward", "my_reward")
    def my_reward(prompt, completion, **fields) -> float: ...
    fn = get("reward", "my_reward")      # unknown name -> error listing the known ones

Plugins live in plain modules that `load_plugins()` imports explicitly (no lazy tricks), so
go-to-definition always works and a newcomer sees every plugin module in one list.
"""
KINDS = ("algo", "advantage", "reward", "kernel", "engine", "task")
_REGISTRY: dict[str, dict[str, object]] = {kind: {} for kind in KINDS}


class RegistryError(KeyError):
    def __str__(self):  # KeyError would print the message with quotes around it
        return self.args[0]


def register(kind: str, name: str):
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown plugin kind {kind!r}; known kinds: {', '.join(KINDS)}")

    def deco(obj):
        if name in _REGISTRY[kind]:
            raise RegistryError(f"{kind} {name!r} is registered twice")
        _REGISTRY[kind][name] = obj
        return obj
    return deco


def get(kind: str, name: str):
    load_plugins()
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown plugin kind {kind!r}; known kinds: {', '.join(KINDS)}")
    if name not in _REGISTRY[kind]:
        known = ", ".join(sorted(_REGISTRY[kind])) or "(none)"
        raise RegistryError(f"unknown {kind} {name!r}; known: {known}")
    return _REGISTRY[kind][name]


def names(kind: str) -> list[str]:
    load_plugins()
    return sorted(_REGISTRY[kind])


def load_plugins():
    """Import every module that registers plugins. Add a new plugin module to this list."""
    import algos  # noqa: F401  (algos/__init__.py imports each algorithm file)
    import rewards  # noqa: F401
    import kernels  # noqa: F401
    import rollout  # noqa: F401
    import rollout_vllm  # noqa: F401  (importing it never needs vLLM)
    import data  # noqa: F401
    import data_files  # noqa: F401
