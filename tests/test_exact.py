"""exact_logprobs (engines/exact.py, docs/exact.md): the engine's sampled log-probs equal the trainer's bit for bit.

Unit tests on conftest's random 2-layer GQA model (a second each), the same check through train.py on the shipped
models (single-turn, multi-turn hilo, LoRA; a few seconds each), the option's refusals, and a GPU test (bf16,
the graphed decode step) skipped without CUDA."""
import json
import os

import pytest
import torch

import engines.exact as exact
from config import Config, UserError
from engines.base import SamplingParams
from engines.builtin import BuiltinEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rowwise_gives_a_row_the_same_bits_whatever_the_batch_and_wherever_the_row_sits(monkeypatch):
    monkeypatch.setattr(exact, "ROWS", 32)       # several chunks, the last one padded
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(150, 96, generator=g), torch.randn(80, 96, generator=g)
    full = exact.rowwise(lambda c: torch.nn.functional.linear(c, w), x)                 # (150, 80)
    pick = torch.tensor([149, 3, 77, 64, 0])
    for rows in (pick, pick[:1], torch.arange(150).flip(0)):
        assert torch.equal(exact.rowwise(lambda c: torch.nn.functional.linear(c, w), x[rows]), full[rows])


def prompts():
    return [[2, 3, 4, 5, 6, 7, 8], [9, 10], [4, 4, 4, 4, 11], [5], [6, 7, 8, 9, 10, 11, 12, 13, 2]]


def generate(model, n=3, max_new=12, seed=0):
    engine = BuiltinEngine(model, eos_id=1, pad_id=0, exact=True)
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    return engine.generate(prompts(), n, SamplingParams(temperature=0.9, max_new_tokens=max_new), g)


def trainer_logprobs(model, r, order, splits=2):
    """The trainer's log-probs of rollout r, its rows in another order and micro-batches, each re-padded wider."""
    C, out = r.completion_mask.shape[1], torch.zeros_like(r.logprobs)
    for rows in order.chunk(splits):
        ids, mask = r.input_ids[rows], r.attention_mask[rows]
        ids, mask = (torch.cat([torch.zeros_like(t[:, :3]), t], 1) for t in (ids, mask))
        dev = next(model.parameters()).device
        with torch.no_grad():   # the GPU path gives values only (kernels/exact_gemm.py)
            out[rows] = exact.completion_logprobs(model, ids.to(dev), mask.to(dev), C, 0.9)[0].float().cpu()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_logprobs_equal_the_trainers_in_any_batch(random_model_dir, dtype, monkeypatch):
    from models import load_model
    monkeypatch.setattr(exact, "BLOCK", 8)     # several key blocks within the model's 64 positions
    model, _ = load_model(random_model_dir, torch.device("cpu"), dtype)
    r = generate(model)
    m = r.completion_mask.bool()
    assert m.sum() > 20 and r.completion_mask.shape[1] > 3
    got = trainer_logprobs(model, r, torch.randperm(len(m), generator=torch.Generator().manual_seed(1)))
    assert torch.equal(got[m], r.logprobs[m])
    # and the forward is the model: its log-probs are transformers' up to rounding
    from models import completion_logprobs
    ref = completion_logprobs(model, r.input_ids, r.attention_mask, m.shape[1], 0.9)[0].detach().float()
    assert (ref[m] - r.logprobs[m]).abs().max() < (1e-4 if dtype == torch.float32 else 0.1)


def test_lora_adapters_reach_both_sides(random_model_dir, monkeypatch):
    monkeypatch.setattr(exact, "BLOCK", 8)
    import lora
    from config import LoRAConfig
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cpu"), torch.float32)
    model = lora.wrap(model, LoRAConfig(r=4), random_model_dir)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)                     # peft starts B at zero: the adapters would add nothing
    r = generate(model, n=2, max_new=8)
    m = r.completion_mask.bool()
    assert torch.equal(trainer_logprobs(model, r, torch.arange(len(m)).flip(0))[m], r.logprobs[m])
    lp = exact.completion_logprobs(model, r.input_ids, r.attention_mask, m.shape[1], 0.9)[0]
    lp[m].sum().backward()                             # the gradient reaches the adapters
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("key,value", [("engine", "vllm"), ("engine_lag", 1), ("top_k", 2),
                                       ("logprobs_mode", "processed"),
                                       ("top_p", 0.9), ("engine_dtype", "bfloat16"), ("max_staleness", 1)])
def test_the_option_is_refused_where_exactness_cannot_hold(key, value):
    cfg = Config()
    cfg.exact_logprobs, cfg.mode = True, "async"        # async itself is fine at max_staleness=0
    setattr(cfg, key, value)
    if key != "max_staleness":
        cfg.max_staleness = 0
    with pytest.raises(UserError, match=f"exact_logprobs=true needs .*{key.split('_')[0]}"):
        exact.check_config(cfg)


def test_a_model_outside_the_families_is_refused_by_name(tmp_path):
    cfg = Config()
    cfg.exact_logprobs, cfg.max_staleness = True, 0
    exact.check_config(cfg)                              # the shipped model: a covered family
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "granite"}))
    cfg.model = str(tmp_path)
    with pytest.raises(UserError, match="covers the model families qwen2, llama.*qwen3_moe; .* is 'granite'"):
        exact.check_config(cfg)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe"])
def test_other_families_sliding_windows_and_routed_experts(family, monkeypatch):
    """gemma3 (sliding and global layers, soft-capped logits, its norms) and qwen3_moe (routed experts): the
    engine's log-probs equal the trainer's bits, and transformers' forward up to rounding."""
    from test_architectures import tiny_model
    monkeypatch.setattr(exact, "BLOCK", 8)     # the tiny models' windows (4) cross key blocks
    model = tiny_model(family)
    r = generate(model, n=2, max_new=10)
    m = r.completion_mask.bool()
    assert torch.equal(trainer_logprobs(model, r, torch.arange(len(m)).flip(0))[m], r.logprobs[m])
    from models import completion_logprobs
    ref = completion_logprobs(model, r.input_ids, r.attention_mask, m.shape[1], 0.9)[0].detach().float()
    assert (ref[m] - r.logprobs[m]).abs().max() < 1e-4


def _fsdp_rank(rank: int, world: int, port: int, model_dir: str, out: str):
    """One of two forked ranks: the engine (a plain copy) samples; the FSDP2-sharded trainer recomputes the same
    log-probs, and its gradient equals the plain model's."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import distributed
    from models import load_model
    distributed.init()
    plain, _ = load_model(model_dir, torch.device("cpu"), torch.float32)
    sharded, _ = load_model(model_dir, torch.device("cpu"), torch.float32)
    distributed.shard(sharded, torch.device("cpu"), torch.float32)
    r = generate(plain, n=2, max_new=8)                  # the same seed on both ranks: the same samples
    m = r.completion_mask.bool()
    got = exact.completion_logprobs(sharded, r.input_ids, r.attention_mask, m.shape[1], 0.9)[0]
    assert torch.equal(got.detach()[m], r.logprobs[m])
    got[m].sum().backward()
    exact.completion_logprobs(plain, r.input_ids, r.attention_mask, m.shape[1], 0.9)[0][m].sum().backward()
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7, msg=name)
    open(f"{out}.{rank}", "w").write("ok")


def test_fsdp2_trainer_on_two_ranks_equals_the_engine(tmp_path, random_model_dir, monkeypatch):
    """FSDP2 under gloo with 2 ranks (forked from this process: no second import of torch): the sharded trainer's
    log-probs equal the engine's bit for bit and its gradients reach every shard as one process computes them."""
    import multiprocessing
    import socket
    monkeypatch.setattr(exact, "BLOCK", 8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_fsdp_rank, args=(r, 2, port, random_model_dir, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0] and all(os.path.exists(f"{out}.{r}") for r in range(2))


# two micro-batches each (32, 32 and 8 samples a step)
@pytest.mark.parametrize("extra", [["algo.epochs=2", "algo.tis=token", "micro_batch_size=16"],
                                   ["lora.r=4", "lr=1e-2", "micro_batch_size=16"],
                                   ["--config", os.path.join(ROOT, "configs/multiturn.yaml"), "samples_per_prompt=2",
                                    f"model={os.path.join(ROOT, 'assets/hilo-model')}", "micro_batch_size=4"]],
                         ids=["single", "lora", "hilo"])
def test_a_training_run_has_zero_mismatch_at_every_step(tmp_path, extra):
    import train
    threads = torch.get_num_threads()
    try:   # in this process: a subprocess would import torch and transformers again (most of its time)
        # micro-batches: past the first, each reads the engine's log-probs until an optimizer step (update.py)
        train.main([*extra, "exact_logprobs=true", "steps=3", "prompts_per_step=4", "eval_every=100", "eval_size=4",
                    "threads=1", "progress=false", f"out_dir={tmp_path}"])
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > 0]
    assert len(steps) == 3 and all(row["logprob_mismatch/max"] == 0.0 for row in steps), steps
    if "algo.tis=token" in extra:   # a second epoch weighs by old (trainer) over sample (engine) log-probs: equal bits
        assert all(row["tis_weight"] == 1.0 for row in steps), steps
    if "hilo" in str(extra):
        assert all(row["episode/turns"] > 1 and row["tokens/out_of_loss"] > 0 for row in steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_graphed_decode_equals_the_trainer(random_model_dir):
    from models import load_model
    model, _ = load_model(random_model_dir, torch.device("cuda"), torch.bfloat16)
    r = generate(model, n=8, max_new=20)
    m = r.completion_mask.bool()
    got = trainer_logprobs(model, r, torch.randperm(len(m), generator=torch.Generator().manual_seed(2)), splits=3)
    assert torch.equal(got[m], r.logprobs[m])
