"""A corpus of hostile programs for the code reward, one per class of attack in issue 31 (and a few more).

Each program would earn reward if it escaped: a token reader makes `assert False` pass by printing the
harness's token; an expected-value thief returns the value it found (7321987 is in no program); a memory
hog answers "ok" only once it holds more memory than the limit allows. So reward 0 means containment, not a
crash. `allowed` is the set of failure categories that count as contained for that program, each one a
reason the supervisor observed (a comparison made outside, a kernel counter, an exit status), never one
the program printed. `fields` are sample fields sent through the reward pool (a dataset row). `needs`
names the guarantees (keys of rewards.sandbox.capabilities()) that contain it: on a machine without
one, the case is skipped and the runner says so, as the sandbox itself logs the missing guarantee.
tests/test_rewards_code.py::test_hostile_corpus runs them all in parallel and checks the host afterwards.
"""
import glob
import os
import tempfile
import time
from collections import namedtuple

UID_BASE = 2_000_000        # rewards.sandbox_launch.UID_BASE: the sandbox's dedicated uids start here

Case = namedtuple("Case", "name cls program cases allowed fields needs", defaults=({}, ()))
SECRET = 7321987                      # the expected value: in the tests, never in a program
ASSERTS = {"asserts": ["assert False", f"assert solve() == {SECRET}", f"assert solve() == 42 and 1 == 2"]}
STDOUT_OK = {"tests": [{"input": "", "output": "ok"}]}
CHEATED = {"wrong_answer", "error"}   # what a thief gets: its values compared outside, or its run failing
HOG = 256                             # MB a memory hog tries to hold, past the corpus's memory_mb

# shared by the thieves: pull every number of 5+ digits out of a text, and answer with it
FIND = """
import re as _re
found = []
def _look(text):
    if isinstance(text, bytes):
        text = text.decode('latin1')
    if isinstance(text, str):
        found.extend(int(x) for x in _re.findall(r'(?<![0-9])[0-9]{5,8}(?![0-9])', text))
def solve(*args):
    return found[-1] if found else 42
"""
# shared by the token readers: print a 32-hex token as the last stdout line and leave with status 0
TOKEN = """
import os as _os, sys as _sys
def _emit(t):
    if isinstance(t, str) and len(t) == 32:
        _sys.stdout.write('\\n' + t + '\\n')
        _sys.stdout.flush()
        _os._exit(0)
def _scan_frame(f):
    while f is not None:
        for k, v in list(f.f_locals.items()):
            if k == 'token':
                _emit(v)
            if isinstance(v, (str, bytes)):
                _look(v)
        for c in f.f_code.co_consts:
            if isinstance(c, int) and not isinstance(c, bool):
                found.append(c)
            _look(c)
        f = f.f_back
"""

HOSTILE = [
    Case("fd_read_token", "fd reads", FIND + TOKEN + """
import os, fcntl
for fd in (4, 3):                     # say "ready" where the old harness listened for it
    try:
        os.write(fd, b'r')
    except OSError:
        pass
for fd in range(0, 64):
    try:
        os.set_blocking(fd, False)
        data = os.read(fd, 1 << 20)
    except OSError:
        continue
    _look(data)
    first = data.split(b'\\n', 1)[0].decode('latin1')
    if len(first) == 32:
        import atexit
        atexit.register(_emit, first)
""", ASSERTS, CHEATED),
    Case("shadowed_compile_exec", "shadowed compile/exec", FIND + """
import builtins
def exec(*a, **k):
    return None
def compile(*a, **k):
    return builtins.compile('None', 'x', 'eval')
def eval(*a, **k):
    return True
builtins.exec, builtins.eval = exec, eval
_real_compile = builtins.compile
builtins.compile = lambda src, *a, **k: _real_compile('True', 'x', 'eval') if 'solve' in str(src) or 'False' in str(src) else _real_compile(src, *a, **k)
""", ASSERTS, CHEATED),
    Case("optimize_2", "optimize=2", FIND + """
import builtins
_c = builtins.compile
def compile(source, filename, mode, flags=0, dont_inherit=False, optimize=-1, **kw):
    return _c(source, filename, mode, flags, dont_inherit, 2)
builtins.compile = compile
""", ASSERTS, CHEATED),
    Case("patched_os_read", "patched os.read", FIND + """
import os
_read = os.read
def read(fd, n):
    data = _read(fd, n)
    _look(data)
    if fd == 5 and data:        # the old harness's test channel: keep the token, drop the test
        token = data.split(b'\\n', 1)[0]
        return token + b'\\npass\\n'
    return data
os.read = read
""", ASSERTS, CHEATED),
    Case("trace_token", "trace function", FIND + TOKEN + """
import sys, threading
def tracer(frame, event, arg):
    _scan_frame(frame)
    return tracer
sys.settrace(tracer)
sys.setprofile(lambda f, e, a: _scan_frame(f))
threading.settrace(tracer)
""", ASSERTS, CHEATED),
    Case("audit_hook", "audit hook", FIND + TOKEN + """
import sys
def hook(event, args):
    if event in ('compile', 'exec', 'os.read'):
        for a in args:
            _look(a)
    if event == 'exec':
        _scan_frame(sys._getframe(1))
sys.addaudithook(hook)
""", ASSERTS, CHEATED),
    Case("excepthook", "excepthook", FIND + TOKEN + """
import sys
def hook(kind, value, tb):
    while tb is not None:
        _scan_frame(tb.tb_frame)
        tb = tb.tb_next
sys.excepthook = hook
""", ASSERTS, CHEATED),
    Case("atexit", "atexit handler", FIND + TOKEN + """
import atexit, gc, sys
def late():
    for tb in (getattr(sys, 'last_traceback', None), getattr(getattr(sys, 'last_exc', None), '__traceback__', None)):
        while tb is not None:
            _scan_frame(tb.tb_frame)
            tb = tb.tb_next
    for o in gc.get_objects():
        if type(o).__name__ == 'frame':
            _scan_frame(o)
atexit.register(late)
""", ASSERTS, CHEATED),
    Case("thread_reader", "live thread", FIND + TOKEN + """
import sys, threading, time
sys.setswitchinterval(1e-6)
def watch():
    while True:
        for f in list(sys._current_frames().values()):
            _scan_frame(f)
        time.sleep(0.001)
threading.Thread(target=watch, daemon=True).start()
time.sleep(0.05)
def solve(*args):
    time.sleep(0.05)          # let the watcher look at the caller's frames
    big = [x for x in found if x >= 10000]
    return big[-1] if big else 42
""", ASSERTS, CHEATED),
    Case("frame_walk", "frame walking", FIND + TOKEN + """
import sys
def solve(*args):
    _scan_frame(sys._getframe(1))
    big = [x for x in found if x >= 10000]
    return big[-1] if big else 42
""", ASSERTS, CHEATED),
    Case("traceback_frames", "traceback frames", FIND + TOKEN + """
def solve(*args):
    try:
        raise RuntimeError
    except RuntimeError as e:
        _scan_frame(e.__traceback__.tb_frame.f_back)
    big = [x for x in found if x >= 10000]
    return big[-1] if big else 42
""", ASSERTS, CHEATED),
    Case("proc_self_mem", "/proc/self/mem scanning", FIND + """
import re
def solve(*args):
    hits = []
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split('-'))
            if 'r' not in perms or hi - lo > 64 << 20:
                continue
            try:
                mem.seek(lo)
                chunk = mem.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue
            hits += re.findall(rb'== ?([0-9]{5,8})(?![0-9])', chunk)
    return int(hits[-1]) if hits else 42
""", ASSERTS, CHEATED),
    Case("eq_trick", "the __eq__ trick", """
class Yes:
    def __eq__(self, other):
        return True
    __ne__ = lambda self, other: False
    __bool__ = lambda self: True
    __hash__ = object.__hash__
class YesInt(int):
    __eq__ = lambda self, other: True
def solve(*args):
    return Yes()
def solve2(*args):
    return YesInt(0)
""", {"asserts": [f"assert solve() == {SECRET}", f"assert solve2() == {SECRET}", "assert solve() == 42 and 1 == 2",
                  f"assert [solve()] == [{SECRET}]"]}, CHEATED),
    Case("forged_results", "forged results channel", """
import atexit, os
def forge():
    for fd in range(1, 16):
        try:
            os.write(fd, b'ok True\\nok True\\nok 42\\n')
        except OSError:
            pass
atexit.register(forge)
forge()
def solve(*args):
    return True
""", ASSERTS, CHEATED),
    # ---- whole-sandbox limits: each hog answers "ok" only once it holds HOG MB (the corpus's limit is 64)
    Case("sysv_shm", "SysV shm", f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
while held < {HOG}:
    sid = libc.shmget(0, 8 << 20, 0o1000 | 0o600)          # IPC_PRIVATE, IPC_CREAT
    if sid < 0:
        break
    addr = libc.shmat(sid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(addr, 1, 8 << 20)
    libc.shmdt(ctypes.c_void_p(addr))      # detached, the segment keeps its pages: no address space is used
    held += 8
print('ok' if held >= {HOG} else f'blocked at {{held}} MB, errno {{ctypes.get_errno()}}')
""", STDOUT_OK, {"memory", "wrong_answer"}),
    Case("memfd", "memfd", f"""
import os
fds, held = [], 0
try:
    while held < {HOG}:
        fd = os.memfd_create('hog')
        for _ in range(8):
            os.write(fd, b'x' * (1 << 20))
        fds.append(fd)
        held += 8
except OSError as e:
    print('blocked', e)
print('ok' if held >= {HOG} else 'blocked')
""", STDOUT_OK, {"memory", "wrong_answer", "output_limit"}, needs=("cgroup",)),
    Case("forked_children", "fork", f"""
import os, time
r, w = os.pipe()
kids = []
for i in range(8):
    pid = os.fork()
    if pid == 0:
        block = bytearray({HOG} // 8 << 20)
        for j in range(0, len(block), 4096):
            block[j] = 1
        os.write(w, b'k')
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
got = b''
os.close(w)
while len(got) < 8:
    chunk = os.read(r, 8)
    if not chunk:
        break
    got += chunk
print('ok' if len(got) == 8 else f'blocked: {{len(got)}} children got their share')
""", STDOUT_OK, {"memory", "wrong_answer"}, needs=("cgroup",)),
    Case("nested_userns_tmpfs", "nested user namespace + tmpfs", f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x00020000) != 0:          # CLONE_NEWUSER | CLONE_NEWNS
    print('blocked: unshare errno', ctypes.get_errno())
else:
    for name, text in (('setgroups', 'deny'), ('uid_map', f'0 {{uid}} 1'), ('gid_map', f'0 {{gid}} 1')):
        with open(f'/proc/self/{{name}}', 'w') as f:
            f.write(text)
    os.makedirs('/tmp/work/big', exist_ok=True)
    if libc.mount(b'none', b'/tmp/work/big', b'tmpfs', 0, b'size=4g') != 0:
        print('blocked: mount errno', ctypes.get_errno())
    else:
        for i in range({HOG} // 8):           # files of 8 MB: under any file size limit
            with open(f'/tmp/work/big/f{{i}}', 'wb') as f:
                f.write(b'x' * (8 << 20))
        print('ok')
""", STDOUT_OK, {"memory", "wrong_answer", "output_limit"}, needs=("no_new_user_namespace",)),
    Case("fork_bomb_pids", "process count", """
import os, time
n = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print('blocked after', n, e)
print('ok' if n == 200 else 'blocked')
""", STDOUT_OK, {"wrong_answer", "memory"}),
    Case("disk_exhaustion", "disk exhaustion", """
import os, sys
i = 0
try:
    while True:
        with open(f'/tmp/work/f{i}', 'wb') as f:
            f.write(b'x' * (4 << 20))
        i += 1
except OSError:
    sys.stderr.write('\\0' * 200)                # the reason once logged as 200 NUL characters
    sys.exit(1)
""", STDOUT_OK, {"output_limit"}),
    Case("printed_memory_error", "printed fake MemoryError", """
import sys
sys.stderr.write('Traceback (most recent call last):\\nMemoryError\\n')
sys.exit(1)
""", STDOUT_OK, {"error"}),
    Case("printed_setup_failure", "printed fake setup failure", """
import sys
sys.stderr.write('SETUP: OSError: the sandbox broke\\n')
sys.exit(125)
""", STDOUT_OK, {"error"}),
    Case("escape_codes_in_stderr", "unprintable reason", """
import sys
sys.stderr.write('\\x1b[2J\\x1b[31mfake\\r\\x07\\x00' * 20)
sys.exit(3)
""", STDOUT_OK, {"error"}),
    # ---- limits from the data row: through the reward pool, the config says wall_s=2
    Case("data_row_wall_s", "data-row limits", """
import time
time.sleep(4)
print('ok')
""", STDOUT_OK, {"timeout"}, {"wall_s": 20, "cpu_s": 20}),
    Case("data_row_memory_mb", "data-row limits", f"""
block = bytearray({HOG} << 20)
for j in range(0, len(block), 4096):
    block[j] = 1
print('ok')
""", STDOUT_OK, {"memory"}, {"memory_mb": 4096}, ("cgroup",)),
]


# ------------------------------------------------------------------------------ what must not remain

def sandbox_processes() -> list[int]:
    """Host pids running under a sandbox uid, less other process trees' live sandboxes. A sandbox's uid is
    UID_BASE + its launcher's pid (rewards/sandbox_launch.py). A launcher that still runs under a parent other than
    init, outside this process's tree, belongs to another test process (pytest-xdist runs two at once) or another
    job: its sandbox is live, not a leftover of ours. An orphaned launcher (parent init) counts as a leftover."""
    left = []
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        uid = _status(pid, "Uid")
        if uid is None or uid < UID_BASE:
            continue
        launcher = uid - UID_BASE
        if _status(launcher, "PPid") not in (None, 1) and not _ours(launcher):
            continue
        left.append(pid)
    return left


def _ours(pid: int) -> bool:
    """pid is this process or one of its descendants."""
    while pid and pid != 1:
        if pid == os.getpid():
            return True
        pid = _status(pid, "PPid") or 0
    return False


def settled(probe, seconds: float = 5.0):
    """probe() (sandbox_processes or left_on_host) once it finds nothing, or its last answer after `seconds`.
    Another test process (pytest-xdist runs two) may be tearing a sandbox or a killed trainer's workers down
    while we look: what it leaves goes within moments, where a leftover of ours stays."""
    deadline = time.monotonic() + seconds
    while (found := probe()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def left_on_host() -> dict:
    """Whatever a sandbox or a reward worker left behind: processes of a sandbox uid whose launcher is gone,
    cgroups of dead launchers, worker dirs of dead trainers, System V segments of sandbox uids in the host's
    namespace. Live ones belong to runs still going (other jobs)."""
    def dead(pid: str) -> bool:
        return pid.isdigit() and not os.path.exists(f"/proc/{pid}")
    left = {"processes": [p for p in sandbox_processes() if dead(str(_uid(p) - UID_BASE))]}
    left["cgroups"] = [d for d in glob.glob("/sys/fs/cgroup/**/sbx-*", recursive=True) if dead(d.rsplit("sbx-", 1)[1])]
    tmp = tempfile.gettempdir()
    left["worker_dirs"] = [d for d in glob.glob(os.path.join(tmp, "reward-worker-*"))
                           if dead(os.path.basename(d).split("-")[2])]
    with open("/proc/sysvipc/shm") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    left["shm"] = [r for r in rows if len(r) > 7 and int(r[7]) >= UID_BASE]
    return {k: v for k, v in left.items() if v}


def _status(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration):
        return None


def _uid(pid: int) -> int:
    return _status(pid, "Uid") or 0
