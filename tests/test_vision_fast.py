"""Prompts with pictures on the built-in engine's fast path (engines/fast_decode.py over a Qwen2-VL's text decoder,
engines/families.py `text_decoder`): the prefill takes the pictures' embeddings (vision.embed) and M-RoPE positions
(vision.positions), the decode after it is text. On the CPU the step runs eagerly; the CUDA test graphs and
compiles it as train.py's rollouts do (tools/gpu_tests.sh finds it by its skip marker)."""
import io

import pytest
import torch

import vision
from engines.base import SamplingParams, left_pad
from engines.builtin import BuiltinEngine
from engines.families import _mrope, mrope_rotation, rotary_tables, text_decoder
from engines.fast_decode import FastDecoder, supported
from models import completion_logprobs

PAD, EOS, START, IMG, END, VOCAB = 0, 1, 2, 3, 4, 48
SIDE = 64   # pictures resized to 64 x 64: 8 x 8 patches of 8, merged 2 x 2: 16 image tokens in a 4 x 4 grid


def image_processor():
    try:   # transformers >= 5.2x names the PIL processor apart; older ones (the GPU image's) call it the default
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:
        from transformers import Qwen2VLImageProcessor as cls
    return cls(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE)


def tiny_vlm(kind: str = "qwen2_vl", seed: int = 0):
    """A random Qwen2-VL or Qwen2.5-VL (text: 2 layers, 2 query heads and 1 KV head of 32, M-RoPE sections 4/6/6),
    float32, with random norms and biases (a misplaced one shows), sharper attention (positions matter more) and
    logits scaled up (no near-ties between the two most likely tokens: greedy tokens are stable under float noise)."""
    import transformers
    special = dict(eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=256, **special,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    patches = dict(patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
    if kind == "qwen2_vl":
        config, cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        tower = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, **patches)
    else:   # windowed attention in the tower but its last block
        config, cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        tower = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, window_size=16,
                     fullatt_block_indexes=[1], **patches)
    cfg = config(text_config=text, vision_config=tower, image_token_id=IMG, vision_start_token_id=START,
                 vision_end_token_id=END, tie_word_embeddings=True, **special)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith(("q_proj.weight", "k_proj.weight")) and "language_model" in name:
                p.mul_(3.0)
        model.model.language_model.norm.weight.mul_(8.0)
    vision.freeze_tower(model, train_tower=False)
    return model


def prompts(seed: int = 0) -> list:
    """Three prompts of different lengths (left padding), text before and after a picture of noise each."""
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    proc, out = image_processor(), []
    for before, after in ((2, 3), (7, 1), (1, 9)):
        text = lambda k: torch.randint(5, VOCAB, (k,), generator=g).tolist()
        pixels = torch.randint(0, 256, (SIDE, SIDE, 3), generator=g, dtype=torch.uint8).numpy()
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        out.append(vision.ImagePrompt(text(before) + [START] + [IMG] * 16 + [END] + text(after), png.getvalue(), proc))
    return out


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "text_positions"])
def vlm(request):
    """M-RoPE's Qwen2-VL and Qwen2.5-VL, and a Qwen2-VL on the project's text positions (config text_positions:
    the shipped tiny VLM, tools/make_tiny_vlm.py)."""
    model = tiny_vlm(request.param.replace("text_positions", "qwen2_vl"))
    model.config.text_positions = request.param == "text_positions"
    return model


def rollout(model, fast: bool, sampling: SamplingParams, prompts_, n: int = 3, seed: int | None = 0, decoder=None):
    engine = BuiltinEngine(model, EOS, PAD, fast=fast)
    engine.decoder = decoder or (FastDecoder(model, use_graph=False, compile=False) if fast else None)
    g = None if seed is None else torch.Generator().manual_seed(seed)
    r = engine.generate(prompts_, n, sampling, g)
    assert (engine.decoder is not None) == fast                  # the path asked for ran
    return r


def teacher_gap(model, r, prompts_, n: int, temperature: float) -> float:
    """Largest |engine log-prob - teacher forcing's (the trainer's, with the pictures)| over completion tokens."""
    device = next(model.parameters()).device
    C = r.completion_mask.shape[1]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, r.input_ids.to(device), r.attention_mask.to(device), C, temperature,
                                      vision.batch_images(prompts_, n) or None)
    return ((logp.cpu() - r.logprobs).abs() * r.completion_mask).max().item()


def test_a_qwen2_vl_takes_the_fast_step_and_its_prompts_need_mrope(vlm):
    """The fast step covers the VLM's text decoder; the test prompts are ones where M-RoPE matters: a picture's
    rows and columns differ, and a row's next position (one past its largest) is not its token count. A model on
    text positions gets them, pictures or not."""
    assert supported(vlm)
    ps = prompts()
    ids, mask = left_pad([p for p in ps for _ in range(3)], PAD)
    pos = vision.positions(vlm, ids, mask, vision.batch_images(ps, 3))
    if vlm.config.text_positions:
        assert torch.equal(pos, (mask.cumsum(-1) - 1).clamp(min=0))
        return
    assert pos.shape == (3, *ids.shape) and not torch.equal(pos[1], pos[2])
    assert (pos.amax(dim=(0, 2)) + 1 < mask.sum(-1)).all()


def test_fast_step_with_pictures_samples_the_portable_loops_tokens(vlm):
    """Greedy (the in-graph sampler's path, top_p = 1) and sampled with top_p < 1 (both paths draw with
    torch.multinomial from one generator): the same tokens, EOS and padding; each group of 3 shares a picture."""
    ps = prompts()
    for sampling in (SamplingParams(temperature=1e-5, max_new_tokens=8),
                     SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)):
        fast, plain = rollout(vlm, True, sampling, ps), rollout(vlm, False, sampling, ps)
        assert torch.equal(fast.input_ids, plain.input_ids), sampling
        assert torch.equal(fast.completion_mask, plain.completion_mask)


def test_fast_step_with_pictures_logprobs_are_teacher_forcings(vlm):
    """The in-graph sampler at temperature 1 (other draws than the loop's): the log-probs it wrote are the trainer's
    teacher-forced ones with the pictures (float32). A text-only prompt on the same VLM too."""
    ps = prompts()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    r = rollout(vlm, True, sampling, ps)
    assert teacher_gap(vlm, r, ps, 3, 1.0) <= 1e-4
    assert (r.logprobs * r.completion_mask).sum() < 0                          # the log-probs were written
    text = [list(p) for p in ps]                                               # the same ids, no pictures
    t = rollout(vlm, True, sampling, text, n=2)
    assert teacher_gap(vlm, t, text, 2, 1.0) <= 1e-4


@pytest.mark.parametrize("weights", ["fused", "in_place"])
def test_fast_step_with_pictures_under_lora(weights):
    """lora.r=4 on the language model (peft over the VLM): the step merges or packs the adapters of the text
    decoder it runs (engines/decode_weights.py) and still samples the loop's tokens and teacher forcing's
    log-probs with the pictures."""
    import lora
    from config import LoRAConfig
    policy = lora.wrap(tiny_vlm(), LoRAConfig(r=4), "tiny-vlm")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # B starts at zero: give the adapters something to add
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=g)
    ps, top_p = prompts(), SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8)
    decoder = lambda: FastDecoder(policy, use_graph=False, compile=False, weights=weights)
    fast, plain = rollout(policy, True, top_p, ps, decoder=decoder()), rollout(policy, False, top_p, ps)
    assert torch.equal(fast.input_ids, plain.input_ids)
    r = rollout(policy, True, SamplingParams(temperature=1.0, max_new_tokens=10), ps, decoder=decoder())
    assert teacher_gap(policy, r, ps, 3, 1.0) <= 1e-4


def test_text_tokens_rotary_is_mropes_with_equal_positions(vlm):
    """After the prompt every token is text, its three M-RoPE positions equal: the model's own M-RoPE rotation is
    then the plain rotary table the decode step reads (cos and sin of position x the inverse frequencies), while
    unequal positions (a picture's tokens) give another."""
    S, D, text = 40, 32, text_decoder(vlm)
    cos, sin = rotary_tables(text, ["default"], S, D, "cpu", torch.float32)             # (1, S, D) each
    at = torch.arange(S)
    mcos, msin = mrope_rotation(text, at.expand(3, 1, S), torch.float32)                # (1, S, D) each
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)                          # (D/2,)
    angle = torch.cat([at[:, None] * inv] * 2, dim=-1)                                   # (S, D)
    for table, m, f in ((cos, mcos, torch.cos), (sin, msin, torch.sin)):
        assert torch.allclose(table[0], f(angle), atol=1e-6) and torch.allclose(m[0], f(angle), atol=1e-6)
    grid = torch.stack([at, at + 1, at + 2])[:, None]                                    # (3, 1, S): unequal
    gcos, gsin = mrope_rotation(text, grid, torch.float32)
    assert not torch.allclose(gcos[0], cos[0], atol=1e-3)
    # transformers before 5.2x: the module returns one table per axis (3, B, T, D), composed by sections here
    axes = torch.cat([grid[..., None] * inv] * 2, dim=-1)                                # (3, 1, S, D)
    old = _mrope((axes.cos(), axes.sin()), [4, 6, 6])
    assert torch.allclose(old[0], gcos, atol=1e-6) and torch.allclose(old[1], gsin, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_step_with_pictures_graphed_and_compiled_on_a_gpu():
    """As the CPU tests, with the step compiled and captured in a CUDA graph (train.py's rollouts on a GPU):
    greedy tokens equal the portable loop's, sampled log-probs equal teacher forcing's (float32; 2e-3 leaves room
    for TF32 matmuls on either side)."""
    model = tiny_vlm().cuda()
    ps = prompts()
    dec = FastDecoder(model)
    greedy = SamplingParams(temperature=1e-5, max_new_tokens=8)
    fast, plain = rollout(model, True, greedy, ps, seed=None, decoder=dec), rollout(model, False, greedy, ps, seed=None)
    assert dec.use_graph and dec.captured and dec._step != dec._forward       # graphed, and the compiled step
    assert torch.equal(fast.input_ids, plain.input_ids)
    r = rollout(model, True, SamplingParams(temperature=1.0, max_new_tokens=16), ps, seed=None, decoder=dec)
    assert teacher_gap(model, r, ps, 3, 1.0) <= 2e-3
    assert (r.logprobs * r.completion_mask).sum() < 0


def test_compile_true_compiles_a_vlms_language_layers(tmp_path, monkeypatch):
    """train.py's compile=true (run_setup.build_models) compiles each decoder layer; a Qwen2-VL keeps them under
    model.language_model (before: refused in one line). Here the compile is recorded, not run (a CPU compile costs
    tens of seconds); the GPU test below runs it."""
    import sys
    import torch._functorch.config
    import run_setup
    from config import Config
    sys.path.insert(0, "tools")
    from make_tiny_vlm import build
    _, model = build(str(tmp_path))
    model.save_pretrained(str(tmp_path))
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    budget = torch._functorch.config.activation_memory_budget
    try:
        policy, _, _ = run_setup.build_models(Config(model=str(tmp_path), compile=True), torch.device("cpu"),
                                              torch.float32, fsdp=False)
    finally:
        torch._functorch.config.activation_memory_budget = budget
    assert compiled == list(policy.model.language_model.layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_language_layers_with_pictures_match_eager_on_a_gpu():
    """compile=true on a VLM with grad_checkpointing's recompute inside each compiled layer (activation_memory_budget
    0, as run_setup.build_models sets it): log-probs with pictures and their gradients equal the eager model's."""
    import torch._functorch.config
    ps = prompts()
    ids, mask = [t.cuda() for t in left_pad([list(p) + [7, 8, 9] for p in ps for _ in range(2)], PAD)]   # (B, T)
    images = vision.batch_images(ps, 2)
    grads, logps, budget = [], [], torch._functorch.config.activation_memory_budget
    for compiled in (False, True):
        model = tiny_vlm().cuda().train()
        if compiled:
            torch._functorch.config.activation_memory_budget = 0.0
            for layer in model.model.language_model.layers:
                layer.compile()
        try:
            logp, _ = completion_logprobs(model, ids, mask, 3, 1.0, images)
            logp.sum().backward()
        finally:
            torch._functorch.config.activation_memory_budget = budget
        logps.append(logp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(logps[0], logps[1], atol=1e-3), (logps[0] - logps[1]).abs().max()
    assert torch.allclose(grads[0], grads[1], atol=1e-3, rtol=1e-3), (grads[0] - grads[1]).abs().max()
