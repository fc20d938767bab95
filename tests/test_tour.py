"""docs/tour.md cannot go stale: its code blocks run, in order, in one session; its file:line links land on the
functions they name."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR = os.path.join(ROOT, "docs", "tour.md")
# [text ending in a name](../path#L123): the name is the last identifier of the text (`update.py: update`,
# `BuiltinEngine.generate`, `Experience`)
LINK = re.compile(r"\[([^\]]+)\]\(\.\./([^)#]+)#L(\d+)\)")


def test_links_land_on_what_they_name():
    wrong = []
    for text, path, line in LINK.findall(open(TOUR).read()):
        name = re.findall(r"\w+", text)[-1]
        lines = open(os.path.join(ROOT, path)).read().splitlines()
        at = re.compile(rf"^\s*(def|class) {name}\b")
        if not at.match(lines[int(line) - 1]):
            where = [i + 1 for i, x in enumerate(lines) if at.match(x)]
            wrong.append(f"{path}#L{line} should point at {name}: line {where}")
    assert not wrong, wrong


def test_code_blocks_run_in_order():
    blocks = re.findall(r"```python\n(.*?)```", open(TOUR).read(), re.S)
    assert len(blocks) >= 5
    script = "\n".join(f"print('--- block {i}')\n{b}" for i, b in enumerate(blocks))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
