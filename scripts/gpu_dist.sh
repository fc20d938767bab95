#!/usr/bin/env bash
# Issue 8 on one machine with 2 GPUs, in one command: the distributed tests that need GPUs (NCCL fixed-batch
# equivalence, train.py 1 process vs 2 ranks, train.py on 2 GPUs with and without offload), then W1 through
# train.main on 1 GPU and under torchrun on 2 (bench.py --gpus 1,2), so both step times come from one machine.
#
#     bash scripts/gpu_dist.sh OUT       # OUT/bench/bench.md: the table; OUT/tests.tgz: every test process's log
#     OURS=64 bash scripts/gpu_dist.sh OUT   # other bench.py --ours variants (default: the #9 one and micro 64)
#
# The tests run side by side (they mostly wait on imports and compiles), each cut at 120 s so that a hang
# cannot eat the benchmark's time. NVLink multicast stays off (shared machines: see the device notes).
set -u
out=${1:?usage: bash scripts/gpu_dist.sh OUT}
mkdir -p "$out/bench"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
tmp=$(mktemp -d)
for t in fsdp_update train_under_torchrun train_on_two_gpus; do
    timeout 120 python3 -m pytest tests/test_distributed.py -q -x -p no:cacheprovider -k "$t" \
        --basetemp="$tmp/$t" >"$tmp/pytest-$t.log" 2>&1 &
done
wait
for t in "$tmp"/pytest-*.log; do echo "== $t"; tail -n 25 "$t"; done
(cd "$tmp" && tar czf "$out/tests.tgz" $(find . -name '*.log' -o -name metrics.jsonl))
python3 bench.py --parts ours --gpus 1,2 --ours "${OURS:-32:ckpt:compile,64:compile}" --out "$out/bench"
