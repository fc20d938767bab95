"""What travels between the trainer and an environment worker (envs/pool.py), and the checks on the way back.

    trainer -> worker   frame(pickle.dumps(message))        the trainer's own data: sys.path, the spec, jobs
    worker -> trainer   frame(encode(message))              JSON only, decoded by decode_reply under a size cap

A frame is a 4-byte big-endian length and the payload. The worker runs environment code, so anything it sends
is untrusted: the trainer never unpickles it, reads it without blocking (FrameReader: a worker that sends half
a frame and stalls cannot hold the trainer), refuses a frame longer than its cap before reading it, and checks
every field of a decoded reply (check_result). The replies:

    ["ready"]                                   the worker imported the environments
    ["error", traceback]                        it could not (before "ready" only)
    ["result", job_id, result]                  result: ["ok", state, observation, reward, done, success,
                                                role, tool_calls, tool_errors] or ["fail", category, reason]
                                                (observation: text, null, or {"text", "image": base64})

`state` is the pickled environment as base64 text: the trainer stores it and hands it to the next worker
without decoding it; `success` is info["success"] as a bool, or None (the rest of info stays in the worker).
"""
import base64
import binascii
import json
import math
import struct

HEADER = struct.Struct(">I")
CATEGORIES = ("error", "timeout", "signal")
ROLES = ("user", "tool")


class WireError(Exception):
    """A worker sent something that is not a well-formed reply: the worker is killed, its job fails."""


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def encode(message) -> bytes:
    """Plain data -> JSON bytes (ASCII: a reply's size in bytes is bounded by its size in characters)."""
    return json.dumps(message, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class FrameReader:
    """Frames from a socket the trainer reads only when it is readable; never holds more than one capped frame."""

    def __init__(self, sock, max_bytes: int):
        self.sock, self.max_bytes, self.buf = sock, max_bytes, bytearray()

    def read(self) -> list[bytes]:
        """What the socket has now -> the complete frames (possibly none). EOFError when the worker closed it,
        WireError for a frame announced past the cap (its bytes are never read)."""
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError
        self.buf += data
        frames = []
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if n > self.max_bytes:
                raise WireError(f"a reply of {n} bytes (at most {self.max_bytes})")
            if len(self.buf) < HEADER.size + n:
                break
            frames.append(bytes(self.buf[HEADER.size:HEADER.size + n]))
            del self.buf[:HEADER.size + n]
        return frames


def _refuse_constant(name):
    raise ValueError(f"{name} is not a number a reply may hold")


def decode_reply(data: bytes) -> list:
    """JSON bytes -> a list whose first item says what it is; WireError for anything else."""
    try:
        msg = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:   # RecursionError: nesting bombs
        raise WireError(f"a reply that is not JSON ({type(e).__name__})") from None
    if not isinstance(msg, list) or not msg or msg[0] not in ("ready", "error", "result"):
        raise WireError("a reply of unknown kind")
    return msg


def _is_int(x) -> bool:
    return type(x) is int and 0 <= x < 1 << 31


def _picture(obs: dict) -> dict:
    """{"text": str, "image": base64 str} -> {"text", "image": bytes}; what the bytes hold is checked by the trainer
    before it decodes them (envs/base.py check_image, from engines/multiturn.py)."""
    if set(obs) != {"text", "image"} or type(obs["text"]) is not str or type(obs["image"]) is not str:
        raise WireError("a picture observation that is not {text, image}")
    try:
        return {"text": obs["text"], "image": base64.b64decode(obs["image"], validate=True)}
    except (ValueError, binascii.Error):
        raise WireError("a picture observation whose image is not base64") from None


def check_result(msg: list, job_id: int) -> tuple:
    """A decoded ["result", ...] for the job the worker is running -> the pool's result tuple, every field checked."""
    if len(msg) != 3 or type(msg[1]) is not int or msg[1] != job_id or not isinstance(msg[2], list):
        raise WireError(f"a reply for job {str(msg[1:2])[:40]} while job {job_id} was running")
    res = msg[2]
    if len(res) == 3 and res[0] == "fail" and res[1] in CATEGORIES and type(res[2]) is str:
        return "fail", res[1], res[2][:300]
    if len(res) != 9 or res[0] != "ok":
        raise WireError("a result that is neither ok nor fail")
    _, state, obs, reward, done, success, role, calls, errors = res
    if type(obs) is dict:   # a picture observation: its text and its bytes as base64
        obs = _picture(obs)
    if type(state) is not str or not (obs is None or type(obs) in (str, dict)):
        raise WireError("a result whose state or observation is not text")
    if type(reward) not in (int, float) or not math.isfinite(reward) or type(done) is not bool:
        raise WireError("a result whose reward is not a finite number or whose done is not a bool")
    if not (success is None or type(success) is bool) or role not in ROLES or not (_is_int(calls) and _is_int(errors)):
        raise WireError("a result whose success, role or tool counts are malformed")
    return "ok", state, obs, float(reward), done, {} if success is None else {"success": success}, role, calls, errors
