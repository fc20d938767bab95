"""Code reward and its sandbox: real programs, honest ones and hostile ones.

Each hostile program is written so that it would PASS its test case if it escaped (it prints the secret,
"connected", "written", ...), so reward 0 means containment, not merely a crash.
"""
import os
import socket
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.code import code_reward, evaluate, extract_code  # noqa: E402
from hostile_programs import sandbox_processes, settled  # noqa: E402
from rewards.sandbox import Limits, capabilities, run  # noqa: E402

LIM = Limits(wall_s=3.0, cpu_s=2)
CAPS = capabilities()
ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "-10 4\n", "output": "-6"}, {"input": "0 0\n", "output": "0"}]


def hostile(code: str, expected: str, max_s: float = LIM.wall_s + 2.0, asserts=None):
    """Score a program that would pass if it escaped; -> the reason its one case failed."""
    t0 = time.monotonic()
    cases = {"asserts": asserts} if asserts else {"tests": [{"input": "", "output": expected}]}
    score, failures = evaluate(code, **cases, limits=LIM)
    took = time.monotonic() - t0
    assert score == 0.0, f"the hostile program escaped: {failures}"
    assert failures and failures[0][1].startswith("case 0: ")
    assert took < max_s, f"took {took:.1f}s, limit {max_s}s"
    assert settled(sandbox_processes, 2.0) == []
    return failures[0][1]


# --------------------------------------------------------------------------------- honest programs

def test_passing_program_scores_one():
    completion = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\nDone."
    assert extract_code(completion).startswith("a, b =")
    assert code_reward("", completion, tests=ADD) == 1.0


def test_partly_wrong_program_scores_fraction():
    score, failures = evaluate("a, b = map(int, input().split())\nprint(abs(a) + b)", tests=ADD, limits=LIM)
    assert score == pytest.approx(2 / 3)
    assert failures == [("wrong_answer", "case 1: wrong answer")]


def test_crashing_program_scores_zero_with_the_error():
    score, failures = evaluate("raise ValueError('boom')", tests=ADD[:1], limits=LIM)
    assert score == 0.0 and failures[0][0] == "error" and "ValueError: boom" in failures[0][1]
    score, failures = evaluate("def f(:\n", tests=ADD[:1], limits=LIM)
    assert score == 0.0 and "SyntaxError" in failures[0][1]


def test_asserts_and_json_string_tests():
    prog = "def add(a, b):\n    return a + b\n"
    assert code_reward("", prog, asserts=["assert add(1, 2) == 3", "assert add(2, 2) == 5"]) == 0.5
    assert code_reward("", "print(int(input()) * 2)", tests='[{"input": "4", "output": "8"}]') == 1.0


def test_an_honest_program_may_end_with_sys_exit_and_print():
    # SystemExit ends the program's step, not the case: the asserts still run, and its prints stay its own
    prog = "def solve():\n    return 42\nprint('ready')\nimport sys\nsys.exit(0)"
    score, failures = evaluate(prog, asserts=["assert solve() == 42", "assert solve() == 41"], limits=LIM)
    assert score == 0.5 and failures == [("wrong_answer", "case 1: assertion failed: solve() == 41 (42 == 41 is false)")]
    r = run("print('out')", limits=LIM, exprs=["print('from the test')"])
    assert r.status == "ok" and r.stdout == "out\nfrom the test\n" and r.values == [("ok", None)]


def test_missing_tests_is_a_named_error():
    with pytest.raises(ValueError, match="no 'tests' or 'asserts'"):
        code_reward("", "print(1)")


# -------------------------------------------------------------------------------- hostile programs

def test_infinite_loop_is_stopped():
    reason = hostile("while True:\n    pass", "never")
    assert "time limit" in reason


def test_sleeping_forever_hits_the_wall_clock():
    reason = hostile("import time\ntime.sleep(1000)", "never")
    assert "wall time" in reason


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    reason = hostile(bomb, "never")
    assert "time limit" in reason


def test_setsid_escape_dies_with_the_sandbox():
    # a daemon that leaves the process group still lives in the PID namespace, which dies with its init
    if not CAPS["pid_namespace"]:
        pytest.skip("no PID namespace here: " + CAPS["probe"])
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    hostile(code, "never")


def test_memory_bomb_is_contained():
    reason = hostile("a = []\nwhile True:\n    a.append(bytearray(64 * 2**20))", "never")
    assert "memory limit" in reason


def test_disk_fill_is_contained():
    one_big = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)"
    assert "size limit" in hostile(one_big, "never")
    many = ("i = 0\nwhile True:\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * 8 * 2**20)\n"
            "    i += 1")
    reason = hostile(many, "never")
    assert "No space left" in reason or "size limit" in reason


def test_environment_and_file_secrets_are_out_of_reach(tmp_path, monkeypatch):
    import tempfile
    secret = "hunter2-" + os.urandom(4).hex()
    monkeypatch.setenv("REWARD_TEST_SECRET", secret)         # the trainer's environment
    files = [tmp_path / "secret.txt"]                         # a private file under /tmp
    if CAPS["dedicated_uid"]:      # a 0600 file outside /tmp is protected by the uid drop (root only)
        fd, home_file = tempfile.mkstemp(dir=os.path.expanduser("~"), prefix=".reward-test-secret-")
        os.close(fd)
        files.append(home_file)
    try:
        for f in files:
            with open(f, "w") as out:
                out.write(secret)
            os.chmod(f, 0o600)
        code = f"""
import glob, os
found = [v for v in os.environ.values() if 'hunter2' in v]
for p in glob.glob('/proc/*/environ') + ['/proc/{os.getpid()}/environ'] + {[str(f) for f in files]!r}:
    try:
        data = open(p, 'rb').read().decode('latin1')
        found += [w for w in data.replace('=', ' ').split() if 'hunter2' in w]
    except OSError:
        pass
print(found[0] if found else 'nothing found')
"""
        hostile(code, secret)
    finally:
        for f in files[1:]:
            os.unlink(f)


def test_writing_outside_the_workdir_is_contained(tmp_path):
    # host-only places must refuse the write; the world-writable ones (/tmp, /var/tmp, /dev/shm, /run/lock)
    # may accept it, but into the sandbox's private tmpfs: nothing may appear on the host either way
    name = "escaped-" + os.urandom(4).hex()
    host_only = [str(tmp_path / name), os.path.join(os.path.dirname(os.path.abspath(__file__)), name)]
    shared = [os.path.join(d, name) for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock") if os.path.isdir(d)]
    code = f"""
written = []
for p in {host_only + shared!r}:
    try:
        open(p, 'w').write('x')
        written.append(p)
    except OSError:
        pass
print('escaped' if set(written) & set({host_only!r}) else 'blocked')
"""
    hostile(code, "escaped")
    assert [p for p in host_only + shared if os.path.exists(p)] == []


def test_network_is_unreachable():
    if not CAPS["network_namespace"]:
        pytest.skip("no network namespace here: " + CAPS["probe"])
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"""
import socket
try:
    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
    s.sendall(b'hello')
    print('connected')
except OSError as e:
    print('blocked', e)
"""
    try:
        hostile(code, "connected")
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_killing_the_parent_and_everyone_fails():
    bystander = subprocess.Popen(["sleep", "30"])       # kill(-1) from an unconfined root would take it
    try:
        code = f"""
import os, signal
for pid in (os.getppid(), {os.getpid()}, {bystander.pid}, 1, -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print('killed')
"""
        hostile(code, "definitely not this")
        assert bystander.poll() is None, "a process outside the sandbox was killed"
    finally:
        bystander.kill()
        bystander.wait()
    os.kill(os.getpid(), 0)   # and we are alive


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit",
                                       "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
                                       "import atexit, os\natexit.register(os._exit, 0)\n"
                                       "import sys\nsys.stdout.write('ok\\n' * 3)"])
def test_an_early_exit_does_not_pass_asserts(exit_call):
    # before the harness, the asserts were appended to the program, which could leave before reaching them
    reason = hostile(exit_call, "", asserts=["assert solve() == 42"])
    assert "NameError" in reason or "no well-formed result" in reason or "signal 9" in reason


def test_the_program_cannot_read_its_source_or_the_tests():
    # a program that answers from a table: it looks for the expected value wherever it might be (its own file,
    # any file it can open, its command lines, its open descriptors) and returns what it finds
    code = r"""
import glob, os, re
seen = ''
if '__file__' in globals():
    seen += open(__file__).read()
for p in glob.glob('/tmp/**', recursive=True) + glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ'):
    try:
        seen += open(p, errors='replace').read()
    except OSError:
        pass
for fd in range(3, 16):
    try:
        os.set_blocking(fd, False)
        seen += os.read(fd, 1 << 16).decode(errors='replace')
    except OSError:
        pass
found = re.findall(r'== (\d+)', seen)
def solve():
    return int(found[0]) if found else -1
"""
    reason = hostile(code, "", asserts=["assert solve() == 7321987"])
    assert reason.startswith("case 0: assertion failed: solve() == 7321987 (") and "7321987 is false" in reason


def test_host_files_are_out_of_sight():
    if not CAPS["minimal_root"]:
        pytest.skip("no minimal root here: " + CAPS["probe"])
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"""
import os
readable = []
for p in ['/etc/passwd', '/etc/hostname', {__file__!r}, {os.path.join(os.path.dirname(here), 'README.md')!r}]:
    try:
        open(p).read(1)
        readable.append(p)
    except OSError:
        pass
print('escaped' if readable or os.path.exists({here!r}) or os.path.exists('/root') else sorted(os.listdir('/')))
"""
    assert "escaped" not in hostile(code, "escaped")
    r = run(code, limits=LIM)
    assert r.status == "ok" and set(eval(r.stdout)) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32",
                                                         "proc", "sbin", "tmp", "usr"}
    r = run("open('/usr/hacked', 'w')", limits=LIM)                  # and the tree is read-only
    assert r.status == "error" and "Read-only file system" in r.reason


def test_ipc_objects_die_with_the_program():
    # System V shared memory and POSIX message queues outlive their creator in a shared IPC namespace
    import ctypes
    key, queue = int.from_bytes(os.urandom(3), "big") + 1, "/sbx-test-" + os.urandom(4).hex()
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
shm = libc.shmget({key}, 1 << 20, 0o1000 | 0o666)                    # IPC_CREAT
mq = libc.mq_open({queue.encode()!r}, 0o100 | 0o2, 0o666, None)       # O_CREAT | O_RDWR
print('created' if shm >= 0 and mq >= 0 else ('failed', shm, mq, ctypes.get_errno()))
"""
    r = run(code, limits=LIM)
    libc = ctypes.CDLL(None, use_errno=True)
    shm, mq = libc.shmget(key, 0, 0), libc.mq_open(queue.encode(), 0)
    if shm >= 0:
        libc.shmctl(shm, 0, None)     # IPC_RMID: do not leave it behind for the next run either
    if mq >= 0:
        libc.mq_close(mq)
        libc.mq_unlink(queue.encode())
    assert r.stdout.strip() == "created", r
    assert shm == -1 and mq == -1, "an IPC object outlived the sandbox"


def test_a_self_kill_is_not_a_time_limit():
    for sig in ("SIGKILL", "SIGXCPU"):
        r = run(f"import os, signal\nos.kill(os.getpid(), signal.{sig})", limits=LIM)
        assert r.status == "killed" and f"({sig})" in r.reason and "time limit" not in r.reason, r.reason


def test_a_timeout_names_the_cases_it_skipped():
    loop, fast = "while True:\n    pass", Limits(wall_s=1.0, cpu_s=1)
    score, failures = evaluate(loop, tests=ADD[:1], limits=fast)
    assert score == 0.0 and len(failures) == 1 and failures[0][0] == "timeout"     # not "cases 1..0"
    score, failures = evaluate(loop, tests=ADD, limits=fast)
    assert [f[1].split(":")[0] for f in failures] == ["case 0", "cases 1..2"]
    score = code_reward("", loop, tests=ADD[:1], wall_s=1.0)       # a float that carries its failures
    assert score == 0.0 and [c for c, _ in score.failures] == ["timeout"]


def test_output_flood_is_capped():
    r = run("while True:\n    print('x' * 1000)", limits=LIM)
    assert r.status == "output_limit" and len(r.stdout) <= LIM.output_chars


def test_capabilities_report_is_honest():
    caps = capabilities()
    assert caps["probe"] == "ok"
    if os.geteuid() == 0:
        assert caps["dedicated_uid"], "running as root, the sandbox must drop to its own uid"
        assert caps["minimal_root"] and caps["ipc_namespace"]


# ------------------------------------------------------------------ the hostile corpus (issue 31)

def test_hostile_corpus():
    """Every program of tests/hostile_programs.py scores 0, for a reason the supervisor observed (a printable
    one), and leaves nothing on the host. Cases run two at a time; the data-row ones through the pool."""
    from concurrent.futures import ThreadPoolExecutor

    from hostile_programs import HOSTILE, left_on_host, settled
    from rewards.pool import RewardPool
    config = {"wall_s": 2.0, "cpu_s": 2, "memory_mb": 64}
    limits = Limits(**config)
    missing = {c.name: [n for n in c.needs if not CAPS[n]] for c in HOSTILE}
    missing = {name: needs for name, needs in missing.items() if needs}
    if missing:      # the sandbox logs the missing guarantee too; here the cases it would have contained
        print(f"hostile corpus: skipped for want of {missing}: {CAPS['notes']}")
    direct = [c for c in HOSTILE if not c.fields and c.name not in missing]
    via_pool = [c for c in HOSTILE if c.fields and c.name not in missing]
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda c: evaluate(c.program, **c.cases, limits=limits), direct))
    with RewardPool([(code_reward, 1.0, config)], workers=2, timeout_s=30) as pool:
        rewards, info = pool.submit([""] * len(via_pool), [c.program for c in via_pool],
                                    [{**c.cases, **c.fields} for c in via_pool]).result()
    for i, c in enumerate(via_pool):
        got.append((rewards[i].item(), [(f["category"], f["reason"]) for f in info["failed"] if f["sample"] == i]))
    took = time.monotonic() - t0
    rewarded = [c.name for c, (score, _) in zip(direct + via_pool, got) if score != 0.0]
    assert rewarded == [], f"rewarded: {rewarded}"
    for c, (score, failures) in zip(direct + via_pool, got):
        cats = {cat for cat, _ in failures}
        assert failures and cats <= c.allowed, f"{c.name}: {failures}"
        assert all(r.isprintable() for _, r in failures), f"{c.name}: unprintable reason {failures}"
    # what each limit class must be stopped by, not merely scored 0 for
    by_name = {c.name: failures for c, (_, failures) in zip(direct + via_pool, got)}
    assert {cat for cat, _ in by_name["data_row_wall_s"]} == {"timeout"}
    assert "wall time limit 2s" in by_name["data_row_wall_s"][0][1]
    assert not any("MemoryError" in r and c == "memory" for c, r in by_name["printed_memory_error"])
    if CAPS["cgroup"]:
        assert "memory limit 64 MB" in by_name["data_row_memory_mb"][0][1]
        assert {cat for cat, _ in by_name["forked_children"]} == {"memory"}
    if CAPS["no_new_user_namespace"]:
        assert by_name["nested_userns_tmpfs"][0][0] == "wrong_answer"       # it printed "blocked: unshare ..."
    assert "disk limit" in by_name["disk_exhaustion"][0][1]
    assert settled(left_on_host) == {}
    ran = len(direct) + len(via_pool)
    print(f"hostile corpus: {ran} of {len(HOSTILE)} programs, rewarded 0, left on host 0, {took:.1f} s")


# ------------------------------------------------------------- an assert case, split (code_asserts)

def test_expected_values_stay_outside_the_sandbox():
    from rewards.code_asserts import plan
    p = plan("import math\nassert abs(f(2) - 2.5) < 1e-6 and math.isclose(g(1), 0.1 + 0.2)\n"
             "assert h(3) == [0] * 3 and k() is None and not f(0)\nassert f(1) == sorted(my_list)")
    # the sandbox that ran the program sees the calls, none of 2.5, 0.3, [0, 0, 0] or None
    assert p.program_exprs == ["f(2)", "g(1)", "h(3)", "k()", "f(0)", "f(1)", "my_list"]
    assert p.free_exprs == [] and p.setup == ["import math"]
    ok = [("ok", 2.5), ("ok", 0.30000000000000004), ("ok", [0, 0, 0]), ("ok", None), ("ok", 0), ("ok", [1, 2]), ("ok", [2, 1])]
    assert p.check(ok, []) == (True, "")
    wrong = list(ok)
    wrong[4] = ("ok", 5)                                                     # `not f(0)` fails
    assert p.check(wrong, [])[0] is False
    wrong = list(ok)
    wrong[0] = ("error", "ZeroDivisionError: division by zero")
    assert "f(2) raised ZeroDivisionError" in p.check(wrong, [])[1]
    # an expected side that is an expression of its own is computed without the program
    p = plan("assert f(1) == EXPECTED_TABLE[1]")
    assert p.program_exprs == ["f(1)", "EXPECTED_TABLE"]     # a name the program may define goes with it
    p = plan("assert f(1) == frozenset(range(3))")
    assert p.program_exprs == ["f(1)"] and p.free_exprs == ["range(3)"]
    assert p.check([("ok", {0, 1, 2})], [("error", "TypeError: range is not plain data")])[0] is False


def test_an_assert_case_passes_only_by_its_values():
    prog = "def add(a, b):\n    return a + b\n"
    cases = ["assert add(1, 2) == 3", "assert add(1, 2) == 3 and 1 == 2", "assert False", "assert add(2, 2) != 4",
             "add(1, 1) == 2", "assert add(1, 2) in (3, 4) and add(0, 0) is not None",
             "import math\nassert math.isclose(add(0.1, 0.2), 0.3)", "assert add('a', 'b') == 'ab'"]
    score, failures = evaluate(prog, asserts=cases, limits=LIM)
    assert score == 5 / 8
    assert [f[1].split(":")[0] for f in failures] == ["case 1", "case 2", "case 3"]
    assert failures[0] == ("wrong_answer", "case 1: assertion failed: add(1, 2) == 3 and 1 == 2 (1 == 2 is false)")
    score, failures = evaluate("raise ValueError('at import')", asserts=["assert 1 == 1"], limits=LIM)
    assert score == 0.0 and "ValueError: at import" in failures[0][1]       # the program runs, even for literals


def test_an_assert_entry_of_another_kind_is_a_named_error():
    with pytest.raises(ValueError, match="only `assert EXPR`, expressions and imports, got a FunctionDef"):
        evaluate("pass", asserts=["def check(candidate):\n    assert candidate(1) == 2"], limits=LIM)
    with pytest.raises(ValueError, match="does not parse"):
        evaluate("pass", asserts=["assert f(1) =="], limits=LIM)


def test_a_machine_without_usable_cgroups_is_named(monkeypatch, tmp_path):
    """Where the cgroup cannot be had, the launcher says why (and runs on per-process limits)."""
    from rewards import sandbox_limits as sl
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cgroup.subtree_control").write_text("cpu io\n")       # a v2 parent that delegates neither
    monkeypatch.setattr(sl, "_mounts", lambda: [("cgroup2", str(tmp_path), "/", set())])
    monkeypatch.setattr(sl, "_own", lambda ctrl: "/job" if ctrl is None else None)
    assert sl.cgroup_create(64, 16) == (None, f"cgroup v2 at {tmp_path}/job does not delegate memory and pids (it has: cpu io)")
    monkeypatch.setattr(sl, "_mounts", lambda: [])
    assert sl.cgroup_create(64, 16) == (None, "no cgroup v1 memory+pids hierarchy and no cgroup v2 mount")
