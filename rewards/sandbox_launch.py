"""The in-sandbox half of rewards/sandbox.py: run as `python -I -S rewards/sandbox_launch.py SPEC`.

It builds the cgroup, namespaces, minimal root, uid, rlimits and seccomp filter described in
rewards/sandbox.py, then execs the interpreter on HARNESS, which runs the program (and, for an assert
case, evaluates the test's expressions). Everything travels through descriptors the caller passed, no file
on the host: SPEC["fds"] names them (job: the program and expressions; stdin, stdout, stderr and results
for the program; report: what the supervisor observed, one JSON object per line).
It imports only what it needs (os, sys, signal, resource, fcntl, ctypes, json;
the limits' module by path): it starts once per test
case, and its start-up time is most of a sandboxed run's cost. SPEC is visible on the host's process list,
so it holds nothing of the case.
"""
import ctypes
import fcntl
import json
import os
import resource
import signal
import sys



def _load_limits():
    """rewards/sandbox_limits.py by path: `-I` keeps this file's dir off sys.path, and putting it there
    would let rewards/math.py shadow the standard library's math."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_limits.py")
    spec = importlib.util.spec_from_file_location("sandbox_limits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sandbox_limits = _load_limits()

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
PR_SET_PDEATHSIG = 1
UID_BASE = 2_000_000
SETUP_FAILED = 125          # exit code when the sandbox could not be built (like env(1)); see "SETUP:" on stderr
JOB_FD, RESULTS_FD = 3, 4   # in the program's process: the job pipe (read, then closed); the results channel
NEW_ROOT = "/tmp/.sandbox-root"   # in the sandbox's own mount namespace, on a tmpfs mounted there: never on the host
# What the new root holds: the interpreter and the libraries it loads, read-only. /etc is left out on
# purpose (accounts, hosts, secrets); only the dynamic linker's cache comes from it.
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
SYSTEM_FILES = ("/etc/ld.so.cache",)
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

# Runs in the sandbox as `python -I -B -c HARNESS [eval]`; it is no file the program could import or read.
# It reads its job (the program; for an assert case also the test's imports and expressions) from a pipe
# that it closes before the program runs, runs the program as __main__ in a module of its own (the
# harness's globals are not the program's), then evaluates each expression and writes one line per
# expression on the results channel: "ok <plain-data literal>" or "error <message literal>". The
# expected values are not in the job: the caller compares what comes back, so a program that meddles
# with this process can only change the values of its own expressions. Values must be plain data (None,
# bool, int, float, complex, str, bytes, and lists, tuples, sets, dicts of them): an object with an
# __eq__ of its own does not leave the sandbox.
HARNESS = r"""
def _harness():
    import json, os, sys, types
    data = []
    while chunk := os.read(3, 1 << 16):
        data.append(chunk)
    os.close(3)
    job = json.loads(b"".join(data))
    del data, chunk
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exprs = job["exprs"]
    code = compile(job["program"], "main.py", "exec", dont_inherit=True, optimize=0)
    del job["program"]
    try:
        exec(code, main.__dict__)
    except SystemExit:
        if exprs is None:
            raise
    if exprs is None:
        return
    del code
    inf, limit, used = float("inf"), job["result_chars"], [0]

    def enc(v, depth):
        if depth > 100:
            raise ValueError("nested deeper than 100 levels")
        if v is None or v is True or v is False:
            s = repr(v)
        elif isinstance(v, int):
            s = int.__repr__(int(v))
        elif isinstance(v, float):
            f = float(v)
            if f != f:
                raise ValueError("NaN is not comparable")
            s = float.__repr__(f) if abs(f) != inf else ("1e999" if f > 0 else "-1e999")
        elif isinstance(v, complex):
            c = complex(v)
            if not all(abs(x) != inf and x == x for x in (c.real, c.imag)):
                raise ValueError("a non-finite complex number is not comparable")
            s = complex.__repr__(c)
        elif isinstance(v, str):
            s = str.__repr__(str.__str__(v))
        elif isinstance(v, (bytes, bytearray)):
            s = bytes.__repr__(bytes(v))
        elif isinstance(v, (list, tuple)):
            items = [enc(x, depth + 1) for x in v]
            if isinstance(v, list):
                s = "[" + ", ".join(items) + "]"
            else:
                s = "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        elif isinstance(v, (set, frozenset)):
            s = "{" + ", ".join(enc(x, depth + 1) for x in v) + "}" if v else "set()"
        elif isinstance(v, dict):
            s = "{" + ", ".join(enc(k, depth + 1) + ": " + enc(x, depth + 1) for k, x in v.items()) + "}"
        else:
            raise TypeError(f"{type(v).__name__} is not plain data")
        used[0] += len(s)
        if used[0] > limit:
            raise ValueError(f"the value is larger than {limit} characters")
        return s

    for statement in job["setup"]:
        exec(compile(statement, "test", "exec", dont_inherit=True, optimize=0), main.__dict__)
    lines = []
    for e in exprs:
        used[0] = 0
        try:
            lines.append("ok " + enc(eval(compile(e, "test", "eval", dont_inherit=True, optimize=0), main.__dict__), 0))
        except BaseException as exc:    # SystemExit too: this expression fails, the others still run
            try:
                why = f"{type(exc).__name__}: {exc}"
            except BaseException:
                why = type(exc).__name__
            lines.append("error " + repr(why[:300]))
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            pass
    out = memoryview("".join(line + "\n" for line in lines).encode())
    while out:
        out = out[os.write(4, out):]
    os._exit(0)
_harness()
"""


def clean_env(home: str) -> dict:
    """The program's whole environment: nothing is inherited from the trainer."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret, what):
        if ret != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")
    return libc, check


def _mount(libc, check, src, target: str, fstype, flags: int, data=None):
    check(libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), f"mount {src or fstype} on {target}")


def _bind_ro(libc, check, src: str, target: str):
    _mount(libc, check, src, target, None, MS_BIND | MS_REC)
    # a bind mount takes the read-only flag only on a remount
    _mount(libc, check, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def _build_root(libc, check, new: str, spec: dict) -> str:
    """Mount the program's whole world at `new` and pivot into it; returns the interpreter's path there.

    / is a small read-only tmpfs; the system dirs (or their symlinks), the interpreter's prefix and a few
    device nodes are read-only bind mounts; /tmp (the working directory's home) and /dev/shm are fresh
    size-capped tmpfs; /proc shows the sandbox's processes only. Nothing else of the host is reachable.
    """
    python = os.path.realpath(spec["python"])
    dirs = [d for d in SYSTEM_DIRS if os.path.lexists(d)]
    if not any(python.startswith(d + "/") for d in dirs):          # e.g. /opt/conda/bin/python3
        dirs.append(os.path.dirname(os.path.dirname(python)))
    _mount(libc, check, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for d in dirs:
        target = new + d
        if os.path.islink(d):       # merged /usr: /lib -> usr/lib stays a symlink
            os.symlink(os.readlink(d), target)
            continue
        os.makedirs(target)
        _bind_ro(libc, check, d, target)
    for f in SYSTEM_FILES + DEVICES:
        if os.path.exists(f):
            os.makedirs(os.path.dirname(new + f), exist_ok=True)
            open(new + f, "w").close()
            _bind_ro(libc, check, f, new + f)
    for d, mb in (("/tmp", spec["disk_mb"]), ("/dev/shm", 1)):
        os.makedirs(new + d, exist_ok=True)
        _mount(libc, check, "tmpfs", new + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={mb}m,mode=1777")
    os.makedirs(new + "/proc")
    _mount(libc, check, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # pivot_root, then detach the old root: unlike chroot, nothing of the host stays reachable even to a
    # process that keeps its capabilities (the unprivileged user-namespace mode)
    os.chdir(new)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    check(libc.syscall(nr, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    _mount(libc, check, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return python


def _read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    data = []
    while chunk := os.read(fd, 1 << 16):
        data.append(chunk)
    return b"".join(data)


def _report(spec: dict, **observed):
    """One JSON line on the report channel (the launcher and the namespace's init each write theirs)."""
    os.write(spec["fds"]["report"], (json.dumps(observed) + "\n").encode())


class Stopped(BaseException):
    """SIGTERM before the program started: unwind, removing what was built."""


def _stop(*_):
    raise Stopped


def launch(spec: dict) -> int:
    # SIGTERM (the reward worker stopping, or dying: PDEATHSIG) ends the run the clean way: before the
    # program starts it unwinds, after that it kills the namespace's init; either way the cgroup goes
    signal.signal(signal.SIGTERM, _stop)
    libc, check = _libc()
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl")
    if os.getppid() != spec["parent"]:          # the reward worker died before we armed the signal
        return SETUP_FAILED
    try:
        return _launch(spec, libc, check)
    finally:
        if spec.get("_cgroup_dirs"):
            sandbox_limits.cgroup_remove(spec["_cgroup_dirs"])


def _launch(spec: dict, libc, check) -> int:
    fds, root = spec["fds"], os.geteuid() == 0
    job = _read_fd(fds["job"])
    os.close(fds["job"])
    notes = []              # the guarantees this machine cannot give, reported to the caller
    cg = None
    if root:
        cg, why = sandbox_limits.cgroup_create(spec["memory_mb"], spec["max_procs"])
        spec["_cgroup_dirs"] = cg       # removed by launch() however this ends
        if why:
            notes.append(f"no cgroup: {why}; memory_mb and max_procs hold per process only")
    else:
        notes.append("not root: no cgroup, memory_mb and max_procs hold per process only")
    seccomp, why = sandbox_limits.seccomp_filter()
    if why:
        notes.append(why)
    spec["cgroup"] = bool(cg)
    uid = UID_BASE + os.getpid() if root else None     # unique while this launcher runs
    isolated = True
    try:
        if root:
            check(libc.unshare(CLONE_NEWPID), "unshare pid")
        else:   # an unprivileged user namespace in which we are root, mapped to our own uid
            outer_uid, outer_gid = os.getuid(), os.getgid()
            check(libc.unshare(CLONE_NEWUSER | CLONE_NEWPID), "unshare user+pid")
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {outer_uid} 1"), ("gid_map", f"0 {outer_gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    except OSError as e:
        notes.append(f"no namespaces ({e}): rlimits and wall kill only")
        isolated = False
    init = os.fork()
    if init:
        return _wait_init(spec, init, cg, notes)
    # ---- init of the new PID namespace (or a plain child without namespaces)
    spec["_cgroup_dirs"] = None     # the launcher's to remove, not ours
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if cg:
            sandbox_limits.cgroup_join(cg)      # first: everything started from here on is counted
        _init(spec, libc, check, job, uid, isolated, seccomp)
    except BaseException as e:  # noqa: BLE001  the program never ran
        os.write(2, f"SETUP: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    os._exit(0)


def _wait_init(spec: dict, init: int, cg: dict | None, notes: list[str]) -> int:
    """Enforce wall time here rather than in the caller: killing the namespace's init makes the kernel kill
    everything inside, and wait4 returns only once all of it is gone, so when this launcher exits nothing
    of the program is left running. Then report what the kernel counted and remove the cgroup."""
    ended = []

    def end(signum, _):
        os.kill(init, signal.SIGKILL)
        ended.append(signum)
    signal.signal(signal.SIGALRM, end)
    signal.signal(signal.SIGTERM, end)
    signal.setitimer(signal.ITIMER_REAL, spec["wall_s"])
    _, status, usage = os.wait4(init, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    observed = sandbox_limits.cgroup_report(cg) if cg else {}
    _report(spec, wall_timeout=signal.SIGALRM in ended, stopped=signal.SIGTERM in ended,
            cpu_s=round(usage.ru_utime + usage.ru_stime, 3), cgroup=cg["version"] if cg else "", notes=notes,
            **observed)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _init(spec: dict, libc, check, job: bytes, uid: int | None, isolated: bool, seccomp) -> int:
    """As the namespace's init: build the program's world, start it, supervise it (never returns)."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    root = uid is not None
    python, workdir = spec["python"], "/"
    if isolated:
        # a private IPC namespace: System V shared memory and POSIX message queues die with the program
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC), "unshare mount+net+ipc")
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        why = sandbox_limits.ipc_quotas(spec["memory_mb"]) if root else ""
        if why:
            _report(spec, notes=[why])
        if os.path.realpath(python).startswith("/tmp/"):
            raise OSError(f"the interpreter {python} lies under /tmp, where the sandbox builds its root")
        # the new root is built on a tmpfs in this mount namespace only: nothing of it exists on the host
        _mount(libc, check, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700")
        os.mkdir(NEW_ROOT)
        python = _build_root(libc, check, NEW_ROOT, spec)
        workdir = "/tmp/work"
        os.mkdir(workdir, 0o700)
        if root:
            os.chown(workdir, uid, uid)
    job_r, job_w = os.pipe()
    child = os.fork()
    if child:
        os.close(job_r)
        try:
            _write_all(job_w, job)
        except OSError:         # the harness is already gone: its exit status says why
            pass
        os.close(job_w)
        rc = _supervise(child)
        if isolated:    # observed here, not taken from what the program printed
            st = os.statvfs("/tmp")
            _report(spec, disk_full=st.f_bavail == 0 or st.f_favail == 0,
                    disk_used_mb=round((st.f_blocks - st.f_bavail) * st.f_frsize / 2**20, 1),
                    largest_file_mb=round(_largest_file("/tmp") / 2**20, 1))
        os._exit(rc)
    os.close(job_w)
    f = spec["fds"]
    _exec_program(spec, libc, check, [f["stdin"], f["stdout"], f["stderr"], job_r, f["results"]],
                  json.loads(job)["exprs"] is not None, workdir, python, uid, isolated, seccomp)


def _exec_program(spec: dict, libc, check, fds: list[int], evaluates: bool, workdir: str, python: str,
                  uid: int | None, isolated: bool, seccomp):
    """In the program's process: its descriptors, limits, uid and seccomp filter, then exec the harness
    (never returns)."""
    high = [fcntl_dupfd(fd) for fd in fds]     # above 99 first: no target may clobber a later source
    for std, fd in enumerate(high):                  # 0-2: stdio; 3: JOB_FD; 4: RESULTS_FD
        os.dup2(fd, std)
    if not evaluates:
        os.close(RESULTS_FD)
    os.closerange(RESULTS_FD + 1, 1 << 16)
    os.chdir(workdir)
    mb = 1 << 20
    # with a cgroup, memory_mb bounds the whole sandbox (and the kernel reports the hit); the address space
    # then only stops a mapping far past it, so that a program over its memory meets the cgroup first
    per_process = spec["memory_mb"] + (max(2048, 3 * spec["memory_mb"]) if spec["cgroup"] else 0)
    for lim, val in ((resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (per_process * mb,) * 2),
                     (resource.RLIMIT_FSIZE, (spec["file_mb"] * mb,) * 2),    # files, memfds, stdout, stderr
                     (resource.RLIMIT_NOFILE, (spec["max_files"],) * 2),
                     (resource.RLIMIT_MSGQUEUE, (mb // 4,) * 2),
                     (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(lim, val)
    if uid is not None:    # as root: the process cap is real only for a uid of our own (root ignores RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_procs"],) * 2)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif isolated:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_procs"],) * 2)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")   # a uid change cleared it
    if seccomp:
        seccomp()
    # no -O: the launcher fixes the optimisation level (asserts in the program stay asserts)
    argv = [python, "-I", "-B", "-c", HARNESS]
    os.execve(python, argv, clean_env("/tmp/work" if isolated else workdir))


def fcntl_dupfd(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD, 100)


def _write_all(fd: int, data: bytes):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _largest_file(top: str, budget: int = 10000) -> int:
    """Size of the largest file under `top` (the sandbox's tmpfs), looking at no more than `budget` entries."""
    largest, stack = 0, [top]
    while stack and budget > 0:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries[:budget]:
            budget -= 1
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    largest = max(largest, e.stat(follow_symlinks=False).st_size)
            except OSError:
                pass
    return largest


def _supervise(child: int) -> int:
    """As PID 1 we inherit orphans: reap everything until the program itself exits, then leave (our exit
    makes the kernel kill whatever is left in the namespace)."""
    while True:
        got, status = os.waitpid(-1, 0)
        if got == child:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    try:
        rc = launch(json.loads(sys.argv[1]))
    except Stopped:          # told to stop before the program ran; what was built is removed
        rc = SETUP_FAILED
    except Exception as e:   # the program never ran: report why, distinguishable from its own failures
        print(f"SETUP: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        rc = SETUP_FAILED
    os._exit(rc)
