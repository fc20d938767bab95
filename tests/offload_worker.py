"""Worker for tests/test_distributed.py: offload_optimizer's streamed AdamW step on FSDP2 shards.

    torchrun --nproc_per_node=2 tests/offload_worker.py OUT      # gloo on CPU, NCCL on GPUs (the state moves)

Two copies of one small model, sharded alike: one AdamW steps as usual, the other streamed (offload.stream, one
parameter per chunk). After three steps the shards and their AdamW state agree exactly on every rank, and the
streamed state sits in CPU memory; the full optimizer state gathered as checkpoint.py gathers it (inside
`offload.resident`) is the plain one's; loading it into a third streamed optimizer, as a resume does, leaves
that state in CPU memory again, equal to the second's. Rank 0 writes OUT/ok.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import distributed  # noqa: E402
import offload  # noqa: E402

MOMENTS = ("exp_avg", "exp_avg_sq")


def make(device: torch.device):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=device.type == "cuda")


def shard(state: dict, key: str) -> torch.Tensor:
    return state[key]._local_tensor   # this rank's part, wherever it lives (parked: CPU memory)


def main(out: str):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    rank, _ = distributed.init()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    (a, opt_a), (b, opt_b), (c, opt_c) = make(device), make(device), make(device)
    offload.stream(opt_b, device, chunk_bytes=1)
    offload.stream(opt_c, device)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank)).to(device)     # (6, 8) per rank
    for _ in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        for k in MOMENTS:
            assert shard(opt_b.state[q], k).device.type == "cpu"
            assert torch.equal(shard(opt_a.state[p], k).cpu(), shard(opt_b.state[q], k))
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    want = get_optimizer_state_dict(a, opt_a, options=opts)
    with offload.resident(opt_b):
        got = get_optimizer_state_dict(b, opt_b, options=opts)
    if rank == 0:
        assert got["state"].keys() == want["state"].keys() and len(want["state"]) == 4
        for name, state in want["state"].items():
            assert all(torch.equal(got["state"][name][k], state[k]) for k in MOMENTS)
    with offload.resident(opt_c):   # as checkpoint.py loads
        set_optimizer_state_dict(c, opt_c, got, options=StateDictOptions(full_state_dict=True,
                                                                         broadcast_from_rank0=True))
    for q, r in zip(b.parameters(), c.parameters()):
        for k in MOMENTS:
            assert shard(opt_c.state[r], k).device.type == "cpu"
            assert torch.equal(shard(opt_c.state[r], k), shard(opt_b.state[q], k))
    if rank == 0:
        open(os.path.join(out, "ok"), "w").close()


if __name__ == "__main__":
    main(sys.argv[1])
    if torch.distributed.is_initialized():   # as tests/dist_worker.py: a gloo group left to the interpreter's exit
        import gc                            # aborted one run in five here ("terminate called without an active
        gc.collect()                         # exception" after the work was done); FSDP's meshes hold it in cycles
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
