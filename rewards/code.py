"""Code reward: run the completion's program against test cases in the sandbox; reward = fraction passed.

    from registry import get
    code = get("reward", "code")
    code(prompt, completion, tests=[{"input": "1 2\\n", "output": "3"}])     # stdin -> stdout cases
    code(prompt, completion, asserts=["assert add(1, 2) == 3"])             # function-style cases
    score, failures = evaluate(completion, tests=..., asserts=...)         # [(category, reason)] behind it

Sample fields: `tests` (list of {"input", "output"} dicts, or the same list as a JSON string, as many
parquet datasets store it) and/or `asserts` (list of Python statements, each one case).
An assert case passes only if its statement ran to the end: the sandbox's harness runs the program, then
(in a second step, in the program's namespace) the statement, and prints a per-call random token after
it. SystemExit from the program's top level ends only its step (the statement still runs); os._exit or
a signal ends the process before the token, and the case fails. The program's source and the
statement are on no disk the program can read, and the statement reaches the process only once the
program's top level has returned. Not closed: code that runs during the statement (the function under
test) can inspect its caller's frame (the expected value is a constant there) or return an object whose
__eq__ always holds; a policy that learns those needs a stricter checker (compare serialised values
outside the sandbox).
The reward returns a `rewards.score.Score`: a float that carries [(category, reason)] per failed case,
which the pool counts per step (reward_fail/code/timeout, ...).
The program is the last fenced ```python block of the completion (or the whole completion when it has
no fence). Each test case runs in its own sandbox (rewards/sandbox.py: namespaces, dedicated uid,
rlimits, wall-time kill). Output matches when it equals the expected output after stripping trailing
whitespace on each line and trailing blank lines.
Give the reward pool a per-call timeout above (number of cases) x wall_s, or slow honest programs
score 0 as pool timeouts. A case that times out ends the evaluation: the remaining cases count as failed (a program that loops
on one input almost always loops on the next, and this keeps a hostile sample's cost at one time limit).
"""
import json
import re

from registry import register
from rewards.score import Score
from rewards.sandbox import Limits, run

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _norm(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def _cases(tests, asserts) -> list[tuple[str, str | None, str]]:
    """-> [(stdin, expected stdout or None, statement to append)]"""
    if isinstance(tests, str):
        tests = json.loads(tests)
    if isinstance(tests, dict) and "inputs" in tests:      # {"inputs": [...], "outputs": [...]} layout
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
    cases = []
    for t in tests or []:
        if not isinstance(t, dict) or "input" not in t or "output" not in t:
            raise ValueError(f"code reward: a test case must be a dict with 'input' and 'output', got {t!r:.80}")
        cases.append((str(t["input"]), str(t["output"]), ""))
    if isinstance(asserts, str):
        asserts = [asserts]
    cases += [("", None, a) for a in asserts or []]
    if not cases:
        raise ValueError("code reward: the sample has no 'tests' or 'asserts' field")
    return cases


# sandbox status -> failure category (rewards/pool.py counts them per step: reward_fail/code/<category>)
CATEGORY = {"timeout": "timeout", "memory": "memory", "output_limit": "output_limit", "killed": "signal",
            "setup_failed": "setup", "error": "error"}


def evaluate(completion: str, tests=None, asserts=None,
             limits: Limits | None = None) -> tuple[float, list[tuple[str, str]]]:
    """-> (fraction of cases passed, [(category, reason)] for each failed case)."""
    cases = _cases(tests, asserts)
    program = extract_code(completion)
    passed, failures = 0, []
    for k, (stdin, expected, statement) in enumerate(cases):
        r = run(program, stdin, limits, test=statement or None)   # the statement runs after the program
        if r.status == "ok" and (expected is None or _norm(r.stdout) == _norm(expected)):
            passed += 1
            continue
        if r.status == "ok":
            failures.append(("wrong_answer", f"case {k}: wrong answer"))
        else:
            failures.append((CATEGORY[r.status], f"case {k}: {r.reason}"))
        if r.status == "timeout":
            rest = len(cases) - k - 1
            if rest:
                skipped = f"case {k + 1}" if rest == 1 else f"cases {k + 1}..{len(cases) - 1}"
                failures.append(("timeout", f"{skipped}: skipped after a timeout"))
            break
    return passed / len(cases), failures


@register("reward", "code")
def code_reward(prompt: str, completion: str, tests=None, asserts=None, wall_s: float = 5.0,
                memory_mb: int = 512, **fields) -> float:
    limits = Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb)
    return Score(*evaluate(completion, tests, asserts, limits))     # a float that carries its failures
