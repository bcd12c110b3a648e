"""The runtime's all-to-all issued on the process group equals ``dist.all_to_all_single``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.alltoall import all_to_all


def _exchange(group_kind: str) -> list[list[float]]:
    """Uneven splits (rank r sends r + j + 1 elements to rank j) on the default group and a
    new gloo group of the same ranks, against the wrapper's result."""
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
