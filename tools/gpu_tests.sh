#!/usr/bin/env bash
# Every test that uses a GPU, then every Triton kernel under compute-sanitizer's memcheck, in one command:
#
#     bash tools/gpu_tests.sh OUT        # OUT/: one log per stage, junit XML per pytest run; prints a table by
#                                        # file and `N passed, N failed`; exits 1 on any failure
#     bash tools/gpu_tests.sh /tmp/gt; rc=$?; tar czf $OUT/gpu_tests.tgz -C /tmp gt; exit $rc
#                                        # where only a few files of OUT come back (the device tool): one archive
#
# Stages, all started at once (each has its own time budget, seconds, overridable by the variable named; the whole
# run takes about the longest budget that a stage needs: 313 s on 2 H200s at the first gate with every kernel swept):
#   tests      GPU tests of tests/test_lora.py then tests/test_multiturn.py, in one process, in that order: lora.tf32's
#              precision once leaked into the multi-turn graph test  (T_TESTS=540: `kernels` took 276 and 377 s in
#              the two gates of 2026-11-28, the second host ~35% slower in every stage)
#   kernels    every other test with a CUDA/GPU skip marker (tools/gpu_only.py finds them)  (T_TESTS)
#   graphs     tests/test_capture_fallback.py, on GPU 0: the compile-heavy capture test in a process of its own (the
#              gate of 2026-11-28 ran `kernels` out of 400 s, its last test after them unfinished)  (T_TESTS)
#   arch-*     tests/test_architectures.py's GPU tests (every family graphed and compiled; the generic path's step
#              compiles too), in two processes  (T_ARCH=540: arch-train 259-359 s)
#   dist       with 2+ GPUs: tests/test_distributed.py, in 6 groups side by side  (T_DIST=300); on one GPU the
#              table has a skipped `dist` row instead, so a one-GPU run does not pass for the whole gate
#   sweep      tools/kernel_sweep.py --size gpu: each kernel against its torch twin at edge shapes, in three
#              processes (each family's first launches are mostly Triton compiles): `sweep` the sampling,
#              decode-attention and log-prob families and the decoder, `sweep-exact` the exact path's kernels,
#              `sweep-more` decode attention's options and the fused KL's, the FP8 and the MoE experts' kernels
#              (tools/kernel_families*.py)  (T_SWEEP=400: the first gate with them ran `sweep` out of 270)
#   sanitizer  the sweep's smaller size under `compute-sanitizer --tool memcheck`, 9 processes  (T_SAN=330);
#              the FP8 families print one `skip` line on a card without FP8 (before sm_89) and count nothing
# A stage that runs out of time counts as one failure. GPU 0 takes the tests, `graphs`, `sweep`, `sweep-exact` and half of
# the sanitizer runs; GPU 1 (when there is one) the kernel tests, `sweep-more` and the other half; the family tests
# go to GPUs 2 and 3 where there are 4, else share GPUs 0 and 1. Every family of tools/kernel_sweep.py belongs in
# one `sanitize` line below and one `sweep` line (tests/test_kernel_edges.py checks).
# Under the sanitizer: expandable segments off (torch's allocator then fails with "cuMemCreate: operation not
# permitted"), and for the kernel families no caching allocator either, so that each tensor is its own allocation
# and a read just outside it is reported instead of landing in a neighbour (the decoder family keeps the cache:
# its CUDA graph capture cannot call cudaMalloc).
set -u
out=${1:?usage: bash tools/gpu_tests.sh OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
T_TESTS=${T_TESTS:-540} T_ARCH=${T_ARCH:-540} T_DIST=${T_DIST:-300} T_SWEEP=${T_SWEEP:-400} T_SAN=${T_SAN:-330}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$ngpu" -lt 1 ]; then echo "error: no GPU visible (torch.cuda.device_count() = 0)"; exit 2; fi
g1=$((ngpu > 1 ? 1 : 0))
g2=$((ngpu > 2 ? 2 : 0)) g3=$((ngpu > 3 ? 3 : g1))   # with 4 GPUs the family tests get their own
{
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
                'transformers', transformers.__version__)"
    echo "budgets (s): tests $T_TESTS, dist $T_DIST, sweep $T_SWEEP, sanitizer $T_SAN; started $(date -u +%FT%TZ)"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)
tmp=$(mktemp -d)

pytest_stage() {   # name gpu budget args...: one pytest process, junit XML and log under OUT
    local name=$1 gpu=$2 budget=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu timeout -k 15 "$budget" python3 -m pytest -v -p no:cacheprovider -p tools.gpu_only \
        --basetemp="$tmp/$name" --junitxml="$out/junit-$name.xml" "$@" >"$out/$name.log" 2>&1
    echo $? >"$out/$name.rc"
}

sanitize() {   # name gpu uncached families: the sweep's sanitizer size under memcheck
    local name=$1 gpu=$2 uncached=$3 fams=$4
    if [ -z "$san" ]; then echo "compute-sanitizer not found" >"$out/$name.log"; echo 127 >"$out/$name.rc"; return; fi
    local env=(CUDA_VISIBLE_DEVICES="$gpu" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)
    [ "$uncached" = 1 ] && env+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    env "${env[@]}" timeout -k 15 "$T_SAN" "$san" --tool memcheck --report-api-errors no --print-limit 50 \
        --error-exitcode 99 python3 tools/kernel_sweep.py --size sanitizer --only "$fams" >"$out/$name.log" 2>&1
    echo $? >"$out/$name.rc"
}

sweep() {   # name gpu families: the sweep's gpu size, each kernel against its twin
    CUDA_VISIBLE_DEVICES=$2 timeout -k 15 "$T_SWEEP" python3 tools/kernel_sweep.py --size gpu --only "$3" \
        >"$out/$1.log" 2>&1
    echo $? >"$out/$1.rc"
}

dist_stage() {   # name -k expression [file]: part of tests/test_distributed.py (or the file) on GPUs 0 and 1
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 "$T_DIST" python3 -m pytest -q -p no:cacheprovider \
        "${3:-tests/test_distributed.py}" -k "$2" --basetemp="$tmp/$1" --junitxml="$out/junit-$1.xml" \
        >"$out/$1.log" 2>&1
    echo $? >"$out/$1.rc"
}

pytest_stage tests 0 "$T_TESTS" tests/test_lora.py tests/test_multiturn.py &
pytest_stage kernels "$g1" "$T_TESTS" tests --ignore=tests/test_lora.py --ignore=tests/test_multiturn.py \
    --ignore=tests/test_distributed.py --ignore=tests/test_architectures.py \
    --ignore=tests/test_capture_fallback.py &
pytest_stage graphs 0 "$T_TESTS" tests/test_capture_fallback.py &
# every model family graphed and compiled: mostly compile time, so in two processes of their own
pytest_stage arch-decode "$g2" "$T_ARCH" tests/test_architectures.py -k "not compiled_layers and not fsdp2" &
pytest_stage arch-train "$g3" "$T_ARCH" tests/test_architectures.py -k "compiled_layers" &
if [ "$ngpu" -ge 2 ]; then   # as tools/gpu_dist.sh: they mostly wait on imports and compiles, so side by side
    groups=(fsdp_update train_under_torchrun train_on_two_gpus ppo_critic reinforce_pp)
    for k in "${groups[@]}"; do dist_stage "dist-$k" "$k" & done
    dist_stage dist-rest "not ($(printf '%s or ' "${groups[@]}" | sed 's/ or $//'))" &
    dist_stage dist-arch-fsdp2 fsdp2 tests/test_architectures.py &   # qwen3 and qwen3_moe under FSDP2 (#32)
else   # the summary says so: a one-GPU run is not the whole gate
    echo "needs 2 GPUs, $ngpu visible" >"$out/dist-skipped.txt"
fi
sweep sweep 0 sample,decode,logprob,linear,loss,decoder &
sweep sweep-exact 0 exact_gemm,exact_cat,exact_silu,exact_attn,exact_rope,exact_rows &
sweep sweep-more "$g1" decode_opts,fused_kl,fp8_gemm,fp8_quant,moe,moe_route &
sanitize sanitizer-sample 0 1 sample &
sanitize sanitizer-logprob 0 1 logprob,linear,loss &
sanitize sanitizer-exact-attn 0 1 exact_attn,exact_rope,exact_rows &
sanitize sanitizer-fp8-moe 0 1 fp8_gemm,fp8_quant,moe,moe_route &
sanitize sanitizer-opts 0 1 decode_opts &
sanitize sanitizer-decode "$g1" 1 decode &
sanitize sanitizer-decoder "$g1" 0 decoder &
sanitize sanitizer-exact-gemm "$g1" 1 exact_gemm,exact_cat,exact_silu &
sanitize sanitizer-kl "$g1" 1 fused_kl &
wait
rm -rf "$tmp"
echo "wall: $(($(date +%s) - t0)) s on $ngpu GPU(s)"
python3 - "$out" <<'EOF'
import glob, os, re, sys
import xml.etree.ElementTree as ET

out = sys.argv[1]
rows = []   # (stage, file or family, passed, failed, skipped, note)


def rc(name):
    try:
        return int(open(os.path.join(out, name + ".rc")).read())
    except (OSError, ValueError):
        return -1


for path in sorted(glob.glob(os.path.join(out, "junit-*.xml"))):
    stage = os.path.basename(path)[6:-4]
    by_file = {}
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except ET.ParseError:
        cases = []
    for c in cases:
        f = c.get("classname", "?").replace(".", "/") + ".py"
        n = by_file.setdefault(f, [0, 0, 0])
        kinds = {x.tag for x in c}
        n[2 if "skipped" in kinds else 1 if kinds & {"failure", "error"} else 0] += 1
    for f, (p, fl, s) in sorted(by_file.items()):
        rows.append((stage, f, p, fl, s, ""))
    code = rc(stage)
    if code in (124, 137):
        rows.append((stage, "(time budget)", 0, 1, 0, "timed out: see " + stage + ".log"))
    elif code not in (0, 5) and not any(r[3] for r in rows if r[0] == stage):
        rows.append((stage, "(pytest)", 0, 1, 0, f"exit {code}: see {stage}.log"))
pytest_stages = ["tests", "kernels", "graphs", "arch-decode", "arch-train"] + [os.path.basename(p)[:-3] for p in glob.glob(os.path.join(out, "dist-*.rc"))]
for stage in [s for s in pytest_stages if not os.path.exists(os.path.join(out, f"junit-{s}.xml"))]:
    rows.append((stage, "(pytest)", 0, 1, 0, f"no junit XML (exit {rc(stage)}): see {stage}.log"))
if os.path.exists(os.path.join(out, "dist-skipped.txt")):
    why = open(os.path.join(out, "dist-skipped.txt")).read().strip()
    rows.append(("dist", "tests/test_distributed.py, FSDP2 families", 0, 0, 1, f"not run: {why}"))

logs = lambda pattern: sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(out, pattern)))
for log in logs("sweep*.log") + logs("sanitizer-*.log"):
    text = open(os.path.join(out, log + ".log"), errors="replace").read()
    fams = {}
    for m in re.finditer(r"^(ok|FAIL) +(\w+) ", text, re.M):
        n = fams.setdefault(m.group(2), [0, 0])
        n[m.group(1) == "FAIL"] += 1
    for fam, (p, fl) in sorted(fams.items()):
        rows.append((log, f"tools/kernel_sweep.py {fam}", p, fl, 0, ""))
    for m in re.finditer(r"^skip +(\w+) +(.*)$", text, re.M):   # a family this card cannot run (FP8 before sm_89)
        rows.append((log, f"tools/kernel_sweep.py {m.group(1)}", 0, 0, 1, m.group(2)[:80]))
    code, note = rc(log), ""
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    if log.startswith("sanitizer-") and (not errors or int(errors[-1])):
        note = f"memcheck: {errors[-1]} errors" if errors else "no memcheck summary"
    if code in (124, 137):
        note = (note + "; " if note else "") + "timed out"
    elif not re.search(r"^\d+ passed, \d+ failed$", text, re.M):
        note = note or f"no summary line (exit {code})"
    elif code not in (0, 1) and not note:
        note = f"exit {code}"
    if note:
        rows.append((log, "(process)", 0, 1, 0, f"{note}: see {log}.log"))

w = max(len(r[1]) for r in rows) if rows else 10
print(f"\n{'stage':20s} {'file / family':{w}s} {'passed':>6s} {'failed':>6s} {'skipped':>7s}")
for stage, f, p, fl, s, note in rows:
    print(f"{stage:20s} {f:{w}s} {p:6d} {fl:6d} {s:7d}  {note}".rstrip())
passed, failed = sum(r[2] for r in rows), sum(r[3] for r in rows)
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed or not passed else 0)
EOF
