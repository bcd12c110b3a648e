#!/usr/bin/env bash
# One short GPU check (<= 8 minutes): Newton–Schulz throughput vs the bf16 matmul peak and
# single-GPU step latency of canzona.Muon vs torch.optim.Muon. Needs one CUDA device and a
# CUDA build of torch (>= 2.13) in the current environment; then the GPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e . --no-deps
timeout 300 python benchmarks/gpu_check.py "$@"
# The GPU tests: canzona.Muon on CUDA against torch, state on the device, no host sync in a step.
if python -c "import pytest" 2>/dev/null; then
    timeout 180 python -m pytest -q -p no:cacheprovider tests/runtime/test_gpu.py
else
    echo "pytest is not installed here: tests/runtime/test_gpu.py not run"
fi
