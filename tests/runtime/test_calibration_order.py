"""A calibration's order: rounds lightest first, second batch sizes cheapest first."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor.placement_types import Shard

import canzona
from canzona.plan.measured import MeasuredCost
from canzona.runtime import calibrate as calibrate_module
from canzona.runtime import timing
from canzona.runtime.table import ComputeBatch

from _cases import CALIBRATION_SHAPES, full_tensors, grad_steps, plan, set_grads, sharded_params
from _dist import mesh

#: Seconds per matrix of each shape's fake call (plus FIXED_S per call): companions (two
#: matrices) cost 6 x 9, 6 x 13 and 6 x 17 ms to time, and each shape alone 6 x 5, 6 x 7 and
#: 6 x 9 ms (126 ms in all; every call short, so timed five times after its warm-up).
UNIT_S = {(16, 16): 4e-3, (24, 8): 6e-3, (8, 24): 8e-3}
FIXED_S = 1e-3
#: Room for the shapes alone and one companion of at most 102 ms: the two cheaper
#: companions (54 + 78 ms) do not both fit, and the cheapest is the one that must.
BUDGET_S = 0.23
SHAPES = CALIBRATION_SHAPES


def _fake_once(self: timing.Call) -> float:
    """A deterministic call time: FIXED_S plus UNIT_S of the shape per matrix."""
    _, m, n = self.full.shape
    return FIXED_S + self.k * UNIT_S[(m, n)]


def _lines_within_budget() -> list[tuple[int, int]]:
    """The shapes that get a batch line from a calibration with deterministic call times."""
    from canzona.runtime import plan_inputs

    params = sharded_params(full_tensors(SHAPES), mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    real, once, evict = plan_inputs.calibrate, timing.Call.once, calibrate_module._eviction_seconds
    calibrate_module._CACHE.clear()

    def budgeted(*args: Any, **kw: Any) -> Any:
        return real(*args, **{**kw, "budget_s": BUDGET_S})

    plan_inputs.calibrate = budgeted  # type: ignore[assignment]
    timing.Call.once = _fake_once  # type: ignore[method-assign]
    calibrate_module._eviction_seconds = lambda device: 0.0  # type: ignore[assignment]
    try:
        opt = canzona.Muon(params, lr=0.02, ns_dtype=torch.float32, plan=plan())
        set_grads(params, grad_steps(SHAPES, 1)[0])
        opt.step()
    finally:
        plan_inputs.calibrate = real  # type: ignore[assignment]
        timing.Call.once = once  # type: ignore[method-assign]
        calibrate_module._eviction_seconds = evict  # type: ignore[assignment]
        calibrate_module._CACHE.clear()
    model = opt._runtime.plan.optimizer
    costs = [c for c in model.models.values() if isinstance(c, MeasuredCost)]
    return sorted((m, n) for c in costs for (m, n), *_ in c.batches)


def test_second_batch_sizes_are_timed_cheapest_first(dist: Any) -> None:
    """Catches: the companions timed in the main pass's order (the shape with the most
    owner work first, after the cheapest): the budget then goes to a 78 or 102 ms timing
    and the 54 ms one, whose fixed part is the larger share of its calls, gets no line."""
    for lines in dist(2).run(_lines_within_budget):
        assert lines == [(16, 16)]


def _call(first: float, seen: list[float]) -> timing.Call:
    def run(batch: ComputeBatch, full: torch.Tensor) -> torch.Tensor:
        seen.append(first)
        return full

    batch = ComputeBatch((), 0, {}, "direction")
    return timing.Call(run, batch, torch.zeros(1, 2, 2), 1, first=first)


def test_each_round_times_the_calls_lightest_first(monkeypatch: Any) -> None:
    """As the pipeline computes a micro-group's batches (``light_first``): a call right after
    a heavier one runs slower on a CPU (20-60% for a 1152 x 384 bf16 Newton-Schulz after a
    2304 x 768 one, on the Xeon with AMX, even 20 ms later), so the calibration times each
    call after lighter ones, as the steps run it. Catches: the rounds in the order the
    shapes were started (heaviest owner work first)."""
    monkeypatch.setattr(timing, "SHORT_CALL_S", 0.0)  # every call long: two timed rounds
    seen: list[float] = []
    calls = [_call(first, seen) for first in (0.3, 0.1, 0.2)]
    timing.time_rounds(calls)
    assert seen == [0.1, 0.2, 0.3] * 2
    assert [len(c.times) for c in calls] == [2, 2, 2]


def test_the_order_puts_the_cheapest_shape_first_on_the_cpu_only() -> None:
    """Catches: the CPU's cheapest-first order on an accelerator (there a launch-bound shape
    prices every large one past the cap), or the CPU's order lost (its first rate is then
    not the highest: a large call could be started past the budget)."""
    from canzona.runtime.calibrate import Shape, timing_order

    # (side, count): the 16s are cheapest, the 64 carries the most work (count x FLOPs)
    shapes = [Shape(0, m, m, 1, torch.float32, c) for m, c in ((32, 4), (16, 2), (64, 3))]
    flops = [float(s.m**3) for s in shapes]
    assert timing_order(shapes, flops, torch.device("cpu")) == [1, 2, 0]
    assert timing_order(shapes, flops, torch.device("cuda")) == [2, 0, 1]
    assert timing_order(shapes, flops, torch.device("meta")) == [2, 0, 1]
