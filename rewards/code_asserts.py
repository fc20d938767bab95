"""An assert case, split: the sandbox computes values, this process compares them (rewards/code.py uses it).

    p = plan("assert add(1, 2) == 3 and add(0, 0) == 0")
    p.program_exprs                      # ["add(1, 2)", "add(0, 0)"]: evaluated after the program, in the sandbox
    holds, why = p.check(program_values, free_values)     # the comparisons, made here on plain data

Each statement of a case is `assert E` or an expression `E` (imports are allowed and run before the
expressions, in every sandbox of the case). E is taken apart down to its operands: `and`, `or`, `not`
and comparison chains (==, !=, <, <=, >, >=, in, not in, is, is not) are applied here, and so are
arithmetic, displays ([a, b], {k: v}), indexing and a few pure builtins on plain data (SAFE_CALLS: so in
`abs(f(x) - 2.5) < 1e-6` the sandbox sees only `f(x)`); what is left is
  * a literal (`3`, `[1, (2, 'a')]`, `-0.5`, `None`): its value is computed here (ast.literal_eval) and
    never enters a sandbox;
  * an expression that names only builtins and the case's imports (`sorted([3, 1])`, `math.pi`): evaluated
    in a sandbox WITHOUT the program, so the program never sees it either;
  * anything else (it names the program's functions): evaluated in a fresh sandbox that ran the program.
A bare operand (`assert is_prime(7)`) must be truthy, `not E` falsy, with the truth taken here from plain data.
So the program's process holds the case's calls but none of its expected values: a program that meddles
with its interpreter (frames, hooks, fds, the harness) can only change the values of its own calls, and
an object with an __eq__ of its own never leaves the sandbox (values come back as plain-data literals).
Statements of other kinds (assignments, loops, `def check(candidate)`) are refused with a named error.
"""
import ast
import builtins
import math
import operator
from dataclasses import dataclass, field

BUILTIN_NAMES = frozenset(dir(builtins))
COMPARE = {ast.Eq: ("==", operator.eq), ast.NotEq: ("!=", operator.ne), ast.Lt: ("<", operator.lt),
           ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt), ast.GtE: (">=", operator.ge),
           ast.In: ("in", lambda a, b: a in b), ast.NotIn: ("not in", lambda a, b: a not in b),
           ast.Is: ("is", operator.is_), ast.IsNot: ("is not", operator.is_not)}

BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
          ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
          ast.BitAnd: operator.and_, ast.BitXor: operator.xor}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
# pure functions of plain data, applied here; `math.` ones only where the case imports math
SAFE_CALLS = {name: getattr(builtins, name) for name in ("abs", "round", "len", "sorted", "set", "frozenset", "list",
                                                          "tuple", "sum", "min", "max", "float", "int", "str",
                                                          "bool", "all", "any", "reversed")}
SAFE_MATH = {name: getattr(math, name) for name in ("isclose", "fabs", "sqrt", "floor", "ceil", "pi", "inf", "e")}
BIG = 10**6     # a repeat count, shift or exponent past this is refused rather than computed in the worker


def _apply(fn, args: list, kwargs: dict):
    """fn(*args, **kwargs) on plain data, refusing the few operations that could cost the worker minutes."""
    ints = [a for a in args if isinstance(a, int)]
    if fn in (operator.mul, operator.lshift, operator.pow) and any(abs(a) > BIG for a in ints) and \
            (fn is not operator.mul or any(isinstance(a, (str, bytes, list, tuple)) for a in args)):
        raise Failed(f"{getattr(fn, '__name__', fn)} on an operand past {BIG}: refused")
    if fn is operator.pow and all(isinstance(a, int) for a in args) and abs(args[1]) > 10000 and abs(args[0]) > 1:
        raise Failed("an integer power past 10000: refused")
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  TypeError, ZeroDivisionError, ... on plain data
        raise Failed(f"{type(e).__name__}: {e}")
    return list(out) if fn is reversed else out


class Failed(Exception):
    """An operand the case needs has no value (it raised in the sandbox, or compares with a TypeError)."""


def _short(value, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


@dataclass
class Plan:
    source: str
    setup: list[str] = field(default_factory=list)          # import statements
    program_exprs: list[str] = field(default_factory=list)  # evaluated after the program
    free_exprs: list[str] = field(default_factory=list)     # evaluated without the program
    checks: list = field(default_factory=list)               # one tree per statement; all must hold
    imported: set = field(default_factory=set)

    def check(self, program_values: list, free_values: list) -> tuple[bool, str]:
        """-> (every statement holds, why not). Values: [("ok", value) | ("error", message)] per expression."""
        self._values = {"program": program_values, "free": free_values}
        for node, src in self.checks:
            self._why = ""
            try:
                if not self._truth(node):
                    return False, f"assertion failed: {src}" + (f" ({self._why})" if self._why else "")
            except Failed as e:
                return False, f"assertion failed: {src} ({e})"
        return True, ""

    # -------------------------------------------------------------------------- building the tree
    def _node(self, e: ast.expr):
        if isinstance(e, ast.BoolOp):
            return ("and" if isinstance(e.op, ast.And) else "or", [self._node(v) for v in e.values])
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return ("not", self._node(e.operand))
        if isinstance(e, ast.Compare) and all(type(op) in COMPARE for op in e.ops):
            return ("cmp", [self._operand(x) for x in [e.left, *e.comparators]], [type(op) for op in e.ops])
        return self._operand(e)

    def _operand(self, e: ast.expr):
        """Literals and the structure around the calls stay here; the rest becomes a sandbox expression."""
        src = ast.unparse(e)
        try:
            return ("lit", ast.literal_eval(e), src)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        parts = self._parts(e)
        if parts is not None:
            fn, args, kwargs = parts
            return ("apply", fn, [self._operand(a) for a in args], {k: self._operand(v) for k, v in kwargs.items()}, src)
        return self._leaf(e, src)

    def _parts(self, e: ast.expr):
        """-> (function, [arg nodes], {keyword: node}) when `e` is computed here from its parts, else None."""
        if isinstance(e, ast.BinOp) and type(e.op) in BINOPS:
            return BINOPS[type(e.op)], [e.left, e.right], {}
        if isinstance(e, ast.UnaryOp) and type(e.op) in UNARY:
            return UNARY[type(e.op)], [e.operand], {}
        if isinstance(e, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(x, ast.Starred) for x in e.elts):
            make = {ast.List: lambda *xs: list(xs), ast.Tuple: lambda *xs: xs, ast.Set: lambda *xs: set(xs)}[type(e)]
            return make, e.elts, {}
        if isinstance(e, ast.Dict) and None not in e.keys:
            return (lambda *kv: dict(zip(kv[::2], kv[1::2]))), [x for kv in zip(e.keys, e.values) for x in kv], {}
        if isinstance(e, ast.Subscript) and not isinstance(e.slice, ast.Slice):
            return operator.getitem, [e.value, e.slice], {}
        if isinstance(e, ast.Call) and not any(isinstance(a, ast.Starred) for a in e.args) and \
                all(k.arg for k in e.keywords):
            fn = None
            if isinstance(e.func, ast.Name) and e.func.id in SAFE_CALLS:
                fn = SAFE_CALLS[e.func.id]
            elif (isinstance(e.func, ast.Attribute) and isinstance(e.func.value, ast.Name)
                  and e.func.value.id == "math" and "math" in self.imported and e.func.attr in SAFE_MATH):
                fn = SAFE_MATH[e.func.attr]
            if fn is not None:
                return fn, e.args, {k.arg: k.value for k in e.keywords}
        return None

    def _leaf(self, e: ast.expr, src: str):
        names = {n.id for n in ast.walk(e) if isinstance(n, ast.Name)}
        where = "free" if names <= BUILTIN_NAMES | self.imported else "program"
        exprs = self.free_exprs if where == "free" else self.program_exprs
        exprs.append(src)
        return (where, len(exprs) - 1, src)

    # ------------------------------------------------------------------------- evaluating it here
    def _value(self, node):
        kind = node[0]
        if kind == "lit":
            return node[1]
        if kind in ("program", "free"):
            status, value = self._values[kind][node[1]]
            if status != "ok":
                raise Failed(f"{node[2]} raised {value}")
            return value
        if kind == "apply":
            return _apply(node[1], [self._value(a) for a in node[2]], {k: self._value(v) for k, v in node[3].items()})
        return self._truth(node)

    def _truth(self, node) -> bool:
        kind = node[0]
        if kind == "and":
            return all(self._truth(x) for x in node[1])
        if kind == "or":
            return any(self._truth(x) for x in node[1])
        if kind == "not":
            return not self._truth(node[1])
        if kind == "cmp":
            operands, ops = node[1], node[2]
            left = self._value(operands[0])
            for op, right_node in zip(ops, operands[1:]):
                right = self._value(right_node)
                symbol, fn = COMPARE[op]
                try:
                    holds = fn(left, right)
                except TypeError as e:
                    raise Failed(f"{symbol}: {e}")
                if not holds:
                    self._why = f"{_short(left)} {symbol} {_short(right)} is false"
                    return False
                left = right
            return True
        value = self._value(node)
        try:
            return bool(value)      # plain data: its truth is no program's code
        except Exception as e:      # noqa: BLE001
            raise Failed(str(e))


def plan(source: str) -> Plan:
    """Parse one case (statements) into a Plan; ValueError names what is not supported."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"code reward: an asserts entry does not parse ({e.msg}): {source!r:.80}")
    p = Plan(source)
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            p.setup.append(ast.unparse(stmt))
            p.imported |= {(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assert):
            p.checks.append((p._node(stmt.test), ast.unparse(stmt.test)))
        elif isinstance(stmt, ast.Expr):
            p.checks.append((p._node(stmt.value), ast.unparse(stmt.value)))
        elif not isinstance(stmt, (ast.Import, ast.ImportFrom)):
            raise ValueError(f"code reward: an asserts entry may hold only `assert EXPR`, expressions and imports, "
                             f"got a {type(stmt).__name__} statement: {ast.unparse(stmt)!r:.80}")
    if not p.checks:
        raise ValueError(f"code reward: an asserts entry holds no assert or expression: {source!r:.80}")
    return p
