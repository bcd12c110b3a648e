#!/usr/bin/env bash
# One short GPU check (<= 10 minutes): Newton–Schulz throughput vs the bf16 matmul peak,
# single-GPU step latency of canzona.Muon vs torch.optim.Muon, the host cost per matrix; cost
# tables of Qwen3 models timed on the GPU (for benchmarks/device_plans.py); then the GPU
# tests. Needs one CUDA device and a CUDA build of torch in the current environment.
# Runs from the source tree (no install: a GPU image may have no network); PYTHON picks the
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 "$PYTHON" benchmarks/gpu_check.py "$@"
# canzona calibrate on this device, one table per model, split and world size, each shape
# timed on the stack an owner of that world's plan forms (CANZONA_TABLES: where).
TABLES="${CANZONA_TABLES:-benchmarks/results/device_costs}"
mkdir -p "$TABLES"
timeout 300 "$PYTHON" - "$TABLES" <<'EOF'
import sys

from canzona.cli import main

for model, split in (("qwen3-32b", "heads"), ("qwen3-32b", "qkv"), ("qwen3-30b-a3b", "qkv")):
    for world in (8, 64, 256):
        out = f"{sys.argv[1]}/{model}__{split}__w{world}.json"
        argv = ["calibrate", "--model", model, "--split", split, "--world", str(world)]
        if main([*argv, "--device", "cuda", "--budget", "60", "--out", out]):
            sys.exit(1)
EOF
# The GPU tests: canzona.Muon on CUDA against torch, state on the device, the host syncs of a
# step (one device and two ranks sharing it), CUDA-event calibration, the NCCL path.
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    timeout 240 "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/runtime/test_gpu.py
else
    echo "pytest is not installed here: tests/runtime/test_gpu.py not run"
fi
