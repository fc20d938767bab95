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


def check_reset(obs, max_chars: int) -> str:
    if not isinstance(obs, str):
        raise EnvError(f"reset returned {type(obs).__name__}, expected str")
    if len(obs) > max_chars:
        raise EnvError(f"reset returned an observation of {len(obs)} chars (max_obs_chars={max_chars})")
    return obs


def check_step(out, max_chars: int) -> tuple[str | None, float, bool, dict]:
    """Validate what step() returned; -> (observation, reward, done, info) or raise EnvError with the reason."""
    if not isinstance(out, tuple) or len(out) != 4:
        raise EnvError(f"step returned {type(out).__name__}, expected (observation, reward, done, info)")
    obs, reward, done, info = out
    if obs is not None and not isinstance(obs, str):
        raise EnvError(f"step returned an observation of type {type(obs).__name__}, expected str or None")
    if obs is not None and len(obs) > max_chars:
        raise EnvError(f"step returned an observation of {len(obs)} chars (max_obs_chars={max_chars})")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvError(f"step returned reward {reward!r}, expected a finite number")
    if not isinstance(done, bool) or not isinstance(info, dict):
        raise EnvError(f"step returned done={done!r} (bool expected) and info of type {type(info).__name__} (dict)")
    if obs is None and not done:
        raise EnvError("step returned no observation for an episode that is not done")
    return obs, float(reward), done, info
