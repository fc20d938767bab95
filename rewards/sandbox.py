"""Run one untrusted Python program under OS limits and return what it printed.

    from rewards.sandbox import Limits, run
    r = run("print(input()[::-1])", stdin="abc\n", limits=Limits(wall_s=5))
    r.status, r.stdout, r.reason          # "ok", "cba\n", ""
    python -m rewards.sandbox             # prints what this machine enforces

Every call starts a fresh launcher (`python -I -S rewards/sandbox_launch.py SPEC`) in its own session
and process group. The launcher, before the program runs:
  * new PID namespace: the program's process tree dies with its init, so setsid() cannot escape and
    kill(-1) / kill(parent) reach nothing outside;
  * new network namespace: no interfaces but a downed loopback, so no connection leaves it;
  * new IPC namespace: System V shared memory, semaphores and POSIX message queues are private and die
    with the program (in the host's namespace they outlive it and hold host memory);
  * new mount namespace and a minimal root (pivot_root): read-only bind mounts of the system dirs that
    hold the interpreter and its libraries (/usr, /lib*, /bin, /sbin, the interpreter's prefix if
    elsewhere, the linker cache), /dev/null, zero, random, urandom; fresh size-capped tmpfs on /tmp (the
    empty working directory /tmp/work) and /dev/shm; a /proc that shows only the sandbox's processes.
    No /etc, /home, /root or project checkout: host files are out of sight, not merely protected;
  * as root, drops to a dedicated uid/gid (2,000,000 + launcher pid, no supplementary groups), so the
    program cannot write outside its tmpfs, cannot read the launcher's memory, and RLIMIT_NPROC counts
    only its own processes (root ignores RLIMIT_NPROC, so this is what makes the process cap real);
  * rlimits: CPU seconds, address space (memory), file size (also caps stdout/stderr, which go to
    files, not pipes), open files, processes, no core dumps;
  * an environment with nothing inherited (PATH, HOME=/tmp/work, LANG, thread caps only);
  * PR_SET_PDEATHSIG so the whole tree dies if the reward worker that started it dies.
The interpreter runs a small harness (sandbox_launch.HARNESS): it reads the program from a pipe (there is
no main.py to read back) and runs it as __main__; with `test=` it then asks the launcher for the test,
runs it in the program's namespace and prints a per-call random token; `run` reports "ok" only when the
token ends stdout, so leaving early (os._exit, a signal) cannot pass a test.
The launcher enforces wall time by SIGKILLing the namespace's init and returns only when every process
of the program is gone; the caller SIGKILLs the whole process group as a backstop. A SIGKILL or SIGXCPU
counts as the CPU limit only when the program's processes used that much CPU (the launcher reports it).

Without root, the launcher tries an unprivileged user namespace for the same isolation (no uid drop: the
program is root in its namespace, so it could read the launcher's memory, which holds the test);
where namespaces are not available at all it still applies rlimits, the clean environment, the harness
and wall-time kill, and `capabilities()` says which guarantees are missing.
Not enforced: CPU use up to the limits. Cost: about 0.1 s per run on an idle core, most of it two
interpreter start-ups (the launcher's and the program's); the mounts add little (docs/speed.md).
The interpreter must be reachable by the dedicated uid: sys.executable when every parent directory is
world-traversable, else the first python3 on a system path (e.g. pyenv under a 0700 /root). In the
sandbox it runs as its real path, without a virtual environment: the program gets the standard library
and whatever the system installs under the mounted dirs, not the trainer's packages.
"""
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from rewards.sandbox_launch import SETUP_FAILED, UID_BASE, clean_env

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")


@dataclass
class Limits:
    wall_s: float = 5.0      # enforced by the launcher (kill the namespace's init), backstop in the caller
    cpu_s: int = 5           # RLIMIT_CPU per process: SIGXCPU, then SIGKILL one second later
    memory_mb: int = 512     # RLIMIT_AS per process
    file_mb: int = 16        # RLIMIT_FSIZE: largest file, stdout and stderr included
    disk_mb: int = 32        # size of the tmpfs holding the working directory (caps many-file disk fills)
    max_procs: int = 16      # RLIMIT_NPROC for the dedicated uid (processes + threads)
    max_files: int = 64      # RLIMIT_NOFILE
    output_chars: int = 65536  # stdout kept for the caller


@dataclass
class Result:
    status: str      # ok | error | timeout | memory | output_limit | killed | setup_failed (ok: test's token seen)
    returncode: int  # program exit code, 128 + signal when killed by a signal, -1 on wall timeout
    stdout: str
    stderr: str      # last 2,000 characters
    wall_s: float
    reason: str      # one line for logs; "" when status is ok


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
        test: str | None = None) -> Result:
    """Run `code` as a Python program fed `stdin`, then `test` (Python statements) in the program's namespace
    when given; never raises for anything the program does. With a test, "ok" means the test ran to its
    end: the harness prints a per-call random token after it, and a run without the token fails."""
    limits = limits or Limits()
    host = tempfile.mkdtemp(prefix="sbx-")   # 0700, root's: holds the program and its captured output
    token = secrets.token_hex(16)
    try:
        files = [("program", code), ("stdin", stdin)] + ([("test", token + "\n" + test)] if test is not None else [])
        for name, text in files:
            with open(os.path.join(host, name), "w") as f:
                f.write(text)
        spec = {"host": host, "python": python or default_python(), "parent": os.getpid(),
                "has_test": test is not None, **asdict(limits)}
        cmd = [sys.executable, "-I", "-S", LAUNCHER, json.dumps(spec)]
        t0 = time.monotonic()
        with open(os.path.join(host, "launcher.err"), "w") as err:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd=host,
                                 env=clean_env(host), start_new_session=True, close_fds=True)
            try:   # the launcher enforces wall_s itself; this is the backstop if the launcher hangs
                rc = p.wait(timeout=limits.wall_s + 5.0)
            except subprocess.TimeoutExpired:
                rc = -1
            finally:
                _kill_group(p.pid)     # stragglers, where there is no PID namespace to take them down
                p.wait()
        if os.path.exists(os.path.join(host, "wall_timeout")):
            rc = -1
        wall = time.monotonic() - t0
        out = _read(os.path.join(host, "stdout"), limits.output_chars, head=True)
        err_text = _read(os.path.join(host, "stderr"), 2000, head=False)
        launcher_err = _read(os.path.join(host, "launcher.err"), 500, head=False)
        try:
            cpu = float(_read(os.path.join(host, "cpu_s"), 32, head=True))
        except ValueError:      # the launcher died before writing it
            cpu = 0.0
        status, reason = _classify(rc, err_text, launcher_err, limits, cpu)
        if test is not None:
            end = "\n" + token + "\n"
            if _read(os.path.join(host, "stdout"), len(end), head=False) == end:
                out = out.removesuffix(end)
            elif status == "ok":
                status, reason = "error", "exit code 0 before the tests finished (no harness token)"
        return Result(status, rc, out, err_text, wall, reason)
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(path: str, n: int, head: bool) -> str:
    try:
        with open(path, "rb") as f:
            if not head:
                f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read(n).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _classify(rc: int, stderr: str, launcher_err: str, lim: Limits, cpu_s: float) -> tuple[str, str]:
    last = (stderr.strip().splitlines() or [""])[-1][:200]
    if rc == -1:
        return "timeout", f"wall time limit {lim.wall_s:g}s exceeded"
    if rc == SETUP_FAILED and "SETUP:" in launcher_err:
        return "setup_failed", "sandbox setup failed: " + launcher_err.split("SETUP:")[-1].strip()[:200]
    if rc == 0:
        return "ok", ""
    # SIGXCPU comes at the soft CPU limit, SIGKILL at the hard one (a second later); the same signals sent
    # by the program itself are told apart by the CPU time its processes used
    if rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and cpu_s >= lim.cpu_s - 0.05:
        return "timeout", f"cpu time limit {lim.cpu_s}s exceeded (signal {rc - 128}, {cpu_s:.1f}s used)"
    if rc == 128 + signal.SIGXFSZ or "File too large" in last:   # Python ignores SIGXFSZ: writes fail EFBIG
        return "output_limit", f"file/output size limit {lim.file_mb} MB exceeded"
    if "MemoryError" in last:
        return "memory", f"memory limit {lim.memory_mb} MB exceeded ({last})"
    if rc > 128:
        return "killed", f"killed by signal {rc - 128} ({_signame(rc - 128)}) {last}".strip()
    return "error", f"exit code {rc}: {last}"


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unnamed"


def capabilities() -> dict:
    """Which guarantees hold on this machine (runs one tiny probe program)."""
    probe = ("import os\nns=[os.readlink(f'/proc/self/ns/{k}') for k in ('net', 'ipc')]\n"
             "print(os.getuid(), os.getpid(), os.getcwd(), *ns, os.path.exists('/etc/passwd'))")
    r = run(probe, limits=Limits(wall_s=20))
    fields = r.stdout.split()
    ok = r.status == "ok" and len(fields) == 6
    return {"root": os.geteuid() == 0,
            "dedicated_uid": ok and int(fields[0]) >= UID_BASE,
            "pid_namespace": ok and fields[1] == "2",
            "private_tmp_workdir": ok and fields[2] == "/tmp/work",
            "network_namespace": ok and fields[3] != os.readlink("/proc/self/ns/net"),
            "ipc_namespace": ok and fields[4] != os.readlink("/proc/self/ns/ipc"),
            "minimal_root": ok and fields[5] == "False",
            "rlimits": True, "clean_env": True, "wall_kill": True,
            "python": default_python(), "probe": r.reason or "ok"}


if __name__ == "__main__":
    print(json.dumps(capabilities(), indent=1))
