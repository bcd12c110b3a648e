"""What a plan is built from: the items, their planner specs, and measured costs for them."""

from __future__ import annotations

from pathlib import Path

import torch

from canzona.plan import GroupedCost, MatrixSpec
from canzona.runtime.calibrate import calibrate, shapes_of
from canzona.runtime.calibration_cache import DiskCache
from canzona.runtime.calibration_keys import device_name
from canzona.runtime.config import PipelineConfig
from canzona.runtime.routing import Item, build_items, item_holders, plan_specs
from canzona.runtime.table import ComputeFn, StepTable
from canzona.runtime.topology import Topology
from canzona.runtime.watchdog import Watchdog


def items_and_specs(
    topology: Topology, table: StepTable, *, replica_dedup: bool
) -> tuple[list[Item], list[MatrixSpec]]:
    """The table's matrices as items (blocks and stacks apart) and their planner specs."""
    rows = list(zip(table.matrix, table.rows, strict=True))
    items = build_items(
        topology,
        table.matrix,
        replica_dedup=replica_dedup,
        splits={p: row.split for p, row in rows if row.split},
        flatten=frozenset(p for p, row in rows if row.flatten),
    )
    grouped = table.cost is not None and not isinstance(table.cost, str)
    specs = plan_specs(
        items,
        lambda p: table.row(p).itemsize,
        (lambda p: str(table.row(p).batch_key)) if grouped else (lambda p: None),
        item_holders(items, topology),
    )
    return items, specs


def calibrated(
    items: list[Item],
    table: StepTable,
    compute: ComputeFn,
    *,
    world: int,
    config: PipelineConfig,
    watchdog: Watchdog,
    device: torch.device,
) -> GroupedCost:
    """The table's cost with the owner math of ``items`` timed (collective; see calibrate)."""
    assert isinstance(table.cost, GroupedCost)
    where = config.calibration_cache
    return calibrate(
        shapes_of(items, table, world),
        table,
        compute,
        {int(k): m for k, m in table.cost.models.items()},
        watchdog=watchdog,
        device=device,
        cache=None if where is None else DiskCache(Path(where), device_name(device)),
    )
