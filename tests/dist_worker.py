"""Worker for tests/test_distributed.py: two GRPO updates on fixed global batches, at any world size.

    python tests/dist_worker.py MODEL OUT                            # one process
    torchrun --nproc_per_node=2 tests/dist_worker.py MODEL OUT       # two ranks (gloo on CPU, NCCL on GPUs)
    python tests/dist_worker.py MODEL OUT --resume OUT2/state1.pt    # step 2 only, from a saved full state

Why fixed batches: sampled rollouts depend on the world size (each rank has its own sampling stream), so an
equality test needs the same samples in both runs. The batches here come from the seed alone (random token
ids, completion lengths and 0/1 rewards, 8 groups of 4); every rank builds the whole batch and keeps its
share of groups, as train.py does with prompts. The update uses train.py's pieces: the algorithm's
advantages and loss, `distributed.loss_scale`, FSDP2 sharding, clipping, AdamW and `sync_weights` into a
separate full-weight engine copy. Rank 0 writes OUT/result.pt (losses, grad norms, engine weights) and
OUT/state1.pt (full model and optimizer state after step 1, for the resume check).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import algos  # noqa: E402,F401  (registers the algorithms)
import distributed  # noqa: E402
import registry  # noqa: E402
from buffer import Experience  # noqa: E402
from config import Config  # noqa: E402
from models import completion_logprobs, load_model  # noqa: E402
from engines.builtin import BuiltinEngine  # noqa: E402

G, N, P, C, VOCAB = 8, 4, 4, 6, 14   # groups, samples per group, prompt and completion widths, token ids < VOCAB


def make_batch(seed: int) -> Experience:
    g = torch.Generator().manual_seed(seed)
    B = G * N
    prompt_len = torch.randint(1, P + 1, (G,), generator=g).repeat_interleave(N)          # (B,) left-padded
    comp_len = torch.randint(1, C + 1, (B,), generator=g)                                 # (B,)
    cols = torch.arange(P + C)
    attention_mask = ((cols >= P - prompt_len[:, None]) & (cols < P + comp_len[:, None])).long()  # (B, P + C)
    input_ids = torch.randint(2, VOCAB, (B, P + C), generator=g) * attention_mask
    completion_mask = attention_mask[:, P:].float()                                        # (B, C)
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    return Experience(input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask,
                      sample_logprobs=torch.zeros(B, C), rewards=rewards,
                      group_ids=torch.arange(G).repeat_interleave(N), versions=torch.zeros(B, dtype=torch.long),
                      truncated=torch.zeros(B, dtype=torch.bool))


def local_share(batch: Experience) -> Experience:
    groups = torch.tensor(distributed.share(list(range(G))))                               # this rank's groups
    rows = (groups[:, None] * N + torch.arange(N)).flatten()
    local = batch.select(rows)
    local.group_ids = torch.arange(len(groups)).repeat_interleave(N)                      # local ids, like a rollout
    return local


def main(model_path: str, out: str, resume: str | None):
    rank, world = distributed.init()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = Config()
    cfg.algo.loss_agg = "token-mean"   # the mode whose normaliser (tokens) differs across ranks
    algo = registry.get("algo", cfg.algo.name)
    engine_model, _ = load_model(model_path, device, torch.float32)
    policy = engine_model
    if world > 1:
        policy = distributed.shard(load_model(model_path, torch.device("cpu"), torch.float32)[0], device,
                                   torch.float32)
    engine = BuiltinEngine(engine_model, eos_id=1, pad_id=0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.0)
    if resume:
        state = torch.load(resume, weights_only=False) if rank == 0 else {"model": {}, "optim": {}}
        distributed.load_full_state(policy, optimizer, state["model"], state["optim"])
    result = {"loss": {}, "grad_norm": {}}
    for step in ([2] if resume else [1, 2]):
        batch = local_share(make_batch(seed=step))
        batch.advantages = algo.advantages(batch, cfg.algo)
        mb = batch.to(device)
        logp, entropy = completion_logprobs(policy, mb.input_ids, mb.attention_mask, C)
        loss, _ = algo.loss({"logprobs": logp, "entropy": entropy}, mb, cfg.algo)
        loss = loss * distributed.loss_scale(mb.completion_mask, cfg.algo.loss_agg)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        optimizer.step()
        result["loss"][step] = distributed.all_sum([loss.item()])[0] / world     # the global-batch loss
        result["grad_norm"][step] = distributed.grad_norm_value(grad_norm)
        if step == 1:
            model_state, optim_state = distributed.full_state(policy, optimizer)
            if rank == 0:
                torch.save({"model": model_state, "optim": optim_state}, os.path.join(out, "state1.pt"))
    engine.load_weights(distributed.sync_weights(policy))
    if rank == 0:
        result["weights"] = {k: v.detach().cpu().clone() for k, v in engine_model.state_dict().items()}
        result["world"] = world
        torch.save(result, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[3] if len(args) > 3 and args[2] == "--resume" else None)
    if torch.distributed.is_initialized():   # as tests/offload_worker.py: FSDP's meshes hold the group in cycles,
        import gc                            # collected here, not at the interpreter's exit after gloo is gone
        gc.collect()
        torch.distributed.barrier()   # tearing gloo down while a peer still works can abort ("terminate called")
        torch.distributed.destroy_process_group()
