"""Which ranks already hold a matrix whole, and which held matrices stay put (no processes)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from canzona.plan import Split
from canzona.runtime.layout import LayoutError
from canzona.runtime.routing import Item, _item_part, build_items, item_holders, plan_specs
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


def _coord(position: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """A row-major mesh position's coordinate."""
    strides = [math.prod(mesh_shape[i + 1 :]) for i in range(len(mesh_shape))]
    return tuple(position // s % n for s, n in zip(strides, mesh_shape, strict=True))


def _holders_one_by_one(items: list[Item], topology: Topology) -> dict[str, tuple[int, ...]]:
    """The reference: the ranks whose routed fragment of the item (what a step reads from
    their shard) is all of it, each rank and item on its own."""
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        layout = topology.layouts[item.param]
        if item.is_local or not any(
            isinstance(p, Shard | _StridedShard) for p in layout.placements
        ):
            continue
        held = []
        for r in item.unit:
            frag, _, _ = _item_part(layout, _coord(item.copy.index(r), layout.mesh_shape), item)
            if frag is not None and frag.numel == item.m * item.n:
                held.append(r)
        if held and len(held) < len(item.unit):
            out[item.name] = tuple(sorted(held))
    return out


_PLACEMENTS = st.sampled_from(
    [Shard(0), Shard(1), Replicate(), _StridedShard(0, split_factor=2), Shard(2)]
)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    mesh_shape=st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (8,)]),
    rows=st.integers(1, 24),
    cols=st.integers(1, 12),
    stack=st.booleans(),
)
def test_holders_by_position_equal_the_ranks_read_one_by_one(
    data: st.DataObject, mesh_shape: tuple[int, ...], rows: int, cols: int, stack: bool
) -> None:
    """Blocks of every size and dimension, stacks, uneven and strided shards on 1-D and 2-D
    meshes: the cover indexed by position names the holders that reading every rank's
    fragment for every item names. Catches: a run that holds a block missed by the search
    window (e.g. bisecting on the block's end), blocks of different sizes sharing the first
    block's holders, the other dimension's extent taken from the block."""
    shape = (data.draw(st.integers(1, 4)), rows, cols) if stack else (rows, cols)
    placements = tuple(
        p
        for p in (data.draw(_PLACEMENTS) for _ in mesh_shape)
        if not (isinstance(p, Shard) and p.dim >= len(shape))
    )
    if len(placements) != len(mesh_shape):
        placements = tuple(Replicate() for _ in mesh_shape)
    world = math.prod(mesh_shape)
    ranks = tuple(range(world))
    layout = ParamLayout(0, "w", shape, torch.float32, mesh_shape, None, placements, ranks)
    topology = Topology((layout,), {(mesh_shape, None): (ranks,)}, 0, world)
    dim = data.draw(st.integers(0, 1))
    extent = shape[-2:][dim]
    cuts = sorted(data.draw(st.sets(st.integers(1, extent - 1), max_size=6))) if extent > 1 else []
    sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, extent], strict=True))
    split = {0: Split(dim=dim, sizes=sizes)} if data.draw(st.booleans()) else {}
    for dedup in (True, False):
        items = build_items(topology, [0], replica_dedup=dedup, splits=split)
        assert item_holders(items, topology) == _holders_one_by_one(items, topology)


def test_a_remembered_part_names_the_parameter_that_asks() -> None:
    """Catches: a matricised weight cut past its first dimension refused only the first time
    (errors are not remembered), or named after the parameter that asked first."""
    topology = _topology({"conv": ((4, 2, 3), Shard(1)), "conv2": ((4, 2, 3), Shard(1))})
    items = build_items(topology, [0, 1], replica_dedup=True, flatten=frozenset({0, 1}))
    for item in [*items, *items]:
        layout = topology.layouts[item.param]
        with pytest.raises(LayoutError, match=f"parameter {layout.name!r} "):
            _item_part(layout, (0,), item)
    whole = ParamLayout(2, "w", (4, 6), torch.float32, (2,), None, (Shard(0),), (0, 1))
    item = Item("w", 2, None, 4, 6, (0, 1), (0, 1))
    assert _item_part(whole, (1,), item) is _item_part(whole, (1,), item)  # remembered
