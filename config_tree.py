"""The machinery of a typed option tree, with no option of its own: a field with its help (`opt`), a plugin's
section added to the tree in place (`add_field`, `sections`), YAML and `key=value` read onto the tree with one-line
errors that name the key (`parse`, `apply`), and --help (`help_text`). config.py holds the tree itself (`Config`
and its core sections) and `section`, the decorator a plugin declares its options with; it passes its `Config` as
the root here. Edit here to change how options are read or printed; add an option in config.py or in its plugin.
"""
import dataclasses
import os
import sys
import typing
from dataclasses import field

import yaml

import registry


class UserError(Exception):
    """Bad input from the user: train.py prints it as one line and exits non-zero."""


REPO = os.path.dirname(os.path.abspath(__file__))
INT_LIMIT = 2 ** 62   # far past any real count; larger ints break len() and tensor sizes far from the option


def repo_path(path: str) -> str:
    """A relative path that is not there from the working directory but is in the repository (the embedded
    assets and configs: assets/tiny-model, configs/x.yaml) -> its absolute path there; any other path as given."""
    if path and not os.path.isabs(path) and not os.path.exists(path) and os.path.exists(os.path.join(REPO, path)):
        return os.path.join(REPO, path)
    return path


class _UniqueKeys(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue   # PyYAML's own construct_mapping refuses it with its message
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text):
    """yaml.safe_load, but a key twice in one mapping is an error (text: str or bytes, read as UTF-8/16)."""
    return yaml.load(text, Loader=_UniqueKeys)


def opt(default, help: str, registered: str = "", choices: tuple = ()):
    """A config field with its help text. Sections (dataclass defaults) get a fresh instance per Config.
    `registered`: the registry kind the option names ("algo", "task", ...); --help lists that kind's names as they
    are registered, so a new plugin shows up there without an edit here. `choices`: the valid values of an option
    that names one (config_checks.validate refuses any other with the list)."""
    meta = {"help": help, "registered": registered, "choices": tuple(choices)}
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


def add_field(cls, name: str, t: type, f: dataclasses.Field):
    """cls (a dataclass) with one more field, changed in place so that every holder of cls (Config's default
    factories, `from config import AlgoConfig`) sees it: dataclasses regenerates the methods that list fields."""
    kept = [(g.name, g.type, field(default=g.default, default_factory=g.default_factory, metadata=g.metadata))
            for g in dataclasses.fields(cls)]
    made = dataclasses.make_dataclass(cls.__name__, kept + [(name, t, f)])
    for attr in ("__init__", "__repr__", "__eq__", "__dataclass_fields__", "__match_args__"):
        setattr(cls, attr, getattr(made, attr))
    cls.__annotations__ = {**cls.__annotations__, name: t}


def sections(cfg) -> list[tuple[str, object]]:
    """(path, section object) of every plugin section declared so far, in the order of their paths."""
    out = []
    for path in registry.names("section"):
        obj = cfg
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            out.append((path, obj))
    return out


def plugin_args(cfg, path: str) -> dict:
    """The keyword arguments that a reward's or an environment's own section gives it ("reward.<name>" -> its
    fields as a dict); {} for a plugin that declares none."""
    return next((dataclasses.asdict(s) for p, s in sections(cfg) if p == path), {})


def help_of(f: dataclasses.Field) -> str:
    """A field's help text, with the names registered under its kind (once the plugin packages are imported)."""
    text, kind = f.metadata.get("help", ""), f.metadata.get("registered")
    names = registry.names(kind) if kind else []
    return f"{text}; registered: {', '.join(names)}" if names else text


def _type_name(t) -> str:
    return getattr(t, "__name__", str(t))


def _convert(key: str, value, t):
    """Coerce a YAML/CLI value to the field type t, or raise a UserError naming the key."""
    if t is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif t is int and not isinstance(value, bool):
        try:
            if isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
                if abs(int(value)) >= INT_LIMIT:
                    raise UserError(f"config key '{key}' must be below 2**62 in size; got {value!r}")
                return int(value)
        except ValueError:
            pass
    elif t is float and not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif t is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise UserError(f"config key '{key}' expects {_type_name(t)}, got {value!r}")


def apply(cfg, updates: dict, prefix: str = ""):
    """Set (possibly nested) values from a dict onto the dataclass cfg, checking keys and types."""
    hints = typing.get_type_hints(type(cfg))
    for key, value in updates.items():
        name = f"{prefix}{key}"
        if key not in hints:
            raise UserError(f"unknown config key '{name}' (see python train.py --help)")
        t = hints[key]
        if dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise UserError(f"config key '{name}' is a section; set its fields, e.g. {name}.<field>=...")
            apply(getattr(cfg, key), value, prefix=f"{name}.")
        else:
            setattr(cfg, key, _convert(name, value, t))
    return cfg


def _nest(dotted: str, value) -> dict:
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _merge(a: dict, b: dict) -> dict:
    for k, v in b.items():
        a[k] = _merge(a.get(k, {}), v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return a


def help_text(cfg, prefix: str = "", script: str = "train.py") -> str:
    """--help: every option of the tree cfg (a dataclass instance) with its value, type and help, section by section."""
    lines = [] if prefix else [f"usage: python {script} [--config FILE.yaml] [key=value ...]", "", "options:"]
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"  [{prefix}{f.name}]  {help_of(f)}")
            inner = help_text(value, prefix=f"{prefix}{f.name}.").rstrip("\n")
            lines += [inner] if inner else []
        else:
            lines.append(f"  {prefix}{f.name}={value!r:<22} ({_type_name(hints[f.name])}) {help_of(f)}")
    return "\n".join(lines) + "\n"


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's message in one line: what is wrong, and where (1-based line and column)."""
    if isinstance(e, yaml.reader.ReaderError):   # bytes that are no text, or control characters
        return f"not {e.encoding or 'Unicode'} text ({e.reason} at character {e.position + 1})"
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}"


def field_type(root: type, dotted: str):
    """The type of the option a dotted key names in the tree root (a dataclass), or None (an unknown key: apply()
    reports it)."""
    t = root
    for part in dotted.split("."):
        hints = typing.get_type_hints(t) if dataclasses.is_dataclass(t) else {}
        if part not in hints:
            return None
        t = hints[part]
    return t


def _cli_value(root: type, key: str, text: str):
    """A key=value's value, read as YAML (so steps=10 is an int and algo={...} a section). A text option keeps
    the text as typed unless YAML reads a string from it (quotes removed): YAML would turn
    files.prompt_template={prompt} into a mapping, system_prompt=yes into a bool."""
    if not text:
        return ""
    try:
        value = load_yaml(text)
    except yaml.YAMLError as e:
        if field_type(root, key) is str:
            return text
        raise UserError(f"config key '{key}': {text!r} is not valid YAML: {_yaml_problem(e)}")
    return text if field_type(root, key) is str and not isinstance(value, str) else value


def parse(root: type, argv: list[str], script: str = "train.py"):
    """argv -> a root (the tree's dataclass) instance. Order: defaults < YAML file < key=value overrides.
    `script` names the entry script in --help."""
    updates: dict = {}
    args = list(argv)
    while args:
        a = args.pop(0)
        if a in ("-h", "--help"):
            print(help_text(root(), script=script))
            sys.exit(0)
        if a == "--config" or a.startswith("--config="):
            path = repo_path(a.split("=", 1)[1] if "=" in a else (args.pop(0) if args else ""))
            try:
                with open(path, "rb") as f:   # bytes: PyYAML reports a bad encoding as a YAMLError with its place
                    loaded = load_yaml(f) or {}
            except OSError as e:
                raise UserError(f"cannot read config file '{path}': {e.strerror}")
            except yaml.YAMLError as e:
                raise UserError(f"config file '{path}' is not valid YAML: {_yaml_problem(e)}")
            if not isinstance(loaded, dict):
                raise UserError(f"config file '{path}' must hold a mapping of keys to values")
            updates = _merge(updates, loaded)
        elif "=" in a and not a.startswith("-"):
            key, value = a.split("=", 1)
            updates = _merge(updates, _nest(key, _cli_value(root, key, value)))
        else:
            raise UserError(f"unexpected argument '{a}': use key=value or --config FILE (see --help)")
    return apply(root(), updates)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
