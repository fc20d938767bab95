"""The environment contract (kind "env" in the registry), as small as the reward contract.

    @register("env", "my_env")
    class MyEnv:
        def __init__(self, **args): ...              # env.args="a=1,b=2" from the config
        def reset(self, fields: dict) -> str: ...    # the task row (prompt + its fields) -> first observation
        def step(self, action: str) -> tuple[str | None, float, bool, dict]: ...
                                                     # the model's turn as text -> (observation or None, reward, done, info)

`reset` returns the first observation: the text the model sees first (the rollout renders it as the prompt,
through the chat template when the tokenizer has one); most environments return fields["prompt"].
`step` gets one assistant turn (end-of-turn token stripped) and returns what comes back:
  observation  text appended to the context as observation tokens (in the context, out of the loss); None when done
  reward       float, this turn's reward (per-turn reward; the episode's return is the sum of them)
  done         True ends the episode
  info         dict; info["success"] (bool) on the last step says whether the episode counts as solved
               (held-out accuracy); without it, success = return > 0
An environment is plain Python and its state must pickle (plain attributes): it lives in a killable worker
(envs/pool.py) and travels between workers as bytes, so a crash, hang, huge observation or wrong type costs
one episode (a recorded failure with its reason), never the trainer. Tool calls (envs/tools.py, offered with
env.tools=...) are handled before `step`: the environment sees only the turns that call no tool.

Optional, for a warm start (tools/make_warm_start.py builds a tiny model that imitates it):

        @staticmethod
        def scripted_turn(fields: dict, history: list[str], rng: random.Random) -> str: ...

a scripted player's next turn, given the task row and the episode so far as text (history = [first observation,
turn 1, observation 1, turn 2, ...], ending with an observation); its randomness comes from rng only. It need not
play well (envs/hilo.py's guesses anywhere the feedback allows): RL starts from a policy that writes the format.
"""
import math


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


def check_reset(obs, max_chars: int) -> str:
    return as_text(obs, "reset", max_chars)


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


def check_step(out, max_chars: int) -> tuple[str | None, float, bool, bool | None]:
    """Validate what step() returned; -> (observation, reward, done, success) or raise EnvError with the reason."""
    if type(out) is not tuple or len(out) != 4:
        raise EnvError(f"step returned {type(out).__name__}, expected (observation, reward, done, info)")
    obs, reward, done, info = out
    if obs is not None:
        obs = as_text(obs, "step", max_chars)
    if isinstance(reward, bool) or not issubclass(type(reward), (int, float)) or not _finite(reward):
        raise EnvError(f"step returned reward {str(reward)[:40]!r}, expected a finite number")
    if type(done) is not bool:
        raise EnvError(f"step returned done of type {type(done).__name__}, expected bool")
    if obs is None and not done:
        raise EnvError("step returned no observation for an episode that is not done")
    return obs, float(reward), done, check_info(info, max_chars)
