"""Shared fixtures: a tiny random transformers model saved locally (no hub needed)."""
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import algos, engines, envs, rewards, tasks  # noqa: E402,F401,E401  (register every plugin and its config section)


def make_random_model(path: str, seed: int = 0, vocab_chars: str = "0123456789+="):
    """A 2-layer Qwen2 with a character tokenizer (ids: <pad>=0, <eos>=1, then the chars)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(vocab_chars)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_word_classifier(path: str, words: list[str], num_labels: int, hidden: int, layers: int):
    """A tiny LlamaForSequenceClassification over a whitespace word tokenizer (ids in the order of words; words
    must hold <pad>, <eos>, <unk>), saved to path: the reward-model and process-reward-model tests' judge.
    -> (path, the model in eval mode, the tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(words), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 8, num_key_value_heads=hidden // 16,
                      num_labels=num_labels, pad_token_id=words.index("<pad>"))
    model = LlamaForSequenceClassification(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), model.eval(), tok


def step_rows(run_dir) -> list[dict]:
    """The per-step rows of a run's metrics.jsonl: step 0 (the held-out evaluation before training) left out."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if row["step"] > 0]


def logprob_mismatch(sample_logprobs, trainer_logprobs, mask) -> dict[str, float]:
    """Mean and max |engine log-prob - trainer log-prob| over the completion tokens in mask, all (B, C): what the
    loop logs as logprob_mismatch/* (update.py), for tests that drive an engine by hand."""
    diff = (sample_logprobs.float() - trainer_logprobs.detach().float().to(sample_logprobs.device)).abs()[mask.bool()]
    if diff.numel() == 0:
        return {"logprob_mismatch/mean": 0.0, "logprob_mismatch/max": 0.0}
    return {"logprob_mismatch/mean": diff.mean().item(), "logprob_mismatch/max": diff.max().item()}


@contextlib.contextmanager
def as_a_process():
    """What a train.py run changes for its process, put back afterwards: torch's threads, global RNG and
    activation_memory_budget (compile=true sets it), the environment, sys.argv, the working directory (ROOT
    meanwhile, as `python train.py` in the repository has it); and the GPU memory it cached, which processes
    started later may need."""
    import torch._functorch.config as functorch
    threads, rng, env, cwd = torch.get_num_threads(), torch.get_rng_state(), dict(os.environ), os.getcwd()
    argv, budget = list(sys.argv), functorch.activation_memory_budget
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.argv[:] = argv
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        functorch.activation_memory_budget = budget
        os.environ.clear()
        os.environ.update(env)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def train_here(args: list[str]) -> dict:
    """train.py's main in this process, as `python train.py ARGS` in the repository would run it, for a run that
    is neither killed nor launched by torchrun: no second import of torch and transformers (most of a small run's
    time). The process's state comes back as it was (as_a_process)."""
    import train
    with as_a_process():
        return train.main(args)


def script_here(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in the repository, run in this process: the script's own `__main__` block (runpy), with
    sys.argv as the command line sets it, its stdout and stderr captured and its exit code taken from SystemExit:
    for a run that stops before any training (a bad input's one-line error), whose time as a subprocess would be
    nearly all the import of torch. -> (returncode, stdout, stderr) as subprocess.run gives them; an exception the
    script lets through propagates (where a subprocess would print its traceback and exit 1)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with as_a_process(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv[:] = [script, *args]
        try:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    return subprocess.CompletedProcess([script, *args], code, out.getvalue(), err.getvalue())


def train_here_beside(procs: list, here) -> None:
    """train_here for each argument list of `here` while the started processes (procs) run; if one of these runs
    fails, the processes are killed, not left running past the failed test."""
    try:
        for args in here:
            train_here(args)
    except BaseException:
        for p in procs:
            p.kill()
        raise

_saved_threads: dict = {}
# The test files that take longest (many train.py or torchrun processes), run first: README's `--dist loadfile`
# hands each file whole to one worker, and a long file started last would leave the other worker idle meanwhile
# (`--no-loadscope-reorder` keeps this order: xdist would otherwise start the files with the most tests first).
SLOW_FILES = ("test_distributed.py", "test_checkpoint.py", "test_async.py", "test_train.py", "test_bad_input.py",
              "test_lora.py", "test_vision.py", "test_vision_dist.py", "test_envs_hostile.py", "test_offline_and_ablate.py",
              "test_full_kl.py", "test_vision_turns.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_FILES)))   # stable: files stay whole, in order


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs requirements-vllm.txt (tools/ci_vllm.sh); skipped without it")
    # Under pytest-xdist (README's `-n 2`) each worker takes its share of the cores, for torch here and for the
    # processes it starts (OMP_NUM_THREADS): one thread per core in every worker would oversubscribe the CPU, and
    # threads that wait on each other are slower than fewer threads. torch.compile's inductor likewise: it compiles
    # in a pool of one process per core, each of which imports torch first; on a share of one core it compiles in
    # the process itself (TORCHINDUCTOR_COMPILE_THREADS=1), without the pool's start-up.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "PYTEST_XDIST_WORKER" in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        share = max(1, cores // workers)
        _saved_threads.update(torch=torch.get_num_threads(),
                              env={k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")})
        torch.set_num_threads(share)
        for k in _saved_threads["env"]:
            os.environ.setdefault(k, str(share))


def pytest_unconfigure(config):
    if _saved_threads:
        torch.set_num_threads(_saved_threads["torch"])
        for k, v in _saved_threads["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    return make_random_model(str(tmp_path_factory.mktemp("random-model")))
