#!/usr/bin/env bash
# W5 (docs/benchmarks.md, docs/async.md): W1 on one GPU (sync) against two GPUs, colocated (parallel=replicate)
# and disaggregated (mode=async: rank 0 trains, rank 1 generates, max_staleness=1), in one command.
#     bash tools/gpu_async.sh OUT [STEPS]          # needs 2 GPUs; OUT/*/bench.md hold the tables
# With 3 or more GPUs it also runs 1 rollout + 2 trainer ranks on 3 of them (mode=async, the trainers FSDP2 or
# replicate among themselves), the same 128 samples per step.
# Samples per step are the same (128) in every run, so samples/s ratios are step-time ratios: async's step is the
# trainer's wall time per step (time/step), the others' the sum of their phases (tools/bench.py part_ours).
set -euo pipefail
OUT=${1:-bench-async}
STEPS=${2:-12}
VARIANT=32:ckpt:compile
python tools/bench.py --parts ours --ours $VARIANT --steps "$STEPS" --gpus 1 --out "$OUT/sync-1gpu"
python tools/bench.py --parts ours --ours $VARIANT:rep --steps "$STEPS" --gpus 2 --out "$OUT/replicate-2gpu"
python tools/bench.py --parts ours --ours $VARIANT --steps "$STEPS" --gpus 2 --out "$OUT/async-2gpu" \
    --set "mode=async rollout_ranks=1 max_staleness=1 algo.tis=token"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 3 ]; then   # 1 rollout + 2 trainer ranks
    for P in fsdp rep; do
        python tools/bench.py --parts ours --ours $VARIANT$([ $P = rep ] && echo :rep) --steps "$STEPS" --gpus 3 \
            --out "$OUT/async-3gpu-$P" --set "mode=async rollout_ranks=1 max_staleness=1 algo.tis=token"
    done
fi
python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
res = {}
for name in ("sync-1gpu", "replicate-2gpu", "async-2gpu", "async-3gpu-fsdp", "async-3gpu-rep"):
    if name.startswith("async-3gpu") and not os.path.exists(os.path.join(out, name)):
        continue   # fewer than 3 GPUs
    got = json.load(open(os.path.join(out, name, "bench.json")))
    res[name] = next((v for k, v in got.items() if k.startswith("ours")), None)
base = res["sync-1gpu"]["step_s"]
import torch
print(f"W5 on {torch.cuda.get_device_name()} (128 samples per step)")
for name, r in res.items():
    if r is None:
        print(f"{name}: failed (see {out}/{name}/*.log)")
        continue
    print(f"{name}: step {r['step_s']:.3f} s (steps {', '.join(f'{s:.3f}' for s in r['steps_s'])}), "
          f"samples/s {128 / r['step_s']:.1f} = {base / r['step_s']:.2f}x of 1-GPU sync; split {r['split_s']}")
PY
