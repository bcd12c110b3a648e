"""Distributed Shampoo and SOAP equal their single-device selves (fp32), on several meshes."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

import canzona

from _cases import (
    SHAPES,
    compare,
    full_tensors,
    grad_steps,
    local_optimizer,
    plan,
    run_steps,
    sharded_params,
    strategies,
)
from _dist import mesh

# small refresh intervals so that preconditioning starts and refreshes within the steps
CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "shampoo": (
        canzona.Shampoo,
        {
            "lr": 0.01,
            "weight_decay": 0.01,
            "precondition_frequency": 2,
            "start_preconditioning_step": 2,
            "max_precond_dim": 20,  # the 24-long sides stay unpreconditioned
        },
    ),
    "soap": (
        canzona.SOAP,
        {"lr": 0.01, "precondition_frequency": 2, "max_precond_dim": 20},
    ),
}
STEPS = 5
RTOL = 1e-5


def _case(
    name: str,
    mesh_shape: tuple[int, ...],
    placements: dict[str, tuple[Placement, ...]],
    *,
    dedup: bool = True,
    capacity_mb: float = 512.0,
) -> dict[str, Any]:
    cls, kw = CONFIGS[name]
    shapes = {n: SHAPES[n] for n in placements}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, STEPS)
    want = local_optimizer(cls, fulls, grads, **kw)
    dm = mesh(mesh_shape)
    out: dict[str, Any] = {}
    for strategy in strategies():
        params = sharded_params(fulls, dm, placements)
        got = run_steps(
            lambda ps, s=strategy: cls(
                ps, **kw, plan=plan(s, capacity_mb=capacity_mb, replica_dedup=dedup)
            ),
            params,
            grads,
        )
        out[strategy] = compare(got, want)
    return out


def _assert_close(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):
        for case, comp in results.items():
            bad = {n: rel for n, (_, rel) in comp.items() if rel > RTOL}
            assert not bad, f"rank {rank}, {case}: relative difference above {RTOL}: {bad}"


ROWS = {n: (Shard(0),) if len(s) == 2 else (Shard(1),) for n, s in SHAPES.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fsdp_world4(dist: Any, name: str) -> None:
    _assert_close(dist(4).run(_case, name, (4,), ROWS))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_2d_world4_small_groups(dist: Any, name: str) -> None:
    placements = {n: (Shard(0), Shard(len(s) - 1)) for n, s in SHAPES.items()}
    _assert_close(dist(4).run(_case, name, (2, 2), placements, capacity_mb=1e-3))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hsdp_world4_per_replica(dist: Any, name: str) -> None:
    placements = {n: (Replicate(), Shard(len(s) - 2)) for n, s in SHAPES.items()}
    _assert_close(dist(4).run(_case, name, (2, 2), placements, dedup=False))


def _bitwise(name: str) -> bool:
    """The owner runs the very same code on the very same full matrix: bit-identical."""
    results = _case(name, (2,), ROWS)
    return all(eq for comp in results.values() for eq, _ in comp.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bitwise_world2(dist: Any, name: str) -> None:
    assert all(dist(2).run(_bitwise, name))
