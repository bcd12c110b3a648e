"""canzona.Muon on DeviceMeshes equals torch.optim.Muon on the full tensors, bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

import canzona

from _cases import (
    SHAPES,
    compare,
    full_tensors,
    grad_steps,
    plan,
    reference_muon,
    run_steps,
    set_grads,
    sharded_params,
    strategies,
)
from _dist import mesh

KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}


def _muon_case(
    mesh_shape: tuple[int, ...],
    placements: dict[str, tuple[Placement, ...]],
    *,
    capacity_mb: float = 512.0,
    dedup: bool = True,
    steps: int = 3,
    kinds: tuple[str, ...] | None = None,
    overlaps: tuple[bool, ...] = (True, False),
    depth: int = 1,
) -> dict[str, Any]:
    shapes = {n: SHAPES[n] for n in placements}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, steps)
    want = reference_muon(fulls, grads, **KW)
    dm = mesh(mesh_shape)
    results: dict[str, Any] = {}
    for strategy in kinds or strategies():
        for overlap in overlaps:
            params = sharded_params(fulls, dm, placements)
            got = run_steps(
                lambda ps, s=strategy, o=overlap: canzona.Muon(
                    ps,
                    **KW,
                    plan=plan(s, capacity_mb=capacity_mb, replica_dedup=dedup),
                    pipeline=canzona.PipelineConfig(overlap=o, depth=depth),
                ),
                params,
                grads,
            )
            results[f"{strategy}/overlap={overlap}"] = compare(got, want)
    return results


def _assert_bitwise(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):
        for case, comp in results.items():
            bad = {n: rel for n, (eq, rel) in comp.items() if not eq}
            assert not bad, f"rank {rank}, {case}: not bitwise equal to torch.optim.Muon: {bad}"


ALL_ROWS = {n: (Shard(0),) if len(s) == 2 else (Shard(1),) for n, s in SHAPES.items()}


def test_fsdp_rows_world4(dist: Any) -> None:
    """Shard(0) on 4 ranks: uneven and empty shards (7x13, 5x3), a stack sharded by rows."""
    _assert_bitwise(dist(4).run(_muon_case, (4,), ALL_ROWS))


def test_tp_columns_and_stacks_world4(dist: Any) -> None:
    placements = {n: (Shard(len(s) - 1),) for n, s in SHAPES.items()}
    placements["stack"] = (Shard(0),)  # experts split across ranks (3 over 4: one rank holds none)
    _assert_bitwise(dist(4).run(_muon_case, (4,), placements))


def test_2d_mesh_world4(dist: Any) -> None:
    placements = {n: (Shard(0), Shard(len(s) - 1)) for n, s in SHAPES.items()}
    placements["odd"] = (Shard(0), Shard(0))
    _assert_bitwise(dist(4).run(_muon_case, (2, 2), placements))


@pytest.mark.parametrize("dedup", [True, False])
def test_hsdp_world4(dist: Any, dedup: bool) -> None:
    placements = {n: (Replicate(), Shard(len(s) - 2)) for n, s in SHAPES.items()}
    placements["square"] = (Replicate(), Replicate())
    _assert_bitwise(dist(4).run(_muon_case, (2, 2), placements, dedup=dedup))


@pytest.mark.parametrize("depth", [1, 3])
def test_world2_with_small_micro_groups(dist: Any, depth: int) -> None:
    """A tiny capacity forces one matrix per owner per micro-group: many groups in flight."""
    _assert_bitwise(dist(2).run(_muon_case, (2,), ALL_ROWS, capacity_mb=1e-4, depth=depth))


def _mixed_case() -> dict[str, Any]:
    shapes = {"square": SHAPES["square"], "wide": SHAPES["wide"], "odd": SHAPES["odd"]}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    want = reference_muon(fulls, grads, **KW)
    dm = mesh((2, 2), ("dp", "tp"))
    meshes = {"square": dm, "wide": dm["dp"], "odd": dm["tp"]}
    placements = {"square": (Shard(0), Shard(1)), "wide": (Shard(1),), "odd": (Shard(0),)}
    out = {}
    for strategy in strategies():
        params = sharded_params(fulls, meshes, placements)
        got = run_steps(lambda ps, s=strategy: canzona.Muon(ps, **KW, plan=plan(s)), params, grads)
        out[strategy] = compare(got, want)
    return out


def test_mixed_meshes_world4(dist: Any) -> None:
    """One optimizer over params on a 2-D mesh and on two different 1-D sub-meshes."""
    _assert_bitwise(dist(4).run(_mixed_case))


def _owners_and_stats() -> dict[str, Any]:
    shapes = {"square": (16, 16), "tall": (24, 8)}
    fulls = full_tensors(shapes)
    params = sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Muon(params, lr=0.02)
    for p in (p for _, p in params):
        p.grad = torch.zeros_like(p)
    opt.step()
    stats = opt.last_step_stats
    assert stats is not None
    return {"computed": stats.matrices_computed, "collectives": stats.collectives}


def test_more_ranks_than_matrices(dist: Any) -> None:
    """Two matrices on four ranks: two ranks own nothing, every matrix is computed once."""
    out = dist(4).run(_owners_and_stats)
    assert sum(o["computed"] for o in out) == 2
    assert sorted(o["computed"] for o in out) == [0, 0, 1, 1]


def test_single_process_matches_torch() -> None:
    shapes = dict(SHAPES)
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    want = reference_muon(fulls, grads, **KW)
    from _cases import local_optimizer

    got = local_optimizer(canzona.Muon, fulls, grads, **KW)
    for name, (eq, rel) in compare(got, want).items():
        assert eq, f"{name}: {rel}"


def _fully_shard_case(world_mesh: tuple[int, ...]) -> dict[str, bool]:
    """FSDP2's own sharding (uneven dims included) against torch.optim.Muon on one device."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(13, 7, bias=False), torch.nn.Linear(7, 30, bias=False)
    )
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=mesh(world_mesh))
    opt = canzona.Muon(model.parameters(), **KW)
    ref_opt = torch.optim.Muon(ref.parameters(), **KW)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ref.named_parameters()}
        set_grads(list(model.named_parameters()), grads)
        set_grads(list(ref.named_parameters()), grads)
        opt.step()
        ref_opt.step()
    return {
        n: bool(torch.equal(p.full_tensor(), q.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    }


@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_bitwise(dist: Any, world: int) -> None:
    for out in dist(world).run(_fully_shard_case, (world,)):
        assert all(out.values()), out


def _tp_only_case() -> dict[str, bool]:
    """parallelize_module alone on a (4,) mesh: Colwise Shard(0), Rowwise Shard(1)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(10, 22, bias=False), torch.nn.ReLU(), torch.nn.Linear(22, 9, bias=False)
    )
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh((4,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = canzona.Muon(model.parameters(), **KW)
    ref_opt = torch.optim.Muon(ref.parameters(), **KW)
    x = torch.randn(6, 10)
    for _ in range(3):
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        set_grads(list(model.named_parameters()), grads)
        opt.step()
        ref_opt.step()
    return {
        n: bool(torch.equal(p.full_tensor(), q.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    }


def test_tensor_parallel_only_world4(dist: Any) -> None:
    for out in dist(4).run(_tp_only_case):
        assert out == {"0.weight": True, "2.weight": True}
