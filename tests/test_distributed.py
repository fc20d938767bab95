"""Distributed equivalence under torchrun (gloo on CPU): 2 ranks with the same global batch and seed give
the same update as 1 process. See distributed.py for what the ranks share and why.

Two checks, each honest about where its samples come from:
- `test_fsdp_update_matches_one_process`: fixed global batches made from the seed (tests/dist_worker.py),
  two GRPO updates with nonzero advantages through the algorithm, loss scaling, FSDP2, clipping, AdamW and
  the weight sync; then a 1-process run resumes from the 2-rank checkpoint (another world size).
- `test_train_under_torchrun_matches_one_process`: train.py end to end. Sampling streams differ per rank,
  so rollouts are made deterministic with top_p -> 0 (greedy tokens; log-probs still at temperature 1).
  Greedy groups have identical samples, so GRPO's advantages are 0 and the gradient comes from a k1 KL
  term (its gradient is nonzero even at step 1). Step 2's rollouts come from the synced engine. Micro-batches
  of 2 make the ranks accumulate gradients with FSDP's reduce-scatter only on the last one. A third run,
  one rank with offload=true, checks FSDP at world size 1 with CPU-offloaded shards and AdamW state.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import script_here, step_rows, train_here, train_here_beside  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(*cmds, here=(), logs=None, timeout=600):
    """Run the commands side by side (most of their time is importing torch and transformers), and meanwhile
    train.py with each argument list of `here` in this process (conftest.train_here: torch is imported already).
    With `logs` (a folder), each command's whole output goes to logs/run-<i>.log: on a GPU machine a failure's
    cause can sit far above the last lines that the assertion shows. The timeout only catches a hang: several
    torchrun jobs side by side on a busy 2-core machine (CI runs two test files at once) are slow without being
    stuck."""
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
             for c in cmds]
    train_here_beside(procs, here)
    for i, (cmd, p) in enumerate(zip(cmds, procs)):
        out, _ = p.communicate(timeout=timeout)
        if logs:
            with open(os.path.join(logs, f"run-{i}.log"), "w") as f:
                f.write(" ".join(cmd) + "\n" + out)
        assert p.returncode == 0, f"{' '.join(cmd[-4:])} failed:\n{out[-3000:]}"


def metrics(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl, one per step."""
    return step_rows(run_dir)


def test_fsdp_update_matches_one_process(tmp_path, random_model_dir):
    one, two, resumed = (tmp_path / n for n in ("one", "two", "resumed"))
    for d in (one, two, resumed):
        d.mkdir()
    run([sys.executable, "tests/dist_worker.py", random_model_dir, str(one)],
        [*TORCHRUN, "tests/dist_worker.py", random_model_dir, str(two)], logs=tmp_path)
    run([sys.executable, "tests/dist_worker.py", random_model_dir, str(resumed), "--resume", str(two / "state1.pt")],
        logs=resumed)
    a, b, c = (torch.load(d / "result.pt") for d in (one, two, resumed))
    assert (a["world"], b["world"]) == (1, 2)
    for step in (1, 2):
        assert b["loss"][step] == pytest.approx(a["loss"][step], rel=1e-5, abs=1e-7)
        assert b["grad_norm"][step] == pytest.approx(a["grad_norm"][step], rel=1e-5)
    assert c["loss"][2] == pytest.approx(b["loss"][2], rel=1e-5, abs=1e-7)
    from transformers import AutoModelForCausalLM
    init = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    moved = max((a["weights"][k] - init[k]).abs().max().item() for k in init)
    assert moved > 1e-3                                      # two AdamW steps of lr 1e-3 really moved them
    for k in init:   # the 2-rank engine copy got the gathered weights; the resumed 1-process run agrees
        torch.testing.assert_close(b["weights"][k], a["weights"][k], rtol=0, atol=1e-5)
        torch.testing.assert_close(c["weights"][k], b["weights"][k], rtol=0, atol=1e-5)
    s1, s2 = (torch.load(d / "state1.pt") for d in (one, two))   # full optimizer state: same keys and values
    assert s1["optim"]["state"].keys() == s2["optim"]["state"].keys()
    for k, v in s1["optim"]["state"].items():
        torch.testing.assert_close(s2["optim"]["state"][k]["exp_avg"].cpu(), v["exp_avg"].cpu(), rtol=1e-4, atol=1e-8)


def test_train_under_torchrun_matches_one_process(tmp_path, random_model_dir):
    """train.py on 1 process, on 2 ranks (FSDP, layers compiled), on 1 rank with offload and on 2 ranks with
    parallel=replicate: same metrics and weights; then the 1- and 2-rank runs each resume on 1 process (a
    different world size for the second) and agree on step 3."""
    args = [f"model={random_model_dir}", "steps=2", "eval_every=1", "eval_size=8", "prompts_per_step=4",
            "samples_per_prompt=2", "top_p=1e-6", "algo.kl_coef=0.1", "algo.kl_estimator=k1", "lr=1e-2",
            "micro_batch_size=2",                # 2 ranks: 2 micro-batches each, one gradient reduce-scatter
            "dtype=float32", "progress=false"]   # float32 on GPUs too (python -m pytest there runs NCCL)
    one_rank = [*TORCHRUN[:-1], "--nproc_per_node=1"]   # FSDP with CPU offload at world size 1
    run([*TORCHRUN, "train.py", *args, "compile=true", f"out_dir={tmp_path / 'two'}"],   # compiled FSDP2 layers
        [*one_rank, "train.py", *args, "offload=true", f"out_dir={tmp_path / 'offload'}"],
        [*TORCHRUN, "train.py", *args, "parallel=replicate", f"out_dir={tmp_path / 'replicate'}"],
        here=[[*args, f"out_dir={tmp_path / 'one'}"]], logs=tmp_path)
    runs = ("one", "two", "offload", "replicate")
    rows = {n: metrics(tmp_path / n) for n in runs}
    for a, *others in zip(*rows.values(), strict=True):
        for key in ("loss", "grad_norm", "kl", "completion_len", "reward", "eval/reward", "eval/accuracy"):
            for name, b in zip(runs[1:], others):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, key)
    assert rows["two"][0]["grad_norm"] > 0.1 and abs(rows["two"][1]["kl"]) > 0.01   # the policy moved
    assert rows["two"][1]["logprob_mismatch/max"] < 1e-4   # step 2 sampled with the synced weights, not stale ones
    # resume at another world size: the 2-rank run and the 1-process run each continue on 1 process for a 3rd
    # step; near-greedy sampling (top_p) makes the samples world-size independent, so step 3 must agree
    import shutil
    for n in ("one", "two"):
        shutil.copytree(tmp_path / n, tmp_path / f"{n}-more")
    for n in ("two", "one"):   # one process each: in this one (a process start would be most of a step's time)
        train_here([*args, "steps=3", f"resume={tmp_path / f'{n}-more'}"])
    more = {n: metrics(tmp_path / f"{n}-more")[-1] for n in ("one", "two")}
    assert more["one"]["step"] == more["two"]["step"] == 3
    for key in ("loss", "grad_norm", "kl", "reward", "eval/accuracy"):
        assert more["two"][key] == pytest.approx(more["one"][key], rel=1e-4, abs=1e-6), key
    from safetensors.torch import load_file
    a, *others = (load_file(tmp_path / n / "final" / "model.safetensors") for n in runs)
    for b in others:
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4)   # lr 1e-2: the weights moved ~1e-2


def test_ppo_critic_under_torchrun_matches_one_process(tmp_path):
    """PPO's critic is sharded with FSDP2 as the policy is (parallel=fsdp) or whole on every rank with its
    gradients averaged (parallel=replicate): with either, its gradient norms, loss metrics and final weights
    (gathered into the checkpoint) match one process's.
    Greedy sampling as above; whitening off, since it has no exact split over ranks (algos/ppo.py)."""
    args = ["model=assets/tiny-model", "algo.name=ppo", "steps=3", "eval_every=3", "eval_size=8",   # rewards > 0
            "prompts_per_step=8", "samples_per_prompt=2", "top_p=1e-6", "lr=1e-2", "algo.ppo.critic_lr=1e-2",
            "algo.ppo.whiten=false", "dtype=float32", "progress=false"]
    runs = {"one": [sys.executable, "train.py"], "fsdp": [*TORCHRUN, "train.py"],
            "replicate": [*TORCHRUN, "train.py", "parallel=replicate"]}
    run(*[[*cmd, *args, f"out_dir={tmp_path / name}"] for name, cmd in runs.items() if name != "one"],
        here=[[*args, f"out_dir={tmp_path / 'one'}"]], logs=tmp_path)
    rows = {n: metrics(tmp_path / n) for n in runs}
    assert rows["one"][1]["critic_grad_norm"] > 0.1 and rows["one"][2]["value"] != 0   # the critic learned
    assert rows["one"][1]["grad_norm"] > 0.1                                             # and so did the policy
    from safetensors.torch import load_file
    critic = {n: load_file(next((tmp_path / n / "checkpoints").glob("step_*")) / "critic.safetensors") for n in runs}
    for name in ("fsdp", "replicate"):
        # the loss metrics too: per-rank token means, weighted by each rank's share of the tokens (loss_scale),
        # whose mean is the global one also where completion lengths differ between the ranks (step 3 here)
        for a, b in zip(rows["one"], rows[name], strict=True):
            # step 3 follows AdamW's first real step (step 1's gradient is 0), which moves every entry by about
            # lr whatever its gradient's size, so entries whose gradient is float noise (16 rows in one forward
            # against 8 per rank) move apart: on 2 H100s step 3's grad_norm and entropy differed by 4e-4, 2e-4
            rel = 1e-4 if a["step"] < 3 else 1e-3
            for key in ("critic_grad_norm", "grad_norm", "loss", "value_loss", "value", "entropy", "clip_frac"):
                assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-6), (name, a["step"], key)
        for k, v in critic["one"].items():
            torch.testing.assert_close(critic[name][k], v, rtol=0, atol=1e-4)   # critic lr 1e-2: it moved
    # resume: the sharded run's checkpoint goes back into a sharded critic (2 ranks) for a 4th step, which must
    # match an uninterrupted 4-step run of one process (the critic's weights and AdamW state came back whole)
    import shutil
    shutil.copytree(tmp_path / "fsdp", tmp_path / "fsdp-more")
    run([*runs["fsdp"], *args, "steps=4", f"resume={tmp_path / 'fsdp-more'}"],
        here=[[*args, "steps=4", f"out_dir={tmp_path / 'one-4'}"]], logs=tmp_path)
    more = {n: metrics(tmp_path / n)[-1] for n in ("one-4", "fsdp-more")}
    assert more["one-4"]["step"] == more["fsdp-more"]["step"] == 4
    # the critic's own numbers: the policy's grad_norm at step 4 carries AdamW's amplified float noise (above;
    # 8.9e-4 apart already on CPU)
    for key in ("critic_grad_norm", "value_loss", "value"):
        assert more["fsdp-more"][key] == pytest.approx(more["one-4"][key], rel=1e-3, abs=1e-6), key


def test_reinforce_pp_whitens_over_all_ranks(tmp_path):
    """REINFORCE++ whitens the reward-to-go over every token of the batch. Under torchrun each rank holds a
    part, so the mean and std are summed over ranks (distributed.all_sum): 2 ranks then take one process's
    update. Greedy sampling as above; step 1's prompts differ in reward, so its advantages are nonzero (step 2's
    are all 0: a zero gradient either way)."""
    args = ["model=assets/tiny-model", "algo.name=reinforce_pp", "steps=2", "eval_every=2", "eval_size=8",
            "prompts_per_step=16", "samples_per_prompt=2", "top_p=1e-6", "lr=1e-2", "dtype=float32", "progress=false"]
    runs = {"one": [sys.executable, "train.py"], "replicate": [*TORCHRUN, "train.py", "parallel=replicate"]}
    run([*runs["replicate"], *args, f"out_dir={tmp_path / 'replicate'}"], here=[[*args, f"out_dir={tmp_path / 'one'}"]],
        logs=tmp_path)
    rows = {n: metrics(tmp_path / n) for n in runs}
    assert rows["one"][0]["grad_norm"] > 0.1                       # step 1's advantages were not all zero
    for a, b in zip(rows["one"], rows["replicate"], strict=True):  # whitened per rank, step 1's was 1.58, not 1.14
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6), a["step"]
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / n / "final" / "model.safetensors") for n in runs)
    for k in a:   # AdamW divides by each entry's own gradient scale, so an entry whose gradient is near 0
        # magnifies float32 summation-order differences: one of 16,384 differed by 1.4e-4 (lr 1e-2 moves ~1e-2)
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=5e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_train_on_two_gpus(tmp_path):
    """train.py under torchrun on 2 GPUs as a user runs it: NCCL, float32 shards computing in bf16 (layers compiled),
    the CUDA-graph decode path in each rank's engine, the fused log-prob kernel, a sharded reference (KL),
    micro-batches, and rank 0 writing final/. Two more runs at the same time: offload=true (shards and AdamW on
    the CPU) and parallel=replicate (whole model per rank, one gradient all-reduce)."""
    args = ["model=assets/tiny-model", "steps=2", "eval_every=2", "eval_size=32", "prompts_per_step=8",
            "micro_batch_size=16", "algo.kl_coef=0.05", "progress=false"]
    runs = {"gpu": ["compile=true"], "offload": ["offload=true"], "replicate": ["compile=true", "parallel=replicate"]}
    run(*[[*TORCHRUN, "train.py", *args, *extra, f"out_dir={tmp_path / name}"] for name, extra in runs.items()],
        logs=tmp_path)
    from transformers import AutoModelForCausalLM
    init = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets", "tiny-model")).state_dict()
    for name in runs:
        rows = metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [1, 2] and "eval/accuracy" in rows[-1], name
        assert all(math.isfinite(r["loss"]) and 0 < r["grad_norm"] < math.inf for r in rows), (name, rows)
        final = AutoModelForCausalLM.from_pretrained(tmp_path / name / "final").state_dict()   # loadable
        assert final.keys() == init.keys(), name
        assert max((final[k].float() - init[k].float()).abs().max().item() for k in init) > 0, name   # it trained


@pytest.mark.parametrize("settings, error", [
    (["offload=true"], "offload=true shards the policy with FSDP: launch with torchrun (--nproc_per_node=1 is fine)"),
    (["offload=true", "parallel=replicate"], "offload=true keeps FSDP shards in CPU memory: it needs parallel=fsdp"),
    (["parallel=ddp"], "config key 'parallel' must be one of fsdp, replicate; got 'ddp'")])
def test_bad_parallel_settings(random_model_dir, tmp_path, settings, error):
    r = script_here("train.py", [f"model={random_model_dir}", *settings, f"out_dir={tmp_path}"])   # in this process
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [f"error: {error}"]
    assert not os.path.exists(tmp_path / "config.yaml")   # refused before anything was written


def test_streamed_optimizer_step_on_fsdp_shards(tmp_path):
    """offload_optimizer under FSDP2: the streamed AdamW step equals the plain one on every rank's shards, and
    checkpoints gather and load its state (tests/offload_worker.py says what it checks)."""
    run([*TORCHRUN, "tests/offload_worker.py", str(tmp_path)], logs=tmp_path, timeout=120)
    assert (tmp_path / "ok").exists()


@pytest.mark.parametrize("offload, moved", [(True, False), (False, True)])
def test_shard_moves_the_model_to_the_gpu_only_without_offload(monkeypatch, offload, moved):
    """distributed.shard on a GPU: the whole float32 model goes to the device first (plain FSDP), never with
    offload=true (its shards live in CPU memory: a whole copy on the GPU is what offload exists to avoid). CPU
    check with fully_shard stubbed and the move recorded."""
    import torch.distributed.fsdp as fsdp

    import distributed
    model = torch.nn.Linear(2, 2)
    moves, units = [], []
    monkeypatch.setattr(model, "to", lambda *a, **k: moves.append(a) or model)
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, **kw: units.append(kw))
    distributed.shard(model, torch.device("cuda", 0), torch.float32, offload=offload)
    assert bool(moves) == moved and len(units) == 1 and ("offload_policy" in units[0]) == offload
