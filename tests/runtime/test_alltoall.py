"""The runtime's all-to-all issued on the process group equals ``dist.all_to_all_single``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime import alltoall
from canzona.runtime.alltoall import all_to_all


def _exchange(group_kind: str, direct: bool = True) -> list[list[float]]:
    """Uneven splits (rank r sends r + j + 1 elements to rank j) on the default group and a
    new gloo group of the same ranks, against the wrapper's result. ``direct=False``: as
    where process groups have no all-to-all of their own (torch 2.11), counting that the
    call took the wrapper."""
    if not direct:
        wrapper, calls = dist.all_to_all_single, []

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs.get("async_op"))
            return wrapper(*args, **kwargs)

        alltoall.DIRECT, dist.all_to_all_single = False, counted
        try:
            got = _exchange(group_kind)
        finally:
            alltoall.DIRECT, dist.all_to_all_single = True, wrapper
        return [*got, [float(len(calls)), float(calls == [True, None])]]
    rank, world = dist.get_rank(), dist.get_world_size()
    group = None if group_kind == "default" else dist.new_group(backend="gloo")
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [j + rank + 1 for j in range(world)]
    inp = torch.arange(sum(in_splits), dtype=torch.float32) + 100 * rank
    got = torch.full((sum(out_splits),), -1.0)
    want = torch.full((sum(out_splits),), -1.0)
    all_to_all(got, inp, out_splits, in_splits, group).wait()
    dist.all_to_all_single(want, inp, out_splits, in_splits, group=group)
    equal = [torch.equal(got, want), got.tolist() == want.tolist()]
    if group is not None:
        dist.destroy_process_group(group)
    return [got.tolist(), [float(e) for e in equal]]


def test_uneven_all_to_all_equals_the_c10d_wrapper(dist: Any) -> None:
    for kind in ("default", "new"):
        results = dist(2).run(_exchange, kind)
        # rank 0 receives 1 element from itself and 2 from rank 1, rank 1: 2 and 3
        assert results[0][0] == [0.0, 100.0, 101.0]
        assert results[1][0] == [1.0, 2.0, 102.0, 103.0, 104.0]
        assert all(r[1] == [1.0, 1.0] for r in results)


def test_without_a_process_group_all_to_all_the_call_takes_the_wrapper(dist: Any) -> None:
    """Catches: the process group's own all_to_all_single called where it does not exist
    (torch 2.11's ProcessGroup has none)."""
    assert alltoall.DIRECT  # torch 2.13, which the project pins
    results = dist(2).run(_exchange, "new", False)
    assert results[0][0] == [0.0, 100.0, 101.0]
    assert results[1][0] == [1.0, 2.0, 102.0, 103.0, 104.0]
    # ours (async) then the reference call (blocking) went through the wrapper
    assert all(r[1] == [1.0, 1.0] and r[2] == [2.0, 1.0] for r in results)
