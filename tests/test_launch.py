"""canzona.launch: results in rank order, progress, and every way a rank can fail, reported."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch.distributed as dist

from canzona.launch import RankFailure, run_ranks


def _ok(progress: Any) -> int:
    progress({"rank": dist.get_rank()})
    return dist.get_rank() * 10


def test_results_come_back_in_rank_order_with_progress() -> None:
    seen: list[dict[str, Any]] = []
    assert run_ranks(2, _ok, seen.append) == [0, 10]
    assert sorted(p["rank"] for p in seen) == [0, 1]


def _fail_on_rank_1(progress: Any) -> int:
    if dist.get_rank() == 1:
        raise RuntimeError("rank one breaks")
    time.sleep(60)  # busy elsewhere: it never reports on its own
    return dist.get_rank()


def test_a_failing_rank_is_named_with_its_traceback_and_the_others_stopped() -> None:
    """Catches: a failure reported without the rank's traceback, or a launcher that waits
    for a rank that will not finish once another one failed (rank 0 would then end its
    sleep and fail at the closing barrier with an error of its own)."""
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _fail_on_rank_1)
    text = str(info.value)
    assert text.startswith("rank 1 failed:\nTraceback")
    assert "RuntimeError: rank one breaks" in text
    assert text.endswith("\nrank 0 stopped after another rank failed")


def _dies_on_rank_0(progress: Any) -> int:
    if dist.get_rank() == 0:
        os._exit(3)
    return 1


def test_a_rank_that_dies_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RankFailure, match=r"rank 0 failed:\ndied \(exit code 3\)"):
        run_ranks(2, _dies_on_rank_0)


def _sleeps(progress: Any) -> int:
    time.sleep(60)
    return 0


def test_a_deadline_stops_every_rank() -> None:
    with pytest.raises(RankFailure, match="rank 0 did not finish in time\nrank 1 did not finish"):
        run_ranks(2, _sleeps, timeout_s=1.0)
