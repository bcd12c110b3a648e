"""Which ranks already hold a matrix whole, and which held matrices stay put (no processes)."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from canzona.runtime.routing import build_items, item_holders, plan_specs
from canzona.runtime.topology import ParamLayout, Topology


def _topology(params: dict[str, tuple[tuple[int, ...], Placement]]) -> Topology:
    """Parameters on one (2,) mesh, one placement each."""
    layouts = tuple(
        ParamLayout(i, name, shape, torch.float32, (2,), None, (placement,), (0, 1))
        for i, (name, (shape, placement)) in enumerate(params.items())
    )
    return Topology(layouts, {((2,), None): ((0, 1),)}, 0, 2)


def test_holders_and_the_held_matrices_that_stay() -> None:
    """Catches: a 2-D matrix that one rank holds pinned there like an expert (refinement
    could no longer move it), and experts in strided runs taken as replicated."""
    topo = _topology(
        {
            "experts": ((4, 8, 6), Shard(0)),  # experts 0-1 on rank 0, 2-3 on rank 1
            "strided": ((4, 8, 6), _StridedShard(0, split_factor=2)),  # 0, 2 | 1, 3
            "row": ((1, 8), Shard(0)),  # one row: rank 0 holds it, rank 1 nothing
            "rows": ((4, 8), Shard(0)),  # cut in two: nobody holds it
            "copied": ((4, 8), Replicate()),  # every rank holds it: no holder to prefer
        }
    )
    items = build_items(topo, range(5), replica_dedup=True)
    holders = item_holders(items, topo)
    assert holders == {
        "experts[0]": (0,),
        "experts[1]": (0,),
        "experts[2]": (1,),
        "experts[3]": (1,),
        "strided[0]": (0,),
        "strided[1]": (1,),
        "strided[2]": (0,),
        "strided[3]": (1,),
        "row": (0,),
    }
    specs = {s.name: s for s in plan_specs(items, lambda p: 4, holders=holders)}
    assert {n for n, s in specs.items() if s.pinned} == {n for n in holders if "[" in n}
    assert specs["row"].holders == (0,) and not specs["row"].pinned
    assert specs["rows"].holders is None and specs["copied"].holders is None
