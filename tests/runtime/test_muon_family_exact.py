"""NorMuon, and Muon with a Polar Express schedule and a spectral scale, on DeviceMeshes equal
their own single-device results bit for bit.

The owner runs the same code on the same full matrix as one device does (NorMuon's per-row
second moment lives there, owner-held), so every layout and strategy gives one device's
parameters exactly. Newton–Schulz runs in fp32 to keep the CPU test short.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

import canzona

from _cases import (
    SHAPES,
    assert_bitwise,
    compare,
    full_tensors,
    grad_steps,
    local_optimizer,
    plan,
    run_steps,
)
from _cases import sharded_params as shard
from _dist import mesh

CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "muon": (
        canzona.Muon,
        {
            "lr": 0.02,
            "weight_decay": 0.1,
            "ns_coefficients": "polar_express",
            "adjust_lr_fn": "spectral",
            "scale": 0.5,
            "ns_dtype": torch.float32,
        },
    ),
    "normuon": (
        canzona.NorMuon,
        {
            "lr": 0.02,
            "weight_decay": 0.1,
            "ns_coefficients": "polar_express",
            "beta2": 0.9,
            "ns_dtype": torch.float32,
        },
    ),
}
# SHAPES (square, tall, wide, odd 7x13, tiny 5x3, a (3, 6, 10) stack) plus a second 16x16, so
# that an owner computes two same-shape matrices in one batch (NorMuon stacks their states),
# two 44x33 matrices (one device stacks them, an owner may compute one alone: Newton-Schulz
# returns a tall matrix transposed in memory or not by how many it ran with, and NorMuon's row
# reductions over 33 columns round by the memory order), and a stack of 4 experts
MATRICES: dict[str, tuple[int, ...]] = {
    **SHAPES,
    "square2": (16, 16),
    "tall_a": (44, 33),
    "tall_b": (44, 33),
    "experts": (4, 16, 12),
}
STEPS = 3
STRATEGIES = ("canzona", "replicated", "round_robin")


def _case(
    mesh_shape: tuple[int, ...],
    placements: dict[str, tuple[Placement, ...]],
    dedups: tuple[bool, ...] = (True,),
) -> dict[str, Any]:
    """Every optimizer x strategy x ``replica_dedup``: per parameter, (bitwise, rel. diff)."""
    fulls = full_tensors(MATRICES)
    grads = grad_steps(MATRICES, STEPS)
    dm = mesh(mesh_shape)
    out: dict[str, Any] = {}
    for name, (cls, kw) in CONFIGS.items():
        want = local_optimizer(cls, fulls, grads, **kw)
        for strategy in STRATEGIES:
            for dedup in dedups:
                got = run_steps(
                    lambda ps, s=strategy, d=dedup, cls=cls, kw=kw: cls(
                        ps, **kw, plan=plan(s, replica_dedup=d)
                    ),
                    shard(fulls, dm, placements),
                    grads,
                )
                out[f"{name}/{strategy}/dedup={dedup}"] = compare(got, want)
    return out


ONE_DEVICE = "not bitwise equal to one device"


def _rows(shape: tuple[int, ...]) -> tuple[Placement, ...]:
    return (Shard(0),) if len(shape) == 2 else (Shard(1),)


def test_fsdp_world4(dist: Any) -> None:
    """FSDP rows on (4,): uneven and empty shards; one stack split by experts (3 over 4: a
    rank holds none), the other by rows."""
    placements = {n: _rows(s) for n, s in MATRICES.items()}
    placements["stack"] = (Shard(0),)
    assert_bitwise(dist(4).run(_case, (4,), placements), ONE_DEVICE)


def test_2d_world4(dist: Any) -> None:
    """``Shard(0), Shard(1)`` on (2, 2): every matrix cut both ways; one stack by the rows and
    columns of each expert, the other by experts and columns."""
    placements = {n: (Shard(len(s) - 2), Shard(len(s) - 1)) for n, s in MATRICES.items()}
    placements["experts"] = (Shard(0), Shard(2))
    assert_bitwise(dist(4).run(_case, (2, 2), placements), ONE_DEVICE)


def test_hsdp_world4(dist: Any) -> None:
    """``(Replicate(), Shard(0))``: with ``replica_dedup`` one owner per matrix, without it one
    per replica group (each holding its own second moment), and both give one device."""
    placements = {n: (Replicate(), Shard(len(s) - 2)) for n, s in MATRICES.items()}
    placements["square"] = (Replicate(), Replicate())
    assert_bitwise(dist(4).run(_case, (2, 2), placements, (True, False)), ONE_DEVICE)
