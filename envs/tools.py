"""Tools a model may call inside an episode (kind "tool"), and the parsers that find calls in its turn.

    env.tools=calculator,python env.parser=tag       # <calculator>12*7</calculator>, <python>print(2**10)</python>
    env.tools=calculator env.parser=hermes           # <tool_call>{"name": "calculator", "arguments": {...}}</tool_call>

A tool is `fn(arguments: str | dict) -> str` registered as @register("tool", name), with a `schema` attribute (the
JSON schema transformers' `apply_chat_template(..., tools=[...])` renders into the prompt). Parsers are plain
functions `parser(text, tool_names) -> (calls, error)`: `calls` is [(name, arguments)], `error` a message for a
malformed call. Both conventions are pluggable: add a function to PARSERS.
A turn that calls a tool gets the tools' outputs as its observation (role "tool"), reward 0, and the episode goes
on; a malformed call, an unknown tool or a tool that raises gives an observation saying so: the model sees its
mistake. Turns without a call go to the environment's step(). All of this runs in the environment workers
(envs/pool.py), so a hanging tool costs one episode.
"""
import ast
import json
import operator
import re

from registry import get, register


def _schema(name: str, description: str, param: str, param_description: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {param: {"type": "string", "description": param_description}},
        "required": [param]}}}


def _argument(arguments, key: str) -> str:
    if isinstance(arguments, dict):
        if key not in arguments:
            raise ValueError(f"missing argument '{key}'")
        arguments = arguments[key]
    if not isinstance(arguments, str):
        raise ValueError(f"argument '{key}' must be a string")
    return arguments


# the calculator: + - * / // % ** and parentheses on numbers, evaluated on the syntax tree (no eval of text)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:   # 9**9**9 would take the worker's whole deadline
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


@register("tool", "calculator")
def calculator(arguments) -> str:
    """'12*(3+4)' or {"expression": "12*(3+4)"} -> '84'."""
    expression = _argument(arguments, "expression")
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


calculator.schema = _schema("calculator", "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                            "expression", "the expression, e.g. 12*(3+4)")


@register("tool", "python")
def python(arguments) -> str:
    """Run a Python program in the sandbox (rewards/sandbox.py: no network, no host files, CPU/memory/time
    limits); -> what it printed, or the error."""
    from rewards.sandbox import Limits, run   # only workers of environments that use the tool pay for it
    r = run(_argument(arguments, "code"), limits=Limits(wall_s=5, cpu_s=5, output_chars=2000))
    if r.status != "ok":
        return f"error ({r.status}): {(r.reason or r.stderr.strip().splitlines()[-1:] or [''])[0]}"[:500]
    return r.stdout[:2000]


python.schema = _schema("python", "Run a Python program and return what it printed.", "code", "the program")


# --- parsers: the model's turn -> [(tool name, arguments)], or an error message for a malformed call ---

def parse_tags(text: str, tool_names) -> tuple[list, str | None]:
    """<name>arguments</name> for each offered tool name (a convention small char-level models can learn)."""
    calls = []
    for name in tool_names:
        opened, closed = text.count(f"<{name}>"), text.count(f"</{name}>")
        if opened != closed:
            return [], f"malformed call: <{name}> opened {opened} times, closed {closed} times"
        calls += [(m.start(), name, m.group(1)) for m in re.finditer(f"<{name}>(.*?)</{name}>", text, re.S)]
    return [(name, args) for _, name, args in sorted(calls)], None


def parse_hermes(text: str, tool_names) -> tuple[list, str | None]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5 / Hermes chat templates)."""
    if text.count("<tool_call>") != text.count("</tool_call>"):
        return [], "malformed call: unbalanced <tool_call> tags"
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        try:
            call = json.loads(body)
            calls.append((call["name"], call.get("arguments", {})))
        except (ValueError, KeyError, TypeError) as e:
            return [], f"malformed call: {type(e).__name__}: {e}"[:200]
    return calls, None


PARSERS = {"tag": parse_tags, "hermes": parse_hermes}


def check_tools(names: list[str], parser: str):
    """Unknown tool or parser -> an error listing the known ones (registry.RegistryError / ValueError)."""
    for name in names:
        get("tool", name)
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")


def call_tools(action: str, tool_names, parser: str) -> tuple[str, int, int] | None:
    """The turn's tool calls run -> (observation, calls, errors); None when the turn calls no tool."""
    if not tool_names:
        return None
    calls, error = PARSERS[parser](action, tool_names)
    if error:
        return f"error: {error}", 0, 1
    if not calls:
        return None
    outputs, errors = [], 0
    for name, arguments in calls:
        try:
            if name not in tool_names:
                raise ValueError(f"unknown tool {name!r}; available: {', '.join(tool_names)}")
            out = get("tool", name)(arguments)
            if not isinstance(out, str):
                raise TypeError(f"tool {name!r} returned {type(out).__name__}, expected str")
        except Exception as e:   # noqa: BLE001  a tool's failure is something the model should see
            out, errors = f"error: {type(e).__name__}: {e}"[:500], errors + 1
        outputs.append(out)
    return "\n".join(outputs), len(calls), errors
