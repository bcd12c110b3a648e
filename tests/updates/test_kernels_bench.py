"""Smoke test: the kernel benchmark runs end to end on tiny shapes and writes where it is told."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def test_kernels_benchmark_tiny(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("kernels_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    argv = ["--models", "qwen3-0.6b", "--scale", "128", "--batch", "2", "--repeats", "1"]
    payload = module.main([*argv, "--out-dir", str(tmp_path), "--doc", str(doc)])

    rows = payload["results"]
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"}
    assert all(r["batched_gflops"] > 0 and r["loop_gflops"] > 0 for r in rows)
    assert all(r["bitwise_equal"] for r in rows if r["default_uses_batched"])
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert saved["results"] == rows and "machine" in saved
    text = doc.read_text()
    assert "kept" in text and "<!-- BEGIN kernels -->" in text and "GFLOP/s" in text
