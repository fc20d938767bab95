"""memory_budget_gib (memory.py): the prediction against the peaks measured on H100s (docs/memory.md), the
chooser's decisions at the 0.5B and 7B shapes (configs only, no weights), its order, its errors, and a tiny run."""
import json
import math
import os

import pytest
from transformers import Qwen2Config

import memory
import registry
from config import Config, UserError
from config_checks import validate

GiB = 2**30
W1 = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)     # Qwen2.5-0.5B
B15 = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)    # Qwen2.5-1.5B
W6 = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)    # Qwen2.5-7B


def config(prompts: int, **settings) -> Config:
    """The benchmarks' batch (prompts x 8 samples, 64 + 256 tokens) with dotted settings."""
    cfg = Config(prompts_per_step=prompts, samples_per_prompt=8, max_new_tokens=256)
    for key, value in settings.items():
        *path, last = key.split("__")
        section = cfg
        for part in path:
            section = getattr(section, part)
        setattr(section, last, value)
    return cfg


def shape(mc, cfg) -> memory.Shape:
    return memory.Shape.of(mc, 64, cfg, 1, 2)   # bf16, prompts of 64 tokens


def grpo():
    return registry.get("algo", "grpo")


# (measured GiB by stage, docs/memory.md's table: docs/speed.md and docs/lora.md, one H100 80GB HBM3 each)
MEASURED = [
    (W1, config(16, compile=True), 32, True, False, {"update": 5.31}),
    (W1, config(16, compile=True), 64, False, False, {"update": 23.3}),
    (W6, config(8, lora__r=16), 8, False, False, {"rollout": 28.86, "update": 36.69}),
    (W6, config(8, lora__r=16), 32, True, False, {"rollout": 28.9, "update": 21.2}),
    (B15, config(8, algo__kl_coef=0.05), 16, True, True, {"rollout": 14.3, "logprobs": 13.0, "update": 15.7}),
    (B15, config(8, algo__kl_coef=0.05, offload_models=True, offload_optimizer=True), 16, True, True,
     {"rollout": 5.6, "logprobs": 7.3, "update": 7.1}),
]


@pytest.mark.parametrize("mc, cfg, micro, ckpt, ref, measured", MEASURED)
def test_prediction_is_within_a_third_of_a_gib_of_every_measured_peak(mc, cfg, micro, ckpt, ref, measured):
    got = memory.predict(shape(mc, cfg), cfg, micro, ckpt, ref, logprobs=ref)
    for stage, gib in measured.items():
        assert abs(got[stage] / GiB - gib) < 0.35, (stage, got[stage] / GiB, gib)


def decide(mc, cfg, budget: float) -> tuple[int, bool]:
    cfg.memory_budget_gib = budget
    line = memory.apply_budget(cfg, shape(mc, cfg), grpo())
    assert line.startswith(f"memory_budget_gib={budget:g}: micro_batch_size={cfg.micro_batch_size}") and "update" in line
    return cfg.micro_batch_size, cfg.grad_checkpointing


def test_decisions_at_the_half_b_and_7b_shapes():
    # W1 against TRL's two peaks (docs/benchmarks.md): 5.32 GiB with its checkpointing, 19.1 GiB without
    assert decide(W1, config(16, compile=True), 5.32) == (32, True)       # today's hand-picked setting
    assert decide(W1, config(16, compile=True), 19.1) == (32, False)      # no recompute: 13.4 GiB predicted
    assert decide(W1, config(16, compile=True), 24) == (64, False)
    assert decide(W1, config(16, compile=True), 80) == (0, False)         # the whole batch of 128 in one pass
    assert decide(W6, config(8, lora__r=16), 40) == (8, False)            # W6's measured fastest (36.7 GiB)
    assert decide(W6, config(8, lora__r=16, decode_weights="in_place"), 24) == (32, True)   # copies gone: 17 GiB
    # the user's own value is kept; the budget chooses the other
    assert decide(W1, config(16, compile=True, grad_checkpointing=True), 19.1) == (0, True)
    assert decide(W1, config(16, compile=True, micro_batch_size=16), 5.32) == (16, True)


@pytest.mark.parametrize("mc, cfg", [(W1, config(16, compile=True)), (W6, config(8, lora__r=16)),
                                     (B15, config(8, algo__kl_coef=0.05))])
def test_a_bigger_budget_never_picks_a_slower_setting(mc, cfg):
    s, last = shape(mc, cfg), math.inf
    for budget in [x / 4 for x in range(4, 4 * 200)]:
        cfg.micro_batch_size, cfg.grad_checkpointing = 0, False
        try:
            m, c = decide(mc, cfg, budget)
        except UserError:
            continue
        assert memory.seconds(s, m, c, cfg.compile) <= last
        last = memory.seconds(s, m, c, cfg.compile)
    assert last < math.inf


def test_too_small_a_budget_is_one_line_naming_the_floor():
    with pytest.raises(UserError, match=r"under the static floor of 3\.7 GiB \(weights 0\.9 \+ gradients 0\.9 \+ "
                                        r"AdamW state 1\.8\)"):
        decide(W1, config(16), 3)
    with pytest.raises(UserError, match="the rollout stage alone is predicted at 28.8 GiB"):
        decide(W6, config(8, lora__r=16), 20)
    with pytest.raises(UserError, match="micro_batch_size=64 grad_checkpointing=true"):   # both set: checked only
        decide(W1, config(16, micro_batch_size=64, grad_checkpointing=True), 5)
    cfg = config(16, memory_budget_gib=20.0)
    cfg.algo.name = "ppo"
    with pytest.raises(UserError, match="memory_budget_gib predicts one process"):
        validate(cfg)
    cfg = config(16, memory_budget_gib=-1.0)
    with pytest.raises(UserError, match="'memory_budget_gib' must be >= 0"):
        validate(cfg)


def test_tiny_run_with_a_budget_runs_with_the_chosen_settings(tmp_path, monkeypatch, capsys):
    """A budget (~10 MB) that forces micro-batches on the shipped tiny model, recompute set by the user: the run logs
    the choice, runs with it (config.yaml, which a resume reads, holds it) and trains. Micro-batching and recompute
    are exact (tests/test_microbatch.py, test_train.py), so these are the numbers of those settings set by hand.
    The decoder's workspace is a GPU figure (0.9 GiB): 0 here."""
    import train
    import yaml
    monkeypatch.setattr(memory, "DECODE_WORK", 0)
    out = tmp_path / "budget"
    train.main([f"out_dir={out}", "memory_budget_gib=0.0095", "grad_checkpointing=true", "steps=2",
                "prompts_per_step=4", "samples_per_prompt=4", "eval_every=100", "eval_size=4", "reward_workers=1",
                "arithmetic.n_train=200", "arithmetic.n_eval=20", "threads=1", "progress=false"])
    assert ("memory_budget_gib=0.0095: micro_batch_size=2 grad_checkpointing=true (grad_checkpointing as set); "
            "predicted peak GiB: rollout 0.01, update 0.01" in capsys.readouterr().out)
    saved = yaml.safe_load(open(out / "config.yaml"))
    assert (saved["micro_batch_size"], saved["grad_checkpointing"], saved["memory_budget_gib"]) == (2, True, 0.0095)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")][1:]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)


def test_the_gpu_tool_reads_the_log_line():
    """tools/gpu_memory.py puts the prediction beside the measured peaks by parsing apply_budget's line."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import gpu_memory
    cfg = config(16, compile=True, memory_budget_gib=19.1)
    line = memory.apply_budget(cfg, shape(W1, cfg), grpo())
    got = gpu_memory.predicted(f"step 0\n{line}\nmore")
    assert got["budget_choice"] == "micro_batch_size=32 grad_checkpointing=false"
    assert set(got["predicted_gib"]) == {"rollout", "update"} and 13 < got["predicted_gib"]["update"] < 14
