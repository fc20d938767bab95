#!/usr/bin/env bash
# W4 (docs/benchmarks.md) on one GPU, in one command: the GPU tests of tests/test_multiturn.py (the CUDA-graphed,
# compiled multi-turn step against the portable loop and teacher forcing), then tools/bench.py's w4 part:
# multi-turn episodes on the fast path against W1's single-turn rollout of the same length, and the portable
# multi-turn loop for reference.
#
#     bash tools/gpu_w4.sh OUT        # OUT/bench.md: the table and the ratio; OUT/tests.log: the tests' output
#     PYTHON=.venv/bin/python SMALL=1 bash tools/gpu_w4.sh OUT    # the same at toy shapes on a CPU (GPU tests skip)
#     FAST_ONLY=1 W4_PROFILE=1 bash tools/gpu_w4.sh OUT    # no portable loop (~10 s); OUT/w4_profile.txt: torch.profiler
# 7 timed calls per variant (the median); the fast multi-turn row also gets a per-phase split (3 more, synchronised).
set -u
out=${1:?usage: bash tools/gpu_w4.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
timeout 400 "$py" -m pytest tests/test_multiturn.py -q -p no:cacheprovider -k "fast_path" >"$out/tests.log" 2>&1
echo "== tests/test_multiturn.py -k fast_path (exit $?):"; tail -n 15 "$out/tests.log"
W4_PROFILE_OUT="$out/w4_profile.txt" "$py" tools/bench.py --parts w4 --repeats 7 ${SMALL:+--small} \
    ${FAST_ONLY:+--fast-only} --out "$out" | grep -E '^part '   # done in N s, or why it failed
sed -n '/^| W4/,$p' "$out/bench.md"
