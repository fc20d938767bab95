"""The layout's promises (docs/architecture.md), checked on the source: no import cycles, function-level imports
included; every file imports only its own layer or layers below; the registry is a leaf; the step loop stays short."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# lowest first; a module may import modules of its own layer or of a lower one (docs/architecture.md, "Layers")
LAYERS = [
    ["registry"],
    ["config", "config_tree", "config_checks"],
    ["buffer", "kernels", "algos", "microbatch"],
    ["distributed", "models", "lora", "memory", "offload", "critic", "profiling", "checkpoint", "async_link",
     "workers", "vision", "full_kl"],
    ["engines", "tasks", "rewards", "envs"],
    ["update", "rollout", "run_dir", "run_setup", "async_rl", "async_checkpoint"],
    ["train", "train_dpo", "tools"],
]


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every project file outside tests/."""
    out = {}
    for d, subdirs, files in os.walk(ROOT):
        subdirs[:] = [s for s in subdirs if not s.startswith(".") and s not in ("tests", "runs", "__pycache__", "assets")]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """Each module's project imports, wherever they stand in the file (module or function level)."""
    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in filter(None, map(resolve, names)):
                if target != m:
                    graph[m].add(target)
    return graph


def layer(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_module_has_a_layer():
    missing = [m for m in modules() if not any(m.split(".")[0] in names for names in LAYERS)]
    assert not missing, f"add these to LAYERS here and to docs/architecture.md: {missing}"


def test_no_import_cycles():
    graph = imports(modules())
    state: dict[str, int] = {}        # 1 = on the current path, 2 = done

    def visit(m: str, path: list[str]):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [m, t]))
            if t not in state:
                visit(t, path + [m])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_imports_go_down_the_layers():
    graph = imports(modules())
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if layer(t) > layer(m))
    assert not upward, f"imports from a lower layer up to a higher one: {upward}"
    assert graph["registry"] == set()


def test_step_loop_and_library_functions_stay_short():
    """train_step reads on one screen; no library function (tools excepted) grows past ~80 lines."""
    long = []
    for m, path in modules().items():
        if m.startswith("tools"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 85 or (node.name == "train_step" and n > 60):
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_files_stay_near_the_size_bound():
    """No file grows far past ~500 lines (STYLE.md): one that does is split along its seam, as engines/fast_decode.py
    was (its multi-turn calls: engines/fast_turns.py; its prefill: engines/fast_prefill.py) and engines/multiturn.py
    (its per-episode record: engines/episodes.py)."""
    sizes = {os.path.relpath(path, ROOT): sum(1 for _ in open(path)) for path in modules().values()}
    assert not {f: n for f, n in sizes.items() if n > 550}
    for split in ("engines/fast_decode.py", "engines/fast_turns.py", "engines/fast_prefill.py", "engines/multiturn.py",
                  "engines/episodes.py"):
        assert sizes[split] <= 500, (split, sizes[split])


def test_every_engines_file_is_in_its_table():
    """engines/ holds engines and the decoders they share: its __init__.py's table names each file, so a reader
    finds e.g. the fast decoder's multi-turn half (fast_turns.py) from the package's front page."""
    table = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "engines", "__init__.py")).read()))
    files = [f for f in os.listdir(os.path.join(ROOT, "engines")) if f.endswith(".py") and f != "__init__.py"]
    assert {"fast_turns.py", "episodes.py"} <= set(files)
    assert not [f for f in files if f not in table], "name these in engines/__init__.py's table"
