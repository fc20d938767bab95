"""Every bad input is a one-line error that names the option (or file) and what would be valid, raised before any
work: option ranges and batch splits (config_checks.validate), YAML syntax, model folders, the run directory, damaged
checkpoints. In process (config_checks.validate, run_dir.check, checkpoint.resolve_resume): no train.py subprocess."""
import json
import os

import pytest
import torch

import checkpoint
import config
import config_checks
import models
import registry
import run_dir
from buffer import OnPolicyBuffer
from config import UserError


def check(*overrides, world: int = 1):
    """parse -> fill_defaults -> validate, as train.main does."""
    config_checks.validate(config.fill_defaults(config.parse(list(overrides))), world)


def one_line_error(fn, *args, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


# (overrides, the exact message): the table in the closing note of issue #19 is this list
RANGES = [
    (["lr=0"], "config key 'lr' must be a finite number > 0; got 0.0"),
    (["lr=nan"], "config key 'lr' must be a finite number > 0; got nan"),
    (["temperature=0"], "config key 'temperature' must be > 0; got 0.0"),
    (["top_p=0"], "config key 'top_p' must be in (0, 1]; got 0.0"),
    (["top_p=1.5"], "config key 'top_p' must be in (0, 1]; got 1.5"),
    (["samples_per_prompt=0"], "config key 'samples_per_prompt' must be >= 1; got 0"),
    (["prompts_per_step=0"], "config key 'prompts_per_step' must be >= 1; got 0"),
    (["max_new_tokens=0"], "config key 'max_new_tokens' must be >= 1; got 0"),
    (["steps=0"], "config key 'steps' must be >= 1; got 0"),
    (["eval_every=0"], "config key 'eval_every' must be >= 1; got 0"),
    (["reward_workers=0"], "config key 'reward_workers' must be >= 1; got 0"),
    (["reward_timeout_s=0"], "config key 'reward_timeout_s' must be > 0 (seconds); got 0.0"),
    (["threads=-1"], "config key 'threads' must be >= 0 (0 = torch's default); got -1"),
    (["keep_checkpoints=-1"], "config key 'keep_checkpoints' must be >= 0 (0 = keep all); got -1"),
    (["micro_batch_size=-1"], "config key 'micro_batch_size' must be >= 0 (0 = the whole mini-batch in one pass); "
                              "got -1"),
    (["algo.epochs=0"], "config key 'algo.epochs' must be >= 1; got 0"),
    (["eval_size=-1"], "config key 'eval_size' must be >= 0 (0 = every held-out prompt); got -1"),
    (["algo.dapo.max_rounds=0"], "config key 'algo.dapo.max_rounds' must be >= 1; got 0"),
    (["micro_batch_size=3"], "micro_batch_size=3 must divide the mini-batch of 256 samples: one of 1, 2, 4, 8, 16, "
                             "32, 64, 128, or 0 / >= 256 (one pass)"),
    (["algo.minibatch_size=100"], "algo.minibatch_size=100 must split the batch of 256 samples (prompts_per_step x "
                                  "samples_per_prompt) into whole groups of 8: one of 8, 16, 32, 64, 128, 256, or 0 "
                                  "(the whole batch)"),
    (["algo.minibatch_size=6", "samples_per_prompt=4", "prompts_per_step=6"],
     "algo.minibatch_size=6 must split the batch of 24 samples (prompts_per_step x samples_per_prompt) into whole "
     "groups of 4: one of 4, 8, 12, 24, or 0 (the whole batch)"),
    (["algo.minibatch_size=64", "micro_batch_size=24"], "micro_batch_size=24 must divide the mini-batch of 64 "
                                                        "samples: one of 1, 2, 4, 8, 16, 32, or 0 / >= 64 (one pass)"),
    (["samples_per_prompt=1"], "algo 'grpo' compares the samples of one prompt (a group baseline or a pair): "
                               "samples_per_prompt must be >= 2; got 1"),
    (["device=tpu9"], "config key 'device' must be auto, cpu, cuda or cuda:N; got 'tpu9'"),
]


@pytest.mark.parametrize("overrides, message", RANGES, ids=[" ".join(o) for o, _ in RANGES])
def test_out_of_range_values_are_one_line_errors(overrides, message):
    assert one_line_error(check, *overrides) == message


def test_the_defaults_and_the_documented_zeros_pass():
    check()
    check("threads=0", "keep_checkpoints=0", "micro_batch_size=0", "eval_size=0", "algo.minibatch_size=0")
    check("micro_batch_size=64", "algo.minibatch_size=64")   # divides
    check("micro_batch_size=512")                            # larger than the mini-batch: one pass, as 0
    check("algo.name=reinforce_pp", "samples_per_prompt=1")  # no group baseline: one sample per prompt is fine
    check("algo.name=ppo", "samples_per_prompt=1")


def test_splits_are_checked_per_rank():
    # 2 ranks: 128 samples each; a mini-batch of 64 is 32 per rank, in whole groups of 8
    check("algo.minibatch_size=64", "micro_batch_size=16", world=2)
    assert one_line_error(check, "algo.minibatch_size=8", world=2).startswith(
        "algo.minibatch_size=8 must split the batch of 256 samples (prompts_per_step x samples_per_prompt) into "
        "whole groups of 8 on each of 2 ranks: one of 16, 32, 64, 128, 256")
    assert "mini-batch of 128 samples on each rank" in one_line_error(check, "micro_batch_size=48", world=2)


def test_group_algorithms_declare_it_and_refuse_one_sample_per_prompt():
    group = {"grpo", "dr_grpo", "gspo", "rloo", "dapo", "reinforce_pp_baseline", "online_dpo"}
    assert {n for n in registry.names("algo") if registry.get("algo", n).needs_groups} == group
    for name in group:
        assert f"algo '{name}' compares the samples of one prompt" in \
            one_line_error(check, f"algo.name={name}", "samples_per_prompt=1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu():
    assert one_line_error(check, "device=cuda") == \
        "device=cuda but torch sees no CUDA GPU: use device=auto (a GPU if there is one) or cpu"


# --- YAML ----------------------------------------------------------------------------------------------------
def test_yaml_syntax_errors_name_the_file_or_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nalgo: {name: grpo\n")
    assert one_line_error(config.parse, ["--config", str(bad)]).startswith(
        f"config file '{bad}' is not valid YAML: expected ',' or '}}', but got '<stream end>' (line 3, column 1)")
    assert one_line_error(config.parse, ["steps=[1"]) == \
        "config key 'steps': '[1' is not valid YAML: expected ',' or ']', but got '<stream end>' (line 1, column 3)"


def test_text_options_keep_what_yaml_would_turn_into_a_mapping_or_a_bool():
    # the documented default of files.prompt_template; YAML reads {prompt} as a mapping
    cfg = config.parse(["files.prompt_template={prompt}", "files.system_prompt=yes", "files.fields=[a]"])
    assert (cfg.files.prompt_template, cfg.files.system_prompt, cfg.files.fields) == ("{prompt}", "yes", "[a]")
    cfg = config.parse(["files.prompt_template=Q: {prompt}\nA:", "files.answer_regex='####\\s*(.+)'", "steps=7"])
    assert (cfg.files.prompt_template, cfg.files.answer_regex, cfg.steps) == ("Q: {prompt}\nA:", "####\\s*(.+)", 7)


# --- the model folder ----------------------------------------------------------------------------------------
def test_an_empty_model_folder(tmp_path):
    assert one_line_error(models.load_model, str(tmp_path), torch.device("cpu"), torch.float32) == \
        f"model folder '{tmp_path}' holds no config.json: not a transformers model folder (save_pretrained writes " \
        "config.json, the weights and the tokenizer files)"


# --- the run directory ---------------------------------------------------------------------------------------
def test_out_dir_must_be_a_writable_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert one_line_error(run_dir.check, str(f), False) == f"out_dir '{f}' is a file, not a directory"
    assert one_line_error(run_dir.check, str(f / "run"), False) == f"out_dir '{f / 'run'}' cannot be made: '{f}' is a file"
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert one_line_error(run_dir.check, str(locked / "run"), False) == \
            f"out_dir '{locked / 'run'}' is not writable (no write permission on '{locked}')"
    run_dir.check(str(tmp_path / "new" / "run"), False)   # made later, with its parents
    assert not (tmp_path / "new").exists()


def test_a_non_empty_out_dir_is_refused_unless_resuming(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    assert one_line_error(run_dir.check, str(tmp_path), False) == \
        f"out_dir '{tmp_path}' is not empty and holds no checkpoint to resume: choose a new out_dir, or remove this " \
        "one first (a run directory with a checkpoint resumes by itself)"
    run_dir.check(str(tmp_path), True)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n'


# --- damaged checkpoints -------------------------------------------------------------------------------------
def tiny_checkpoints(run: str, steps=(1, 2)) -> list[str]:
    """A run directory with real checkpoints (checkpoint.save) of a small linear policy."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    cfg = config.Config()
    cfg.out_dir = run
    out = []
    for step in steps:
        policy(torch.randn(2, 4)).sum().backward()
        optimizer.step(), schedule.step()
        out.append(checkpoint.save(run, cfg, step, step, policy, optimizer, schedule, OnPolicyBuffer(),
                                   {"data": torch.Generator()}, torch.arange(5), step, {"start": {}}))
    return out


def snapshot(root) -> dict:
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(root) for f in fs}


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
    run = str(tmp_path / "run")
    old, new = tiny_checkpoints(run)
    assert checkpoint.damage(old) is None and checkpoint.damage(new) is None
    assert checkpoint.resolve_resume(config.parse([f"resume={run}"]), [])[1] == new
    weights = os.path.join(new, "model.safetensors")
    with open(weights, "r+b") as f:                       # a truncated copy
        f.truncate(os.path.getsize(weights) - 8)
    before = snapshot(run)
    capsys.readouterr()
    cfg, ckpt = checkpoint.resolve_resume(config.parse([f"out_dir={run}"]), [])
    assert ckpt == old and cfg.out_dir == run
    assert f"warning: checkpoint {new} is damaged (model.safetensors does not match its checksum (truncated or " \
           "changed)); resuming from step_000001 instead" in capsys.readouterr().out
    assert snapshot(run) == before                        # nothing on disk changes before a checkpoint loads
    # a checkpoint named by itself is that one or an error
    assert one_line_error(checkpoint.resolve_resume, config.parse([f"resume={new}"]), []) == \
        f"checkpoint {new} is damaged (model.safetensors does not match its checksum (truncated or changed)); " \
        "resume=<its run directory> takes the newest intact one"


@pytest.mark.parametrize("edit", [lambda m: "{not json", lambda m: json.dumps({**json.loads(m), "step": 7})])
def test_a_bad_meta_json_is_damage(tmp_path, edit):
    run = str(tmp_path / "run")
    old, new = tiny_checkpoints(run)
    meta = os.path.join(new, "meta.json")
    with open(meta) as f:
        text = f.read()
    with open(meta, "w") as f:
        f.write(edit(text))
    assert checkpoint.damage(new) is not None and checkpoint.newest_intact(run) == old


def test_every_checkpoint_damaged_is_an_error(tmp_path):
    run = str(tmp_path / "run")
    (only,) = tiny_checkpoints(run, steps=(3,))
    os.remove(os.path.join(only, "rank_state.safetensors"))
    assert one_line_error(checkpoint.newest_intact, run) == \
        f"every checkpoint in {run}/checkpoints is damaged (the newest, step_000003: rank_state.safetensors is " \
        "missing); start afresh with another out_dir"
