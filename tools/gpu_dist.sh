#!/usr/bin/env bash
# Issue 8 on one machine with 2 GPUs, in one command: the distributed tests on GPUs (NCCL fixed-batch
# equivalence; train.py 1 process vs 2 ranks for GRPO, PPO with its critic and REINFORCE++; train.py on 2 GPUs:
# FSDP, offload, replicate), then W1 (docs/benchmarks.md) through train.main on 1 GPU, under torchrun on 2,
# and on 1 GPU again, so both step times come from one machine.
#
#     bash tools/gpu_dist.sh OUT       # OUT/bench-*/bench.md: the tables; OUT/tests.tgz: every test process's log
#     OURS=64:compile:rep bash tools/gpu_dist.sh OUT   # other 2-GPU variants (tools/bench.py --ours)
#
# The 1-GPU update is partly host-bound (docs/speed.md), so the 1-GPU baseline runs before and after the 2-GPU
# runs, each preceded by a fixed Python loop's time. 12 measured steps each: in a run whose compiles hit the
# cache, the first ~5 steps are slow while inductor's compile workers start beside it (docs/speed.md), so the
# second 1-GPU run goes without them.
# The tests run side by side (they mostly wait on imports and compiles), each cut at 240 s so that a hang
# cannot eat the benchmark's time. NVLink multicast stays off, as the shared GPU hosts measured here require.
set -u
out=${1:?usage: bash tools/gpu_dist.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
host_speed() { python3 -c "import time; t = time.perf_counter(); sum(i * i for i in range(10**7))
print(f'host speed: a 1e7-step Python loop took {time.perf_counter() - t:.3f} s')"; }
tmp=$(mktemp -d)
for t in fsdp_update train_under_torchrun train_on_two_gpus ppo_critic reinforce_pp; do
    timeout 240 python3 -m pytest tests/test_distributed.py -q -x -p no:cacheprovider -k "$t" \
        --basetemp="$tmp/$t" >"$tmp/pytest-$t.log" 2>&1 &
done
wait
for t in "$tmp"/pytest-*.log; do echo "== $t"; tail -n 25 "$t"; done
(cd "$tmp" && tar czf "$out/tests.tgz" $(find . -name '*.log' -o -name metrics.jsonl))
base=32:ckpt:compile
for run in "1 $base 1a" "2 ${OURS:-$base:rep,$base} 2" "1 $base 1b"; do
    set -- $run
    host_speed
    # 1b's compiles all hit the cache that 1a filled; without inductor's compile-worker pool its first steps
    # are not slowed by the pool starting (measured: docs/speed.md, "Seventh session")
    pool=(); [ "$3" = 1b ] && pool=(env TORCHINDUCTOR_COMPILE_THREADS=1)
    "${pool[@]}" python3 tools/bench.py --parts ours --gpus "$1" --ours "$2" --steps 12 --out "$out/bench-$3" |
        grep -E '^\| this|^split'
done
host_speed
