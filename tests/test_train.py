"""Tier-2 smoke tests: train.py end to end, and every kind of bad input. The runs that need no process of their own
(neither killed nor signalled, nor read from the console) call train.main in the test process (conftest.train_here):
a subprocess would spend most of a small run's time importing torch again."""
import json
import os
import subprocess
import sys

import pytest
from conftest import script_here, step_rows, train_here  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_few_steps(tmp_path, random_model_dir):
    out = tmp_path / "run"
    train_here([f"model={random_model_dir}", "steps=3", "eval_every=2", "eval_size=16", "prompts_per_step=4",
                f"out_dir={out}", "algo.kl_coef=0.05", "progress=false"])   # kl on: the reference-model path runs too
    rows = step_rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])   # the evaluation before training
    assert first["step"] == 0 and set(first) == {"step", "eval/accuracy", "eval/reward"}
    assert all({"step", "reward", "loss", "kl"} <= row.keys() for row in rows)
    assert "eval/accuracy" in rows[1] and "eval/accuracy" in rows[2] and "eval/accuracy" not in rows[0]
    for name in ["config.yaml", "curve.png", "final/config.json", "final/model.safetensors"]:
        assert (out / name).exists(), name
    assert any(p.name.startswith("events.out.tfevents") for p in out.iterdir())
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out / "final")               # the saved policy loads


def test_compiled_layers_train_like_eager(tmp_path, random_model_dir):
    """compile=true changes speed, not the maths: the same seeded run gives the same losses and gradients, with
    the recompute inside the compiled layers (the default) and with transformers' checkpoint wrapper."""
    import torch
    rows = {}
    try:
        for name, flags in {"eager": ["compile=false"], "compiled": ["compile=true"],
                            "wrapper": ["compile=true", "compiled_recompute=false"]}.items():
            out = tmp_path / name
            train_here([f"model={random_model_dir}", "steps=2", "eval_size=8", "prompts_per_step=4", "threads=1",
                        "micro_batch_size=8", "grad_checkpointing=true", *flags, f"out_dir={out}", "progress=false"])
            rows[name] = step_rows(out)
    finally:   # the layers' compiled code leaves this process's caches: later tests compile from scratch
        torch._dynamo.reset()
    for other in ("compiled", "wrapper"):
        for a, b in zip(rows["eager"], rows[other]):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and a["reward"] == b["reward"], other


def test_fused_loss_trains_like_autograd(tmp_path):
    """fused_loss=true end to end (micro-batches, KL to the reference): same losses and gradient norms."""
    rows = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        train_here(["steps=2", "eval_size=8", "prompts_per_step=8", "threads=1",   # the shipped model: rewards vary
                    "micro_batch_size=8", "algo.kl_coef=0.05", f"fused_loss={flag}", f"out_dir={out}", "progress=false"])
        rows[flag] = step_rows(out)
    assert rows["false"][0]["grad_norm"] > 1e-2                     # a real gradient, not rounding noise
    for a, b in zip(rows["false"], rows["true"]):
        for key in ("loss", "grad_norm", "kl", "reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key


def test_help_lists_options():
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "algo.kl_coef=" in r.stdout and "max_new_tokens=" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["algo.name=nope"], "unknown algo 'nope'; known: "),
    (["rewards=nope"], "unknown reward 'nope'; known: "),
    (["stepz=3"], "unknown config key 'stepz'"),
    (["steps=many"], "config key 'steps' expects int"),
    (["model=./no/such/model"], "model './no/such/model' is not a folder here or in the repository"),
    (["arithmetic.n_train=0"], "config key 'arithmetic.n_train' must be >= 1; got 0"),
    (["arithmetic.digits=1", "arithmetic.n_train=1000"], "task 'arithmetic': asked for 1000 distinct train problems"),
    (["max_new_tokens=60"], "exceeds the model's context of 64 tokens"),
    (["task=nope"], "unknown task 'nope'; known: "),
    (["algo.name=online_dpo", "micro_batch_size=8"], "has no exact split over micro-batches or ranks"),
    (["algo.name=ppo", "fused_loss=true"], "fused_loss=true needs a loss that splits over rows and no critic"),
    (["algo.name=ppo", "micro_batch_size=2"], "algo 'ppo' with these settings has no exact split"),
    (["steps=[1"], "config key 'steps': '[1' is not valid YAML"),                  # the rest: tests/test_bad_input.py
    (["micro_batch_size=3"], "micro_batch_size=3 must divide the mini-batch of 256 samples"),
    (["accuracy_reward=format"], "accuracy_reward 'format' is not one of the rewards (arithmetic)"),
])
def test_bad_input_is_one_line_error(args, message, random_model_dir, tmp_path):
    # train.py's own __main__ block in this process (conftest.script_here): a subprocess's time would be nearly all
    # imports; test_help_lists_options and the runs above start train.py as a process of its own
    r = script_here("train.py", [f"model={random_model_dir}", f"out_dir={tmp_path / 'run'}", *args, "progress=false"])
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], r.stderr[-2000:]


def test_default_run_improves_heldout_accuracy(tmp_path, capsys):
    """Tier 3: a short seeded run of the embedded default (shipped model, default config) must learn.
    The full 60-step default goes 0.195 -> ~0.78; 15 steps reach ~0.6. The threshold is loose on purpose."""
    out = tmp_path / "run"
    capsys.readouterr()
    train_here(["steps=15", "eval_every=15", "eval_size=100", f"out_dir={out}", "threads=1", "progress=false"])
    rows = step_rows(out)
    start = float(capsys.readouterr().out.split("step 0: held-out accuracy ")[1].split()[0])
    end = rows[-1]["eval/accuracy"]
    assert start < 0.35 and end >= start + 0.2, (start, end)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_saves_and_prints_the_resume_command(sig, tmp_path, random_model_dir):
    """Ctrl-C (or a scheduler's SIGTERM) mid-run: the step ends, a checkpoint is written, one line says how to go on,
    no traceback; the same command then resumes from that checkpoint."""
    import signal
    import time
    out = tmp_path / "run"
    args = [f"model={random_model_dir}", "steps=500", "eval_every=500", "eval_size=4", "prompts_per_step=2",
            f"out_dir={out}", "progress=false"]
    p = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").exists() or '"step": 1,' not in (out / "metrics.jsonl").read_text():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.2)
    p.send_signal(getattr(signal, sig))
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {sig} after step ") and last.endswith(f"To continue: python train.py "
                                                                             f"resume={out}")
    step = int(last.split("after step ")[1].split(";")[0])
    assert (out / "checkpoints" / f"step_{step:06d}" / "meta.json").exists()
    assert [r["step"] for r in step_rows(out)] == list(range(1, step + 1))
    import checkpoint
    import config
    assert checkpoint.resolve_resume(config.parse(args), args)[1] == str(out / "checkpoints" / f"step_{step:06d}")
