"""docs/tour.md cannot go stale: its code blocks run, in order, in one session; each link to a source file names a
function or class (`[update.py: update](../update.py)`, `[engines/builtin.py: BuiltinEngine.generate](...)`) that the
file defines. Links carry no line numbers, so adding an option or a helper above a function breaks nothing."""
import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR = os.path.join(ROOT, "docs", "tour.md")
# [text](../path.py): the symbol is the text after the last ": " (or the whole text), backticks dropped
LINK = re.compile(r"\[([^\]]+)\]\(\.\./([^)#]+\.py)(#[^)]*)?\)")


def defined(path: str, dotted: str) -> bool:
    """True if `dotted` (a name, or Class.method) is a top-level def/class of the file, or a def inside that class."""
    scope = ast.parse(open(path).read()).body
    for part in dotted.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part]
        if not found:
            return False
        scope = found[0].body
    return True


def test_links_name_what_their_file_defines():
    links = LINK.findall(open(TOUR).read())
    assert len(links) >= 10
    wrong = []
    for text, path, anchor in links:
        symbol = text.split(": ")[-1].strip("` ")
        full = os.path.join(ROOT, path)
        if anchor:
            wrong.append(f"{path}{anchor}: link by symbol, not by line")
        elif not os.path.exists(full):
            wrong.append(f"{path}: no such file")
        elif not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", symbol) or not defined(full, symbol):
            wrong.append(f"{path}: defines no function or class {symbol!r}")
    assert not wrong, wrong


def test_code_blocks_run_in_order():
    blocks = re.findall(r"```python\n(.*?)```", open(TOUR).read(), re.S)
    assert len(blocks) >= 5
    script = "\n".join(f"print('--- block {i}')\n{b}" for i, b in enumerate(blocks))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
