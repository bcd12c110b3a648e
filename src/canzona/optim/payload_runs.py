"""A param group's payload views grouped into runs that one concatenation fills."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = ["PayloadRun", "payload_runs"]


@dataclass(frozen=True, slots=True)
class PayloadRun:
    """Payload views that lie back to back in one flat buffer and share a trailing shape.

    Attributes:
        positions: Their positions in the group's prepared lists, in buffer order.
        out: The run's region of the buffer, shaped ``(-1, *tail)``: ``torch.cat`` of the
            run's tensors (each shaped ``(rows, *tail)``) along dimension 0 fills it.
        views: The payload views of the run, in buffer order.
        take: Picks the run's tensors, in buffer order, out of a list in prepared order.
    """

    positions: tuple[int, ...]
    out: Tensor
    views: tuple[Tensor, ...]
    take: Callable[[Sequence[Tensor]], tuple[Tensor, ...]]


def _taker(positions: tuple[int, ...]) -> Callable[[Sequence[Tensor]], tuple[Tensor, ...]]:
    if len(positions) == 1:
        (only,) = positions
        return lambda xs: (xs[only],)
    return operator.itemgetter(*positions)


def _base_offset(view: Tensor) -> tuple[Tensor, int] | None:
    """The flat buffer ``view`` was cut from and its element offset there (None: not one)."""
    base = view._base
    if base is None or base.dim() != 1 or not view.is_contiguous() or view.dim() < 1:
        return None
    return base, int(view.storage_offset() - base.storage_offset())


def payload_runs(payloads: Sequence[Tensor]) -> list[PayloadRun] | None:
    """The payloads (views cut from flat buffers) as maximal runs, or None where one is not.

    Consecutive payloads (in buffer order) join a run when they are adjacent in the same
    buffer and have the same shape past their first dimension; every payload is in exactly
    one run. None when a payload is not a contiguous view of a 1-D buffer.

    Args:
        payloads: The group's payload views, in prepared order.
    """
    placed: list[tuple[int, int, int]] = []  # (buffer order, offset, position)
    bases: dict[int, tuple[int, Tensor]] = {}
    for k, view in enumerate(payloads):
        found = _base_offset(view)
        if found is None:
            return None
        base, offset = found
        order, _ = bases.setdefault(id(base), (len(bases), base))
        placed.append((order, offset, k))
    placed.sort()
    runs: list[PayloadRun] = []
    by_order = {order: base for order, base in bases.values()}
    start = 0
    for i in range(1, len(placed) + 1):
        if i < len(placed):
            (o0, off0, k0), (o1, off1, k1) = placed[i - 1], placed[i]
            prev, this = payloads[k0], payloads[k1]
            if o0 == o1 and off1 == off0 + prev.numel() and prev.shape[1:] == this.shape[1:]:
                continue
        order, offset, first = placed[start]
        positions = tuple(k for _, _, k in placed[start:i])
        numel = sum(payloads[k].numel() for k in positions)
        tail = tuple(payloads[first].shape[1:])
        out = by_order[order].narrow(0, offset, numel).view(-1, *tail)
        take = _taker(positions)
        runs.append(PayloadRun(positions, out, take(payloads), take))
        start = i
    return runs
