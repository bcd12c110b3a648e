"""The GPU tests' ranks run on the CPU: the code behind tests/runtime/test_gpu.py stays runnable."""

from __future__ import annotations

from pathlib import Path

import _gpu_ranks


def test_the_gpu_ranks_run_on_the_cpu(tmp_path: Path) -> None:
    """Two spawned gloo ranks run the distributed GPU test's steps on the CPU (no sync count).

    Catches: the GPU test's scenario broken by a change made without a GPU at hand (an API it
    calls renamed, a result it reads gone): on a machine without CUDA it is otherwise skipped.
    """
    # with tiny micro-groups, as the GPU test of fused exchanges runs them
    # and through the re-pricing of the plan by the steps' calls (before step 5)
    reports = _gpu_ranks.launch("gloo", 2, tmp_path, device="cpu", capacity_mb=1e-3, steps=6)
    for r in reports:
        assert r["micro_groups"] >= 3 and r["collectives"] == r["micro_groups"] + 1, r
        assert r["bitwise"] == [True] * len(_gpu_ranks.SHAPES)
        assert r["planned"] is True
        assert r["cost_models"] == ["MeasuredCost"]
        assert r["timed_shapes"] and all(tuple(s) in _gpu_ranks.SHAPES for s in r["timed_shapes"])
        assert r["bytes_sent"] > 0
        assert (r["syncs_per_step"], r["sync_sites"]) == ([], [])
        assert r["repricings"] == 1
        assert r["priced_shapes"] == sorted([list(s) for s in set(_gpu_ranks.SHAPES)])
    assert reports[0]["timed_shapes"] == reports[1]["timed_shapes"]
