"""An assert case, split: the sandbox computes values, this process compares them (rewards/code.py uses it).

    p = plan("assert add(1, 2) == 3 and add(0, 0) == 0")
    p.program_exprs                      # ["add(1, 2)", "add(0, 0)"]: evaluated after the program, in the sandbox
    holds, why = p.check(program_values, free_values)     # the comparisons, made here on plain data

Each statement of a case is `assert E` or an expression `E` (imports are allowed and run before the
expressions, in every sandbox of the case). E is taken apart down to its operands: `and`, `or`, `not`
and comparison chains (==, !=, <, <=, >, >=, in, not in, is, is not) are applied here; each operand is
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
import operator
from dataclasses import dataclass, field

BUILTIN_NAMES = frozenset(dir(builtins))
COMPARE = {ast.Eq: ("==", operator.eq), ast.NotEq: ("!=", operator.ne), ast.Lt: ("<", operator.lt),
           ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt), ast.GtE: (">=", operator.ge),
           ast.In: ("in", lambda a, b: a in b), ast.NotIn: ("not in", lambda a, b: a not in b),
           ast.Is: ("is", operator.is_), ast.IsNot: ("is not", operator.is_not)}


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
            return ("cmp", [self._leaf(x) for x in [e.left, *e.comparators]], [type(op) for op in e.ops])
        return self._leaf(e)

    def _leaf(self, e: ast.expr):
        src = ast.unparse(e)
        try:
            return ("lit", ast.literal_eval(e), src)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
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
