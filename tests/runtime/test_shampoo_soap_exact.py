"""Distributed Shampoo and SOAP equal their single-device selves, bit for bit, on several meshes.

The owner runs the very same code on the very same full matrix as one device does, so every
strategy and layout gives the single-device parameters exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

import canzona

from _cases import (
    OWNER_KW,
    SHAPES,
    assert_bitwise,
    compare,
    full_of,
    full_tensors,
    grad_steps,
    local_optimizer,
    plan,
    run_steps,
    set_grads,
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


ONE_DEVICE = "not bitwise equal to one device"


ROWS = {n: (Shard(0),) if len(s) == 2 else (Shard(1),) for n, s in SHAPES.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fsdp_world4(dist: Any, name: str) -> None:
    assert_bitwise(dist(4).run(_case, name, (4,), ROWS), ONE_DEVICE)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_2d_world4_small_groups(dist: Any, name: str) -> None:
    placements = {n: (Shard(0), Shard(len(s) - 1)) for n, s in SHAPES.items()}
    assert_bitwise(dist(4).run(_case, name, (2, 2), placements, capacity_mb=1e-3), ONE_DEVICE)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hsdp_world4_per_replica(dist: Any, name: str) -> None:
    placements = {n: (Replicate(), Shard(len(s) - 2)) for n, s in SHAPES.items()}
    assert_bitwise(dist(4).run(_case, name, (2, 2), placements, dedup=False), ONE_DEVICE)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fsdp_world2(dist: Any, name: str) -> None:
    assert_bitwise(dist(2).run(_case, name, (2,), ROWS), ONE_DEVICE)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hsdp_world4_experts_split_over_the_shard_dim(dist: Any, name: str) -> None:
    """HSDP with the stack's matrices split over the shard dim (each rank holds whole
    matrices) next to a column-sharded matrix, per replica.

    The owners see the stack's matrices at other offsets in their batches and receive
    buffers than one device does. Catches: owner math run on such views, which MKL's
    AVX-512 kernels (matmul, eigh) round differently from the same matrix at another
    alignment (on such CPUs; the owner math must get each matrix in its own allocation).
    """
    placements = {n: (Replicate(), Shard(0)) for n in ("square", "stack")}
    placements["odd"] = (Replicate(), Shard(1))
    assert_bitwise(dist(4).run(_case, name, (2, 2), placements, dedup=False), ONE_DEVICE)


def _mixed_dtypes(name: str, strategy: str, placement: str) -> dict[str, bool]:
    """A float64 matrix next to float32 ones (one micro-group, one param group)."""
    cls = getattr(canzona, name)
    shapes = {"a": (12, 8), "b": (12, 8), "c": (8, 12)}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    fulls["a"] = fulls["a"].double()
    for g in grads:
        g["a"] = g["a"].double()
    params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    ref = cls([p for _, p in params], **OWNER_KW[name])
    for g in grads:
        set_grads(params, g)
        ref.step()
    want = {n: full_of(p) for n, p in params}
    pl: tuple[Placement, ...] = (Shard(0),) if placement == "rows" else (Replicate(),)
    params = sharded_params(fulls, mesh((2,)), {n: pl for n in shapes})
    opt = cls([p for _, p in params], **OWNER_KW[name], plan=plan(strategy=strategy))
    for g in grads:
        set_grads(params, g)
        opt.step()
    got = {n: full_of(p) for n, p in params}
    assert all(p.dtype == (torch.float64 if n == "a" else torch.float32) for n, p in got.items())
    return {n: eq for n, (eq, _) in compare(got, want).items()}


@pytest.mark.parametrize(
    ("name", "strategy", "placement"),
    [
        ("Shampoo", "round_robin", "rows"),
        ("NorMuon", "round_robin", "rows"),
        ("NorMuon", "replicated", "whole"),
    ],
)
def test_mixed_dtypes_in_one_group_stay_bitwise(
    dist: Any, name: str, strategy: str, placement: str
) -> None:
    """Catches: a direction that travelled in a micro-group's common dtype (float64 next to
    a float32 matrix) applied without its cast back (the float32 parameters updated in
    float64), and matrices kept on their rank merged into one run across direction dtypes
    (NorMuon batches float64 and float32 payloads together): bitwise one device."""
    for out in dist(2).run(_mixed_dtypes, name, strategy, placement):
        assert all(out.values()), out
