"""Vision (vision.py, tasks/shapes.py, rewards/vision.py): pictures travel once per prompt, land on the prompt's
image tokens in rollout and training alike, never enter the loss, and the frozen tower takes no gradient."""
import ast
import os
import re
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import registry
import vision
from buffer import Experience
from config import AGG_MODES, AlgoConfig
from conftest import train_here
from engines.base import SamplingParams
from engines.builtin import BuiltinEngine
from microbatch import micro_batches
from models import completion_logprobs, encode_prompts, load_model
from rewards.vision import vision_reward
from tasks import shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "online_dpo"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A random tiny VLM (tools/make_tiny_vlm.py's shape, no warm start), loaded as train.py loads it."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_tiny_vlm import build
    out = str(tmp_path_factory.mktemp("tiny-vlm"))
    torch.manual_seed(0)
    _, model = build(out)
    model.save_pretrained(out)
    model, tok = load_model(out, torch.device("cpu"), torch.float32)
    vision.freeze_tower(model, train_tower=False)
    return model, tok, out


@pytest.fixture(scope="module")
def rollout(vlm):
    return shapes_rollout(*vlm)


def shapes_rollout(model, tok, path):
    """3 shapes prompts x 4 samples through the built-in engine -> (the rollout, the batch's pictures, the prompts).
    (test_vision_llava's rollout too.)"""
    prompts = vision.encode_rows(tok, path, shapes.shapes_samples(3, heldout=False), encode_prompts)
    engine = BuiltinEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    ro = engine.generate(prompts, 4, SamplingParams(1.0, 1.0, 4), torch.Generator().manual_seed(0))
    return ro, vision.batch_images(prompts, 4), prompts


def batch_of(ro, images, seed=0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(ro.input_ids),), generator=g).float()
    mask = ro.completion_mask
    return Experience(input_ids=ro.input_ids, attention_mask=ro.attention_mask, completion_mask=mask,
                      sample_logprobs=ro.logprobs, rewards=rewards, group_ids=ro.group_ids,
                      versions=torch.zeros(len(rewards), dtype=torch.long), truncated=ro.truncated,
                      old_logprobs=(ro.logprobs + 0.1 * torch.randn(mask.shape, generator=g)) * mask,
                      ref_logprobs=ro.logprobs - 0.05 * mask, **images)


# ------------------------------------------------------------------------------------------ task and reward

def test_shapes_rows_answer_their_picture_and_splits_are_disjoint():
    train, held = shapes.shapes_samples(300, False), shapes.shapes_samples(100, True)
    assert not {r["scene"] for r in train} & {r["scene"] for r in held}
    assert shapes.shapes_samples(5, False) == train[:5]                       # deterministic
    for r in train + held:
        scene = ast.literal_eval(r["scene"])
        if scene["kind"] == "count":
            assert r["answer"] == str(sum(k == "red circle" for k, _ in scene["items"]))
        else:   # the circle's area pi r^2 against the square's side^2 decides
            (_, r_circle), (_, side) = scene["items"]
            assert r["answer"] == ("a" if 3.14159 * (r_circle / 2) ** 2 > side ** 2 else "b")
        img = vision.load_image(r["image"])
        assert img.size == (shapes.SIZE, shapes.SIZE) and r["prompt"].count(vision.IMAGE) == 1
    # the picture shows what the row says: red pixels exactly where red shapes were drawn
    count = next(r for r in train if r["kind"] == "count" and "red square" not in r["scene"])
    red = lambda png: int((np.asarray(vision.load_image(png)) == (255, 0, 0)).all(-1).sum())   # red pixels
    reds, one = red(count["image"]), red(shapes.png(shapes.render({"kind": "count", "items": [("red circle", (0, 0))]})))
    assert reds == int(count["answer"]) * one


@pytest.mark.parametrize("completion, answer, extra, expected", [
    ("3", "3", {}, 1.0), ("4", "3", {}, 0.0), ("the answer is 12.5", "12.5", {}, 1.0),
    ("(B) the square", "b", {"choices": "ab"}, 1.0), ("b", "a", {"choices": "ab"}, 0.0),
    ("a or b", "a", {"choices": "ab"}, 0.0), ("a", "a", {}, 1.0), ("", "a", {}, 0.0),
    ("x = \\frac{1}{2}", "\\frac{1}{2}", {}, 1.0)])
def test_vision_reward(completion, answer, extra, expected):
    assert vision_reward("<image>q", completion, answer=answer, image=b"png", **extra) == expected


# ---------------------------------------------------------------------------------------- the data path

def test_a_group_shares_one_picture_through_select_cat_and_micro_batches(rollout):
    ro, images, _ = rollout
    batch = batch_of(ro, images)
    assert batch.pixel_values.shape[0] == 3 and batch.image_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    picture = lambda b, row: b.pixel_values[b.image_index[row]]                  # (N, D)
    sub = batch.select(torch.tensor([9, 1, 2]))
    assert sub.pixel_values.shape[0] == 2                                        # only the pictures it shows
    assert all(torch.equal(picture(sub, i), picture(batch, j)) for i, j in enumerate([9, 1, 2]))
    both = Experience.cat([sub, batch.select(torch.tensor([4, 11]))])
    assert both.pixel_values.shape[0] == 4 and len(both) == 5
    assert all(torch.equal(picture(both, i), picture(batch, j)) for i, j in enumerate([9, 1, 2, 4, 11]))
    pieces = list(micro_batches(batch, 4, "token-mean"))
    assert sum(p.pixel_values.shape[0] for p, _ in pieces) >= 3 and all(p.images() for p, _ in pieces)


def test_engine_and_trainer_agree_and_the_picture_matters(vlm, rollout):
    model, _, _ = vlm
    ro, images, _ = rollout
    C = ro.completion_mask.shape[1]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, C, 1.0, images)
        swapped = {**images, "image_index": images["image_index"].roll(4)}        # each group another's picture
        other, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, C, 1.0, swapped)
    m = ro.completion_mask.bool()
    assert (logp - ro.logprobs)[m].abs().max() < 1e-4                         # rollout's prefill = training's
    assert (other - logp)[m].abs().max() > 1e-4                               # the picture reaches the tokens


@pytest.fixture
def mrope(vlm):
    """The tiny VLM read with Qwen2-VL's M-RoPE positions (it was built for text positions: config.text_positions)."""
    model = vlm[0]
    model.config.text_positions = False
    yield model
    model.config.text_positions = True


def test_mrope_positions_are_the_models_own_and_engine_and_trainer_agree(vlm, rollout, mrope):
    """vision.positions gives the log-probs transformers' Qwen2-VL computes with its own M-RoPE positions (from the
    ids and the picture grid), and the engine's decode continues them as the trainer's teacher forcing does."""
    model, tok, _ = vlm
    ro, images, prompts = rollout
    C = ro.completion_mask.shape[1]
    pos = vision.positions(model, ro.input_ids, ro.attention_mask, images, ro.input_ids.shape[1] - C)
    assert pos.shape == (3, *ro.input_ids.shape) and not torch.equal(pos[1], pos[2])        # a 2-D grid
    index = images["image_index"]
    grid = images["image_grid_thw"][index]                                                    # (B, 3)
    flat = torch.cat([images["pixel_values"][i][:int(g.prod())] for i, g in zip(index.tolist(), grid)])
    ids = ro.input_ids.clone()
    ids[:, -C:][ids[:, -C:] == model.config.image_token_id] = tok.pad_token_id   # none sampled, in any case
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=ro.attention_mask, pixel_values=flat, image_grid_thw=grid,
                    mm_token_type_ids=(ids == model.config.image_token_id).int(), use_cache=False).logits
        ours, _ = completion_logprobs(model, ids, ro.attention_mask, C, 1.0, images)
    own = own[:, -C - 1:-1].log_softmax(-1).gather(-1, ids[:, -C:, None])[..., 0]           # (B, C)
    m = ro.completion_mask.bool()
    assert (ours - own)[m].abs().max() < 1e-4
    engine = BuiltinEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    again = engine.generate(prompts, 4, SamplingParams(1.0, 1.0, 4), torch.Generator().manual_seed(1))
    with torch.no_grad():
        forced, _ = completion_logprobs(model, again.input_ids, again.attention_mask, C, 1.0, images)
    m = again.completion_mask.bool()
    assert (forced - again.logprobs)[m].abs().max() < 1e-4


def test_an_image_token_sampled_in_a_completion_is_text(vlm, rollout):
    """Only the prompt's image tokens take picture features: a sampled one in the completion is a token."""
    model, _, _ = vlm
    ro, images, _ = rollout
    ids = ro.input_ids.clone()
    ids[:, -1] = model.config.image_token_id
    C = ro.completion_mask.shape[1]
    logp, _ = completion_logprobs(model, ids, ro.attention_mask, C, 1.0, images)
    assert logp.shape == ro.completion_mask.shape and torch.isfinite(logp).all()


@pytest.mark.parametrize("algo", ALGOS)
def test_loss_is_on_completion_tokens_only_and_the_tower_stays_frozen(vlm, rollout, algo):
    """Every algorithm and loss_agg: the loss's gradient reaches only completion tokens (image positions are prompt
    positions, outside the (B, C) log-probs), the language model learns, the vision tower takes no gradient."""
    model, _, _ = vlm
    ro, images, _ = rollout
    batch = batch_of(ro, images)
    P = batch.prompt_len
    assert (batch.input_ids[:, :P] == model.config.image_token_id).sum() == 12 * 16   # 16 per picture, every row
    assert_gradient_on_completions_only(model, batch, algo, ~batch.completion_mask.bool(), norm_len=4,
                                        max_new_tokens=4)


def assert_gradient_on_completions_only(model, batch: Experience, algo: str, zero, norm_len: int,
                                        max_new_tokens: int):
    """algo's loss on batch under every loss_agg: finite, its gradient w.r.t. the (B, C) log-probs exactly 0 where
    zero (B, C) is true and nonzero on the completion tokens; the language model's head takes gradient, the vision
    tower none. (test_vision_turns too, where zero marks the observation columns.)"""
    A = registry.get("algo", algo)
    C = batch.completion_mask.shape[1]
    for agg in AGG_MODES:
        cfg = AlgoConfig(name=algo, kl_coef=0.05, loss_agg=agg, norm_len=norm_len, max_new_tokens=max_new_tokens,
                         tis="token")
        b = replace(batch)
        b.advantages = A.advantages(b, cfg)
        logp, entropy = completion_logprobs(model, b.input_ids, b.attention_mask, C, 1.0, b.images())
        logp.retain_grad()
        loss, _ = A.loss({"logprobs": logp, "entropy": entropy}, b, cfg)
        model.zero_grad()
        loss.backward()
        assert torch.isfinite(loss) and (logp.grad[zero] == 0).all(), (algo, agg)
        assert logp.grad[b.completion_mask.bool()].abs().sum() > 0, (algo, agg)
        assert all(p.grad is None for p in vision.tower(model).parameters()), (algo, agg)
        assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0, (algo, agg)
    model.zero_grad()


def test_train_tower_true_trains_the_tower(vlm, rollout):
    model, _, _ = vlm
    ro, images, _ = rollout
    vision.freeze_tower(model, train_tower=True)   # a no-op: only freezing changes anything
    try:
        vision.tower(model).requires_grad_(True)
        C = ro.completion_mask.shape[1]
        logp, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, C, 1.0, images)
        model.zero_grad()
        (logp * ro.completion_mask).sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision.tower(model).parameters())
    finally:
        vision.freeze_tower(model, train_tower=False)
        model.zero_grad()


def test_a_picture_loads_from_bytes_a_path_or_a_datasets_image_dict(tmp_path):
    png = shapes.shapes_samples(1, False)[0]["image"]
    (tmp_path / "a.png").write_bytes(png)
    want = np.asarray(vision.load_image(png))
    for image in (str(tmp_path / "a.png"), {"bytes": png, "path": None}, {"bytes": None, "path": str(tmp_path / "a.png")}):
        assert (np.asarray(vision.load_image(image)) == want).all()
    for bad in ({"bytes": None, "path": None}, {"pixels": png}, str(tmp_path / "missing.png"), 3):
        with pytest.raises(ValueError, match="image must be"):
            vision.load_image(bad)


def test_a_row_without_its_image_slot_is_an_error(vlm):
    _, tok, path = vlm
    row = shapes.shapes_samples(1, False)[0]
    with pytest.raises(ValueError, match="<image>"):
        vision.encode_rows(tok, path, [{**row, "prompt": "no slot"}], encode_prompts)


# -------------------------------------------------------------------------------------------- end to end

def test_train_py_runs_replay_and_resume_on_the_vision_task(vlm, tmp_path, capsys):
    """A short configs/vision.yaml run with replay, micro-batches, two epochs, a reference model and a resume (train.py
    in this process: conftest.train_here)."""
    _, _, path = vlm
    out = tmp_path / "run"
    args = ["--config", "configs/vision.yaml", f"model={path}", "eval_size=8", "prompts_per_step=2",
            "samples_per_prompt=4", "eval_every=1", "replay.enabled=true", "micro_batch_size=4", "algo.epochs=2",
            "algo.kl_coef=0.05", "save_every=1", f"out_dir={out}", "progress=false", "threads=1"]
    train_here(args + ["steps=1"])
    capsys.readouterr()
    train_here(args + ["steps=2"])
    said = capsys.readouterr()
    assert "resuming from" in said.out + said.err
    assert (out / "final" / "preprocessor_config.json").exists()
    model, _ = load_model(str(out / "final"), torch.device("cpu"), torch.float32)   # the final policy loads
    assert vision.tower(model) is not None


def test_lora_adapts_the_language_model_only(tmp_path):
    """lora.r=4 on the warm-started tiny VLM, 2 steps of train.py: the adapter holds language-model modules only,
    they trained (B starts at zero), and the merged policy differs from the base in those layers alone: the tower,
    the embeddings and the norms are the base's bit for bit."""
    from safetensors.torch import load_file
    out = tmp_path / "run"
    train_here(["--config", "configs/vision.yaml", "steps=2", "eval_size=4", "eval_every=100", "prompts_per_step=4",
                "samples_per_prompt=8", "lora.r=4", "lora.save_merged=true", "lr=1e-2", f"out_dir={out}",
                "progress=false", "threads=1"])   # in this process (conftest.train_here)
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert adapter and all(".lora_" in k and "visual" not in k for k in adapter), sorted(adapter)[:4]
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if ".lora_B" in k)          # the adapters learned
    base = load_file(os.path.join(ROOT, "assets", "tiny-vlm", "model.safetensors"))
    merged = load_file(str(out / "final" / "merged" / "model.safetensors"))
    # module names as the checkpoint writes them (transformers saves Qwen2-VL's text layers as model.layers.N)
    adapted = {k.split(".lora_")[0].split("base_model.model.", 1)[-1].replace("language_model.", "") for k in adapter}
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.rsplit(".", 1)[0] in adapted for k in changed), sorted(changed)[:4]
    assert not any("visual" in k for k in changed)


def positions_loop(model, input_ids, attention_mask, images, prompt_len=None, start=None):
    """vision.positions as it was first written, a Python loop per row and per picture: the reference its vectorised
    form must equal."""
    text = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if start is not None:
        text = text + start[:, None]
    merge = vision.base_model(model).config.vision_config.spatial_merge_size
    where = vision.slots(model, input_ids, images, prompt_len)
    out = text[None].repeat(3, 1, 1)
    grids = images["image_grid_thw"].tolist()
    for b, pictures in enumerate(vision.row_pictures(images)):
        cols = where[b].nonzero().flatten()
        for u in pictures:
            t, h, w = grids[u]
            H, W = h // merge, w // merge
            mine, cols = cols[:t * H * W], cols[t * H * W:]
            if len(mine) < t * H * W:
                raise ValueError(f"row {b} has fewer image tokens than its pictures' {t * H * W}")
            s = int(out[0, b, mine[0]])
            k = torch.arange(len(mine))
            out[0, b, mine] = s
            out[1, b, mine], out[2, b, mine] = s + k // W, s + k % W
            out[:, b, mine[-1] + 1:] += max(H, W) - len(mine)
    return out


def random_layout(g, episodes: bool, IMG: int = 9, B: int = 5):
    """Rows of text and pictures' image pads (several per row in episodes, whose pads image_mask names; one or none
    per row else, plus an image pad sampled in the completion that is text), left-padded, with their picture table."""
    grids, index, rows, masks = [], [], [], []
    for b in range(B):
        pictures = int(torch.randint(0, 4 if episodes else 2, (1,), generator=g))
        ids, shown, mine = [], [], []
        for _ in range(pictures):
            t = 1 + int(torch.randint(0, 2, (1,), generator=g))
            h, w = 2 * (1 + torch.randint(0, 3, (2,), generator=g))                # even: whole merged patches
            grids.append([t, int(h), int(w)])
            mine.append(len(grids) - 1)
            text = int(torch.randint(0, 3, (1,), generator=g))
            ids += [1] * text + [IMG] * (t * int(h) * int(w) // 4)
            shown += [False] * text + [True] * (t * int(h) * int(w) // 4)
        extra = int(torch.randint(0, 2, (1,), generator=g))             # pads past the row's pictures: text
        ids, shown = ids + [IMG] * extra + [3], shown + [True] * extra + [False]
        tail = [2, 2, 2]                                                # the last 4 columns: a completion
        tail.insert(int(torch.randint(0, 4, (1,), generator=g)), IMG)   # with a sampled image pad, which is text
        rows.append(ids + tail)
        masks.append(shown + [False] * len(tail))
        index.append(mine)
    T = max(map(len, rows)) + 2
    pad = [T - len(r) for r in rows]
    ids = torch.tensor([[0] * p + r for p, r in zip(pad, rows)])                      # (B, T) left-padded
    mask = torch.tensor([[0] * p + [1] * len(r) for p, r in zip(pad, rows)])
    K = max(1, max(map(len, index)))
    images = {"pixel_values": torch.zeros(len(grids), 1, 1), "image_grid_thw": torch.tensor(grids).view(-1, 3)}
    if episodes:
        images["image_index"] = torch.tensor([m + [-1] * (K - len(m)) for m in index])                  # (B, K)
        images["image_mask"] = torch.tensor([[False] * p + m for p, m in zip(pad, masks)])
    else:
        images["image_index"] = torch.tensor([m[0] if m else -1 for m in index])                         # (B,)
    return ids, mask, images


def test_mrope_positions_equal_the_per_row_loop_on_random_layouts():
    from types import SimpleNamespace
    from transformers import Qwen2VLConfig
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    model = SimpleNamespace(config=Qwen2VLConfig(text_config={"rope_parameters": rope}, image_token_id=9,
                                                 vision_config={"spatial_merge_size": 2}))
    g = torch.Generator().manual_seed(0)
    for trial in range(24):
        episodes = trial % 2 == 1
        ids, mask, images = random_layout(g, episodes)
        start = torch.randint(0, 50, (len(ids),), generator=g) if trial % 4 == 3 else None
        prompt_len = None if episodes else ids.shape[1] - 4
        want = positions_loop(model, ids, mask, images, prompt_len, start)
        got = vision.positions(model, ids, mask, images, prompt_len, start)
        assert got.shape == (3, *ids.shape) and torch.equal(got, want), trial
    # a row whose pads cannot hold its pictures: the same one-line error
    ids, mask, images = random_layout(torch.Generator().manual_seed(3), True)
    rows = (images["image_index"] >= 0).sum(-1).nonzero().flatten()
    images["image_mask"][rows[-1]] = False
    with pytest.raises(ValueError) as want:
        positions_loop(model, ids, mask, images)
    with pytest.raises(ValueError, match=re.escape(str(want.value))):
        vision.positions(model, ids, mask, images)
