"""The environment contract (kind "env" in the registry), as small as the reward contract.

    @register("env", "my_env")
    class MyEnv:
        def __init__(self, **args): ...              # env.args="a=1,b=2" from the config
        def reset(self, fields: dict) -> str: ...    # the task row (prompt + its fields) -> first observation
        def step(self, action: str) -> tuple[str | dict | None, float, bool, dict]: ...
                                                     # the model's turn as text -> (observation or None, reward, done, info)

`reset` returns the first observation: the text the model sees first (the rollout renders it as the prompt,
through the chat template when the tokenizer has one); most environments return fields["prompt"].
`step` gets one assistant turn (end-of-turn token stripped) and returns what comes back:
  observation  text appended to the context as observation tokens (in the context, out of the loss); None when done.
               With a picture (a vision-language policy, docs/vision.md): {"text": "...<image>...", "image": png_bytes},
               the picture placed where the text's one <image> slot is (reset may return one too)
  reward       float, this turn's reward (per-turn reward; the episode's return is the sum of them)
  done         True ends the episode
  info         dict; info["success"] (bool) on the last step says whether the episode counts as solved
               (held-out accuracy); without it, success = return > 0
An environment is plain Python and its state must pickle (plain attributes): it lives in a killable worker
(envs/pool.py) and travels between workers as bytes, so a crash, hang, huge observation or wrong type costs
one episode (a recorded failure with its reason), never the trainer. A picture must be PNG or JPEG bytes of at
most env.max_obs_image_bytes and MAX_IMAGE_PIXELS that Pillow decodes whole (check_image, in the worker and again
in the trainer). Tool calls (envs/tools.py, offered with
env.tools=...) are handled before `step`: the environment sees only the turns that call no tool.

Optional, for a warm start (tools/make_warm_start.py builds a tiny model that imitates it):

        @staticmethod
        def scripted_turn(fields: dict, history: list[str], rng: random.Random) -> str: ...

a scripted player's next turn, given the task row and the episode so far as text (history = [first observation,
turn 1, observation 1, turn 2, ...], ending with an observation); its randomness comes from rng only. It need not
play well (envs/hilo.py's guesses anywhere the feedback allows): RL starts from a policy that writes the format.
"""
import io
import math

IMAGE = "<image>"                 # where an observation's picture sits in its text (vision.IMAGE)
IMAGE_FORMATS = ("PNG", "JPEG")   # the only decoders Pillow may try on an environment's bytes
MAX_IMAGE_PIXELS = 1 << 22        # 2048 x 2048: checked from the header, before the pixels are decoded


class EnvError(Exception):
    """An environment broke its contract (wrong type, huge observation): the episode ends as a failure."""


def as_text(value, what: str, max_chars: int) -> str:
    """An observation -> a plain str the tokenizer can take, or EnvError. A str subclass becomes the plain str of
    its characters (its own __str__, __len__ or __class__ are never asked); characters UTF-8 cannot encode (lone
    surrogates) become '?'; anything that is not a str at all is refused."""
    if not issubclass(type(value), str):   # type(), not isinstance: a __class__ property cannot pass for str
        raise EnvError(f"{what} returned an observation of type {type(value).__name__}, expected str")
    text = str.__str__(value)
    if len(text) > max_chars:
        raise EnvError(f"{what} returned an observation of {len(text)} chars (max_obs_chars={max_chars})")
    return text.encode("utf-8", "replace").decode("utf-8")


def check_image(data, what: str, max_bytes: int) -> bytes:
    """An observation's picture -> its bytes, or EnvError: plain bytes (a path would name a file of the environment's
    machine, not the trainer's), at most max_bytes, a PNG or JPEG of at most MAX_IMAGE_PIXELS (read from the header,
    so a decompression bomb is refused before its pixels exist) that Pillow decodes whole (a truncated file fails)."""
    if type(data) not in (bytes, bytearray):
        raise EnvError(f"{what} returned a picture of type {type(data).__name__}, expected PNG or JPEG bytes")
    if len(data) > max_bytes:
        raise EnvError(f"{what} returned a picture of {len(data)} bytes (max_obs_image_bytes={max_bytes})")
    from PIL import Image
    try:
        with Image.open(io.BytesIO(bytes(data)), formats=IMAGE_FORMATS) as img:
            w, h = img.size
            if not 0 < w * h <= MAX_IMAGE_PIXELS:
                raise EnvError(f"{what} returned a picture of {w} x {h} pixels (at most {MAX_IMAGE_PIXELS} in all)")
            img.load()
    except EnvError:
        raise
    except Exception as e:  # noqa: BLE001  whatever Pillow says about hostile bytes
        raise EnvError(f"{what} returned a picture Pillow cannot read as {' or '.join(IMAGE_FORMATS)} "
                       f"({type(e).__name__})") from None
    return bytes(data)


def check_observation(obs, what: str, max_chars: int, max_image_bytes: int) -> str | dict:
    """An observation -> text (as_text), or a picture observation {"text": text with one <image>, "image": bytes}."""
    if type(obs) is not dict:
        return as_text(obs, what, max_chars)
    if max_image_bytes <= 0:
        raise EnvError(f"{what} returned an observation with a picture: pictures are off (a text policy, or "
                       "env.max_obs_image_bytes=0)")
    if len(obs) != 2 or "text" not in obs or "image" not in obs:
        raise EnvError(f"{what} returned an observation dict of other keys than 'text' and 'image'")
    text = as_text(obs["text"], what, max_chars)
    if text.count(IMAGE) != 1:
        raise EnvError(f"{what} returned a picture whose text holds {text.count(IMAGE)} {IMAGE} slots, expected one")
    return {"text": text, "image": check_image(obs["image"], what, max_image_bytes)}


def check_reset(obs, max_chars: int, max_image_bytes: int = 0) -> str | dict:
    return check_observation(obs, "reset", max_chars, max_image_bytes)


def check_info(info, max_chars: int) -> bool | None:
    """info -> its "success" as a bool (None when absent). The whole dict is capped like an observation, then stays
    in the worker: only success reaches the trainer."""
    if type(info) is not dict:
        raise EnvError(f"step returned info of type {type(info).__name__}, expected dict")
    if _size(info, max_chars) > max_chars:
        raise EnvError(f"step returned info of more than max_obs_chars={max_chars} chars")
    return None if "success" not in info else bool(info["success"])


def _size(obj, budget: int) -> int:
    """About the length of obj written as JSON, counted only up to past budget: a huge info costs no more to refuse
    than the cap (text by its length, containers by their items, anything else as 16 characters)."""
    stack, total = [obj], 0
    while stack and total <= budget:
        x = stack.pop()
        kind = type(x)
        if issubclass(kind, (str, bytes)):
            total += (str.__len__(x) if issubclass(kind, str) else bytes.__len__(x)) + 2
        elif issubclass(kind, dict):
            total += 2 + 2 * dict.__len__(x)
            if total <= budget:
                stack += [*dict.keys(x), *dict.values(x)]
        elif issubclass(kind, (list, tuple)):
            total += 2 + (list.__len__(x) if issubclass(kind, list) else tuple.__len__(x))
            if total <= budget:
                stack += list(x)
        else:
            total += 16
    return total


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (OverflowError, ValueError, TypeError):
        return False


def check_step(out, max_chars: int, max_image_bytes: int = 0) -> tuple[str | dict | None, float, bool, bool | None]:
    """Validate what step() returned; -> (observation, reward, done, success) or raise EnvError with the reason.
    max_image_bytes: the largest picture an observation may carry (0: none, text only)."""
    if type(out) is not tuple or len(out) != 4:
        raise EnvError(f"step returned {type(out).__name__}, expected (observation, reward, done, info)")
    obs, reward, done, info = out
    if obs is not None:
        obs = check_observation(obs, "step", max_chars, max_image_bytes)
    if isinstance(reward, bool) or not issubclass(type(reward), (int, float)) or not _finite(reward):
        raise EnvError(f"step returned reward {str(reward)[:40]!r}, expected a finite number")
    if type(done) is not bool:
        raise EnvError(f"step returned done of type {type(done).__name__}, expected bool")
    if obs is None and not done:
        raise EnvError("step returned no observation for an episode that is not done")
    return obs, float(reward), done, check_info(info, max_chars)
