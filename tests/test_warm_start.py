"""tools/make_warm_start.py: a warm start built in seconds for (a) a toy environment with its own observation format,
defined here, and (b) a task, writes well-formed turns through the real multi-turn rollout where an untrained model
writes none; its training episodes are tokenized exactly as the rollout lays episodes out; bad input is refused.
This module imports no torch at the top: the environment workers import it (to register `toy_lamps`) and start fast."""
import random
import re

import pytest

from registry import register

LAMPS = 4


@register("env", "toy_lamps")
class ToyLamps:
    """Switch every lamp on. The observation shows them ('lamps: .*..', '*' = on); a turn names one lamp by its number
    ('3'); a turn that is not one lamp's number ends the episode as malformed (info["malformed"])."""

    def __init__(self):
        self.on = ""

    def reset(self, fields: dict) -> str:
        self.on = fields["lamps"]
        return f"lamps: {self.on}"

    def step(self, action: str):
        if not re.fullmatch(f"[1-{LAMPS}]", action):
            return None, 0.0, True, {"success": False, "malformed": True}
        i = int(action) - 1
        self.on = self.on[:i] + "*" + self.on[i + 1:]
        if "." not in self.on:
            return None, 1.0, True, {"success": True}
        return f"lamps: {self.on}", 0.0, False, {}

    @staticmethod
    def scripted_turn(fields: dict, history: list[str], rng: random.Random) -> str:
        """Any lamp still off in the last observation."""
        return str(rng.choice([i + 1 for i, c in enumerate(history[-1].split(": ")[1]) if c == "."]))


@register("task", "toy_lamps")
def toy_lamps_task(_section=None) -> tuple[list[dict], list[dict]]:
    """Every start with at least one lamp off; the all-off one and a few others held out."""
    starts = ["".join("*." [n >> i & 1] for i in range(LAMPS)) for n in range(1, 2 ** LAMPS)]
    rows = [{"prompt": "lamps", "lamps": s} for s in starts]
    return rows[:-4], rows[-4:] * 8


@register("env", "toy_answer")
class ToyAnswer:
    """A task as a one-turn episode: the turn is the answer; success when it is the row's."""

    def reset(self, fields: dict) -> str:
        self.answer = fields["answer"]
        return fields["prompt"]

    def step(self, action: str):
        return None, float(action == self.answer), True, {"success": action == self.answer}


SMALL = ["--hidden", "32", "--heads", "1", "--layers", "1", "--mlp", "64", "--batch", "16", "--lr", "1e-2",
         "--threads", "1", "--n_eval", "0"]


def build(out, steps: int, *overrides):
    import torch
    from tools import make_warm_start
    threads = torch.get_num_threads()
    try:
        make_warm_start.main(["--out", str(out), "--steps", str(steps), *SMALL, *overrides])
    finally:
        torch.set_num_threads(threads)   # --threads 1 must not reach the other tests


def turns(out, env: str, rows: list[dict], max_new_tokens: int):
    """The held-out rows through engines/multiturn.py, sampled at temperature 1: -> (each episode's turns as text, the
    Episodes, the tokenizer). A turn is a run of model tokens; one cut before its end-of-turn token is not a turn."""
    import torch
    from config import Config
    from engines.base import SamplingParams
    from engines.multiturn import MultiTurn
    from models import load_model
    model, tok = load_model(str(out), torch.device("cpu"), torch.float32)
    cfg = Config()
    cfg.env.name, cfg.env.workers, cfg.max_new_tokens = env, 1, max_new_tokens
    mt = MultiTurn(model, tok, cfg)
    try:
        ro = mt.generate([], rows, 1, SamplingParams(1.0, 1.0, max_new_tokens), torch.Generator().manual_seed(0))
    finally:
        mt.close()
    C = ro.completion_mask.shape[1]
    episodes = []
    for ids, mask in zip(ro.input_ids[:, -C:].tolist(), ro.completion_mask.tolist()):
        runs, run = [], []
        for t, m in zip(ids, mask):
            if m:
                run.append(t)
            if run and (not m or t == tok.eos_token_id):
                runs.append(run)
                run = []
        episodes.append([tok.decode(r, skip_special_tokens=True) for r in runs if r[-1] == tok.eos_token_id])
    return episodes, ro, tok


def well_formed(episodes, pattern: str) -> float:
    """The share of episodes whose every turn matches pattern (an episode without a whole turn is malformed)."""
    return sum(bool(e) and all(re.fullmatch(pattern, t) for t in e) for e in episodes) / len(episodes)


def test_an_environment_with_its_own_observations_gets_a_warm_start(tmp_path):
    _, held = toy_lamps_task()
    overrides = ["task=toy_lamps", "env.name=toy_lamps", "max_new_tokens=3"]
    build(tmp_path / "cold", 0, *overrides)
    cold, _, _ = turns(tmp_path / "cold", "toy_lamps", held, 3)
    build(tmp_path / "warm", 80, *overrides)
    warm, ro, tok = turns(tmp_path / "warm", "toy_lamps", held, 3)
    assert well_formed(cold, "[1-4]") <= 0.2, cold
    assert well_formed(warm, "[1-4]") >= 0.5, warm
    # what the tool trained on is laid out as the rollout lays out the same turns: ids, and the loss on turns only
    from tools.make_warm_start import Layout
    C = ro.completion_mask.shape[1]
    checked = 0
    for b, episode in enumerate(warm):
        if ro.truncated[b] or not well_formed([episode], "[1-4]"):
            continue
        env, parts = ToyLamps(), []
        parts.append((env.reset(held[b]), False))
        for turn in episode:
            parts.append((turn, True))
            obs, _, done, _ = env.step(turn)
            if not done:
                parts.append((obs, False))
        ids, labels, prompt = Layout(tok).episode(parts)
        real = ro.attention_mask[b].bool()
        assert ids == ro.input_ids[b][real].tolist()
        assert [y != -100 for y in labels[prompt:]] == ro.completion_mask[b, :len(ids) - prompt].bool().tolist()
        assert ro.completion_mask[b, len(ids) - prompt:].sum() == 0 and len(ids) - prompt <= C
        checked += 1
    assert checked >= 4, checked


def test_a_task_gets_a_warm_start_from_its_answers(tmp_path):
    import tasks  # noqa: F401  (registers mul2)
    from registry import get
    held = get("task", "mul2")(None)[1][:32]
    build(tmp_path / "cold", 0, "task=mul2", "max_new_tokens=6")
    build(tmp_path / "warm", 80, "task=mul2", "max_new_tokens=6")
    cold, _, _ = turns(tmp_path / "cold", "toy_answer", held, 6)
    warm, _, _ = turns(tmp_path / "warm", "toy_answer", held, 6)
    assert well_formed(cold, "[0-9]{4}") <= 0.2, cold
    assert well_formed(warm, "[0-9]{4}") >= 0.8, warm


@pytest.mark.parametrize("overrides,message", [
    (["task=toy_lamps", "env.name=echo_nope"], "unknown env 'echo_nope'; known: .*hilo"),
    (["task=toy_lamps", "env.name=toy_answer"], "env 'toy_answer' has no scripted player: .*scripted_turn"),
    (["task=toy_lamps", "env.name=toy_lamps", "env.args=lamps=3"], "env.args='lamps=3': .*unexpected keyword"),
    (["task=hilo"], "task 'hilo' rows have no field 'answer' \\(fields: prompt, secret\\)"),
    (["task=toy_lamps", "env.name=toy_lamps", "max_new_tokens=1"], "the rollout cuts turns at max_new_tokens=1"),
    (["task=toy_lamps", "env.name=toy_lamps", "env.max_tokens=8"], "the rollout cuts episodes at env.max_tokens=8"),
    (["task=mul2", "--chars", "012345678*="], "does not survive the character tokenizer"),
])
def test_bad_input_is_refused_before_training(tmp_path, overrides, message):
    with pytest.raises(SystemExit, match=message):
        build(tmp_path / "never", 5, *overrides)
    assert not (tmp_path / "never").exists()


def test_hilo_scripted_player_keeps_to_the_feedback():
    """Every guess lies inside the ranges the feedback left, and the player wins some episodes but not all."""
    from envs.hilo import Hilo, hilo_task
    from envs.hilo import HiloConfig
    rng, wins = random.Random(0), 0
    for row in hilo_task(HiloConfig())[0][:200]:
        env, history = Hilo(), []
        history.append(env.reset(row))
        for _ in range(4):
            guess = Hilo.scripted_turn(row, history, rng)
            for earlier, fb in zip(history[1::2], history[2::2]):
                for g, e, f in zip(guess, earlier, fb):
                    assert (g > e) if f == ">" else (g < e) if f == "<" else (g == e)
            obs, reward, done, info = env.step(guess)
            history += [guess, obs]
            if done:
                wins += info["success"]
                break
    assert 0 < wins < 100, wins


def test_an_out_that_holds_a_model_is_refused_untouched(tmp_path, capsys):
    from tools import make_warm_start
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        make_warm_start.main(["--out", str(tmp_path), "--steps", "1"])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
