"""The in-sandbox half of rewards/sandbox.py: run as `python -I -S rewards/sandbox_launch.py SPEC`.

It builds the namespaces, the minimal root, the uid and rlimits described in rewards/sandbox.py, then
execs the interpreter on HARNESS, which runs the program (and then its test, when there is one).
It imports only what it needs (os, sys, signal, select, resource, ctypes, json): it starts once per test
case, and its start-up time is most of a sandboxed run's cost. SPEC is visible to the program
(/proc/1/cmdline), so it holds no secret: the program, its test and the token are read from the host dir.
"""
import ctypes
import json
import os
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
PR_SET_PDEATHSIG = 1
UID_BASE = 2_000_000
SETUP_FAILED = 125          # exit code when the sandbox could not be built (like env(1)); see "SETUP:" on stderr
PROGRAM_FD, READY_FD, TEST_FD = 3, 4, 5   # the harness's pipes: program in; "ready" out; test + token in
# What the new root holds: the interpreter and the libraries it loads, read-only. /etc is left out on
# purpose (accounts, hosts, secrets); only the dynamic linker's cache comes from it.
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
SYSTEM_FILES = ("/etc/ld.so.cache",)
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

# Runs in the sandbox as `python -I -B -c HARNESS`. Step 1 runs the program as __main__; its source comes
# through a pipe and is closed before it runs, so it is on no disk the program can read. Step 2, only when
# the case has a test: ask the launcher for the test (it is not in this process before the program's top
# level returned), run it, and print the per-call token last. An exit of any kind before the test's end
# prints no token, and the caller reads "no token" as a failure, whatever the exit code.
HARNESS = r"""
def _harness():
    import os, sys
    g = sys.modules["__main__"].__dict__
    del g["_harness"]
    has_test = len(sys.argv) > 1
    src = []
    while chunk := os.read(3, 1 << 16):
        src.append(chunk)
    os.close(3)
    code = compile(b"".join(src), "main.py", "exec")
    del src, chunk
    try:
        exec(code, g)
    except SystemExit:
        if not has_test:
            raise
    if not has_test:
        return
    del code
    sys.stdout.flush()
    os.write(4, b"r")
    os.close(4)
    os.set_blocking(5, True)    # the program may have changed it
    data = []
    while chunk := os.read(5, 1 << 16):
        data.append(chunk)
    os.close(5)
    token, _, test = b"".join(data).decode().partition("\n")
    del data, chunk
    exec(compile(test, "test", "exec"), g)
    sys.stdout.flush()
    os.write(1, ("\n" + token + "\n").encode())
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


def launch(spec: dict) -> int:
    libc, check = _libc()
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if os.getppid() != spec["parent"]:          # the reward worker died before we armed the signal
        return SETUP_FAILED
    host, root = spec["host"], os.geteuid() == 0
    program = open(os.path.join(host, "program"), "rb").read()
    test = open(os.path.join(host, "test"), "rb").read() if spec["has_test"] else None
    # open the program's stdio now: the host dir disappears under the new root below
    fd_in = os.open(os.path.join(host, "stdin"), os.O_RDONLY)
    fd_out = os.open(os.path.join(host, "stdout"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(os.path.join(host, "stderr"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    uid = UID_BASE + os.getpid()
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
        print(f"sandbox: no namespaces ({e}); rlimits and wall kill only", file=sys.stderr)
        isolated = False
    init = os.fork()
    if init:
        # Enforce wall time here rather than in the caller: killing the namespace's init makes the kernel
        # kill everything inside, and waitpid returns only once all of it is gone, so when this
        # launcher exits nothing of the program is left running.
        def expire(*_):
            os.kill(init, signal.SIGKILL)
            with open(os.path.join(host, "wall_timeout"), "w"):
                pass
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, spec["wall_s"])
        _, status, usage = os.wait4(init, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        with open(os.path.join(host, "cpu_s"), "w") as f:    # the CPU the program's processes used
            f.write(f"{usage.ru_utime + usage.ru_stime:.3f}")
        return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    # ---- init of the new PID namespace (or a plain child without namespaces)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    python, workdir = spec["python"], host
    if isolated:
        # a private IPC namespace: System V shared memory and POSIX message queues die with the program
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC), "unshare mount+net+ipc")
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        python = _build_root(libc, check, host, spec)
        workdir = "/tmp/work"
        os.mkdir(workdir, 0o700)
        if root:
            os.chown(workdir, uid, uid)
    program_r, program_w = os.pipe()
    ready_r, ready_w = os.pipe()
    test_r, test_w = os.pipe()
    child = os.fork()
    if child:
        for fd in (program_r, ready_w, test_r):
            os.close(fd)
        try:
            _write_all(program_w, program)
        except OSError:         # the harness is already gone: its exit status says why
            pass
        os.close(program_w)
        return _supervise(child, ready_r, test_w, test)
    _exec_program(spec, libc, check, [fd_in, fd_out, fd_err, program_r, ready_w, test_r], test is not None,
                  workdir, python, uid if root else None, isolated)


def _exec_program(spec: dict, libc, check, fds: list[int], has_test: bool, workdir: str, python: str,
                  uid: int | None, isolated: bool):
    """In the program's process: its descriptors, limits and uid, then exec the harness (never returns)."""
    for std, fd in enumerate(fds):                   # 0-2: stdio; 3-5: PROGRAM_FD, READY_FD, TEST_FD
        os.dup2(fd, std)
    os.closerange(TEST_FD + 1, 1 << 16)
    if not has_test:
        os.close(READY_FD)
        os.close(TEST_FD)
    os.chdir(workdir)
    mb = 1 << 20
    for lim, val in ((resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (spec["memory_mb"] * mb,) * 2),
                     (resource.RLIMIT_FSIZE, (spec["file_mb"] * mb,) * 2),
                     (resource.RLIMIT_NOFILE, (spec["max_files"],) * 2),
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
    argv = [python, "-I", "-B", "-c", HARNESS] + (["test"] if has_test else [])
    os.execve(python, argv, clean_env(workdir))


def _write_all(fd: int, data: bytes):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _supervise(child: int, ready: int, test_w: int, test: bytes | None) -> int:
    """As PID 1 we inherit orphans: reap everything until the program itself exits, then leave (our exit
    makes the kernel kill whatever is left in the namespace). Meanwhile, when the harness says its
    program's top level has returned, hand it the test (token first line)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)                         # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        while True:
            got, status = os.waitpid(-1, os.WNOHANG)
            if got == child:
                return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            if got == 0:
                break
        watch = [wake_r] + ([ready] if ready is not None else [])
        if wake_r in select.select(watch, [], [])[0]:
            os.read(wake_r, 512)
        elif ready is not None:
            asked = os.read(ready, 1)
            os.close(ready)
            ready = None
            if asked and test is not None:
                try:
                    _write_all(test_w, test)
                except OSError:
                    pass
            os.close(test_w)


if __name__ == "__main__":
    try:
        rc = launch(json.loads(sys.argv[1]))
    except Exception as e:   # the program never ran: report why, distinguishable from its own failures
        print(f"SETUP: {type(e).__name__}: {e}", file=sys.stderr)
        rc = SETUP_FAILED
    os._exit(rc)
