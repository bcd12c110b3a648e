"""Re-pricing a measured plan by the owner calls its own steps made, in :data:`ROUNDS` rounds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import median

import torch

from canzona.plan import GroupedCost, MatrixSpec
from canzona.plan.measured import MeasuredCost, reprice
from canzona.runtime import timing
from canzona.runtime.calibrate import median_over_ranks
from canzona.runtime.watchdog import Watchdog

#: Steps after a new plan whose owner calls are not recorded (first calls, fresh buffers).
SKIPPED_STEPS = 1
#: Re-pricings of a measured plan. The first re-plans on the calls of the calibrated plan's
#: steps; the plan it makes stacks some shapes in batch sizes those steps never ran, priced
#: by a line through the others (measured: such a stack can cost more per matrix than the
#: line says). The second records the new plan's own batches and re-prices on every call
#: of both rounds, so the final plan is priced by the calls it makes.
ROUNDS = 2

#: ``(param group key, m, n)`` of one distinct computation.
ShapeKey = tuple[str, int, int]
#: Per param group key, ``{(m, n): {k: seconds of one call on k stacked matrices}}``.
Observed = dict[str, dict[tuple[int, int], dict[int, float]]]


class Observation:
    """The owner calls of a measured plan's first steps, then a re-pricing of its table.

    Every step after the first :data:`SKIPPED_STEPS` records each owner call's seconds (the
    calibration's clock; CUDA events on a GPU, read once, when the table is re-priced) by
    param group, shape and batch size. After ``steps`` recorded steps every rank has the
    same universe of entries (every shape of the plan, every batch size up to the number of
    its matrices), fills its own medians, and one all-gather gives each entry the median
    over the ranks that made the call (:func:`~canzona.runtime.calibrate.median_over_ranks`),
    so every rank re-prices the table, and re-plans, with identical numbers.

    A round after the first (:meth:`next_round`) keeps what the rounds before it agreed on:
    its own calls replace theirs where both made one (the same shape and batch size), and
    the table re-priced is the calibrated one (``base``), so that every batch size any
    round saw takes part in the shape's line.
    """

    def __init__(
        self,
        specs: Sequence[MatrixSpec],
        steps: int,
        device: torch.device,
        *,
        round_: int = 1,
        base: GroupedCost | None = None,
        earlier: Observed | None = None,
    ) -> None:
        counts: dict[ShapeKey, int] = {}
        for s in specs:
            key = (str(s.cost_key), s.m, s.n)
            counts[key] = counts.get(key, 0) + s.batch
        self.specs = tuple(specs)
        self.universe: list[tuple[ShapeKey, int]] = [
            (key, k) for key, count in sorted(counts.items()) for k in range(1, count + 1)
        ]
        self.round = round_
        self.base = base  # the table the first round re-priced (None in the first round)
        self.earlier: Observed = earlier or {}
        self.steps = steps
        self.runs = 0  # successful steps of the plan so far (the same count on every rank)
        self.device = device
        self._clock = timing.clock()
        self._cpu: dict[tuple[ShapeKey, int], list[float]] = {}
        self._events: list[tuple[tuple[ShapeKey, int], torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def recording(self) -> bool:
        """Whether this step's owner calls are recorded."""
        return SKIPPED_STEPS <= self.runs < SKIPPED_STEPS + self.steps

    @property
    def due(self) -> bool:
        """Whether the table is re-priced before this step (on every rank at once)."""
        return self.runs == SKIPPED_STEPS + self.steps

    def start(self) -> object:
        """A mark before an owner call (a started event on a GPU, the clock elsewhere)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return self._clock()

    def stop(self, mark: object, key: int, m: int, n: int, k: int) -> None:
        """Record the call begun at ``mark``: ``k`` stacked ``m x n`` matrices of group ``key``."""
        entry = ((str(key), m, n), k)
        if isinstance(mark, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            self._events.append((entry, mark, end))
        else:
            assert isinstance(mark, float)
            self._cpu.setdefault(entry, []).append(self._clock() - mark)

    def _mine(self) -> list[float]:
        """This rank's median seconds per universe entry (-1 where it made no such call)."""
        if self._events:
            torch.cuda.synchronize(self.device)
            for entry, begin, end in self._events:
                self._cpu.setdefault(entry, []).append(begin.elapsed_time(end) / 1e3)
            self._events.clear()
        return [median(self._cpu[e]) if e in self._cpu else -1.0 for e in self.universe]

    def agree(self, watchdog: Watchdog) -> Observed:
        """Per param group key, ``{(m, n): {k: seconds}}`` agreed over the ranks (collective).

        The earlier rounds' entries stay where this round made no call of theirs.
        """
        mine = self._mine()
        agreed = (
            median_over_ranks(mine, watchdog, self.device)
            if watchdog.process_group is not None
            else mine
        )
        out: Observed = {
            key: {shape: dict(calls) for shape, calls in shapes.items()}
            for key, shapes in self.earlier.items()
        }
        for ((key, m, n), k), seconds in zip(self.universe, agreed, strict=True):
            if 0 < seconds < math.inf:  # a rank's clock may have given anything
                out.setdefault(key, {}).setdefault((m, n), {})[k] = seconds
        self._cpu.clear()
        return out

    def next_round(self, base: GroupedCost, agreed: Observed) -> Observation | None:
        """The next round's observation of the re-planned steps (None after the last)."""
        if self.round >= ROUNDS:
            return None
        return Observation(
            self.specs, self.steps, self.device, round_=self.round + 1, base=base, earlier=agreed
        )


def repriced(cost: GroupedCost, observed: Observed) -> GroupedCost:
    """``cost`` with every measured model re-priced by its group's observed calls."""
    models = {
        key: reprice(model, observed.get(key, {})) if isinstance(model, MeasuredCost) else model
        for key, model in cost.models.items()
    }
    return GroupedCost(models, name=cost.name)
