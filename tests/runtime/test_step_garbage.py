"""A step leaves no reference cycles: its buffers are freed when it ends, not at a collection."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch.distributed.tensor import Shard

import canzona

from _cases import (
    OWNER_KW,
    SHAPES_TWICE,
    TINY_MB,
    full_tensors,
    grad_steps,
    plan,
    set_grads,
    sharded_params,
)
from _dist import mesh

KW: dict[str, dict[str, Any]] = {"Muon": {"lr": 0.02, "momentum": 0.9}, **OWNER_KW}


def _garbage(
    world: tuple[int, ...], optimizer: str, strategy: str, fuse_bytes: int, fail: bool = False
) -> Any:
    """Unreachable objects a step left behind (after warm-up steps and a full collection).

    With ``fail``, rank 0's owner math raises in that step, which then raises
    :class:`canzona.UpdateFailedError` on every rank (caught and dropped here).
    """
    fulls = full_tensors(SHAPES_TWICE)
    grads = grad_steps(SHAPES_TWICE, 4)
    two_d = len(world) == 2
    placements = {
        n: (Shard(0), Shard(len(s) - 1)) if two_d else (Shard(0),) for n, s in SHAPES_TWICE.items()
    }
    params = sharded_params(fulls, mesh(world), placements)
    pipeline = canzona.PipelineConfig(fuse_bytes=fuse_bytes)
    cls = getattr(canzona, optimizer)
    opt = cls(params, **KW[optimizer], plan=plan(strategy, capacity_mb=TINY_MB), pipeline=pipeline)
    for g in grads[:3]:  # the first steps plan, calibrate and create state
        set_grads(params, g)
        opt.step()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    rank = tdist.get_rank()

    def compute(self: Any, batch: Any, full: torch.Tensor) -> torch.Tensor:
        if rank == 0:
            raise RuntimeError("injected")
        return original(self, batch, full)

    original = cls._directions
    try:
        set_grads(params, grads[3])
        if fail:
            cls._directions = compute
            try:
                opt.step()
            except canzona.UpdateFailedError as exc:
                assert "injected" in str(exc)
            else:
                raise AssertionError("the step did not fail")
        else:
            opt.step()
        found = gc.collect()
        kinds = Counter(type(o).__name__ for o in gc.garbage)
    finally:
        cls._directions = original
        gc.set_debug(0)
        gc.garbage.clear()
    stats = opt.last_step_stats  # type: ignore[attr-defined]
    return {
        "found": found,
        "kinds": dict(kinds),
        "groups": stats.micro_groups,
        "collectives": stats.collectives,
    }


CASES = [
    # world, optimizer, strategy, fuse_bytes (0: every exchange its own all-to-all)
    ((2,), "Muon", "canzona", 0),
    ((2,), "Muon", "canzona", 1 << 20),
    ((2,), "Muon", "replicated", 0),
    ((2,), "Shampoo", "canzona", 1 << 20),
    ((2,), "SOAP", "canzona", 0),
    ((2, 2), "Muon", "canzona", 1 << 20),
    ((2, 2), "NorMuon", "canzona", 0),
]


@pytest.mark.parametrize(("world", "optimizer", "strategy", "fuse_bytes"), CASES)
def test_a_step_leaves_no_reference_cycles(
    dist: Any, world: tuple[int, ...], optimizer: str, strategy: str, fuse_bytes: int
) -> None:
    """The step holds the cyclic collector off, so a cycle through an all-to-all's buffers
    would keep every send and receive buffer of every step alive until the next full
    collection (measured: 45 MB a step on the Qwen3-like benchmark model, each step's
    buffers taken from fresh pages). Catches: an exchange and its all-to-all referring to
    each other after the wait, for single and fused all-to-alls alike."""
    ranks = dist(int(torch.tensor(world).prod())).run(
        _garbage, world, optimizer, strategy, fuse_bytes
    )
    for r, out in enumerate(ranks):
        assert out["found"] == 0, (r, out["kinds"])
    if strategy != "replicated":
        groups, collectives = ranks[0]["groups"], ranks[0]["collectives"]
        assert groups > 2
        # fused: fewer all-to-alls than a gather and a scatter per micro-group
        assert (collectives < 2 * groups) == (fuse_bytes > 0), (groups, collectives)


@pytest.mark.parametrize("world", [(2,), (2, 2)])
def test_a_failed_step_leaves_no_reference_cycles(dist: Any, world: tuple[int, ...]) -> None:
    """A step whose owner math raises on rank 0 fails on every rank; once the caller drops
    the error, nothing of the step is left for the collector. Catches: the step's failure
    record kept where the error's traceback frames can reach it (the record holds the error,
    whose frames hold the record: every buffer of the step then waits for a collection)."""
    size = int(torch.tensor(world).prod())
    ranks = dist(size).run(_garbage, world, "Muon", "canzona", 1 << 20, True)
    for r, out in enumerate(ranks):
        assert out["found"] == 0, (r, out["kinds"])
