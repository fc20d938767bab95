"""Killable worker processes that run environment steps (and the tools a turn calls), each step under its own deadline.

    pool = EnvPool({"name": "hilo", "args": {}, "tools": [], "parser": "tag", "max_obs_chars": 4000,
                    "memory_mb": 2048, "modules": ["envs.hilo"]}, workers=2, timeout_s=10)
    results = pool.run([("reset", fields), ("step", state, "384"), ...])   # one result per job, in order
    pool.close()

A result is ("ok", state, observation, reward, done, info, role, tool_calls, tool_errors) or ("fail", category,
reason) with category "error", "timeout" or "signal" (the worker died). An observation is text, or {"text", "image":
bytes} for a picture (spec "max_obs_image_bytes" > 0 lets one through: envs/base.py check_image). `state` is the
pickled environment after the job (base64 text the trainer never decodes): environments live in the trainer as
data and any worker can take the next step, so killing a worker costs exactly the job it was running. `info` is
{"success": bool} or {}.
Environment code is treated as hostile; what it can do and what that costs:

    raise, wrong types, observation/info/state too big    that episode fails, the worker goes on (envs/base.py)
    run past timeout_s, die, send bytes not a reply       that episode fails, the worker is killed and replaced
    fail FAILS_IN_A_ROW jobs in a row (a corrupted module,   the worker is replaced: the next episodes get a
    a leak that ends in MemoryError)                        fresh one
    block                                                 the jobs queued behind it go to other workers, spares
                                                          start (up to SPARES): deadlines run side by side
    start processes, setsid() included                    killing the worker kills them (isolation below)

Replies are JSON, read without blocking and capped in size before they are read (envs/wire.py): the trainer never
unpickles what a worker sends. Isolation: each worker is the init of its own PID namespace (util-linux `unshare
--pid --fork --kill-child`, with `--user` where the trainer is not root): when it dies the kernel kills every
process in the namespace, setsid() or not. Where no namespace can be made (no `unshare`, user namespaces off),
the worker's process group is killed and then every process that still carries the worker's tag in its
environment (TAG_VAR) is swept; a process that rewrote its environment escapes that sweep.
`setpriv --pdeathsig KILL` (where it exists) kills the workers when the trainer dies, even by SIGKILL.
Jobs go out in chunks (one message per chunk, one per result; the deadline restarts at each result). A worker
stuck on one step for STALL_S gives back the jobs behind it, and for the rest of that run jobs go out one at a
time, to spare workers where none is free; spares stop at the end of the run.
Why not the reward pool (rewards/pool.py): environments are stateful and a rollout waits for every step of a
turn before it goes on, so this pool is synchronous (no dispatcher thread) and moves state with each job.
Workers are fresh `python -c` processes (workers.py, as the reward pool's; no torch: a start costs ~0.1 s) under an
address-space limit.
"""
import base64
import functools
import itertools
import math
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import wait

from envs.wire import FrameReader, WireError, check_result, decode_reply, encode, frame
from workers import start_worker

START_S = 60.0            # a worker's start (imports) has its own, longer deadline
MAX_STATE_BYTES = 1 << 20  # an environment's pickled state; past it the episode fails (the trainer holds B states)
FAILS_IN_A_ROW = 3        # a worker whose last jobs all failed is replaced: its environment may have broken it
SPARES = 16               # extra workers a run may start while every worker is stuck on a slow step
STALL_S = 0.5             # a step running this long (or half the timeout) counts as stuck
TAG_VAR = "ENV_POOL_WORKER"
_count = itertools.count()


def reply_cap(max_obs_chars: int, max_image_bytes: int = 0) -> int:
    """The longest reply a worker can send for an environment within its limits (JSON escapes a character in at most
    12 bytes; the state and a picture go as base64), plus room for the small fields and a start-up traceback."""
    return 4 * (MAX_STATE_BYTES // 3 + 1) + 12 * max_obs_chars + 4 * (max_image_bytes // 3 + 1) + 32768


def _wire_obs(obs):
    """A checked observation -> JSON-ready: text as it is, a picture's bytes as base64 (envs/wire.py decodes it)."""
    if type(obs) is dict:
        return {"text": obs["text"], "image": base64.b64encode(obs["image"]).decode("ascii")}
    return obs


# ------------------------------------------------------------------------------------------ the worker's side
def _pack(env) -> str:
    data = pickle.dumps(env)
    if len(data) > MAX_STATE_BYTES:
        from envs.base import EnvError
        raise EnvError(f"the environment's state pickles to {len(data)} bytes (at most {MAX_STATE_BYTES})")
    return base64.b64encode(data).decode("ascii")


def _job(spec: dict, job) -> list:
    from envs.base import as_text, check_reset, check_step
    from envs.tools import call_tools
    from registry import get
    kind, *payload = job
    limit, image_limit = spec["max_obs_chars"], spec.get("max_obs_image_bytes", 0)
    if kind == "reset":
        env = get("env", spec["name"])(**spec["args"])
        obs = check_reset(env.reset(payload[0]), limit, image_limit)
        return ["ok", _pack(env), _wire_obs(obs), 0.0, False, None, "user", 0, 0]
    state, action = payload
    env = pickle.loads(base64.b64decode(state))
    tooled = call_tools(action, spec["tools"], spec["parser"])
    if tooled is not None:   # a tool turn: the outputs come back to the model, the environment does not step
        obs, calls, errors = tooled
        return ["ok", state, as_text(obs[:limit], "a tool", limit), 0.0, False, None, "tool", int(calls), int(errors)]
    obs, reward, done, success = check_step(env.step(action), limit, image_limit)
    return ["ok", _pack(env), _wire_obs(obs), reward, done, success, "user", 0, 0]


def _reason(e: BaseException) -> str:
    try:
        text = f"{type(e).__name__}: {e}"
    except BaseException:  # noqa: BLE001  an exception whose __str__ raises still has a name
        text = type(e).__name__
    return (text.splitlines() or [""])[0][:300]


def _recv_frame(sock) -> bytes:
    def exactly(n):
        buf = bytearray()
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise EOFError
            buf += part
        return bytes(buf)
    return exactly(int.from_bytes(exactly(4), "big"))


def serve(fd: int):
    """Worker loop: receive (sys.path, spec), then chunks of (job id, job); answer each job, in order, in JSON."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the trainer, which closes the pool
    os.set_inheritable(fd, False)   # what the environment starts does not get the channel
    sock = socket.socket(fileno=fd)
    try:
        path, spec = pickle.loads(_recv_frame(sock))   # from the trainer: trusted
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
        sock.sendall(frame(encode(["error", traceback.format_exc(limit=3)[-4000:]])))
        return
    sock.sendall(frame(encode(["ready"])))
    while True:
        try:
            msg = pickle.loads(_recv_frame(sock))
        except (EOFError, OSError):   # the trainer is gone
            return
        if msg is None:
            return
        for job_id, job in msg:
            try:
                data = encode(["result", job_id, _job(spec, job)])
            except BaseException as e:  # noqa: BLE001  an environment must never take the worker down quietly
                data = encode(["result", job_id, ["fail", "error", _reason(e)]])
            sock.sendall(frame(data))


# ------------------------------------------------------------------------------------------ the trainer's side
@functools.lru_cache(maxsize=None)
def pid_namespace() -> tuple:
    """The command prefix that starts a worker as the init of a new PID namespace, or () where none can be made."""
    exe = shutil.which("unshare")
    for extra in ((), ("--user", "--map-root-user")):   # a user namespace only where a plain one is refused
        prefix = (exe, *extra, "--pid", "--fork", "--kill-child") if exe else ()
        try:
            if prefix and subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            pass
    return ()


@functools.lru_cache(maxsize=None)
def parent_death() -> tuple:
    """The command prefix that SIGKILLs a worker when the trainer dies, even killed (util-linux setpriv), or ()."""
    exe = shutil.which("setpriv")
    try:
        if exe and subprocess.run([exe, "--pdeathsig", "KILL", "true"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10).returncode == 0:
            return exe, "--pdeathsig", "KILL"
    except (OSError, subprocess.SubprocessError):
        pass
    return ()


def sweep(tag: str) -> int:
    """SIGKILL every process whose environment holds TAG_VAR=tag, until none is left; -> how many were found."""
    needle, found_total = f"{TAG_VAR}={tag}".encode(), 0
    for _ in range(50):   # a process may fork while we look: look again until a pass finds nothing
        found = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                continue
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not found:
            break
        found_total += len(found)
        time.sleep(0.01)
    return found_total


def _gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


class _Worker:
    def __init__(self, spec: dict, max_reply: int, send_s: float, isolation: tuple):
        self.tag, self.isolated = f"{os.getpid()}-{next(_count)}-{secrets.token_hex(4)}", bool(isolation)
        self.proc, ours = start_worker("envs.pool", prefix=(*parent_death(), *isolation), env={TAG_VAR: self.tag},
                                        start_new_session=True)
        ours.settimeout(send_s)   # a worker that stops reading cannot block the trainer's send
        self.sock, self.reader = ours, FrameReader(ours, max_reply)
        self.ready, self.fails = False, 0
        self.expect, self.live = deque(), set()   # the ids it will answer, in order; those whose answers count
        self.started, self.deadline = time.monotonic(), time.monotonic() + START_S
        try:
            self.send((sys.path, spec))
        except OSError:   # it is gone already: its channel's end says so, and the pool calls it not started
            pass

    def send(self, message):
        self.sock.sendall(frame(pickle.dumps(message)))

    def kill(self):
        """The worker and everything it started: its PID namespace (or its group and a sweep), then its channel."""
        init = None
        if self.isolated:   # the namespace's init is the child of `unshare`
            try:
                with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                    init = int(f.read().split()[0])
            except (OSError, IndexError, ValueError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the group: unshare, its init, and what did not leave it
        except ProcessLookupError:
            pass
        self.proc.wait()
        if init is not None:   # the kernel kills the namespace when its init dies: wait until it has
            end = time.monotonic() + 5
            while not _gone_or_zombie(init) and time.monotonic() < end:
                time.sleep(0.005)
        if not self.isolated:
            sweep(self.tag)
        self.sock.close()


class EnvPool:
    def __init__(self, spec: dict, workers: int = 2, timeout_s: float = 10.0):
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"EnvPool: workers must be >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.spec, self.n, self.timeout_s = spec, workers, timeout_s
        self.max_reply = reply_cap(spec["max_obs_chars"], spec.get("max_obs_image_bytes", 0))
        self.stall_s, self.isolation = min(STALL_S, timeout_s / 2), pid_namespace()
        self.workers = [self._start() for _ in range(workers)]
        self.broken, self.restarts, self.recycled, self.spares_started = "", 0, 0, 0   # restarts: killed
        self.peak_busy = 0   # the most jobs that ran at once

    def _start(self) -> _Worker:
        return _Worker(self.spec, self.max_reply, self.timeout_s, self.isolation)

    def run(self, jobs: list) -> list:
        results, queue = [None] * len(jobs), deque(range(len(jobs)))
        self.stalled = False   # a step of this run got stuck: from then on, a job at a time, and spares
        try:
            while queue or any(w.live for w in self.workers):
                if self.broken:   # workers cannot start: every job left fails with the reason
                    return [r or ("fail", "error", self.broken) for r in results]
                self._dispatch(jobs, queue)
                self._reclaim(queue)
                self._add_spares(queue)
                self._collect(results, queue)
        finally:
            while len(self.workers) > self.n:   # spares last one run: a slow environment starts them again
                self.workers.pop().kill()
        return results

    def _dispatch(self, jobs: list, queue: deque):
        """Idle workers take the queue in chunks (one message each way per job would cost more than a cheap step)."""
        idle = [w for w in self.workers if w.ready and not w.expect]
        size = 1 if self.stalled else max(1, min(64, -(-len(queue) // max(1, len(idle)))))
        for w in idle:
            if not queue:
                break
            chunk = [queue.popleft() for _ in range(min(size, len(queue)))]
            try:
                w.send([(j, jobs[j]) for j in chunk])
            except OSError:   # gone, or not reading (a timeout is an OSError): none of its jobs started
                queue.extendleft(reversed(chunk))
                self.restarts += 1
                self._replace(w)
                continue
            w.expect, w.live = deque(chunk), set(chunk)
            w.started, w.deadline = time.monotonic(), time.monotonic() + self.timeout_s
        self.peak_busy = max(self.peak_busy, sum(bool(w.expect) for w in self.workers))

    def _reclaim(self, queue: deque):
        """A worker stuck on a step for stall_s gives back the jobs of its chunk it has not started: other workers
        (spares if need be) run them now. Should it get to them later, their answers are read and dropped (a step is
        a function of its state and action, so running it twice changes nothing the trainer keeps)."""
        now = time.monotonic()
        for w in self.workers:
            if w.expect and now - w.started > self.stall_s:
                self.stalled = True
                back = [j for j in list(w.expect)[1:] if j in w.live]
                w.live.difference_update(back)
                queue.extendleft(reversed(back))

    def _add_spares(self, queue: deque):
        """Once a step got stuck: a spare for each waiting job that no idle or starting worker is there to take."""
        free = sum(not w.expect for w in self.workers)
        for _ in range(min(self.n + SPARES - len(self.workers), len(queue) - free) if self.stalled else 0):
            self.workers.append(self._start())
            self.spares_started += 1

    def _collect(self, results: list, queue: deque):
        now = time.monotonic()
        wake = min(w.deadline for w in self.workers)
        stuck = [w.started + self.stall_s for w in self.workers
                 if w.expect and (not self.stalled or any(j in w.live for j in list(w.expect)[1:]))]
        wake = min([wake, *stuck]) + 0.01   # wake up to reclaim or start spares when a step stalls
        ready = set(wait([w.sock for w in self.workers], timeout=max(0.0, min(wake - now, self.timeout_s))))
        for w in list(self.workers):
            if w.sock in ready:
                self._read(w, results, queue)
            elif (w.expect or not w.ready) and time.monotonic() > w.deadline:
                why = f"timeout after {self.timeout_s:g}s" if w.ready else "worker did not start"
                self._lose(w, results, queue, why, "timeout")

    def _read(self, w: _Worker, results: list, queue: deque):
        try:
            for data in w.reader.read():
                if w not in self.workers:   # replaced by what an earlier frame said: the rest is not read
                    return
                self._handle(w, decode_reply(data), results, queue)
        except WireError as e:
            self._lose(w, results, queue, f"environment worker sent {e}", "error")
        except (EOFError, OSError):   # it died, or closed its end: give it a moment to be reaped, then kill
            try:
                rc = w.proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                rc = None
            why = "environment worker closed its channel" if rc is None else f"environment worker died (exit code {rc})"
            self._lose(w, results, queue, why, "signal" if rc is not None and rc < 0 else "error")

    def _handle(self, w: _Worker, msg: list, results: list, queue: deque):
        if msg[0] == "ready":
            if w.ready:
                raise WireError("a second ready")
            w.ready, w.deadline = True, math.inf
        elif msg[0] == "error":   # the environments do not import: retrying will not help
            if w.ready or len(msg) != 2 or type(msg[1]) is not str:
                raise WireError("an error message after its start")
            self.broken = "environment workers cannot start: " + (msg[1].strip().splitlines() or ["?"])[-1][:300]
            print(f"environment pool: a worker failed to start:\n{msg[1][-4000:]}", file=sys.stderr)
        else:
            if not w.expect:
                raise WireError("a result while no job was running")
            res = check_result(msg, w.expect[0])
            j = w.expect.popleft()
            if j in w.live:
                results[j] = res
                w.live.discard(j)
            now = time.monotonic()
            w.started, w.deadline = now, now + self.timeout_s if w.expect else math.inf
            w.fails = w.fails + 1 if res[0] == "fail" else 0
            if w.fails >= FAILS_IN_A_ROW:
                self.recycled += 1
                self._give_back(w, queue)
                self._replace(w)

    def _give_back(self, w: _Worker, queue: deque):
        """w is about to be killed: the live jobs it was still to answer go back to the front of the queue."""
        back = [j for j in w.expect if j in w.live]
        queue.extendleft(reversed(back))
        w.live.difference_update(back)
        w.expect.clear()

    def _lose(self, w: _Worker, results: list, queue: deque, why: str, category: str):
        """Worker w broke: the job it was running fails with the reason, the ones it had not started go back to the
        queue; the worker is replaced."""
        head = w.expect.popleft() if w.expect else None
        if head in w.live:
            results[head] = ("fail", category, why)
            w.live.discard(head)
        self._give_back(w, queue)
        if not w.ready:   # it broke before it could import the environments
            self.broken = self.broken or f"environment workers cannot start ({why})"
        self.restarts += 1
        self._replace(w)

    def _replace(self, w: _Worker):
        w.kill()
        k = self.workers.index(w)
        if len(self.workers) > self.n:   # a spare (or one a spare can stand in for): the pool shrinks back
            del self.workers[k]
        else:
            self.workers[k] = self._start()

    def close(self):
        for w in self.workers:
            try:
                w.send(None)
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
