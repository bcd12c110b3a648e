"""Routing metadata at 64-1024 ranks, computed per rank without processes."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from canzona.plan import PlanConfig, build_plan
from canzona.runtime.routing import build_items, plan_specs, route_all
from canzona.runtime.topology import ParamLayout, Topology

SHAPES = {"q": (512, 256), "k": (128, 256), "o": (256, 512), "up": (700, 256), "down": (256, 700)}


def _topology(dp: int, tp: int, layers: int, rank: int) -> Topology:
    """FSDP x TP on (dp, tp): colwise q/k/up as (_StridedShard, Shard), rowwise o/down."""
    world = dp * tp
    mesh_ranks = tuple(range(world))
    layouts = []
    for layer in range(layers):
        for name, shape in SHAPES.items():
            if name in ("q", "k", "up"):
                placements = (_StridedShard(0, split_factor=tp), Shard(0))
            else:
                placements = (Shard(0), Shard(1))
            layouts.append(
                ParamLayout(
                    len(layouts),
                    f"layers.{layer}.{name}",
                    shape,
                    torch.float32,
                    (dp, tp),
                    ("dp", "tp"),
                    placements,
                    mesh_ranks,
                )
            )
    copies = {((dp, tp), ("dp", "tp")): (mesh_ranks,)}
    return Topology(tuple(layouts), copies, rank, world)


def _check_world(dp: int, tp: int, layers: int, strategy: str) -> dict[str, int]:
    world = dp * tp
    topo = _topology(dp, tp, layers, 0)
    items = build_items(topo, range(len(topo.layouts)), replica_dedup=True)
    plan = build_plan(plan_specs(items, lambda i: 4), world, PlanConfig(strategy=strategy))
    sends: dict[tuple[int, int], list[tuple[str, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[str, int]]] = {}
    computed = [0] * world
    for rank in range(world):
        routes = route_all(items, _topology(dp, tp, layers, rank), plan, rank)
        for name, route in routes.items():
            if route.frag is not None:
                for c in route.send_to:
                    sends.setdefault((rank, c), []).append((name, route.frag.numel))
            for src, frag in route.sources:
                recvs.setdefault((src, rank), []).append((name, frag.numel))
            if route.computes:
                computed[rank] += 1
                covered = sum(f.numel for _, f in route.sources)
                assert covered == route.item.m * route.item.n
    assert sends == recvs  # every (src, dst) pair agrees on what travels, in the same order
    return {"items": len(items), "computed": sum(computed), "idle": computed.count(0)}


def test_routes_agree_between_every_pair_at_256_ranks() -> None:
    out = _check_world(16, 16, 4, "canzona")
    assert out == {"items": 20, "computed": 20, "idle": 236}  # more ranks than matrices


def test_replicated_routes_at_64_ranks() -> None:
    out = _check_world(8, 8, 2, "replicated")
    assert out["computed"] == 64 * out["items"]


def test_one_rank_view_at_1024_ranks() -> None:
    """A single rank's routing for a 1024-rank (32 x 32) job, as every rank computes it."""
    dp = tp = 32
    topo = _topology(dp, tp, 8, 517)
    items = build_items(topo, range(len(topo.layouts)), replica_dedup=True)
    plan = build_plan(plan_specs(items, lambda i: 4), dp * tp, PlanConfig())
    routes = route_all(items, topo, plan, 517)
    assert len(routes) == len(items) == 40
    owned = [r for r in routes.values() if r.computes]
    assert len(owned) <= 1
    held = [r for r in routes.values() if r.frag is not None]
    assert held and all(r.send_to == (plan.owner(r.item.name),) for r in held)


def test_hsdp_sources_come_from_the_owners_replica() -> None:
    """With Replicate x Shard, each fragment is read once, from the owner's replica group."""
    world, rep, shard = 64, 4, 16
    mesh_ranks = tuple(range(world))
    layouts = tuple(
        ParamLayout(
            i,
            f"w{i}",
            (96, 64),
            torch.float32,
            (rep, shard),
            None,
            (Replicate(), Shard(0)),
            mesh_ranks,
        )
        for i in range(6)
    )
    topo = Topology(layouts, {((rep, shard), None): (mesh_ranks,)}, 0, world)
    items = build_items(topo, range(6), replica_dedup=True)
    plan = build_plan(plan_specs(items, lambda i: 4), world, PlanConfig())
    for item in items:
        owner = plan.owner(item.name)
        routes = route_all([item], Topology(layouts, topo.copies, owner, world), plan, owner)
        sources = [r for r, _ in routes[item.name].sources]
        assert len(sources) == shard
        assert {s // shard for s in sources} == {owner // shard}
