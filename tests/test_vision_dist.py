"""FSDP2 on a vision-language policy (distributed.py `shard`, vision.py `model_inputs`): under torchrun with gloo on
CPU, a GRPO step of the tiny VLM on 2 ranks gives one process's loss and gradient norms, and the vision tower is
sharded (its parameters are DTensors) whether it is frozen or trained.

    python -m pytest -q tests/test_vision_dist.py
    python tests/test_vision_dist.py OUT                            # the worker, one process
    torchrun --nproc_per_node=2 tests/test_vision_dist.py OUT       # the worker, two ranks

The batch comes from the seed alone, the same in every process: 4 prompts of task=shapes x 4 samples decoded by the
built-in engine on the whole model, 0/1 rewards drawn from the seed (GRPO needs groups that disagree) and old
log-probs moved off the sampling ones by seeded noise (so that the clipped ratios, and the loss, are not trivial).
Each rank keeps its share of the groups, as train.py does with prompts, and takes one step with train.py's pieces
(the algorithm's advantages and loss, `distributed.loss_scale`, clipping, AdamW), once with the tower frozen and
once with it trained, each from a freshly loaded (and sharded) policy. One launch does both: torchrun's start is
most of the test's time.
"""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODEL = os.path.join(ROOT, "assets", "tiny-vlm")
G, N = 4, 4                                   # prompts (groups) and samples per prompt


def shared_batch(tok, algo, cfg):
    """This rank's share of the seeded global batch."""
    import distributed
    import vision
    from buffer import Experience
    from engines.base import SamplingParams
    from engines.builtin import BuiltinEngine
    from models import encode_prompts, load_model
    from tasks.shapes import shapes_samples
    full, _ = load_model(MODEL, torch.device("cpu"), torch.float32)
    prompts = vision.encode_rows(tok, MODEL, shapes_samples(G, heldout=False), encode_prompts)
    ro = BuiltinEngine(full, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).generate(
        prompts, N, SamplingParams(1.0, 1.0, 3), torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (G * N,), generator=g).float()
    old = (ro.logprobs + 0.1 * torch.randn(ro.logprobs.shape, generator=g)) * ro.completion_mask   # ratios != 1
    batch = Experience(input_ids=ro.input_ids, attention_mask=ro.attention_mask, completion_mask=ro.completion_mask,
                       sample_logprobs=ro.logprobs, old_logprobs=old, rewards=rewards, group_ids=ro.group_ids,
                       versions=torch.zeros(G * N, dtype=torch.long), truncated=ro.truncated,
                       **vision.batch_images(prompts, N))
    groups = torch.tensor(distributed.share(list(range(G))))                               # this rank's groups
    local = batch.select((groups[:, None] * N + torch.arange(N)).flatten())
    local.group_ids = torch.arange(len(groups)).repeat_interleave(N)                      # local ids, as a rollout's
    local.advantages = algo.advantages(local, cfg.algo)
    return local


def step(policy, local, algo, cfg) -> dict:
    """One GRPO step of this rank's share -> the global loss, gradient norms, and whether the tower is sharded."""
    import distributed
    import vision
    from models import completion_logprobs
    from torch.distributed.tensor import DTensor
    world = distributed.world()
    tower = list(vision.tower(policy).parameters())
    sharded = all(isinstance(p, DTensor) for p in tower)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    C = local.completion_mask.shape[1]
    logp, entropy = completion_logprobs(policy, local.input_ids, local.attention_mask, C, 1.0, local.images())
    loss, _ = algo.loss({"logprobs": logp, "entropy": entropy}, local, cfg.algo)
    loss = loss * distributed.loss_scale(local.completion_mask, cfg.algo.loss_agg)
    loss.backward()
    tower_grads = [p.grad for p in tower if p.grad is not None]
    tower_norm = distributed.grad_norm_value(torch.nn.utils.get_total_norm(tower_grads)) if tower_grads else 0.0
    grad_norm = distributed.grad_norm_value(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip))
    optimizer.step()
    return {"world": world, "loss": distributed.all_sum([loss.item()])[0] / world, "grad_norm": grad_norm,
            "tower_grad_norm": tower_norm, "tower_sharded": distributed.all_sum([sharded])[0] == world,
            "tower_trainable": any(p.requires_grad for p in tower)}


def worker(out: str):
    import algos  # noqa: F401  (registers the algorithms)
    import distributed
    import registry
    import vision
    from config import Config
    from models import load_model
    rank, world = distributed.init()
    torch.manual_seed(0)
    cfg = Config()
    algo = registry.get("algo", cfg.algo.name)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    local = shared_batch(tok, algo, cfg)
    results = {}
    for train_tower in (False, True):
        policy = load_model(MODEL, torch.device("cpu"), torch.float32)[0]
        if world > 1:   # as train.py's build_models: sharded float32 masters, the tower frozen after sharding
            policy = distributed.shard(policy, torch.device("cpu"), torch.float32)
        vision.freeze_tower(policy, train_tower)
        results[train_tower] = step(policy, local, algo, cfg)
    if rank == 0:
        torch.save(results, os.path.join(out, "result.pt"))


def test_fsdp_on_a_vlm_matches_one_process_and_shards_the_tower(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / "one", tmp_path / "two"]
    for out in outs:
        out.mkdir()
    procs = [subprocess.Popen([*cmd, __file__, str(out)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for cmd, out in zip([[sys.executable], torchrun], outs)]
    for p in procs:
        log, _ = p.communicate(timeout=600)
        assert p.returncode == 0, log[-8000:]   # enough to show where a rank stopped, before torchrun's report
    ones, twos = (torch.load(out / "result.pt") for out in outs)
    for train_tower in (False, True):
        one, two = ones[train_tower], twos[train_tower]
        assert (one["world"], two["world"]) == (1, 2)
        assert two["tower_sharded"] and two["tower_trainable"] == train_tower, train_tower
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7) and abs(one["loss"]) > 1e-4
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4) and one["grad_norm"] > 0
        assert two["tower_grad_norm"] == pytest.approx(one["tower_grad_norm"], rel=1e-4)
        assert (one["tower_grad_norm"] > 0) == train_tower           # frozen: no gradient at all


if __name__ == "__main__":
    worker(sys.argv[1])
    if torch.distributed.is_initialized():   # as tests/offload_worker.py: FSDP's meshes hold the group in cycles,
        import gc                            # collected here, not at exit after gloo is gone (a rank of this test
        gc.collect()                         # aborted once in CI, "terminate called"; when in the run, not logged)
        torch.distributed.barrier()   # tearing gloo down while a peer still works can abort ("terminate called")
        torch.distributed.destroy_process_group()
