"""A second VLM family (vision.py `Llava`: transformers' LlavaForConditionalGeneration, a CLIP tower and a projector
beside a llama, one `<image>` token per feature, plain positions, pixel_values (U, 3, H, W) without a grid) through
the same code as Qwen2-VL: the engine's portable loop, teacher forcing, the buffer, GRPO steps of train.py, the
frozen encoder, LoRA; and a VLM of a layout vision.py does not know, refused in one line."""
import os
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import registry
import vision
from buffer import Experience, ReplayBuffer
from config import AlgoConfig, ReplayConfig, UserError
from conftest import ROOT, step_rows, train_here
from engines.base import SamplingParams
from engines.builtin import BuiltinEngine
from engines.fast_decode import supported
from microbatch import micro_batches
from models import completion_logprobs, load_model
from tasks import shapes
from test_vision import shapes_rollout

TOKENS = 16   # image tokens per picture: (64 / 16)^2 CLIP patches, CLS dropped (tools/make_tiny_llava.py)


@registry.register("reward", "test_llava_parity")
def parity_reward(prompt, completion, **_):
    """A toy reward a random model's samples split about evenly (the shapes answers it almost never gets), so that
    GRPO's groups carry signal and the steps update the policy."""
    return float(sum(map(ord, completion)) % 2)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from make_tiny_llava import build
    out = str(tmp_path_factory.mktemp("tiny-llava"))
    build(out)
    return out


@pytest.fixture(scope="module")
def llava(llava_dir):
    model, tok = load_model(llava_dir, torch.device("cpu"), torch.float32)   # as train.py loads it
    vision.freeze_tower(model, train_tower=False)
    return model, tok, llava_dir


@pytest.fixture(scope="module")
def rollout(llava):
    return shapes_rollout(*llava)


def batch_of(ro, images, seed=0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(ro.input_ids),), generator=g).float()
    return Experience(input_ids=ro.input_ids, attention_mask=ro.attention_mask, completion_mask=ro.completion_mask,
                      sample_logprobs=ro.logprobs, rewards=rewards, group_ids=ro.group_ids,
                      versions=torch.zeros(len(rewards), dtype=torch.long), truncated=ro.truncated,
                      old_logprobs=ro.logprobs.clone(), **images)


def test_the_engine_samples_a_llava_with_pictures_on_the_portable_loop(llava, rollout):
    """16 image tokens per prompt, the table one (3, 64, 64) image per prompt and no grid; asked for the fast path
    (what a GPU takes by default), a LLaVA with pictures samples on the portable loop: the same tokens."""
    model, tok, _ = llava
    ro, images, prompts = rollout
    assert [sum(t == model.config.image_token_id for t in p) for p in prompts] == [TOKENS] * 3
    assert set(images) == {"pixel_values", "image_index"} and images["pixel_values"].shape == (3, 3, 64, 64)
    assert images["image_index"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert not supported(model)   # engines/fast_decode.py's step has no LLaVA prefill
    fast = BuiltinEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, fast=True)
    again = fast.generate(prompts, 4, SamplingParams(1.0, 1.0, 4), torch.Generator().manual_seed(0))
    assert torch.equal(again.input_ids, ro.input_ids) and torch.equal(again.logprobs, ro.logprobs)


def test_logprobs_are_teacher_forced_and_transformers_own(llava, rollout):
    """The engine's sampling log-probs = the trainer's teacher forcing = transformers' own LLaVA forward (pixel_values
    and the ids: its own placement of the features), within 1e-4 in float32; another picture changes them."""
    model, _, _ = llava
    ro, images, _ = rollout
    C, m = ro.completion_mask.shape[1], ro.completion_mask.bool()
    with torch.no_grad():
        ours, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, C, 1.0, images)
        swapped = {**images, "image_index": images["image_index"].roll(4)}       # each group another's picture
        other, _ = completion_logprobs(model, ro.input_ids, ro.attention_mask, C, 1.0, swapped)
        ids = ro.input_ids.clone()
        ids[:, -C:][ids[:, -C:] == model.config.image_token_id] = 0   # a sampled one: text to us, a slot to transformers
        forced, _ = completion_logprobs(model, ids, ro.attention_mask, C, 1.0, images)
        own = model(input_ids=ids, attention_mask=ro.attention_mask, use_cache=False,
                    position_ids=(ro.attention_mask.cumsum(-1) - 1).clamp(min=0),
                    pixel_values=images["pixel_values"][images["image_index"]]).logits   # (B, T, V)
    own = own[:, -C - 1:-1].log_softmax(-1).gather(-1, ids[:, -C:, None])[..., 0]   # (B, C)
    assert (ours - ro.logprobs)[m].abs().max() < 1e-4
    assert (forced - own)[m].abs().max() < 1e-4
    assert (other - ours)[m].abs().max() > 1e-4                                  # the picture reaches the tokens


def test_a_group_shares_one_picture_through_select_cat_micro_batches_and_replay(rollout):
    ro, images, _ = rollout
    batch = batch_of(ro, images)
    picture = lambda b, row: b.pixel_values[b.image_index[row]]                  # (3, H, W)
    sub = batch.select(torch.tensor([9, 1, 2]))
    assert sub.pixel_values.shape == (2, 3, 64, 64) and sub.image_grid_thw is None
    both = Experience.cat([sub, batch.select(torch.tensor([4, 11]))])
    assert both.pixel_values.shape[0] == 4 and both.images()["image_grid_thw"] is None
    assert all(torch.equal(picture(both, i), picture(batch, j)) for i, j in enumerate([9, 1, 2, 4, 11]))
    pieces = list(micro_batches(batch, 4, "token-mean"))
    assert all(p.images() is not None and p.pixel_values.dim() == 4 for p, _ in pieces)
    buf = ReplayBuffer(ReplayConfig(enabled=True, capacity=64))
    buf.add(batch)
    tensors, meta = buf.state_dict()
    assert "image_grid_thw" not in {k.split(".")[-1] for k in tensors}
    back = ReplayBuffer(ReplayConfig(enabled=True, capacity=64))
    back.load_state_dict(tensors, meta)
    assert torch.equal(back.data.pixel_values, batch.pixel_values) and back.data.image_grid_thw is None


def test_several_pictures_per_row_go_where_the_image_mask_says(llava):
    """The episodes' layout (engines/multiturn.py: a prompt's picture, then an observation's further on): each row's
    pictures, in order, on the image tokens `image_mask` names; the log-probs equal transformers' own forward given
    the same pictures in the same order."""
    model, tok, path = llava
    proc = vision.image_processor(path)
    pics = [r["image"] for r in shapes.shapes_samples(3, heldout=False)]
    slot = tok(vision.image_tokens(proc, pics[0], {}), add_special_tokens=False)["input_ids"]
    assert slot == [model.config.image_token_id] * TOKENS
    text = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([text("ab") + slot + text("q?") + text("1") + slot + text("23"),
                        text("cd") + slot + text("r?") + text("4") + slot + text("56")])       # (2, T)
    C = 1 + TOKENS + 2                                                                          # the "completion"
    mask = ids == model.config.image_token_id                                                  # (2, T)
    images = vision.episode_images(proc, [[pics[0], pics[1]], [pics[2], pics[0]]], mask)
    assert images["pixel_values"].shape == (3, 3, 64, 64) and images["image_index"].tolist() == [[0, 1], [2, 0]]
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ours, _ = completion_logprobs(model, ids, attn, C, 1.0, images)
        own = model(input_ids=ids, attention_mask=attn, use_cache=False, position_ids=torch.arange(ids.shape[1])[None],
                    pixel_values=images["pixel_values"][images["image_index"].flatten()]).logits   # (2, T, V)
        swapped = {**images, "image_index": images["image_index"].flip(-1)}                     # pictures reordered
        other, _ = completion_logprobs(model, ids, attn, C, 1.0, swapped)
    own = own[:, -C - 1:-1].log_softmax(-1).gather(-1, ids[:, -C:, None])[..., 0]              # (2, C)
    assert (ours - own).abs().max() < 1e-4
    assert (other - ours)[:, -2:].abs().max() > 1e-4            # the tokens after the second picture read it


def test_the_loss_reaches_the_language_model_and_the_encoder_stays_frozen(llava, rollout):
    """GRPO's loss: gradient on the completion's log-probs only, into the language model and its head; the tower
    and the projector (the encoder, vision.encoder) none; with train_tower they get one."""
    model, _, _ = llava
    ro, images, _ = rollout
    b = batch_of(ro, images)
    cfg = AlgoConfig(name="grpo", max_new_tokens=4)
    algo = registry.get("algo", "grpo")
    b.advantages = algo.advantages(b, cfg)
    encoder = [p for m in vision.encoder(model) for p in m.parameters()]
    assert len(vision.encoder(model)) == 2 and all(not p.requires_grad for p in encoder)
    logp, entropy = completion_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask.shape[1], 1.0,
                                        b.images())
    logp.retain_grad()
    loss, _ = algo.loss({"logprobs": logp, "entropy": entropy}, b, cfg)
    model.zero_grad()
    loss.backward()
    assert (logp.grad[~b.completion_mask.bool()] == 0).all() and logp.grad.abs().sum() > 0
    assert all(p.grad is None for p in encoder)
    assert model.lm_head.weight.grad.abs().sum() > 0
    try:   # vision.train_tower=true: the encoder's parameters take gradient
        for p in encoder:
            p.requires_grad_(True)
        logp, _ = completion_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask.shape[1], 1.0, b.images())
        model.zero_grad()
        (logp * b.completion_mask).sum().backward()
        for m in vision.encoder(model):
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters()), type(m).__name__
    finally:
        vision.freeze_tower(model, train_tower=False)
        model.zero_grad(set_to_none=True)


def run_args(path, out, *extra) -> list[str]:
    return ["--config", "configs/vision.yaml", f"model={path}", "eval_size=4", "eval_every=100", "prompts_per_step=2",
            "samples_per_prompt=4", "threads=1", f"out_dir={out}", "progress=false", "rewards=test_llava_parity", *extra]


def test_train_py_runs_grpo_with_replay_and_resume_on_a_llava(llava_dir, tmp_path, capsys):
    """Two GRPO steps of task=shapes (replay, micro-batches, a checkpoint after step 1 and a resume from it): the
    engine's log-probs are the trainer's, the language model moved, the encoder is the base's bit for bit, and
    final/ holds the processor and loads."""
    out = tmp_path / "run"
    common = ["replay.enabled=true", "micro_batch_size=4", "save_every=1", "lr=1e-2"]
    train_here(run_args(llava_dir, out, "steps=1", *common))
    train_here(run_args(llava_dir, out, "steps=2", *common))
    assert "resuming from" in capsys.readouterr().out
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["logprob_mismatch/max"] < 1e-4, rows
    # measured on the first mini-batch's fresh samples: with replay, step 2's may hold none (then absent)
    assert all(r["logprob_mismatch/max"] < 1e-4 for r in rows if "logprob_mismatch/max" in r)
    assert (out / "final" / "processor_config.json").exists()
    base, final = load_file(os.path.join(llava_dir, "model.safetensors")), load_file(out / "final" / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], final[k])}
    assert changed and all("language_model" in k or k.startswith("lm_head") for k in changed), sorted(changed)[:4]
    model, _ = load_model(str(out / "final"), torch.device("cpu"), torch.float32)
    assert vision.family(model) is vision.Llava


def test_lora_adapts_the_language_model_only(llava_dir, tmp_path):
    """lora.r=4 (all-linear): adapters on the language model's layers only, none on the tower or the projector."""
    out = tmp_path / "run"
    train_here(run_args(llava_dir, out, "steps=2", "lora.r=4", "lr=1e-2"))
    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert adapter and all("language_model" in k for k in adapter), sorted(adapter)[:4]
    assert not any("vision_tower" in k or "multi_modal_projector" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if ".lora_B" in k)          # the adapters learned


def test_a_vlm_of_an_unknown_layout_is_refused_in_one_line(llava_dir, tmp_path):
    """Before any work (only config.json is read): a VLM family vision.py does not know, and the paths a LLaVA does
    not take yet (engine=vllm, FSDP), each a one-line error."""
    import run_setup
    from transformers import PaliGemmaConfig
    other = tmp_path / "paligemma"
    PaliGemmaConfig().save_pretrained(other)
    with pytest.raises(UserError) as e:
        run_setup.prepare([f"model={other}", "task=shapes", "rewards=vision", f"out_dir={tmp_path / 'a'}"])
    assert "'paligemma'" in str(e.value) and "qwen2_vl, qwen2_5_vl, llava" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="engine=vllm with a llava model"):
        run_setup.prepare([f"model={llava_dir}", "task=shapes", "rewards=vision", "engine=vllm",
                           f"out_dir={tmp_path / 'b'}"])
    cfg = replace(run_setup.prepare([f"model={llava_dir}", "task=shapes", "rewards=vision",
                                     f"out_dir={tmp_path / 'c'}"])[0], parallel="fsdp")
    with pytest.raises(ValueError, match="parallel=fsdp with a llava model"):
        vision.check_config(cfg, world=2)
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl, llava"):
        vision.family_of_config(PaliGemmaConfig())
    from transformers import Qwen2Config          # rows with pictures for a text model: said, not a processor's error
    Qwen2Config().save_pretrained(tmp_path / "text")
    with pytest.raises(ValueError, match="is a text model"):
        vision.image_processor(str(tmp_path / "text"))
