"""What crosses from an optimizer to the runtime: one frozen table per step, two callables."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from canzona.plan import Split
from canzona.runtime.routing import Item


@dataclass(frozen=True, slots=True)
class ParamRow:
    """What the runtime needs to know about one matrix parameter.

    Attributes:
        payload_dtype: Dtype of what travels to the owner (the prepared payload is cast to
            it once, before it travels).
        direction_dtype: Dtype of the direction handed to ``apply``.
        batch_key: The parameter's param group: matrices are computed and applied together
            only when they share it (one set of hyper-parameters per call).
        split: The parameter is several matrices (blocks) along one dimension.
        flatten: The parameter (N-D) is updated as its ``(shape[0], rest)`` matricisation.
        prepared_dtype: Dtype the optimizer prepares the payload in, before that cast
            (None: the parameter's). The gradients' where they differ from the weight's
            (``p.grad_dtype``): fp32 momentum blends of fp16 weights are cast once.
    """

    payload_dtype: torch.dtype
    direction_dtype: torch.dtype
    batch_key: int
    split: Split | None = None
    flatten: bool = False
    prepared_dtype: torch.dtype | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per payload element (what the planner balances)."""
        return self.payload_dtype.itemsize


@dataclass(frozen=True, slots=True)
class StepTable:
    """Everything per-parameter the runtime reads in a step, built by the optimizer.

    The rows change only when param groups or dtypes change, so an optimizer keeps one
    table object across steps (the runtime caches its schedules by the object's
    ``version``); the hyper-parameters are the groups' current values.

    Attributes:
        matrix: Indices of the parameters updated by the matrix algorithm.
        rows: One row per entry of ``matrix``.
        hparams: Per param group (``ParamRow.batch_key``), its hyper-parameters.
        fingerprint: Digest of every group's hyper-parameters (compared across ranks).
        config: Algorithm configuration every rank must share (compared across ranks).
        version: Changes whenever ``matrix``, ``rows`` or ``cost`` change.
        cost: The planner's cost model: one per param group (a
            :class:`~canzona.plan.GroupedCost` keyed by ``str(batch_key)``, built from each
            group's own hyper-parameters), or None for the runtime's default.
        calibration: Per param group, the phases of its owner math to time and their
            weights in a step's average (e.g. Shampoo's root refresh every ``f`` steps:
            ``(("refresh", 1 / f), ("plain", 1 - 1 / f))``).
    """

    matrix: tuple[int, ...]
    rows: tuple[ParamRow, ...]
    hparams: tuple[Mapping[str, Any], ...]
    fingerprint: str
    config: str
    version: int
    cost: Any = None
    calibration: tuple[tuple[tuple[str, float], ...], ...] = ()
    by_param: Mapping[int, ParamRow] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.matrix) != len(self.rows):
            raise ValueError(f"{len(self.matrix)} matrix parameters but {len(self.rows)} rows")
        if not self.by_param:
            object.__setattr__(self, "by_param", dict(zip(self.matrix, self.rows, strict=True)))

    def row(self, param: int) -> ParamRow:
        """The row of matrix parameter ``param``."""
        return self.by_param[param]

    def with_hparams(self, hparams: Sequence[Mapping[str, Any]], fingerprint: str) -> StepTable:
        """The same rows with this step's hyper-parameters."""
        return StepTable(
            matrix=self.matrix,
            rows=self.rows,
            hparams=tuple(hparams),
            fingerprint=fingerprint,
            config=self.config,
            version=self.version,
            cost=self.cost,
            calibration=self.calibration,
            by_param=self.by_param,
        )


@dataclass(frozen=True, slots=True)
class ComputeBatch:
    """Same-shape matrices of one param group, computed in one call on their owner.

    Attributes:
        items: The matrices, in the order of the stacked payload.
        key: Their param group.
        hparams: The group's hyper-parameters.
        calibrate: For a calibration call, the phase to run (random payloads, items that
            belong to no parameter: no optimizer state may change); None in a step.
    """

    items: tuple[Item, ...]
    key: int
    hparams: Mapping[str, Any]
    calibrate: str | None = None


@dataclass(slots=True)
class ApplyBatch:
    """This rank's fragments of same-shape matrices of one param group, and their directions.

    Attributes:
        key: The param group.
        hparams: The group's hyper-parameters.
        shape: ``(m, n)`` of each full matrix.
        params: Per target, the parameter index.
        targets: Per target, the local tensor to update: a 2-D parameter's shard ``(fr,
            fc)``, or consecutive matrices ``(k, fr, fc)`` of a 3-D stack's shard.
        directions: Per target, its fragment of the direction (same shape as the target).
    """

    key: int
    hparams: Mapping[str, Any]
    shape: tuple[int, int]
    params: list[int] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    directions: list[torch.Tensor] = field(default_factory=list)


ComputeFn = Callable[[ComputeBatch, torch.Tensor], torch.Tensor]
"""Owner side: full payloads ``(k, m, n)`` of a batch -> directions ``(k, m, n)``."""

ApplyFn = Callable[[ApplyBatch], None]
"""Storage side: write a batch of direction fragments into the parameters."""
