"""Environments for tests/test_multiturn.py. Their own module, without torch, so the environment workers (which
import an environment's module by name) start fast. `echo` plays nicely; the others break the contract."""
import os
import time

from registry import register


@register("env", "echo")
class Echo:
    """Answers every turn with `obs` for `turns` turns, reward 0.5 per turn, success at the end."""

    def __init__(self, turns: int = 3, obs: str = "<>="):
        self.turns, self.obs, self.n = turns, obs, 0

    def reset(self, fields):
        return fields["prompt"]

    def step(self, action):
        self.n += 1
        done = self.n >= self.turns
        return (None if done else self.obs), 0.5, done, {"success": done}


@register("env", "hostile")
class Hostile:
    """What step() does depends on the row's `mode`: raise, hang, huge, wrong_type, die, bad_reward, or fine."""

    def __init__(self):
        self.mode = "fine"

    def reset(self, fields):
        self.mode = fields["mode"]
        if self.mode == "reset_raises":
            raise RuntimeError("cannot reset")
        return fields["prompt"]

    def step(self, action):
        if self.mode == "raise":
            raise ValueError("the environment is broken")
        if self.mode == "hang":
            time.sleep(600)
        if self.mode == "huge":
            return "9" * 10_000_000, 0.0, False, {}
        if self.mode == "wrong_type":
            return ["not", "a", "tuple"]
        if self.mode == "bad_reward":
            return "1", float("nan"), False, {}
        if self.mode == "die":
            os._exit(7)
        return None, 1.0, True, {"success": True}


# --- the corpus of tests/test_envs_hostile.py: one mode per way an environment can hurt the trainer -----------
POISONED = False   # module state a "poison" step corrupts: every later step in that worker fails


class Sneaky(str):
    """A str subclass that lies about itself: a trainer asking it anything gets another answer than its characters."""

    def __str__(self):
        return "9" * 10_000_000

    def __len__(self):
        return 0

    def __eq__(self, other):
        raise TypeError("Sneaky cannot be compared")

    __hash__ = str.__hash__


class Impostor:
    """Not a str at all, but isinstance(x, str) says it is."""

    @property
    def __class__(self):
        return str


class _Sleeper:
    def __reduce__(self):
        return time.sleep, (600,)


class BadMessage(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def _channel():
    """The worker's socket to the trainer: what a hostile environment writes its own bytes to."""
    import socket
    import stat
    for fd in range(3, 64):
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                return socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
    raise RuntimeError("no channel found")


def _send_raw(payload: bytes, announced: int | None = None):
    ch = _channel()
    ch.sendall((len(payload) if announced is None else announced).to_bytes(4, "big") + payload)


def _spawn_escapees(marker: str, log: str):
    """Processes that leave the worker's process group and session: a setsid child and a double-forked daemon.
    The marker (digits) rides in their command lines as a sleep of 0.<marker> more seconds."""
    import subprocess
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    a = subprocess.Popen(["sleep", "600", f"0.{marker}"], start_new_session=True, **quiet)
    b = subprocess.Popen(["setsid", "sh", "-c", f"sleep 600 0.{marker} & sleep 600 0.{marker}"], **quiet)
    time.sleep(0.2)   # let them leave before the step returns
    if log:           # the test's proof that they were up
        with open(log, "a") as f:
            f.write(f"{a.pid} {b.pid}\n")


@register("env", "adversary")
class Adversary:
    """step() misbehaves as the row's `mode` says (MODES); `marker` names the processes it leaves around, `log` is
    a file where it notes that it started them."""

    def __init__(self):
        self.mode, self.marker, self.log, self.junk, self.n = "fine", "", "", "", 0

    def reset(self, fields):
        self.mode, self.marker, self.log = fields["mode"], fields.get("marker", ""), fields.get("log", "")
        if self.mode == "reset_sneaky":
            return Sneaky("?")
        if self.mode == "reset_impostor":
            return Impostor()
        return fields["prompt"]

    def step(self, action):
        global POISONED
        self.n += 1
        if POISONED:
            raise MemoryError("this worker's environment module is corrupted")
        return getattr(self, "_" + self.mode, self._fine)()   # reset_* modes step like fine

    def _fine(self):
        return None, 1.0, True, {"success": True}

    def _sneaky(self):           # coerced to its characters: the episode goes on
        return (Sneaky("<>=") if self.n < 3 else None), 0.5, self.n >= 3, {"success": True}

    def _impostor(self):
        return Impostor(), 0.0, False, {}

    def _surrogate(self):        # a lone surrogate cannot be UTF-8: '?' instead
        return ("<\ud800>" if self.n < 3 else None), 0.5, self.n >= 3, {"success": True}

    def _special(self):          # control-token text: tokenised as characters
        return ("<eos><pad>" if self.n < 3 else None), 0.5, self.n >= 3, {"success": True}

    def _bad_success(self):      # a success that is not a bool is read in the worker
        return None, 1.0, True, {"success": Impostor()}

    def _huge_info(self):
        return "=", 0.0, False, {"log": "x" * 20_000_000}

    def _bad_info(self):
        return "=", 0.0, False, [("success", True)]

    def _grow_state(self):
        self.junk += "x" * 3_000_000
        return "=", 0.0, False, {}

    def _reward_obj(self):
        return None, Impostor(), True, {}

    def _huge_int_reward(self):
        return None, 10 ** 400, True, {}

    def _bad_message(self):
        raise BadMessage()

    def _exit(self):
        raise SystemExit(3)

    def _interrupt(self):
        raise KeyboardInterrupt

    def _block(self):
        time.sleep(600)

    def _busy(self):
        while True:
            pass

    def _die(self):
        os._exit(9)

    def _kill_self(self):        # a segfault (a PID namespace's init ignores a SIGKILL it sends itself)
        import ctypes
        ctypes.string_at(0)

    def _close_channel(self):
        _channel().close()
        for fd in range(3, 64):
            try:
                os.close(fd)
            except OSError:
                pass
        return "=", 0.0, False, {}

    def _pickle_bomb(self):      # a reply that, unpickled, sleeps for 10 minutes in whoever unpickles it
        import pickle
        _send_raw(pickle.dumps(_Sleeper()))
        time.sleep(600)

    def _json_bomb(self):
        _send_raw(b"[" * 200_000 + b"]" * 200_000)
        time.sleep(600)

    def _oversize(self):         # announces 4 GB; sends nothing
        _send_raw(b"", announced=(1 << 32) - 1)
        time.sleep(600)

    def _half_frame(self):       # announces 100 bytes, sends 10, stalls
        _send_raw(b'["result",', announced=100)
        time.sleep(600)

    def _forged(self):           # a well-formed frame for another job
        import json
        _send_raw(json.dumps(["result", 10 ** 6, ["ok", "", None, 1.0, True, True, "user", 0, 0]]).encode())
        time.sleep(600)

    def _nan_reward(self):       # a frame that would be the right job's, but NaN
        _send_raw(b'["result",0,["ok","",null,NaN,true,true,"user",0,0]]')
        time.sleep(600)

    def _flood(self):            # many small frames: the second is a result with no job running
        for _ in range(1000):
            _send_raw(b'["ready"]')
        time.sleep(600)

    def _setsid(self):           # escapees, then a normal end
        _spawn_escapees(self.marker, self.log)
        return None, 1.0, True, {"success": True}

    def _setsid_block(self):     # escapees, then a hang: the worker is killed at its deadline
        _spawn_escapees(self.marker, self.log)
        time.sleep(600)

    def _poison(self):
        global POISONED
        POISONED = True
        raise RuntimeError("corrupted my worker")


MODES = [m[1:] for m in vars(Adversary) if m.startswith("_") and not m.startswith("__")] + \
    ["reset_sneaky", "reset_impostor"]
