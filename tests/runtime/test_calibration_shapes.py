"""What the calibration times: one shape per group and size, at the batch an owner stacks."""

from __future__ import annotations

import pytest
import torch

from canzona.runtime import timing
from canzona.runtime.calibrate import MAX_BATCH, Shape, _cost, shapes_of
from canzona.runtime.routing import Item
from canzona.runtime.table import ParamRow, StepTable

ROW = ParamRow(torch.float32, torch.float32, 0)


def _items(count: int, m: int = 8, n: int = 8, param: int = 0) -> list[Item]:
    return [Item(f"p{param}.{i}", param, i, m, n, (0, 1), (0, 1)) for i in range(count)]


def test_each_shape_is_timed_at_the_batch_an_owner_stacks() -> None:
    """Catches: a shape timed at its count in the model rather than its share per rank, and
    matrices a rank updates alone (never planned) timed as if they travelled."""
    table = StepTable(
        (0, 1, 2), (ROW, ROW, ParamRow(torch.bfloat16, torch.float32, 1)), ({}, {}), "", "", 0
    )
    local = [Item("alone", 1, None, 16, 4, (0,), (0,))]
    items = [*_items(6), *local, *_items(20, 4, 12, 2)]
    assert shapes_of(items, table, 2) == [
        Shape(0, 8, 8, 3, torch.float32, 6),  # 6 over 2 ranks: 3 per owner
        Shape(1, 4, 12, MAX_BATCH, torch.bfloat16, 20),  # 10 per owner, at most MAX_BATCH
    ]
    assert shapes_of(_items(3), table, 4) == [Shape(0, 8, 8, 1, torch.float32, 3)]


@pytest.mark.parametrize("call_s", [1e-4, 0.1])
def test_a_short_call_costs_its_cache_evictions_too(call_s: float) -> None:
    """Catches: the time a calibration will take estimated without the eviction before each
    timed short call (the budget would admit more shapes than it has time for)."""
    n = timing.repeats(call_s)
    evictions = n * 1e-3 if call_s < timing.SHORT_CALL_S else 0.0
    assert _cost(call_s, 1e-3) == pytest.approx(call_s * (1 + n) + evictions)
