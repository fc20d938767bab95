"""Pictures as multi-turn observations (envs/base.py check_image, engines/multiturn.py, vision.py, buffer.py): an
environment's picture is checked in the worker and again in the trainer, the portable loop feeds it as embeddings,
the engine's log-probs are the trainer's, observation and picture columns take no gradient, and the batch keeps
several pictures per row through select, cat, micro-batches and the replay buffer's state."""
import os
from dataclasses import replace

import pytest
import torch

import picture_envs  # noqa: F401  (tests/: env picture)
import registry
import vision
from buffer import Experience, ReplayBuffer
from config import Config, ReplayConfig, UserError
from engines.base import SamplingParams
from engines.episodes import EpisodeBatch
from engines.multiturn import MultiTurn, Renderer
from envs.pool import EnvPool
from envs.wire import WireError, check_result
from microbatch import micro_batches
from models import completion_logprobs, load_model
from test_vision import ALGOS, assert_gradient_on_completions_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sampler(model, env: str, **env_opts) -> MultiTurn:
    cfg = Config()
    cfg.model, cfg.env.name, cfg.max_new_tokens, cfg.env.timeout_s = os.path.join(ROOT, "assets/tiny-vlm"), env, 3, 5.0
    for k, v in env_opts.items():
        setattr(cfg.env, k, v)
    return MultiTurn(model, model.tok, cfg)


@pytest.fixture(scope="module")
def vlm():
    """The shipped tiny VLM: it answers with its end-of-turn token, so episodes reach their second picture."""
    model, tok = load_model(os.path.join(ROOT, "assets/tiny-vlm"), torch.device("cpu"), torch.float32)
    vision.freeze_tower(model, train_tower=False)
    model.tok = tok
    return model


def rows(n: int) -> list[dict]:
    return registry.get("task", "shapes")(None)[1][:n]


@pytest.fixture(scope="module")
def episodes(vlm):
    """3 shapes rows x 2 episodes of env shapes_pair: each shows the row's picture, then a second one as the first
    turn's observation."""
    mt = sampler(vlm, "shapes_pair")
    try:
        ro = mt.generate([], rows(3), 2, SamplingParams(1.0, 1.0, 3), torch.Generator().manual_seed(0))
    finally:
        mt.close()
    return ro


def observation_pictures(ro) -> torch.Tensor:
    """(B, C) the completion's image pads that show a picture."""
    return ro.images["image_mask"][:, -ro.completion_mask.shape[1]:]


def assert_teacher_forced(model, ro, tol=1e-4):
    C = ro.completion_mask.shape[1]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, C, 1.0, ro.images)
    m = ro.completion_mask.bool()
    assert (logp - ro.logprobs)[m].abs().max() <= tol
    return logp


# ------------------------------------------------------------------------------------- the environment side

def test_the_worker_checks_pictures_and_ships_their_bytes():
    spec = {"name": "picture", "args": {}, "tools": [], "parser": "tag", "max_obs_chars": 100,
            "max_obs_image_bytes": 16384, "memory_mb": 1024, "modules": ["picture_envs"]}
    modes = {"fine": "", "jpeg": "", "huge_bytes": "max_obs_image_bytes=16384", "bomb": "3000 x 3000 pixels",
             "gif": "cannot read as PNG or JPEG", "garbage": "cannot read", "truncated": "cannot read",
             "path": "of type str", "no_slot": "0 <image> slots", "two_slots": "2 <image> slots",
             "extra_key": "other keys", "subclass": "of type Sneaky"}
    with EnvPool(spec, workers=2, timeout_s=5.0) as pool:
        resets = pool.run([("reset", {"mode": m}) for m in modes])
        assert all(r[0] == "ok" and type(r[2]["image"]) is bytes for r in resets)
        out = dict(zip(modes, pool.run([("step", r[1], "1") for r in resets])))
    assert out["fine"][2] == {"text": "<image>red circles?", "image": picture_envs.png()}
    assert out["jpeg"][0] == "ok" and out["jpeg"][2]["image"][:2] == b"\xff\xd8"
    for mode, reason in modes.items():
        if reason:
            assert out[mode][:2] == ("fail", "error") and reason in out[mode][2], (mode, out[mode])
    spec["max_obs_image_bytes"] = 0   # text observations only
    with EnvPool(spec, workers=1, timeout_s=5.0) as pool:
        assert "pictures are off" in pool.run([("reset", {})])[0][2]


def test_the_wire_refuses_a_picture_that_is_not_base64():
    ok = ["result", 0, ["ok", "s", {"text": "<image>", "image": "iVBO"}, 0.0, False, None, "user", 0, 0]]
    assert check_result(ok, 0)[2] == {"text": "<image>", "image": b"\x89PN"}
    for bad in ({"text": "<image>", "image": "not base64!"}, {"text": "<image>"}, {"text": 1, "image": "iVBO"}):
        with pytest.raises(WireError):
            check_result(["result", 0, ["ok", "s", bad, 0.0, False, None, "user", 0, 0]], 0)


def test_a_bad_picture_costs_its_episode_and_the_trainer_checks_again(vlm):
    """Through MultiTurn: each bad picture is its episode's recorded failure, the others go on; bytes a worker sent
    past its own check (the worker runs the environment's code) are refused in the trainer before Pillow decodes."""
    mt = sampler(vlm, "picture", max_obs_image_bytes=16384)
    mt.cut_turns = True   # a turn without its end-of-turn token still goes to the environment: every episode steps
    try:
        modes = ["fine", "bomb", "gif", "no_slot", "thin", "fine"]
        ro = mt.generate([], [{"prompt": "?", "mode": m} for m in modes], 1, SamplingParams(1.0, 1.0, 3),
                         torch.Generator().manual_seed(0))
        ep = EpisodeBatch(1)
        bomb = {"text": "<image>", "image": picture_envs.png((3000, 3000), 0, mode="1")}
        assert mt._tokenise(ep, 0, bomb, "user", "step") is None and "3000 x 3000" in ep.failed[0][1]
    finally:
        mt.close()
    failed = [f is not None for f in ro.info["failed"]]
    assert failed == [False, True, True, True, True, False], ro.info["failed"]
    assert "aspect ratio" in ro.info["failed"][4][1]                     # the worker passed it, the processor did not
    assert (ro.completion_mask[1:5] == 0).all() and ro.info["turns"][0] == ro.info["turns"][5] == 2
    # the fine episodes show two pictures each (reset's and the step's); a failed one keeps its reset's picture
    assert (ro.images["image_index"] >= 0).sum(-1).tolist() == [2, 1, 1, 1, 1, 2]
    assert len(ro.images["pixel_values"]) == 2            # blue and red: each distinct picture once
    assert_teacher_forced(vlm, ro)


def test_a_text_policy_or_a_fast_path_refuses_pictures(vlm, random_model_dir):
    model, tok = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    cfg = Config()
    cfg.env.name = "picture"
    mt = MultiTurn(model, tok, cfg)
    try:   # a text model: the picture fails the episode, with the reason
        ro = mt.generate([], [{"prompt": "1"}], 1, SamplingParams(1.0, 1.0, 3), torch.Generator().manual_seed(0))
    finally:
        mt.close()
    assert "pictures are off (a text policy" in ro.info["failed"][0][1] and ro.images == {}
    for cfg, fast in ((_cfg(), True), (_cfg(exact_logprobs=True), None)):   # before any work: no pool starts
        with pytest.raises(UserError, match="portable loop only"):
            MultiTurn(vlm, vlm.tok, cfg, fast=fast)


def test_only_the_picture_writes_image_pads_inside_the_chat_frame(vlm):
    """Renderer: the slot becomes the picture's ids (special tokens); the environment's own text that spells
    <|image_pad|> stays characters, so it can never claim a picture's place; the chat template frames both."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets/tiny-vlm"))
    tok.chat_template = ("{% for m in messages %}u{{ m.content }}e{% endfor %}{% if add_generation_prompt %}a"
                         "{% endif %}")
    pad = vlm.config.image_token_id
    r = Renderer(tok, tok.eos_token_id, [], picture=lambda image: [41, pad, pad, 43])
    plain = lambda text: tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids = r.prompt("<|image_pad|> <image>?", b"png")
    assert ids == plain("u") + plain("<|image_pad|> ") + [41, pad, pad, 43] + plain("?") + plain("ea")
    assert ids.count(pad) == 2
    obs = r.observation("x<image>", "user", b"png")
    assert obs.count(pad) == 2 and obs[-len(plain("ea")):] == plain("ea") and not r.seen   # not cached
    with pytest.raises(ValueError, match="text model"):
        Renderer(tok, tok.eos_token_id, []).observation("<image>", "user", b"png")


def _cfg(**opts) -> Config:
    cfg = Config()
    cfg.model, cfg.env.name = os.path.join(ROOT, "assets/tiny-vlm"), "shapes_pair"
    for k, v in opts.items():
        setattr(cfg, k, v)
    return cfg


# --------------------------------------------------------------------------------------- rollout and trainer

def test_engine_logprobs_are_teacher_forced_with_an_observation_picture(vlm, episodes):
    ro = episodes
    assert (ro.images["image_index"] >= 0).sum(-1).max() == 2                  # a row showed two pictures
    assert observation_pictures(ro).sum() > 0                          # pictures in the completion columns
    logp = assert_teacher_forced(vlm, ro)
    # the observation's picture reaches the second turn: the same tokens with each row's pictures swapped
    swapped = {**ro.images, "image_index": ro.images["image_index"].flip(-1)}
    with torch.no_grad():
        other, _ = completion_logprobs(vlm, ro.input_ids, ro.attention_mask, ro.completion_mask.shape[1], 1.0, swapped)
    assert (other - logp)[ro.completion_mask.bool()].abs().max() > 1e-4


def test_mrope_positions_continue_the_rows_count(vlm):
    """With Qwen2-VL's M-RoPE positions (the tiny VLM was trained on text positions: config.text_positions), each
    picture's grid positions and the shift after it are the same in the engine's chunks and the trainer's forward."""
    vlm.config.text_positions = False
    try:
        mt = sampler(vlm, "shapes_pair")
        try:
            ro = mt.generate([], rows(2), 2, SamplingParams(1.0, 1.0, 3), torch.Generator().manual_seed(1))
        finally:
            mt.close()
        pos = vision.positions(vlm, ro.input_ids, ro.attention_mask, ro.images)
        assert pos.shape[0] == 3 and not torch.equal(pos[1], pos[2])
        assert_teacher_forced(vlm, ro)
    finally:
        vlm.config.text_positions = True


def test_a_sampled_image_pad_is_text(vlm, episodes):
    """A model token that is the image-pad id is not in image_mask: the trainer embeds it as a token."""
    ro = episodes
    C = ro.completion_mask.shape[1]
    ids = ro.input_ids.clone()
    b, c = ro.completion_mask.nonzero()[0].tolist()
    ids[b, -C + c] = vlm.config.image_token_id
    logp, _ = completion_logprobs(vlm, ids, ro.attention_mask, C, 1.0, ro.images)
    assert torch.isfinite(logp).all()
    with pytest.raises(ValueError, match="image tokens per row"):   # taken for a picture's, it would not fit
        completion_logprobs(vlm, ids, ro.attention_mask, C, 1.0, {**ro.images, "image_mask": ids == ids.new_tensor(
            vlm.config.image_token_id)})


def batch_of(ro, seed=0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    mask = ro.completion_mask
    rewards = ro.returns + torch.rand(len(ro.returns), generator=g)
    return Experience(input_ids=ro.input_ids, attention_mask=ro.attention_mask, completion_mask=mask,
                      sample_logprobs=ro.logprobs, rewards=rewards, group_ids=ro.group_ids,
                      versions=torch.zeros(len(rewards), dtype=torch.long), truncated=ro.truncated,
                      turn_rewards=ro.turn_rewards, old_logprobs=(ro.logprobs + 0.1 * torch.randn(mask.shape,
                                                                                                 generator=g)) * mask,
                      ref_logprobs=ro.logprobs - 0.05 * mask, **ro.images)


@pytest.mark.parametrize("algo", ALGOS)
def test_observation_and_picture_columns_get_exactly_zero_gradient(vlm, episodes, algo):
    ro = episodes
    batch = batch_of(ro)
    C = batch.completion_mask.shape[1]
    obs = batch.attention_mask[:, -C:].bool() & ~batch.completion_mask.bool()            # (B, C)
    assert (obs & observation_pictures(ro)).sum() == observation_pictures(ro).sum() > 0   # pictures are observations
    assert_gradient_on_completions_only(vlm, batch, algo, obs, norm_len=8, max_new_tokens=3)


def test_select_cat_micro_batches_and_replay_keep_each_rows_pictures(vlm, episodes):
    batch = batch_of(episodes)
    C = batch.completion_mask.shape[1]
    shown = lambda b, row: [b.pixel_values[u] for u in b.image_index[row].tolist() if u >= 0]

    def same(b1, r1, b2, r2):
        x, y = shown(b1, r1), shown(b2, r2)
        return len(x) == len(y) > 0 and all(torch.equal(p[:len(q)], q[:len(p)]) for p, q in zip(x, y))
    sub = batch.select(torch.tensor([5, 0, 3]))
    assert all(same(sub, i, batch, j) for i, j in enumerate([5, 0, 3]))
    assert len(sub.pixel_values) == len(set(sub.image_index[sub.image_index >= 0].tolist()))   # only those shown
    text = replace(batch.select(torch.tensor([1, 2])), pixel_values=None, image_grid_thw=None, image_index=None,
                   image_mask=None)                                     # an episode batch where no picture came
    both = Experience.cat([sub, text])
    assert all(same(both, i, batch, j) for i, j in enumerate([5, 0, 3])) and (both.image_index[3:] < 0).all()
    with torch.no_grad():
        whole, _ = completion_logprobs(vlm, batch.input_ids, batch.attention_mask, C, 1.0, batch.images())
        joined, _ = completion_logprobs(vlm, both.input_ids, both.attention_mask, both.completion_mask.shape[1], 1.0,
                                        both.images())
        m = batch.completion_mask.bool()
        assert (joined[:3, :C] - whole[[5, 0, 3]])[m[[5, 0, 3]]].abs().max() < 1e-4
        for piece, _ in micro_batches(batch, 2, "token-mean"):   # trimmed pieces: the same log-probs
            logp, _ = completion_logprobs(vlm, piece.input_ids, piece.attention_mask, piece.completion_mask.shape[1],
                                          1.0, piece.images())
            assert piece.images()["image_mask"].sum() > 0 and torch.isfinite(logp).all()
    replay = ReplayBuffer(ReplayConfig(enabled=True, capacity=64, max_uses=2, max_staleness=4), None)
    replay.add(batch)
    again = ReplayBuffer(ReplayConfig(enabled=True, capacity=64, max_uses=2, max_staleness=4), None)
    again.load_state_dict(*replay.state_dict())
    assert all(torch.equal(getattr(again.data, k), getattr(batch, k)) for k in ("image_index", "image_mask",
                                                                                  "pixel_values", "image_grid_thw"))


def test_train_py_runs_the_multiturn_vision_example_with_replay_and_resume(tmp_path):
    """configs/vision.yaml with env.name=shapes_pair (docs/vision.md), in this process: replay, micro-batches, a
    reference model, a checkpoint and a resume; no environment failure, observation tokens out of the loss."""
    import json
    import train
    out, threads = tmp_path / "run", torch.get_num_threads()
    args = ["--config", os.path.join(ROOT, "configs/vision.yaml"), f"model={os.path.join(ROOT, 'assets/tiny-vlm')}",
            "env.name=shapes_pair", "prompts_per_step=2", "samples_per_prompt=4", "eval_size=4", "eval_every=100",
            "replay.enabled=true", "micro_batch_size=4", "algo.kl_coef=0.05", "save_every=1", "progress=false",
            f"out_dir={out}"]
    try:
        train.main(args + ["steps=1"])
        train.main(args + ["steps=2"])
    finally:
        torch.set_num_threads(threads)
    rows_ = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_ if "loss" in r] == [1, 2], rows_
    assert all(r["env_fail"] == 0 and r["tokens/out_of_loss"] > 0 for r in rows_ if "loss" in r)
    assert all(r.get("logprob_mismatch/max", 0) < 1e-4 for r in rows_)   # measured where the update reads it
