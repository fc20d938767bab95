"""docs/tour.md cannot go stale: its code blocks run, in order, in one session; each link to a source file names a
function or class (`[update.py: update](../update.py)`, `[engines/builtin.py: BuiltinEngine.generate](...)`) that the
file defines. Links carry no line numbers, so adding an option or a helper above a function breaks nothing.
docs/architecture.md's map is held to the same: a function moved to another file fails here until the map follows."""
import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR = os.path.join(ROOT, "docs", "tour.md")
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
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


def architecture_references() -> list[tuple[str, str]]:
    """(file, symbol) pairs that docs/architecture.md names: `file.py: symbol` in backticks, the set-up line of the
    step diagram (`setup (file.py: a, b; other.py: c)`), and the "Where to edit" rows of one file, whose names in
    backticks (plain identifiers) are that file's functions and classes."""
    text = open(ARCHITECTURE).read()
    refs = re.findall(r"`([\w/]+\.py): ([\w.]+)`", text)
    setup = re.search(r"^\s*setup \((.*)\)$", text, re.M).group(1)
    refs += [(path, name.strip()) for part in setup.split("; ") for path, names in [part.split(": ")]
             for name in names.split(",")]
    for path, how in re.findall(r"^\| [^|]+ \| `([\w/]+\.py)` \| ([^|]+) \|$", text, re.M):
        refs += [(path, name) for name in re.findall(r"`([A-Za-z_]\w*)`", how)]
    return refs


def test_architecture_names_what_each_file_defines():
    refs = architecture_references()
    assert ("run_setup.py", "setup") in refs and ("train.py", "train_step") in refs and len(refs) >= 30
    wrong = [f"{path}: {symbol}" for path, symbol in refs
             if not os.path.exists(os.path.join(ROOT, path)) or not defined(os.path.join(ROOT, path), symbol)]
    assert not wrong, f"docs/architecture.md names what these files do not define: {wrong}"


def test_code_blocks_run_in_order():
    blocks = re.findall(r"```python\n(.*?)```", open(TOUR).read(), re.S)
    assert len(blocks) >= 5
    script = "\n".join(f"print('--- block {i}')\n{b}" for i, b in enumerate(blocks))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
