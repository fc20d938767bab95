"""Run one untrusted Python program under OS limits and return what it printed (or the values of expressions).

    from rewards.sandbox import Limits, run
    r = run("print(input()[::-1])", stdin="abc\n", limits=Limits(wall_s=5))
    r.status, r.stdout, r.reason          # "ok", "cba\n", ""
    r = run("def f(x):\n    return x * 2", exprs=["f(3)", "f('a')"])
    r.values                              # [("ok", 6), ("ok", "aa")]: plain data, parsed here, outside
    python -m rewards.sandbox             # prints what this machine enforces

Every call starts a fresh launcher (`python -I -S rewards/sandbox_launch.py SPEC`) in its own session
and process group. Nothing of a run touches the host's disk: the program, its stdin, its stdout/stderr,
the results and the supervisor's report travel in memfds (anonymous memory files) that this process
creates and reads. The launcher, before the program runs:
  * a cgroup of its own (rewards/sandbox_limits.py): memory_mb and max_procs bound the whole sandbox,
    shared memory, memfds, tmpfs pages and forked children included; the kernel's counters say whether
    the limit was hit;
  * new PID namespace: the program's process tree dies with its init, so setsid() cannot escape and
    kill(-1) / kill(parent) reach nothing outside;
  * new network namespace: no interfaces but a downed loopback, so no connection leaves it;
  * new IPC namespace, with System V shared memory capped at memory_mb in total: its objects are private
    and die with the program (in the host's namespace they outlive it and hold host memory);
  * new mount namespace and a minimal root (pivot_root), built on a tmpfs of that namespace: read-only
    bind mounts of the system dirs that hold the interpreter and its libraries (/usr, /lib*, /bin, /sbin,
    the interpreter's prefix if elsewhere, the linker cache), /dev/null, zero, random, urandom; fresh
    size-capped tmpfs on /tmp (the empty working directory /tmp/work) and /dev/shm; a /proc that shows
    only the sandbox's processes. No /etc, /home, /root or project checkout: host files are out of sight;
  * as root, drops to a dedicated uid/gid (2,000,000 + launcher pid, no supplementary groups), so the
    program cannot write outside its tmpfs, cannot read the launcher's memory, and RLIMIT_NPROC counts
    only its own processes;
  * rlimits: CPU seconds, address space, file size (also caps stdout/stderr and every memfd), open files,
    processes, message queues, no core dumps;
  * seccomp: no new namespaces (no user namespace of its own, where it could mount an unbounded tmpfs),
    no setns, mount, bpf, userfaultfd, perf events, keyrings or io_uring;
  * an environment with nothing inherited (PATH, HOME=/tmp/work, LANG, thread caps only);
  * PR_SET_PDEATHSIG so the whole tree dies if the reward worker that started it dies.
The interpreter runs a small harness (sandbox_launch.HARNESS) that reads the program from a pipe and runs
it as __main__; with `exprs=` it then evaluates each expression in the program's namespace and writes
each value as a plain-data literal on the results channel. The caller (rewards/code.py) compares them with
expected values that never enter the sandbox, so nothing in the sandbox is worth stealing.
The launcher enforces wall time by SIGKILLing the namespace's init and returns only when every process
of the program is gone; the caller SIGKILLs the whole process group as a backstop. Every failure reason
comes from what the supervisor observed (exit status, CPU used, the cgroup's OOM kills, output sizes, the
tmpfs filling up), never from what the program printed; the program's last stderr line is quoted after
it, escaped to printable characters.

A machine without cgroups (or seccomp, or root) runs with what it has: `capabilities()` and a one-time
line on stderr say which guarantee is missing. Without root, the launcher tries an unprivileged user
namespace for the same isolation (no uid drop: the program is root in its namespace). Where namespaces
are not available at all it still applies rlimits, the clean environment, the harness and wall-time kill.
Not enforced: CPU use up to the limits. Cost: about 0.1 s per run on an idle core, most of it two
interpreter start-ups (the launcher's and the program's); the mounts add little (docs/speed.md).
The interpreter must be reachable by the dedicated uid: sys.executable when every parent directory is
world-traversable, else the first python3 on a system path (e.g. pyenv under a 0700 /root). In the
sandbox it runs as its real path, without a virtual environment: the program gets the standard library
and whatever the system installs under the mounted dirs, not the trainer's packages.
"""
import ast
import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from rewards.sandbox_launch import SETUP_FAILED, UID_BASE, clean_env

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")
CHANNELS = ("job", "stdin", "stdout", "stderr", "results", "report", "launcher_err")
_noted: set[str] = set()      # degraded guarantees already logged by this process


@dataclass
class Limits:
    wall_s: float = 5.0      # enforced by the launcher (kill the namespace's init), backstop in the caller
    cpu_s: int = 5           # RLIMIT_CPU per process: SIGXCPU, then SIGKILL one second later
    memory_mb: int = 512     # the sandbox's cgroup (all its processes and shared memory); RLIMIT_AS without one
    file_mb: int = 16        # RLIMIT_FSIZE: largest file or memfd, stdout and stderr included
    disk_mb: int = 32        # size of the tmpfs holding the working directory (caps many-file disk fills)
    max_procs: int = 16      # the cgroup's pids.max and RLIMIT_NPROC for the dedicated uid (processes + threads)
    max_files: int = 64      # RLIMIT_NOFILE
    output_chars: int = 65536  # stdout kept for the caller
    result_chars: int = 1 << 20  # largest serialised value of one expression


@dataclass
class Result:
    status: str      # ok | error | timeout | memory | output_limit | killed | setup_failed
    returncode: int  # program exit code, 128 + signal when killed by a signal, -1 on wall timeout
    stdout: str
    stderr: str      # last 2,000 characters
    wall_s: float
    reason: str      # one printable line for logs; "" when status is ok
    values: list | None = None   # with exprs: [("ok", plain value) | ("error", message)] per expression
    observed: dict = field(default_factory=dict)   # the supervisor's report (cgroup counters, cpu_s, notes)


# ----------------------------------------------------------------------------------- caller side

def _traversable_by_others(path: str) -> bool:
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        st = os.stat(os.sep.join(parts[:i]) or os.sep)
        if not st.st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IXOTH)


def default_python() -> str:
    """Interpreter the dedicated uid can execute: ours if reachable, else a system python3."""
    if os.geteuid() != 0 or _traversable_by_others(sys.executable):
        return sys.executable
    for p in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.path.exists(p) and _traversable_by_others(p):
            return p
    raise RuntimeError(f"no python3 reachable by an unprivileged uid ({sys.executable} sits under a private dir)")


def run(code: str, stdin: str = "", limits: Limits | None = None, python: str | None = None,
        exprs: list[str] | None = None, setup: list[str] = ()) -> Result:
    """Run `code` as a Python program fed `stdin`; with `exprs`, then run the `setup` statements (imports)
    and evaluate each expression in the program's namespace, in this one fresh interpreter. Never raises
    for anything the program does. With exprs, "ok" needs a well-formed value or error for each one."""
    limits = limits or Limits()
    job = {"program": code, "exprs": exprs, "setup": list(setup), "result_chars": limits.result_chars}
    fds = {name: os.memfd_create(f"sandbox-{name}") for name in CHANNELS}
    try:
        for name, data in (("job", json.dumps(job).encode()), ("stdin", stdin.encode())):
            os.write(fds[name], data)
            os.lseek(fds[name], 0, os.SEEK_SET)
        spec = {"python": python or default_python(), "parent": os.getpid(), "fds": fds, **asdict(limits)}
        cmd = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec)]
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fds["launcher_err"],
                             cwd="/", env=clean_env("/"), start_new_session=True, pass_fds=list(fds.values()))
        try:   # the launcher enforces wall_s itself; this is the backstop if the launcher hangs
            rc = p.wait(timeout=limits.wall_s + 5.0)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            if p.poll() is None:   # it hangs, or this worker is stopping: SIGTERM lets it remove its cgroup
                p.terminate()
                try:
                    p.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(p.pid)     # stragglers, where there is no PID namespace to take them down
            p.wait()
        wall = time.monotonic() - t0
        observed = _report(fds["report"])
        _log_notes(observed.get("notes", []))
        out = _read(fds["stdout"], limits.output_chars, head=True)
        err_text = _read(fds["stderr"], 2000, head=False)
        sizes = {n: os.fstat(fds[n]).st_size for n in ("stdout", "stderr")}
        status, reason = _classify(rc, observed, sizes, err_text, _read(fds["launcher_err"], 500, head=False), limits)
        values = None
        if exprs is not None and status == "ok":
            values = _parse_values(_read(fds["results"], (limits.result_chars + 64) * len(exprs), head=True), len(exprs))
            if values is None:
                status, reason = "error", "the harness wrote no well-formed result for every expression"
        return Result(status, rc, out, err_text, wall, reason, values, observed)
    finally:
        for fd in fds.values():
            os.close(fd)


def _parse_values(text: str, n: int) -> list | None:
    """The results channel -> [("ok", value) | ("error", message)] * n, or None if it is malformed. Each
    value is parsed by ast.literal_eval, so what comes back is plain data whatever the program did."""
    lines = text.split("\n")
    if len(lines) != n + 1 or lines[-1] != "":
        return None
    values = []
    for line in lines[:-1]:
        kind, _, literal = line.partition(" ")
        try:
            value = ast.literal_eval(literal)
        except Exception:   # noqa: BLE001  anything the program wrote there: SyntaxError, RecursionError, ...
            value, kind = "the result is not a plain-data literal", "error" if kind == "ok" else kind
        if kind not in ("ok", "error") or (kind == "error" and not isinstance(value, str)):
            return None
        values.append((kind, value))
    return values


def _report(fd: int) -> dict:
    """The supervisor's JSON lines (the launcher's and the namespace init's), merged; notes concatenated."""
    merged = {"notes": []}
    for line in _read(fd, 1 << 16, head=True).splitlines():
        try:
            part = json.loads(line)
        except ValueError:
            continue
        merged["notes"] += part.pop("notes", [])
        merged.update(part)
    return merged


def _log_notes(notes: list[str]):
    for note in notes:
        if note not in _noted:
            _noted.add(note)
            print(f"sandbox: {note}", file=sys.stderr)


def _kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(fd: int, n: int, head: bool) -> str:
    size = os.fstat(fd).st_size
    return os.pread(fd, n, 0 if head else max(0, size - n)).decode("utf-8", "replace")


def printable(text: str, n: int = 200) -> str:
    """A program's words, safe for a log line: control and unprintable characters escaped, at most n chars."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:n])[:n]


def _classify(rc: int, obs: dict, sizes: dict, stderr: str, launcher_err: str, lim: Limits) -> tuple[str, str]:
    """-> (status, reason) from what the supervisor observed; the program's last stderr line is quoted after."""
    said = printable((stderr.strip().splitlines() or [""])[-1])
    said = f"; its stderr ends: {said}" if said else ""
    timed_out = rc == -1 or obs.get("wall_timeout")
    if obs.get("oom_kills"):    # first: a program past its memory may then also hang
        return "memory", (f"memory limit {lim.memory_mb} MB exceeded: the kernel killed {obs['oom_kills']} of its "
                          f"processes (peak {obs.get('memory_peak_mb', 0):g} MB)"
                          + (f", then the wall time limit {lim.wall_s:g}s" if timed_out else ""))
    if timed_out:
        return "timeout", f"wall time limit {lim.wall_s:g}s exceeded"
    if rc == SETUP_FAILED and "SETUP:" in launcher_err:
        return "setup_failed", "sandbox setup failed: " + printable(launcher_err.split("SETUP:")[-1].strip())
    full = [n for n, size in sizes.items() if size >= lim.file_mb << 20]
    if full:
        return "output_limit", f"file/output size limit {lim.file_mb} MB reached by its {' and '.join(full)}"
    if rc == 0:
        return "ok", ""
    # SIGXCPU comes at the soft CPU limit, SIGKILL at the hard one (a second later); the same signals sent
    # by the program itself are told apart by the CPU time its processes used. The rusage sum reads up to a few
    # ms either side of the limit here, but twice in some thirty busy full test runs fell short of a 50 ms margin
    # (the cause is not known), so the margin is a tenth of the limit: either way the program scores nothing
    cpu_s = obs.get("cpu_s", 0.0)
    if rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and cpu_s >= 0.9 * lim.cpu_s:
        return "timeout", f"cpu time limit {lim.cpu_s}s exceeded (signal {rc - 128}, {cpu_s:.1f}s used)"
    if rc == 128 + signal.SIGXFSZ:
        return "output_limit", f"file size limit {lim.file_mb} MB exceeded (SIGXFSZ)"
    if obs.get("largest_file_mb", 0) >= lim.file_mb:
        return "output_limit", f"file size limit {lim.file_mb} MB reached by a file in its /tmp, exit code {rc}{said}"
    if obs.get("disk_full"):
        return "output_limit", f"disk limit {lim.disk_mb} MB reached (its /tmp is full), exit code {rc}{said}"
    if obs.get("memory_limit_hits") and obs.get("memory_peak_mb", 0) >= 0.9 * lim.memory_mb:
        return "memory", f"memory limit {lim.memory_mb} MB reached (peak {obs['memory_peak_mb']:g} MB), exit code {rc}{said}"
    if rc > 128:
        used = f", {cpu_s:.2f}s of CPU used" if rc == 128 + signal.SIGXCPU else ""
        return "killed", f"killed by signal {rc - 128} ({_signame(rc - 128)}){used}{said}"
    return "error", f"exit code {rc}{said}"


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unnamed"


PROBE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
userns = libc.unshare(0x10000000) == 0                # CLONE_NEWUSER
print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "cwd": os.getcwd(), "userns": userns,
                  "ns": [os.readlink(f'/proc/self/ns/{k}') for k in ('net', 'ipc')],
                  "etc_passwd": os.path.exists('/etc/passwd')}))
"""


def capabilities() -> dict:
    """Which guarantees hold on this machine (runs one tiny probe program)."""
    r = run(PROBE, limits=Limits(wall_s=20))
    try:
        got = json.loads(r.stdout) if r.status == "ok" else {}
    except ValueError:
        got = {}
    ok = bool(got)
    obs = r.observed
    return {"root": os.geteuid() == 0,
            "dedicated_uid": ok and got["uid"] >= UID_BASE,
            "pid_namespace": ok and got["pid"] == 2,
            "private_tmp_workdir": ok and got["cwd"] == "/tmp/work",
            "network_namespace": ok and got["ns"][0] != os.readlink("/proc/self/ns/net"),
            "ipc_namespace": ok and got["ns"][1] != os.readlink("/proc/self/ns/ipc"),
            "minimal_root": ok and not got["etc_passwd"],
            "cgroup": obs.get("cgroup", ""),           # "v1" / "v2": memory_mb and max_procs bound the whole sandbox
            "no_new_user_namespace": ok and not got["userns"],
            "rlimits": True, "clean_env": True, "wall_kill": True,
            "python": default_python(), "notes": obs.get("notes", []), "probe": r.reason or "ok"}


if __name__ == "__main__":
    print(json.dumps(capabilities(), indent=1))
