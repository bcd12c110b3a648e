"""canzona.launch: results in rank order, progress, and every way a rank can fail, reported."""

from __future__ import annotations

import contextlib
import os
import signal
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


@pytest.mark.parametrize("world", [0, -2, 1.5, True])
def test_a_world_that_is_not_a_positive_int_is_refused(world: Any) -> None:
    """Catches: ``run_ranks(0, job)`` returning ``[]`` as if the job had run."""
    with pytest.raises(ValueError, match=f"world must be a positive int, got {world!r}"):
        run_ranks(world, _ok)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_run_leaves_no_file_descriptor_open() -> None:
    """Catches: the parent's pipe ends left open (one descriptor lost per rank per run)."""
    run_ranks(2, _ok)  # the first run may open what torch keeps for good
    before = _open_fds()
    for _ in range(2):
        run_ranks(2, _ok)
    assert _open_fds() == before


def _sleeps_and_reports(progress: Any) -> int:
    progress({"pid": os.getpid()})
    time.sleep(60)
    return 0


def test_ranks_are_gone_once_a_failure_is_reported() -> None:
    """Catches: a rank left running after the deadline's failure is reported."""
    pids: list[int] = []
    with pytest.raises(RankFailure, match="did not finish in time"):
        run_ranks(2, _sleeps_and_reports, lambda p: pids.append(p["pid"]), timeout_s=3.0)
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ranks_are_not_forked_from_a_process_in_a_process_group() -> None:
    from canzona.launch import prepare_parent

    dist.init_process_group("fake", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="without a default process group"):
            prepare_parent()
    finally:
        dist.destroy_process_group()


def _dies_leaving_a_child(progress: Any) -> int:
    if dist.get_rank() == 0:
        child = os.fork()
        if child == 0:  # holds rank 0's ends of its pipes open
            time.sleep(60)
            os._exit(0)
        progress({"child": child})
        os._exit(3)
    time.sleep(60)
    return 1


def test_a_rank_that_dies_leaving_a_forked_child_is_reported_at_once() -> None:
    """Catches: the death seen only through the pipe's end, which the child holds open (the
    launcher would wait for the deadline and call the rank late, not dead)."""
    children: list[int] = []
    try:
        with pytest.raises(RankFailure) as info:
            run_ranks(
                2, _dies_leaving_a_child, lambda p: children.append(p["child"]), timeout_s=30.0
            )
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    assert str(info.value).startswith("rank 0 failed:\ndied (exit code 3) without a result")
