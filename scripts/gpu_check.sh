#!/usr/bin/env bash
# The GPU code paths on a CUDA host, in one go (what the `device` tool of this workplace runs; any GPU
# host with torch, onnxruntime and pytest can run it too):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Prints the GPU, torch/onnxruntime and their execution providers, then runs tests/host/test_gpu.py and the
# device tests; the log goes to OUT_DIR/gpu_check.log. Wheels in .whl/ (e.g. torchserve, for the
# handler tests, where it is not installed) are put on the path first.
set -uo pipefail
out=${1:-${OUT:-/tmp}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    nvidia-smi -L || true
    python3 - <<'PY'
import torch, onnxruntime as ort
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("onnxruntime", ort.__version__, ort.get_available_providers())
PY
    python3 -m pytest -q -rs -p no:cacheprovider tests/host/test_gpu.py tests/host/test_device.py
} 2>&1 | tee "$out/gpu_check.log"
