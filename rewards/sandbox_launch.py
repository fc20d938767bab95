"""The in-sandbox half of rewards/sandbox.py: run as `python -I -S rewards/sandbox_launch.py SPEC`.

It builds the namespaces, mounts, uid and rlimits described in rewards/sandbox.py, then execs the program.
It imports only what it needs (os, sys, signal, resource, ctypes, json): it starts once per test case,
and its start-up time is most of a sandboxed run's cost.
"""
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1
UID_BASE = 2_000_000
SETUP_FAILED = 125          # exit code when the sandbox could not be built (like env(1)); see "SETUP:" on stderr


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


def _mount_tmpfs(libc, check, target: str, mb: int):
    if os.path.isdir(target):
        check(libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                         f"size={mb}m,mode=1777".encode()), f"mount tmpfs {target}")


def launch(spec: dict) -> int:
    libc, check = _libc()
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if os.getppid() != spec["parent"]:          # the reward worker died before we armed the signal
        return SETUP_FAILED
    host, root = spec["host"], os.geteuid() == 0
    code = open(os.path.join(host, "main.py"), "rb").read()
    # open the program's stdio now: the host dir disappears under the private /tmp below
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
        return _wait_status(init)
    # ---- init of the new PID namespace (or a plain child without namespaces)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    workdir = host
    if isolated:
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare mount+net")
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        _mount_tmpfs(libc, check, "/tmp", spec["disk_mb"])
        _mount_tmpfs(libc, check, "/var/tmp", 1)
        _mount_tmpfs(libc, check, "/dev/shm", 1)
        _mount_tmpfs(libc, check, "/run/lock", 1)
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount proc")
        workdir = "/tmp/work"
        os.mkdir(workdir, 0o700)
    path = os.path.join(workdir, "main.py")
    with open(path, "wb") as f:
        f.write(code)
    if root:
        os.chown(workdir, uid, uid)
        os.chown(path, uid, uid)
    child = os.fork()
    if child:
        return _reap_until(child)
    # ---- the program's process
    for fd, std in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, std)
    os.chdir(workdir)
    mb = 1 << 20
    for lim, val in ((resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (spec["memory_mb"] * mb,) * 2),
                     (resource.RLIMIT_FSIZE, (spec["file_mb"] * mb,) * 2),
                     (resource.RLIMIT_NOFILE, (spec["max_files"],) * 2),
                     (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(lim, val)
    if root:    # the process cap is real only for a uid of our own (root ignores RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_procs"],) * 2)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif isolated:
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_procs"],) * 2)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")   # a uid change cleared it
    os.closerange(3, 1 << 16)
    env = clean_env(workdir)
    os.execve(spec["python"], [spec["python"], "-I", "-B", "main.py"], env)


def _wait_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _reap_until(pid: int) -> int:
    # as PID 1 we inherit orphans: reap everything until the program itself exits, then leave;
    # our exit makes the kernel kill whatever is left in the namespace
    while True:
        got, status = os.wait()
        if got == pid:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    try:
        rc = launch(json.loads(sys.argv[1]))
    except Exception as e:   # the program never ran: report why, distinguishable from its own failures
        print(f"SETUP: {type(e).__name__}: {e}", file=sys.stderr)
        rc = SETUP_FAILED
    os._exit(rc)
