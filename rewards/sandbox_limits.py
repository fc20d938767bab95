"""Whole-sandbox limits for rewards/sandbox_launch.py: a cgroup, the private IPC namespace's quotas, seccomp.

Per-process rlimits do not bound a sandbox: its processes add up (forked children), and some memory
belongs to no process (System V shared memory, memfd, tmpfs pages). What bounds the whole sandbox:
  * a cgroup of its own (v1 memory + pids controllers, or v2 where its parent delegates them): every page
    its processes touch (heap, shm, memfd, tmpfs, pipe buffers) counts against memory_mb, and its tasks
    against max_procs; the kernel's counters (OOM kills, limit hits, peak) are what the supervisor reports;
  * the private IPC namespace's sysctls: System V segments total at most memory_mb;
  * seccomp (through libseccomp): no new namespaces (so no user namespace of its own, where it could mount
    a tmpfs of any size), no setns, no clone3 (whose flags seccomp cannot read).
Each part that the machine lacks is skipped with a one-line note, which the launcher reports and
`rewards.sandbox.capabilities()` shows. The launcher imports this file by path (it runs as `python -I`).
"""
import ctypes
import os

CGROUP_PREFIX = "sbx-"          # sbx-<launcher pid>: a dead launcher's empty cgroup is removed by the next one
NAMESPACE_FLAGS = {"CLONE_NEWUSER": 0x10000000, "CLONE_NEWNS": 0x00020000, "CLONE_NEWPID": 0x20000000,
                   "CLONE_NEWNET": 0x40000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUTS": 0x04000000,
                   "CLONE_NEWCGROUP": 0x02000000}
EPERM, ENOSYS = 1, 38


# ------------------------------------------------------------------------------------------ cgroups

def _mounts() -> list[tuple[str, str, str, set]]:
    """-> [(fstype, mount point, mount root, super options)] for the cgroup mounts."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                out.append((rfields[0], fields[4], fields[3], set(rfields[2].split(",")) if len(rfields) > 2 else set()))
    return out


def _own(controller: str | None) -> str | None:
    """Our cgroup path for a v1 controller, or the v2 path (controller None)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
                return path
    return None


def _under(mount: str, root: str, path: str) -> str:
    rel = path[len(root):] if root != "/" and path.startswith(root) else path
    return os.path.join(mount, rel.lstrip("/"))


def _parents() -> tuple[str, dict[str, str] | str]:
    """-> (version, {controller: parent dir}) or (version, reason none is usable)."""
    mounts = _mounts()
    v1 = {}
    for ctrl in ("memory", "pids"):
        for fstype, point, root, opts in mounts:
            if fstype == "cgroup" and ctrl in opts and _own(ctrl) is not None:
                v1[ctrl] = _under(point, root, _own(ctrl))
    if len(v1) == 2:
        return "v1", v1
    for fstype, point, root, _ in mounts:
        if fstype == "cgroup2" and _own(None) is not None:
            parent = _under(point, root, _own(None))
            try:
                with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                    delegated = set(f.read().split())
            except OSError:
                continue
            if {"memory", "pids"} <= delegated:
                return "v2", {"memory": parent, "pids": parent}
            return "v2", f"cgroup v2 at {parent} does not delegate memory and pids (it has: {' '.join(sorted(delegated)) or 'none'})"
    return "", "no cgroup v1 memory+pids hierarchy and no cgroup v2 mount"


def _write(path: str, value):
    with open(path, "w") as f:
        f.write(str(value))


def _sweep(parent: str):
    """Remove the empty cgroups of launchers that died before removing theirs (a killed trainer's)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(CGROUP_PREFIX):]
        if name.startswith(CGROUP_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


def cgroup_create(memory_mb: int, max_procs: int) -> tuple[dict | None, str]:
    """Create this launcher's cgroup(s) with the limits -> ({"version", "dirs"}, "") or (None, why not)."""
    version, parents = _parents()
    if isinstance(parents, str):
        return None, parents
    name, mem = f"{CGROUP_PREFIX}{os.getpid()}", memory_mb << 20
    dirs = {}
    try:
        for ctrl, parent in parents.items():
            _sweep(parent)
            d = os.path.join(parent, name)
            if d not in dirs.values():
                os.mkdir(d)
            dirs[ctrl] = d
        if version == "v1":
            _write(os.path.join(dirs["memory"], "memory.limit_in_bytes"), mem)
            if os.path.exists(os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")):
                _write(os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes"), mem)   # no swapping past it
        else:
            _write(os.path.join(dirs["memory"], "memory.max"), mem)
            if os.path.exists(os.path.join(dirs["memory"], "memory.swap.max")):
                _write(os.path.join(dirs["memory"], "memory.swap.max"), 0)
        _write(os.path.join(dirs["pids"], "pids.max"), max_procs + 1)     # + the namespace's init
    except OSError as e:
        cgroup_remove({"dirs": dirs})
        return None, f"cannot create a cgroup ({e})"
    return {"version": version, "dirs": dirs}, ""


def cgroup_join(cg: dict):
    """Move the calling process (and so all it will start) into the cgroup(s)."""
    for d in set(cg["dirs"].values()):
        _write(os.path.join(d, "cgroup.procs"), 0)


def _fields(path: str) -> dict[str, int]:
    try:
        with open(path) as f:
            return {k: int(v) for k, v in (line.split() for line in f if len(line.split()) == 2)}
    except (OSError, ValueError):
        return {}


def _number(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def cgroup_report(cg: dict) -> dict:
    """What the kernel counted for the sandbox: OOM kills, memory-limit hits, peak memory, refused forks."""
    mem, pids = cg["dirs"]["memory"], cg["dirs"]["pids"]
    if cg["version"] == "v1":
        oom = _fields(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0)
        hits = _number(os.path.join(mem, "memory.failcnt"))
        peak = _number(os.path.join(mem, "memory.max_usage_in_bytes"))
    else:
        events = _fields(os.path.join(mem, "memory.events"))
        oom, hits = events.get("oom_kill", 0), events.get("max", 0)
        peak = _number(os.path.join(mem, "memory.peak"))
    return {"oom_kills": oom, "memory_limit_hits": hits, "memory_peak_mb": round(peak / 2**20, 1),
            "fork_refusals": _fields(os.path.join(pids, "pids.events")).get("max", 0)}


def cgroup_remove(cg: dict):
    """Remove the cgroup(s) once every process in them is gone (the launcher calls it after its init died)."""
    import time
    for d in set(cg["dirs"].values()):
        for _ in range(50):     # tasks leave a moment after the namespace's init is reaped
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


# ------------------------------------------------------------------------- IPC namespace quotas

def ipc_quotas(memory_mb: int) -> str:
    """In a fresh IPC namespace (these sysctls are per namespace): System V shared memory totals at most
    memory_mb. -> "" or why not."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        for name, value in (("shmmax", memory_mb << 20), ("shmall", (memory_mb << 20) // page), ("shmmni", 64)):
            _write(f"/proc/sys/kernel/{name}", value)
    except OSError as e:
        return f"cannot set System V shm quotas ({e})"
    return ""


# ----------------------------------------------------------------------------------------- seccomp

class _ArgCmp(ctypes.Structure):       # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


SCMP_ACT_ALLOW, SCMP_CMP_MASKED_EQ = 0x7FFF0000, 7


def _errno(e: int) -> int:
    return 0x00050000 | e


def seccomp_filter():
    """-> (a function that loads the filter in the calling process, "") or (None, why not).

    Built before the fork (so a failure is reported by the launcher), loaded in the program's process
    after its uid drop (libseccomp sets no_new_privs), inherited by everything it starts."""
    try:    # by soname: ctypes.util.find_library would cost the launcher a subprocess import
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as e:
        return None, f"no libseccomp ({e}): new namespaces (a user namespace of its own) are not refused"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return None, "seccomp_init failed"

    def rule(action: int, name: str, cmp: _ArgCmp | None = None):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return      # not on this architecture
        ret = lib.seccomp_rule_add_array(ctx, action, nr, 1 if cmp else 0, ctypes.byref(cmp) if cmp else None)
        if ret < 0:
            raise OSError(-ret, f"seccomp rule for {name}: {os.strerror(-ret)}")
    try:
        for flag in NAMESPACE_FLAGS.values():      # any namespace flag refuses the call
            for call in ("unshare", "clone"):
                rule(_errno(EPERM), call, _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
        rule(_errno(ENOSYS), "clone3")      # its flags sit in memory seccomp cannot read; glibc falls back to clone
        for call in ("setns", "mount", "umount2", "pivot_root", "chroot", "bpf", "userfaultfd", "perf_event_open",
                     "keyctl", "add_key", "request_key", "io_uring_setup", "open_tree", "fsopen", "move_mount"):
            rule(_errno(EPERM), call)
    except OSError as e:
        return None, str(e)

    def load():
        ret = lib.seccomp_load(ctx)
        if ret < 0:
            raise OSError(-ret, f"seccomp_load: {os.strerror(-ret)}")
    return load, ""
