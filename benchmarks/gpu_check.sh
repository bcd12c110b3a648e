#!/usr/bin/env bash
# One short GPU check (<= 8 minutes): Newton–Schulz throughput vs the bf16 matmul peak,
# single-GPU step latency of canzona.Muon vs torch.optim.Muon, the host cost per matrix; then
# the GPU tests. Needs one CUDA device and a CUDA build of torch in the current environment.
# Runs from the source tree (no install: a GPU image may have no network); PYTHON picks the
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 "$PYTHON" benchmarks/gpu_check.py "$@"
# The GPU tests: canzona.Muon on CUDA against torch, state on the device, the host syncs of a
# step (one device and two ranks sharing it), CUDA-event calibration, the NCCL path.
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    timeout 240 "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/runtime/test_gpu.py
else
    echo "pytest is not installed here: tests/runtime/test_gpu.py not run"
fi
