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


def test_an_algorithm_refuses_one_sample_per_prompt_exactly_when_it_declares_groups():
    """Read from the registry (each algorithm's needs_groups), so a new algorithm is checked with no list to edit."""
    import algos  # noqa: F401  (registers every algorithm)
    names = registry.names("algo")
    group = {n for n in names if registry.get("algo", n).needs_groups}
    assert {"grpo", "rloo", "online_dpo"} <= group and not {"ppo", "reinforce_pp"} & group   # the flag is honest
    for name in names:
        if name in group:
            assert f"algo '{name}' compares the samples of one prompt" in \
                one_line_error(check, f"algo.name={name}", "samples_per_prompt=1")
        else:
            check(f"algo.name={name}", "samples_per_prompt=1")


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
        f"out_dir '{tmp_path}' is not empty and holds no checkpoint to resume (a run stopped before its first save " \
        f"leaves one like it): to start that run again, remove it first (rm -r {tmp_path}), or choose a new out_dir"
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


# --- the corpus of issue #31: every bad input a one-line error (or a stop with the reason) before any model loads ----
# Each case goes through train.prepare, the exact checks train.main runs before it loads anything (no subprocess).
def prepared(*argv):
    import train
    return train.prepare(list(argv))


def finished_run(run: str, step: int = 60) -> str:
    """A run directory as a finished run leaves it: a checkpoint at its last step, final/, config.yaml."""
    (ckpt,) = tiny_checkpoints(run, steps=(step,))
    os.makedirs(os.path.join(run, "final"))
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write("the run's own config\n")
    return ckpt


def edit_meta(ckpt: str, fn):
    path = os.path.join(ckpt, "meta.json")
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump(fn(meta), f)


def setup_case(name: str, tmp_path) -> list[str]:
    """Files a case needs -> the extra arguments that point at them."""
    run = str(tmp_path / "run")
    if name == "binary_yaml":
        (tmp_path / "x.yaml").write_bytes(b"steps: 3\n\xff\xfe\x00\x01bad: 1\n")
        return ["--config", str(tmp_path / "x.yaml")]
    if name == "yaml_key_twice":
        (tmp_path / "x.yaml").write_text("steps: 3\nalgo:\n  name: grpo\n  name: ppo\n")
        return ["--config", str(tmp_path / "x.yaml")]
    if name in ("meta_empty", "meta_no_checksums_file_missing"):
        (ckpt,) = tiny_checkpoints(run, steps=(1,))
        if name == "meta_empty":
            edit_meta(ckpt, lambda m: {})
        else:
            edit_meta(ckpt, lambda m: {k: v for k, v in m.items() if k not in ("sha256", "checksum")})
            os.remove(os.path.join(ckpt, "rank_state.safetensors"))
        return [f"resume={ckpt}"]
    if name in ("finished_run_seed", "finished_run_fewer_steps"):
        finished_run(run)
        return [f"out_dir={run}"]
    if name in ("killed_before_checkpoint", "killed_before_checkpoint_resume"):
        os.makedirs(run)
        (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
        return [f"resume={run}"] if name.endswith("resume") else [f"out_dir={run}"]
    return [f"out_dir={run}"]


ASYNC = ["mode=async", "algo.tis=token"]
# (name, arguments, what the one line must say); torchrun's ones run with RANK=0 WORLD_SIZE=2 in the environment
CORPUS = [
    # tracebacks before the fix
    ("binary_yaml", [], "is not valid YAML: not utf-8 text (invalid start byte at character 10)"),
    ("huge_int", ["steps=100000000000000000000"], "config key 'steps' must be below 2**62 in size"),
    ("hilo_digits_0", ["task=hilo", "env.name=hilo", "hilo.digits=0"], "config key 'hilo.digits' must be 1..6"),
    ("prompt_template_field", ["task=files", "files.train_path=x.jsonl", "files.prompt_template={nope}"],
     "config key 'files.prompt_template' must be a format string whose only field is {prompt}"),
    ("answer_regex_syntax", ["task=files", "files.train_path=x.jsonl", "files.answer_regex=("],
     "config key 'files.answer_regex' is not a regular expression"),
    ("answer_regex_no_group", ["task=files", "files.train_path=x.jsonl", "files.answer_regex=####"],
     "config key 'files.answer_regex' needs a group"),
    ("env_workers_0", ["env.workers=0"], "config key 'env.workers' must be >= 1; got 0"),
    ("env_timeout_0", ["env.timeout_s=0"], "config key 'env.timeout_s' must be > 0; got 0.0"),
    ("proc_out_dir", ["out_dir=/proc/nope"], "out_dir '/proc/nope' "),   # root: cannot be made; others: not writable
    ("meta_empty", [], "is damaged (meta.json lacks step, version, cursor"),
    ("meta_no_checksums_file_missing", [], "is damaged (rank_state.safetensors is missing)"),
    ("torchrun_rollout_ranks", [*ASYNC, "rollout_ranks=2"], "rollout_ranks=2 must be in 1..1: the world size is 2"),
    ("torchrun_max_staleness", [*ASYNC, "max_staleness=-1"], "config key 'max_staleness' must be >= 0; got -1"),
    ("torchrun_replay", [*ASYNC, "replay.enabled=true"], "mode=async does not combine with offload=true, replay"),
    ("torchrun_lora", [*ASYNC, "lora.r=4"], "mode=async does not combine with"),
    ("torchrun_lora_fsdp", ["lora.r=4"], "lora.r > 0 runs in one process or under torchrun with parallel=replicate"),
    # accepted silently before the fix
    ("kl_coef", ["algo.kl_coef=-1"], "config key 'algo.kl_coef' must be >= 0 (0 = no reference model); got -1.0"),
    ("clip_eps", ["algo.clip_eps=-0.2"], "config key 'algo.clip_eps' must be in (0, 1]"),
    ("gamma", ["algo.name=ppo", "algo.ppo.gamma=2"], "config key 'algo.ppo.gamma' must be in [0, 1]; got 2.0"),
    ("dpo_beta", ["algo.dpo.beta=-1"], "config key 'algo.dpo.beta' must be > 0; got -1.0"),
    ("norm_len", ["algo.norm_len=-4"], "config key 'algo.norm_len' must be >= 0 (0 = max_new_tokens); got -4"),
    ("replay_alpha", ["replay.alpha=-1"], "config key 'replay.alpha' must be >= 0 (0 = uniform); got -1.0"),
    ("seed", ["seed=-1"], "config key 'seed' must be >= 0 (0 = seed 0); got -1"),
    ("eval_k", ["eval_k=100000"], "config keys 'eval_k' must be in 0..1024"),
    ("sync_rollout_ranks", ["rollout_ranks=2"], "rollout_ranks=2 applies to mode=async only"),
    ("sync_max_staleness", ["max_staleness=3"], "max_staleness=3 applies to mode=async only"),
    ("sync_async_timeout", ["async_timeout_s=5"], "async_timeout_s=5.0 applies to mode=async only"),
    ("profile_step", ["profile_step=99", "steps=10"], "profile_step=99 is past the last step (steps=10)"),
    ("offload_models", ["offload_models=true"], "offload_models=true moves the reference model and the critic, and "
                                                "this run has neither"),
    ("env_max_turns", ["env.max_turns=0"], "config key 'env.max_turns' must be >= 1; got 0"),
    ("env_max_tokens", ["env.max_tokens=-1"], "config key 'env.max_tokens' must be >= 1; got -1"),
    ("env_max_obs_chars", ["env.max_obs_chars=-5"], "config key 'env.max_obs_chars' must be >= 1; got -5"),
    ("env_args", ["task=hilo", "env.name=hilo", "env.args=nokey=1"],
     "env.args: environment 'hilo' takes no argument 'nokey'; it takes: max_guesses, digit_reward"),
    ("env_task", ["env.name=hilo", "task=arithmetic"], "env.name=hilo plays the rows of task=hilo"),
    ("env_memory", ["env.memory_mb=1"], "config key 'env.memory_mb' must be >= 64"),
    ("reward_args", ["reward_args=arithmetic.foo=1"], "reward_args: reward 'arithmetic' takes no argument 'foo'"),
    ("yaml_key_twice", [], "is not valid YAML: key 'name' appears twice (line 4, column 3)"),
    # data touched before the fix
    ("finished_run_seed", ["seed=5"], "has trained 60 steps and is finished; steps=60 leaves nothing to train"),
    ("finished_run_fewer_steps", ["steps=2"], "steps=2 leaves nothing to train (nothing was changed). To train on: "
                                              "python train.py resume="),
    ("killed_before_checkpoint", [], "to start that run again, remove it first (rm -r "),
    ("killed_before_checkpoint_resume", [], "holds no checkpoint (the run stopped before its first save): start it "
                                            "again with another out_dir, or remove it first (rm -r "),
    # a new user's first hour
    ("model_typo", ["model=assets/tiny-modle"], "model 'assets/tiny-modle' is not a folder here or in the repository"),
    ("model_missing_dir", ["model=./nowhere/model"], "model './nowhere/model' is not a folder here"),
]


@pytest.mark.parametrize("name, argv, message", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_each_bad_input_is_one_line_before_any_work(name, argv, message, tmp_path, monkeypatch):
    import run_setup
    if name.startswith("torchrun"):   # the checks run with the world size from torchrun's environment
        monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "2")
    before = snapshot(tmp_path)
    monkeypatch.setattr(run_setup, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises((UserError, registry.RegistryError)) as e:
        prepared(*setup_case(name, tmp_path), *argv)
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)
    assert not torch.distributed.is_initialized()
    if name.startswith(("finished", "killed")):   # nothing of the run it refused changed
        assert (tmp_path / "run" / "config.yaml").read_text() == "the run's own config\n" if name.startswith(
            "finished") else (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert before == {} or snapshot(tmp_path) == before


def test_a_data_row_that_is_no_object_names_its_row(tmp_path):
    from tasks.files import files_task
    (tmp_path / "d.jsonl").write_text('{"question": "1+1", "answer": "2"}\n5\n')
    cfg = config.parse([f"files.train_path={tmp_path / 'd.jsonl'}"]).files
    with pytest.raises(ValueError, match=r"d.jsonl row 1 is int '5', not an object with named fields"):
        files_task(cfg)   # train.build_data turns the task's ValueError into a one-line UserError


def test_torchrun_failure_prints_once_and_exits_2(monkeypatch, capsys):
    import distributed
    for rank, printed in (("0", "error: x\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            distributed.fail("error: x")
        assert e.value.code == 2 and capsys.readouterr().err == printed


def test_a_missing_meta_json_falls_back_with_a_warning(tmp_path, capsys):
    run = str(tmp_path / "run")
    old, new = tiny_checkpoints(run)
    os.remove(os.path.join(new, "meta.json"))
    assert checkpoint.newest_intact(run) == old
    assert f"warning: checkpoint {new} has no meta.json (deleted?): skipped" in capsys.readouterr().out


def test_the_embedded_model_resolves_from_any_directory_and_threads_follow_its_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = prepared(f"out_dir={tmp_path / 'run'}")
    assert cfg.model == os.path.join(config.REPO, "assets", "tiny-model") and os.path.isdir(cfg.model)
    assert cfg.threads == (0 if torch.cuda.is_available() else 1)   # tiny model on the CPU: one thread
    assert prepared(f"out_dir={tmp_path / 'run2'}", "threads=3")[0].threads == 3


def test_help_names_the_script(capsys):
    import train_dpo
    with pytest.raises(SystemExit):
        train_dpo.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python train_dpo.py")


def test_a_run_whose_every_reward_breaks_stops_with_the_reason(tmp_path):
    """A `tests` field that is not JSON breaks the code reward on every sample: three such steps stop the run."""
    from types import SimpleNamespace
    import rollout
    from rewards.pool import RewardPool
    from rollout import broken
    with RewardPool([("code", 1.0)], workers=1, timeout_s=30) as pool:
        _, info = pool.submit(["p", "p"], ["print(1)", "print(2)"], [{"tests": "not json"}] * 2).result()
    share, reason = broken(info, 2)
    assert share == 1.0 and "code: JSONDecodeError" in reason
    run = SimpleNamespace(broken=[], broken_steps=0, run_dir=str(tmp_path))
    for step in (1, 2):
        run.broken = [(share, reason)]
        rollout.check_broken(run, step)
    run.broken = [(0.5, reason)]   # a step where half the samples scored: the count starts again
    rollout.check_broken(run, 3)
    for step in (4, 5):
        run.broken = [(1.0, reason)]
        rollout.check_broken(run, step)
    run.broken = [(1.0, reason)]
    msg = one_line_error(rollout.check_broken, run, 6)
    assert msg.startswith("every sample's reward or episode failed for 3 steps in a row (step 6: code: "
                          "JSONDecodeError") and "stopped rather than train on zeros" in msg
    # the environment's failures count the same way (engines/multiturn.py's info: metrics env_fail)
    assert broken({"metrics": {"env_fail": 4.0}, "failed": [{"reward": "env:hilo", "category": "error",
                                                              "reason": "KeyError: 'secret'"}]}, 4) == \
        (1.0, "env:hilo: KeyError: 'secret'")
    # wrong answers are the policy's, not a broken reward
    assert broken({"failures": {"arithmetic": 0}, "failed": [{"reward": "arithmetic", "category": "wrong_answer",
                                                              "reason": "wrong"}]}, 1) == (0.0, None)


def test_evaluations_show_on_the_console_with_pass_at_k():
    from rollout import eval_line
    assert eval_line({"step": 10, "eval/accuracy": 0.25, "eval/reward": 0.25, "eval/mean@4": 0.2, "eval/pass@4": 0.5,
                      "eval/pass@1": 0.2, "eval/pass@2": 0.3}) == \
        "step 10: held-out accuracy 0.250, pass@1 0.200, pass@2 0.300, pass@4 0.500"
