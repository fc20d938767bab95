"""Overlapped reward execution: score a batch in worker processes while the trainer runs its forwards.

    from rewards.pool import RewardPool
    pool = RewardPool([("math", 1.0), ("format", 0.2)], workers=4, timeout_s=30, max_new_tokens=512)
    handle = pool.submit(prompts, completions, fields, completion_tokens=counts)   # returns at once; one dict
                                                           # of fields and one token count per sample
    ref_logprobs = reference_forward(batch)                # ... overlaps with the scoring
    rewards, info = handle.result()                        # rewards: float32 tensor (B,) of weighted sums
    pool.close()                                           # or use `with RewardPool(...) as pool:`

A spec is (name_or_fn, weight) or (name_or_fn, weight, kwargs), or a dict {"name", "weight", "args"}
as it comes from YAML; kwargs are passed to every call (e.g. {"wall_s": 5} for the code reward).

A reward may also ask for what the sampling knows, by naming it in its signature (SAMPLING_ARGS):
`completion_tokens` (the tokens the model wrote for this completion, its end-of-sequence token included) and
`max_new_tokens` (the run's length limit), e.g. `def length_penalty(prompt, completion, completion_tokens,
max_new_tokens, **fields)`. Only a reward that names one gets it; a batched reward gets completion_tokens as a list.
They override a row field of the same name; a reward_args keyword of the same name overrides them.

Per-sample rewards `fn(prompt, completion, **fields) -> float` run one call at a time in `workers`
fresh Python processes (workers.py: `python -c "from rewards.pool import serve; ..."`, like multiprocessing's
"spawn": safe beside torch and CUDA, where forking the trainer is not; unlike it, a worker does not
re-import the trainer's main script, so it starts in about a second and without torch). The functions
travel by reference (module + name, with the trainer's sys.path), so any module-level function works,
registered or not. Each call has a deadline of `timeout_s`: a call past it has its worker SIGKILLed
(a code sandbox under it dies with it) and replaced. A call that raises, returns a non-finite value,
times out, or kills its worker scores 0; the reason is kept in `info`.
Batched rewards (a function with `fn.batched = True`, called as `fn(prompts, completions, fields,
**kwargs) -> list[float]`, e.g. the learned reward model holding a GPU model) run on a thread of this
process instead; a timeout there also scores 0, though the thread itself cannot be stopped.

A reward may return a `rewards.score.Score` instead of a float: a float that also carries
[(category, reason)], the failures behind its value (the code reward's failed test cases). The pool counts samples per category
(CATEGORIES) for each reward, its own failures included (a call past its deadline counts as a timeout).
A reward may also return a list (or tuple) of numbers, one per step of the completion (a process reward; a batched
one, such a list for each sample): the steps are rewards/score.py's `step_ends` of the completion, cut at the
row's `step_separator`, the reward's own attribute of that name, or line ends. Its value in `rewards` and
`per_reward` is their sum (what accuracy reads); `info["steps"]` keeps them. A list of the wrong length, or
holding a non-finite number, is a failure like a raise: 0, recorded with the reason, never cut to fit.

info = {"names": [...], "per_reward": {name: tensor (B,)}, "failures": {name: failed calls},
        "failed": [{"reward", "sample", "category", "reason"}, ...],      # reward failures + Score failures
        "failure_counts": {name: {category: samples}},
        "reasons": ["code[3]: timeout after 30s", ...],                   # the same, one line each
        "steps": {name: [[(end, score), ...] or None per sample]},  # only rewards that returned step lists: each
                                                   # step's score and its end in the completion (a character offset)
        "metrics": {"reward/code": mean, "reward_fail/code": failed calls, "reward_fail/code/timeout": samples}}
The per-category metrics appear for a reward from the first step it reports a failure, every category
from then on. `write_reasons(path, step, info["failed"])` appends a sample of them to a jsonl file.
"""
import inspect
import itertools
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait

from rewards.score import CATEGORIES, Score, read_value, step_ends, step_separator  # noqa: F401  (Score re-exported)
from workers import start_worker

WORKER_PREFIX = "reward-worker-"     # reward-worker-<trainer pid>-XXXX under the temp dir
SAMPLING_ARGS = ("completion_tokens", "max_new_tokens")   # what a reward gets when its signature names it


def _sweep_worker_dirs():
    """Remove the worker dirs of trainers that are gone (a kill -9 of the trainer and its workers at once)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = name[len(WORKER_PREFIX):].partition("-")[0]
        if name.startswith(WORKER_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)

def write_reasons(path: str, step: int, failed: list[dict], limit: int = 20, **extra) -> int:
    """Append up to `limit` of one step's failures (info["failed"]) to the jsonl file `path`, one line each
    as {"step", "reward", "sample", "category", "reason", **extra}; returns how many. Categories take
    turns, so a rare one is not crowded out by a common one. One O_APPEND write for the lot: lines from
    several ranks appending to the same file (pass rank=...) never interleave."""
    by_category: dict[str, list] = {}
    for f in failed:
        by_category.setdefault(f["category"], []).append(f)
    turns = itertools.chain.from_iterable(itertools.zip_longest(*by_category.values()))
    picked = [f for f in turns if f is not None][:limit]
    if not picked:
        return 0
    data = "".join(json.dumps({"step": step, **f, **extra}) + "\n" for f in picked).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return len(picked)


def _parse_spec(spec):
    if isinstance(spec, dict):
        unknown = set(spec) - {"name", "weight", "args"}
        if unknown or "name" not in spec:
            raise ValueError(f"reward spec {spec!r}: expected keys name, weight, args")
        spec = (spec["name"], spec.get("weight", 1.0), spec.get("args") or {})
    if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
        raise ValueError(f"reward spec {spec!r}: expected (name, weight) or (name, weight, kwargs)")
    target, weight, kwargs = (*spec, {})[:3]
    if isinstance(target, str):
        import registry
        name, fn = target, registry.get("reward", target)
    else:
        name, fn = target.__name__, target
    check = getattr(fn, "check_args", None)
    if check is not None:       # a bad option is a one-line error here, before any worker starts
        check(dict(kwargs))
    return name, float(weight), fn, dict(kwargs)


def _asks(fn, kwargs: dict) -> tuple[str, ...]:
    """The SAMPLING_ARGS that fn names as parameters, less those its reward_args set."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):     # a builtin or a C callable: it asks for nothing
        return ()
    return tuple(a for a in SAMPLING_ARGS if a in params and a not in kwargs)


class _Stop(BaseException):
    """SIGTERM (the trainer died): leave, whatever the reward was doing."""


def _stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # one _Stop at most: the clean-up after it runs to its end
    raise _Stop


def serve(fd: int, parent: int = 0):
    """Worker loop: receive (sys.path, pickled rewards), then score one job at a time until told to stop.
    However it leaves (told to, its trainer gone, SIGTERM when the trainer dies), it removes its temp dir."""
    # Ctrl-C belongs to the trainer, which closes the pool; a worker dying on it would only add noise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    conn = Connection(fd)   # held here, closed by _clean_up: not in a __del__ that a SIGTERM could interrupt
    try:
        try:
            _die_with_parent(signal.SIGTERM, parent)
            _serve(conn)
        except (_Stop, OSError):    # the trainer is gone
            pass
        finally:
            _clean_up(conn)
    except _Stop:   # the trainer exited while this worker was leaving anyway: no traceback, the clean-up again
        _clean_up(conn)


def _clean_up(conn: Connection):
    # leaving anyway: a SIGTERM now (the trainer exiting) would only interrupt the clean-up, or land in the
    # interpreter's shutdown after serve returns and print "Exception ignored ... _Stop" on the trainer's stderr
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.close()
    if os.path.basename(tempfile.gettempdir()).startswith(WORKER_PREFIX):
        shutil.rmtree(tempfile.gettempdir(), ignore_errors=True)


def _die_with_parent(sig: int, parent: int):
    """SIGTERM when the trainer's thread that started this worker ends (the main thread, or the pool's
    dispatcher for a replacement): a trainer killed with -9 leaves no worker and no temp dir behind."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):     # not Linux: a gone trainer still shows as end-of-file
        pass
    if parent and os.getppid() != parent:     # the trainer died before the line above
        raise _Stop


def _serve(conn: Connection):
    try:
        path, blob = conn.recv()
        sys.path[:] = path
        fns, kwargs = pickle.loads(blob)     # imports each reward's module
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc(limit=3)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):     # the trainer is gone
            return
        if job is None:
            return
        j, prompt, completion, fields, asked = job
        failures = []
        config_only = getattr(fns[j], "config_only", ())    # e.g. the code sandbox's limits: config, never data
        fields = {k: v for k, v in fields.items() if k not in config_only and k not in asked}
        steps = None
        try:
            out = fns[j](prompt, completion, **fields, **asked, **kwargs[j])
            value, steps, err = read_value(out)
            failures = list(getattr(out, "failures", ()))
        except _Stop:
            raise
        except BaseException as e:      # noqa: BLE001  a reward must never take the worker down quietly
            value, err = 0.0, f"{type(e).__name__}: {e}".splitlines()[0][:300]
        conn.send(("done", value if err is None else 0.0, err, failures, steps))


class _Worker:
    def __init__(self, blob: bytes):
        # its own temp dir for what a reward writes: the worker removes it when it leaves, the pool when it
        # kills the worker, and a later pool the dirs of trainers that died with their workers (kill -9 of all)
        _sweep_worker_dirs()
        self.tmp = tempfile.mkdtemp(prefix=f"{WORKER_PREFIX}{os.getpid()}-")
        self.proc, ours = start_worker("rewards.pool", os.getpid(), env={"TMPDIR": self.tmp})
        self.conn = Connection(ours.detach())
        self.conn.send((sys.path, blob))
        self.ready, self.job, self.deadline = False, None, math.inf


class RewardHandle:
    def __init__(self, pool, n: int, completions: list[str] = (), fields: list[dict] = ()):
        self.pool, self.n = pool, n
        self.completions, self.fields = list(completions), list(fields)   # to count the steps of a step reward
        R = len(pool.specs)
        self.values = [[0.0] * R for _ in range(n)]   # (B, R)
        self.steps: dict[tuple[int, int], list] = {}  # (sample, reward) -> [(end, score)] of a step reward
        self.errors: list[tuple[int, int, str]] = []
        self.failed: list[tuple[int, int, str, str]] = []   # (sample, reward, category, reason)
        self.remaining = n * R
        self.futures = []          # batched rewards: (j, future, deadline)
        self.done_event = threading.Event()
        if self.remaining == 0:
            self.done_event.set()

    def _set(self, i: int, j: int, value: float, err: str | None, category: str = "error", failures=(), steps=None):
        if steps is not None and err is None:
            value, err = self._check_steps(i, j, steps)
        with self.pool.lock:
            self.values[i][j] = value
            if err:
                self.errors.append((i, j, err))
                self.failed.append((i, j, category, err))
            self.failed += [(i, j, c, r) for c, r in failures]
            self.remaining -= 1
            if self.remaining == 0:
                self.done_event.set()

    def _check_steps(self, i: int, j: int, steps: list[float]) -> tuple[float, str | None]:
        """A step list of the right length is kept with its steps' ends -> (value, None); else (0, the reason)."""
        try:
            sep = step_separator(self.fields[i] if self.fields else {}, self.pool.specs[j][2])
        except ValueError as e:
            return 0.0, str(e)
        ends = step_ends(self.completions[i] if self.completions else "", sep)
        if len(steps) != len(ends):
            return 0.0, f"returned {len(steps)} step scores for a completion of {len(ends)} steps (separator {sep!r})"
        self.steps[(i, j)] = list(zip(ends, steps))
        return math.fsum(steps), None

    def done(self) -> bool:
        return self.done_event.is_set()

    def result(self):
        """Block until every call finished or timed out -> (rewards (B,) float32 tensor, info)."""
        import torch   # imported here so that spawned workers never pay for torch
        futures, self.futures = self.futures, []    # a second result() call must not count them twice
        for j, fut, deadline in futures:
            try:
                out = list(fut.result(timeout=max(0.0, deadline - time.monotonic())))
                if len(out) != self.n:
                    raise ValueError(f"returned {len(out)} values for {self.n} samples")
                vals, carried = [read_value(v) for v in out], [getattr(v, "failures", ()) for v in out]
            except BaseException as e:  # noqa: BLE001  including the timeout
                timeout = isinstance(e, TimeoutError)
                why = f"timeout after {self.pool.timeout_s:g}s" if timeout else f"{type(e).__name__}: {e}"
                vals, carried = [why.splitlines()[0][:300]] * self.n, [()] * self.n
                category = "timeout" if timeout else "error"
            for i, (v, fails) in enumerate(zip(vals, carried)):
                if isinstance(v, str):
                    self._set(i, j, 0.0, v, category)
                else:
                    value, steps, err = v
                    self._set(i, j, 0.0 if err else value, err, failures=fails, steps=None if err else steps)
        self.done_event.wait()
        names = [s[0] for s in self.pool.specs]
        weights = torch.tensor([s[1] for s in self.pool.specs], dtype=torch.float32)      # (R,)
        values = torch.tensor(self.values, dtype=torch.float32).view(self.n, len(names))  # (B, R)
        failures = {name: 0 for name in names}
        for _, j, _ in self.errors:
            failures[names[j]] += 1
        failed = sorted(self.failed)
        counts = {name: dict.fromkeys(CATEGORIES, 0) for name in names}
        for i, j, category in sorted({f[:3] for f in failed}):      # samples, not cases: once per sample
            counts[names[j]][category if category in CATEGORIES else "error"] += 1
        self.pool.reporting.update(names[j] for _, j, _, _ in failed)
        metrics = {}
        for j, name in enumerate(names):
            metrics[f"reward/{name}"] = values[:, j].mean().item() if self.n else 0.0
            metrics[f"reward_fail/{name}"] = float(failures[name])
            if name in self.pool.reporting:
                metrics.update({f"reward_fail/{name}/{c}": float(n) for c, n in counts[name].items()})
        info = {"names": names, "per_reward": {n: values[:, j] for j, n in enumerate(names)}, "failures": failures,
                "failed": [{"reward": names[j], "sample": i, "category": c, "reason": r} for i, j, c, r in failed],
                "failure_counts": counts, "reasons": [f"{names[j]}[{i}]: {r}" for i, j, _, r in failed],
                "metrics": metrics}
        stepped = sorted({j for _, j in self.steps})
        if stepped:
            info["steps"] = {names[j]: [self.steps.get((i, j)) for i in range(self.n)] for j in stepped}
        return values @ weights, info                                                   # (B,)


class RewardPool:
    def __init__(self, specs, workers: int = 2, timeout_s: float = 30.0, max_new_tokens: int | None = None):
        if not specs:
            raise ValueError("RewardPool needs at least one reward spec")
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"RewardPool: workers must be >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.specs = [_parse_spec(s) for s in specs]
        names = [s[0] for s in self.specs]
        # the same reward twice (say with other kwargs) gets a numbered name in info and metrics
        self.specs = [(n if names.count(n) == 1 else f"{n}#{names[:j].count(n) + 1}", *rest)
                      for j, (n, *rest) in enumerate(self.specs)]
        self.timeout_s, self.max_new_tokens = timeout_s, max_new_tokens
        self.asks = [_asks(fn, kw) for _, _, fn, kw in self.specs]   # per reward: the SAMPLING_ARGS it gets
        for (name, *_), asks in zip(self.specs, self.asks):
            if "max_new_tokens" in asks and max_new_tokens is None:
                raise ValueError(f"reward {name!r} asks for max_new_tokens: give the pool "
                                 f"RewardPool(..., max_new_tokens=) or the reward reward_args {name}.max_new_tokens")
        self.lock = threading.Lock()
        self.pending: deque = deque()                        # (handle, i, j, prompt, completion, fields, asked)
        self.per_sample = [j for j, s in enumerate(self.specs) if not getattr(s[2], "batched", False)]
        batched = [j for j, s in enumerate(self.specs) if getattr(s[2], "batched", False)]
        self.threads = ThreadPoolExecutor(max_workers=len(batched), thread_name_prefix="reward") if batched else None
        fns = [s[2] if j in self.per_sample else None for j, s in enumerate(self.specs)]
        self.blob = pickle.dumps((fns, [s[3] for s in self.specs]))   # fails here, early, if not picklable
        self.workers = [_Worker(self.blob) for _ in range(workers if self.per_sample else 0)]
        self.wake_r, self.wake_w = os.pipe()
        self.closed = False
        self.restarts, self.start_failures, self.broken = 0, 0, ""
        self.reporting: set[str] = set()   # rewards that reported a failure once: their categories are logged
        self.dispatcher = threading.Thread(target=self._dispatch, name="reward-dispatch", daemon=True)
        self.dispatcher.start()

    # ------------------------------------------------------------------------------------ public
    def submit(self, prompts: list[str], completions: list[str], fields: list[dict] | None = None,
               completion_tokens: list[int] | None = None) -> RewardHandle:
        """completion_tokens: the tokens sampled for each completion, for the rewards that ask for them."""
        fields = fields if fields is not None else [{} for _ in prompts]
        if not len(prompts) == len(completions) == len(fields):
            raise ValueError(f"submit: {len(prompts)} prompts, {len(completions)} completions, {len(fields)} fields")
        if completion_tokens is not None and len(completion_tokens) != len(prompts):
            raise ValueError(f"submit: {len(prompts)} prompts, {len(completion_tokens)} completion_tokens")
        asking = [s[0] for s, asks in zip(self.specs, self.asks) if "completion_tokens" in asks]
        if asking and completion_tokens is None:
            raise ValueError(f"reward {asking[0]!r} asks for completion_tokens: pass submit(..., completion_tokens=)")
        if self.closed:
            raise RuntimeError("submit on a closed RewardPool")
        sampled = {"completion_tokens": [int(n) for n in completion_tokens or ()],
                   "max_new_tokens": self.max_new_tokens}
        h = RewardHandle(self, len(prompts), completions, fields)
        for j, (_, _, fn, kw) in enumerate(self.specs):
            if j not in self.per_sample and len(prompts):
                asked = {a: sampled[a] for a in self.asks[j]}     # completion_tokens as a list (B,)
                fut = self.threads.submit(fn, list(prompts), list(completions), list(fields), **asked, **kw)
                h.futures.append((j, fut, time.monotonic() + self.timeout_s))
        with self.lock:
            for i in range(len(prompts)):
                for j in self.per_sample:
                    asked = {a: sampled[a][i] if a == "completion_tokens" else sampled[a] for a in self.asks[j]}
                    self.pending.append((h, i, j, prompts[i], completions[i], fields[i], asked))
        os.write(self.wake_w, b"x")
        return h

    def wait_ready(self, timeout: float = 60.0):
        """Block until every worker has started (to keep start-up out of a measurement)."""
        end = time.monotonic() + timeout
        while not all(w.ready for w in self.workers) and time.monotonic() < end:
            time.sleep(0.01)

    def close(self):
        if self.closed:
            return
        self.closed = True
        os.write(self.wake_w, b"x")
        self.dispatcher.join(timeout=10)
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.conn.close()
            shutil.rmtree(w.tmp, ignore_errors=True)
        if self.threads:
            self.threads.shutdown(wait=False, cancel_futures=True)
        os.close(self.wake_r)
        os.close(self.wake_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------ dispatcher
    def _replace(self, k: int, why: str, category: str = "error"):
        w = self.workers[k]
        w.proc.kill()          # no-op if it is already dead
        w.proc.wait()
        w.conn.close()
        shutil.rmtree(w.tmp, ignore_errors=True)
        if w.job is not None:  # after the cleanup: result() may return as soon as the last call is set
            h, i, j = w.job
            h._set(i, j, 0.0, why, category)
        # a worker that dies before it is ready cannot import its rewards: stop retrying after a few
        self.start_failures = 0 if w.ready else self.start_failures + 1
        if self.start_failures >= 3:
            self.broken = f"reward workers cannot start ({why})"
        self.restarts += 1
        self.workers[k] = None if self.broken else _Worker(self.blob)

    def _dispatch(self):
        try:
            self._dispatch_loop()
        except BaseException as e:  # noqa: BLE001  a bug here must not leave result() waiting forever
            traceback.print_exc()
            self.broken = f"reward dispatcher crashed: {type(e).__name__}: {e}"
        finally:   # on close (or a crash) every unfinished call scores 0 with the reason
            with self.lock:
                jobs = [job[:3] for job in self.pending] + [w.job for w in self.workers if w.job]
                self.pending.clear()
                for w in self.workers:
                    w.job = None
            for h, i, j in jobs:
                h._set(i, j, 0.0, self.broken or "reward pool closed")

    def _dispatch_loop(self):
        while not self.closed:
            dead = []
            with self.lock:
                if self.broken:
                    dead, self.pending = list(self.pending), deque()
                for w in self.workers:
                    if w.ready and w.job is None and self.pending:
                        h, i, j, prompt, completion, fields, asked = self.pending.popleft()
                        w.job, w.deadline = (h, i, j), time.monotonic() + self.timeout_s
                        try:
                            w.conn.send((j, prompt, completion, fields, asked))
                        except OSError:     # it just died: the end-of-file below fails the job
                            pass
            for h, i, j, *_ in dead:
                h._set(i, j, 0.0, self.broken)
            now = time.monotonic()
            timeout = max(0.0, min([w.deadline for w in self.workers if w.job] + [now + 1.0]) - now)
            # a worker's death shows as end-of-file on its socket
            ready = set(wait([self.wake_r] + [w.conn for w in self.workers], timeout=timeout))
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
            for k, w in enumerate(self.workers):
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is None:
                        rc = w.proc.wait()
                        self._replace(k, f"worker died (exit code {rc})", "signal" if rc < 0 else "error")
                    elif msg[0] == "ready":
                        w.ready = True
                    elif msg[0] == "error":     # its rewards do not import: retrying will not help
                        self.broken = "reward workers cannot start: " + msg[1].strip().splitlines()[-1]
                        print(f"reward pool: a worker failed to start:\n{msg[1]}", file=sys.stderr)
                        self._replace(k, self.broken)
                    elif w.job is not None:
                        h, i, j = w.job
                        w.job, w.deadline = None, math.inf
                        h._set(i, j, msg[1], msg[2], failures=msg[3], steps=msg[4])
                elif w.job is not None and time.monotonic() > w.deadline:
                    self._replace(k, f"timeout after {self.timeout_s:g}s", "timeout")
            self.workers = [w for w in self.workers if w is not None]
