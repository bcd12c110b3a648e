"""An owner computes a micro-group's batches lightest first (the heavy calls go last)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor.placement_types import Shard

import canzona

from _cases import (
    compare,
    full_tensors,
    grad_steps,
    plan,
    reference_muon,
    set_grads,
    sharded_params,
)
from _dist import mesh

#: In plan order the heavy shape comes first.
SHAPES = {"a_big": (48, 40), "b_small": (8, 24), "c_mid": (24, 16), "d_big": (48, 40)}


def _order() -> dict[str, Any]:
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 2)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
    want = reference_muon(fulls, grads, **kw)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    calls: list[tuple[int, ...]] = []
    original = canzona.Muon._directions

    def spy(self: Any, batch: Any, full: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(full.shape))
        return original(self, batch, full)

    canzona.Muon._directions = spy  # type: ignore[method-assign]
    try:
        opt = canzona.Muon(params, **kw, plan=plan("replicated", cost="flops"))
        for g in grads:
            calls.clear()
            set_grads(params, g)
            opt.step()
    finally:
        canzona.Muon._directions = original  # type: ignore[method-assign]
    (pipeline,) = opt._runtime._pipelines.values()
    (group,) = pipeline.schedule.micro_groups
    got = {n: p.full_tensor() for n, p in params}
    return {
        "calls": calls,
        "plan_order": [(len(b.items), b.m, b.n) for b in group.batches],
        "exact": all(eq for eq, _ in compare(got, want).values()),
    }


def test_batches_are_computed_lightest_first(dist: Any) -> None:
    """Catches: a micro-group's batches computed in plan order (here heavy first), and any
    change of the results from the order."""
    for out in dist(2).run(_order):
        assert out["plan_order"][0] == (2, 48, 40)  # the plan lists the heavy batch first
        assert out["calls"] == [(1, 8, 24), (1, 24, 16), (2, 48, 40)]
        assert out["exact"]
