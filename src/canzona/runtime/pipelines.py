"""A step's pipeline: the schedule of a plan for the parameters that have gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from canzona.runtime.pipeline import Pipeline
from canzona.runtime.schedule import ScheduleBuilder
from canzona.runtime.table import StepTable
from canzona.runtime.tensors import local_tensor

if TYPE_CHECKING:
    from canzona.runtime.engine import MatrixRuntime


def build_pipeline(
    runtime: MatrixRuntime,
    table: StepTable,
    matrix_active: Sequence[int],
    tensors: Sequence[torch.Tensor],
) -> Pipeline:
    """A new pipeline of ``runtime``'s current plan for the active matrix parameters."""
    assert runtime.topology is not None
    chosen = set(matrix_active)
    by_name = {it.name: it for it in runtime.items}
    groups = (
        [
            [by_name[n] for n in g.names if by_name[n].param in chosen]
            for g in runtime.plan.micro_groups
        ]
        if runtime.plan
        else []
    )
    local = [
        it
        for it in runtime.items
        if it.is_local and it.unit == (runtime.rank,) and it.param in chosen
    ]
    shapes = {p: tuple(local_tensor(tensors[p]).shape) for p in matrix_active}
    schedule = ScheduleBuilder(
        topology=runtime.topology,
        routes=runtime.routes,
        groups=groups,
        local_items=local,
        table=table,
        local_shapes={p: s for p, s in shapes.items() if _held(s)},
        rank=runtime.rank,
        world=runtime.world,
        replicated=bool(runtime.plan and runtime.plan.assignment.replicated),
        device=runtime.device,
        keep_buffers=runtime.config.keeps_buffers(runtime.device.type),
    ).build()
    return Pipeline(
        schedule=schedule,
        process_group=runtime.process_group,
        rank=runtime.rank,
        world=runtime.world,
        config=runtime.config,
        watchdog=runtime.watchdog,
        device=runtime.device,
    )


def _held(shape: tuple[int, ...]) -> bool:
    return all(s > 0 for s in shape)
