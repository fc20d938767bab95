"""Run Triton kernels on CPU under TRITON_INTERPRET=1, in a subprocess: the variable must be set before triton
is imported, and must not leak into the other tests of this process."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(code: str, timeout: int = 600):
    """Run `code` (which prints 'ok' at its end) with the interpreter on; fail the test with its output."""
    triton = pytest.importorskip("triton")
    if tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9):
        pytest.skip("triton < 3.9's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
