"""Killable worker processes that run environment steps (and the tools a turn calls), with a deadline per step.

    pool = EnvPool({"name": "hilo", "args": {}, "tools": [], "parser": "tag", "max_obs_chars": 4000,
                    "memory_mb": 2048, "modules": ["envs.hilo"]}, workers=2, timeout_s=10)
    results = pool.run([("reset", fields), ("step", state, "384"), ...])   # one result per job, in order
    pool.close()

A result is ("ok", state, observation, reward, done, info, role, tool_calls, tool_errors) or
("fail", category, reason) with category "error" (raised, wrong type, huge observation), "timeout" or "signal"
(the worker died). `state` is the pickled environment after the job: environments live in the trainer as bytes
and any worker can take the next step, so killing a worker costs exactly the job it was running.
Why not the reward pool (rewards/pool.py): environments are stateful and a rollout waits for every step of a
turn before it goes on, so this pool is synchronous (no dispatcher thread) and moves state with each job.
Workers are fresh `python -c` processes (no torch: a start costs ~0.1 s) under an address-space limit; jobs go
out in chunks (one message per chunk, one per result), the deadline restarting at each result.
"""
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_S = 60.0   # a worker's start (imports) has its own, longer deadline


def _job(spec: dict, job):
    from envs.base import check_reset, check_step
    from envs.tools import call_tools
    from registry import get
    kind, *payload = job
    if kind == "reset":
        env = get("env", spec["name"])(**spec["args"])
        obs = check_reset(env.reset(payload[0]), spec["max_obs_chars"])
        return ("ok", pickle.dumps(env), obs, 0.0, False, {}, "user", 0, 0)
    state, action = payload
    env = pickle.loads(state)
    tooled = call_tools(action, spec["tools"], spec["parser"])
    if tooled is not None:   # a tool turn: the outputs come back to the model, the environment does not step
        obs, calls, errors = tooled
        return ("ok", state, obs[:spec["max_obs_chars"]], 0.0, False, {}, "tool", calls, errors)
    obs, reward, done, info = check_step(env.step(action), spec["max_obs_chars"])
    return ("ok", pickle.dumps(env), obs, reward, done, info, "user", 0, 0)


def serve(fd: int):
    """Worker loop: receive (sys.path, spec), then chunks of (job id, job); answer each job as it finishes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the trainer, which closes the pool
    conn = Connection(fd)
    try:
        path, spec = conn.recv()
        sys.path[:] = path
        if spec.get("memory_mb"):
            import resource
            limit = spec["memory_mb"] << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        import importlib
        import envs  # noqa: F401  (registers every environment and tool)
        for module in spec.get("modules", ()):   # environments registered outside envs/ (a test's, a fork's)
            importlib.import_module(module)
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc(limit=3)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):   # the trainer is gone
            return
        if chunk is None:
            return
        for job_id, job in chunk:
            try:
                out = _job(spec, job)
                msg = pickle.dumps((job_id, out))   # an info dict that does not pickle fails here, not in send
            except BaseException as e:  # noqa: BLE001  an environment must never take the worker down quietly
                msg = pickle.dumps((job_id, ("fail", "error", f"{type(e).__name__}: {e}".splitlines()[0][:300])))
            conn.send_bytes(msg)


class _Worker:
    def __init__(self, spec: dict):
        ours, theirs = socket.socketpair()
        code = f"import sys; sys.path.insert(0, {REPO!r}); from envs.pool import serve; serve({theirs.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((sys.path, spec))
        self.ready, self.jobs, self.deadline = False, deque(), time.monotonic() + START_S

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the group: a tool's sandbox goes with it
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.conn.close()


class EnvPool:
    def __init__(self, spec: dict, workers: int = 2, timeout_s: float = 10.0):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"EnvPool: workers must be >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.spec, self.timeout_s = spec, timeout_s
        self.workers = [_Worker(spec) for _ in range(workers)]
        self.broken, self.restarts = "", 0

    def run(self, jobs: list) -> list:
        results, queue = [None] * len(jobs), deque(range(len(jobs)))
        while queue or any(w.jobs for w in self.workers):
            if self.broken:   # workers cannot start: every job left fails with the reason
                for w in self.workers:
                    queue.extend(w.jobs)
                    w.jobs.clear()
                for j in queue:
                    results[j] = ("fail", "error", self.broken)
                break
            size = max(1, min(64, -(-len(queue) // len(self.workers))))
            for w in self.workers:
                if not w.jobs and queue:
                    w.jobs.extend(queue.popleft() for _ in range(min(size, len(queue))))
                    w.conn.send([(j, jobs[j]) for j in w.jobs])
                    if w.ready:
                        w.deadline = time.monotonic() + self.timeout_s
            self._collect(results, queue)
        return results

    def _collect(self, results: list, queue: deque):
        now = time.monotonic()
        timeout = max(0.0, min(w.deadline for w in self.workers if w.jobs or not w.ready) - now) \
            if any(w.jobs for w in self.workers) else 0.0
        ready = set(wait([w.conn for w in self.workers], timeout=timeout))
        for k, w in enumerate(self.workers):
            if w.conn in ready:
                try:
                    msg = w.conn.recv_bytes()
                except (EOFError, OSError):
                    msg = None
                if msg is None:
                    rc = w.proc.wait()
                    self._replace(k, results, queue, f"environment worker died (exit code {rc})",
                                  "signal" if rc < 0 else "error")
                    continue
                msg = pickle.loads(msg)
                if msg[0] == "ready":
                    w.ready, w.deadline = True, time.monotonic() + self.timeout_s
                elif msg[0] == "error":   # the environments do not import: retrying will not help
                    self.broken = "environment workers cannot start: " + msg[1].strip().splitlines()[-1]
                    print(f"environment pool: a worker failed to start:\n{msg[1]}", file=sys.stderr)
                else:
                    job_id, out = msg
                    results[job_id] = out
                    w.jobs.remove(job_id)
                    w.deadline = time.monotonic() + self.timeout_s if w.jobs else math.inf
            elif w.jobs and time.monotonic() > w.deadline:
                why = f"timeout after {self.timeout_s:g}s" if w.ready else "worker did not start"
                self._replace(k, results, queue, why, "timeout")

    def _replace(self, k: int, results: list, queue: deque, why: str, category: str):
        """Kill worker k: the job it was running fails with the reason, its other jobs go back in the queue."""
        w = self.workers[k]
        w.kill()
        if w.jobs:
            results[w.jobs.popleft()] = ("fail", category, why)
            queue.extendleft(reversed(w.jobs))
        self.restarts += 1
        if not w.ready:   # it died before it could import the environments
            self.broken = self.broken or f"environment workers cannot start ({why})"
        self.workers[k] = _Worker(self.spec)

    def close(self):
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self.workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
