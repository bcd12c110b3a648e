"""A step's host work grows with batches, not matrices: the same torch ops for 8 or 32 matrices."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

import canzona

from _cases import CountOps
from _dist import mesh


def _ops_of_a_step(count: int) -> dict[str, int]:
    """The aten ops of one steady-state step of default canzona.Muon on ``count`` matrices.

    64 x 32 matrices (Newton–Schulz stacks them: both sides reach the batched-kernel size),
    ``Shard(0)`` on a (2,) mesh, plus an AdamW-routed vector; the third step is counted.
    """
    gen = torch.Generator().manual_seed(0)
    dp = mesh((2,))
    named = [
        (
            f"w{i}",
            nn.Parameter(distribute_tensor(torch.randn(64, 32, generator=gen), dp, [Shard(0)])),
        )
        for i in range(count)
    ]
    bias = [
        ("bias", nn.Parameter(distribute_tensor(torch.randn(64, generator=gen), dp, [Shard(0)])))
    ]
    grads = [
        distribute_tensor(torch.randn(p.shape, generator=gen), dp, [Shard(0)])
        for _, p in named + bias
    ]
    opt = canzona.Muon([{"params": named}, {"params": bias, "algorithm": "adamw"}])
    for step in range(3):
        for (_, p), g in zip(named + bias, grads, strict=True):
            p.grad = g
        if step < 2:
            opt.step()
            continue
        with CountOps() as counter:
            opt.step()
    assert opt.last_step_stats is not None and opt.last_step_stats.batches == 1
    return dict(counter.ops)


def test_a_step_dispatches_the_same_ops_for_8_and_32_matrices(dist: Any) -> None:
    """Catches: any per-matrix op on the step's path (a Python loop over parameters in the
    element-wise phases, the packing, the assembly, the owner math or the apply)."""
    few, many = (dist(2).run(_ops_of_a_step, n) for n in (8, 32))
    for rank in range(2):
        assert few[rank] == many[rank], {
            op: (few[rank].get(op), many[rank].get(op))
            for op in set(few[rank]) | set(many[rank])
            if few[rank].get(op) != many[rank].get(op)
        }
        assert sum(few[rank].values()) > 20  # the counter saw the step
