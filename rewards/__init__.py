"""Reward plugins: plain functions `(prompt, completion, **sample_fields) -> float`, registered by name.

Pick them in the config as `rewards=name[:weight],name[:weight]`; the total reward is the weighted sum.
Each module below registers its functions on import; a new reward family is one new file plus one line here.
"""
from registry import RegistryError
from rewards import task  # noqa: F401  (the embedded arithmetic verifier)


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
