"""Fresh Python worker processes on a socket pair: how the reward pool (rewards/pool.py) and the environment pool
(envs/pool.py) start their workers.

    proc, sock = start_worker("envs.pool", prefix=("setpriv", "--pdeathsig", "KILL"), env={"TAG": "x"})

The worker runs `python -c "from <module> import serve; serve(<fd>, *args)"`, fd being its end of the socket pair.
Like multiprocessing's "spawn" it is safe beside torch and CUDA, where forking the trainer is not; unlike it, the
worker does not re-import the trainer's main script, so it starts in a fraction of a second and without torch.
It gets nothing on stdin and the trainer's environment plus `env`; each pool sends it the trainer's sys.path first
and keeps its own protocol, deadlines and way of killing (their docstrings say why they differ).
"""
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.abspath(__file__))


def start_worker(module: str, *args, prefix: tuple = (), env: dict | None = None,
                 **popen) -> tuple[subprocess.Popen, socket.socket]:
    """Start `module.serve(fd, *args)` (args: plain literals) in a fresh interpreter, behind the command `prefix`
    (isolation, parent-death signals); -> (the process, the trainer's end of the socket pair). popen: more
    subprocess.Popen arguments (start_new_session=True)."""
    ours, theirs = socket.socketpair()
    call = ", ".join(map(repr, (theirs.fileno(), *args)))
    code = f"import sys; sys.path.insert(0, {REPO!r}); from {module} import serve; serve({call})"
    try:
        proc = subprocess.Popen([*prefix, sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, **popen)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours
