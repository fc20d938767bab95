"""Code reward: run the completion's program against test cases in the sandbox; reward = fraction passed.

    from registry import get
    code = get("reward", "code")
    code(prompt, completion, tests=[{"input": "1 2\\n", "output": "3"}])     # stdin -> stdout cases
    code(prompt, completion, asserts=["assert add(1, 2) == 3"])             # function-style cases
    score, failures = evaluate(completion, tests=..., asserts=...)         # [(category, reason)] behind it

Sample fields: `tests` (list of {"input", "output"} dicts, or the same list as a JSON string, as many
parquet datasets store it) and/or `asserts` (list of cases; each is `assert EXPR` statements or
expressions, with optional imports). Limits (wall_s, memory_mb, ... : rewards.sandbox.Limits) come from
the config only (`reward_args=code.wall_s=5`); a sample field of the same name is dropped by the pool.
Where the expected values live: a stdin/stdout case's expected output never enters the sandbox (the
program's stdout is compared here). An assert case is split by rewards/code_asserts.py: the sandbox runs
the program in a fresh interpreter and evaluates the case's calls (`add(1, 2)`), writing their values as
plain data; the literals and other expected values are compared here. Nothing in the sandbox is worth
stealing, so reading descriptors, walking frames, hooking the interpreter or returning an object whose
__eq__ always holds earns nothing.
The reward returns a `rewards.score.Score`: a float that carries [(category, reason)] per failed case,
which the pool counts per step (reward_fail/code/timeout, ...).
The program is the last fenced ```python block of the completion (or the whole completion when it has
no fence). Each test case runs in its own sandbox (rewards/sandbox.py: cgroup, namespaces, dedicated uid,
rlimits, seccomp, wall-time kill); an assert case whose expected side is an expression of its own (not a
literal, not the program's) costs a second, program-free sandbox. Output matches when it equals the
expected output after stripping trailing whitespace on each line and trailing blank lines.
Give the reward pool a per-call timeout above (number of cases) x wall_s, or slow honest programs
score 0 as pool timeouts. A case that times out ends the evaluation: the remaining cases count as failed (a program that loops
on one input almost always loops on the next, and this keeps a hostile sample's cost at one time limit).
"""
import json
import re

from dataclasses import fields

from registry import register
from rewards.code_asserts import plan
from rewards.score import Score
from rewards.sandbox import Limits, run

LIMIT_ARGS = tuple(f.name for f in fields(Limits))

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def _cases(tests, asserts) -> list[tuple[str, str | None, object]]:
    """-> [(stdin, expected stdout or None, assert Plan or None)]"""
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict) and "inputs" in tests:      # {"inputs": [...], "outputs": [...]} layout
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
    cases = []
    for t in tests or []:
        if not isinstance(t, dict) or "input" not in t or "output" not in t:
            raise ValueError(f"code reward: a test case must be a dict with 'input' and 'output', got {t!r:.80}")
        cases.append((str(t["input"]), str(t["output"]), None))
    if isinstance(asserts, str):
        asserts = [asserts]
    cases += [("", None, plan(str(a))) for a in asserts or []]
    if not cases:
        raise ValueError("code reward: the sample has no 'tests' or 'asserts' field")
    return cases


# sandbox status -> failure category (rewards/pool.py counts them per step: reward_fail/code/<category>)
CATEGORY = {"timeout": "timeout", "memory": "memory", "output_limit": "output_limit", "killed": "signal",
            "setup_failed": "setup", "error": "error"}


def _run_case(program: str, stdin: str, expected, p, limits) -> tuple[str, str]:
    """-> (sandbox status, reason): "ok" when the case passed, "wrong" when it ran but did not."""
    if p is None:
        r = run(program, stdin, limits)
        if r.status != "ok":
            return r.status, r.reason
        return ("ok", "") if _norm(r.stdout) == _norm(expected) else ("wrong", "wrong answer")
    r = run(program, "", limits, exprs=p.program_exprs, setup=p.setup)   # always: a program that crashes fails
    if r.status != "ok":
        return r.status, r.reason
    free = []
    if p.free_exprs:     # the expected side, computed where the program never runs
        f = run("", "", limits, exprs=p.free_exprs, setup=p.setup)
        if f.status != "ok":
            return "error", f"the test's own expressions failed: {f.reason}"
        free = f.values
    holds, why = p.check(r.values, free)
    return ("ok", "") if holds else ("wrong", why)


def evaluate(completion: str, tests=None, asserts=None,
             limits: Limits | None = None) -> tuple[float, list[tuple[str, str]]]:
    """-> (fraction of cases passed, [(category, reason)] for each failed case)."""
    cases = _cases(tests, asserts)
    program = extract_code(completion)
    passed, failures = 0, []
    for k, (stdin, expected, p) in enumerate(cases):
        status, reason = _run_case(program, stdin, expected, p, limits)
        if status == "ok":
            passed += 1
            continue
        if status == "wrong":
            failures.append(("wrong_answer", f"case {k}: {reason}"))
        else:
            failures.append((CATEGORY[status], f"case {k}: {reason}"))
        if status == "timeout":
            rest = len(cases) - k - 1
            if rest:
                skipped = f"case {k + 1}" if rest == 1 else f"cases {k + 1}..{len(cases) - 1}"
                failures.append(("timeout", f"{skipped}: skipped after a timeout"))
            break
    return passed / len(cases), failures


def limits_from(args: dict) -> Limits:
    """The sandbox limits from the reward's config arguments; a one-line error names a bad one."""
    unknown = set(args) - set(LIMIT_ARGS)
    if unknown:
        raise ValueError(f"code reward: unknown argument(s) {', '.join(sorted(unknown))}; valid: {', '.join(LIMIT_ARGS)}")
    for k, v in args.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"code reward: {k} must be a positive number, got {v!r}")
    if "wall_s" in args and "cpu_s" not in args:
        args = {**args, "cpu_s": max(1, int(args["wall_s"]))}
    return Limits(**args)


@register("reward", "code")
def code_reward(prompt: str, completion: str, tests=None, asserts=None, **kwargs) -> float:
    """kwargs: the sandbox limits (LIMIT_ARGS) from the config, and the sample's other fields (ignored)."""
    limits = limits_from({k: v for k, v in kwargs.items() if k in LIMIT_ARGS})
    return Score(*evaluate(completion, tests, asserts, limits))     # a float that carries its failures


# Limits come from the config only: the pool drops sample fields with these names (a dataset column
# `wall_s` must not buy a program more time) and checks the config's arguments before any work.
code_reward.config_only = LIMIT_ARGS
code_reward.check_args = lambda args: limits_from(args)
