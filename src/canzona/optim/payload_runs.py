"""A param group's payload views grouped into runs that one concatenation fills."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from canzona.optim.flat_homes import evict, home
from canzona.updates.batched import flat_blend

__all__ = ["HomedRuns", "LastHome", "PayloadRun", "home_runs", "in_runs", "payload_runs"]


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
    if not positions:
        return lambda xs: ()
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


@dataclass(frozen=True, slots=True)
class HomedRuns:
    """A group's payload runs, with the momentum buffers of the small ones in one flat home.

    Attributes:
        runs: Every run, with its buffers' home (a region ``(-1, *tail)`` holding them back
            to back, in the run's order) or None.
        loose: Picks the buffers (or gradients) of the runs without a home, out of a list in
            prepared order.
        home: The flat buffer holding the homed buffers (None: no home).
        homed: The homed buffers, in the home's order.
        ptrs: Where each of them starts (``data_ptr``) in the home.
    """

    runs: tuple[tuple[PayloadRun, Tensor | None], ...]
    loose: Callable[[Sequence[Tensor]], tuple[Tensor, ...]]
    home: Tensor | None = None
    homed: tuple[Tensor, ...] = ()
    ptrs: tuple[int, ...] = ()

    @property
    def last(self) -> LastHome | None:
        """The home and its buffers (what a later homing of the group evicts from), or None."""
        return None if self.home is None else (self.home, self.homed)

    def moved(self) -> bool:
        """Whether a homed buffer lies elsewhere now (``buf.data = ...``, ``set_``)."""
        return tuple(map(Tensor.data_ptr, self.homed)) != self.ptrs


def in_runs(tensors: Sequence[Tensor], runs: Sequence[PayloadRun]) -> list[Tensor]:
    """``tensors`` (in prepared order) in the runs' order: homed buffers back to back."""
    return [t for run in runs for t in run.take(tensors)]


#: A group's last home and the buffers it took, for :func:`home_runs` to evict from.
LastHome = tuple[Tensor, tuple[Tensor, ...]]


def home_runs(
    bufs: Sequence[Tensor], runs: Sequence[PayloadRun], last: LastHome | None = None
) -> HomedRuns:
    """Give the buffers of the runs that blend flat (:func:`flat_blend`) one home.

    The buffers of those runs move into one new flat buffer, run after run, each run's in
    its order (:func:`~canzona.optim.flat_homes.home`; nothing moves when one cannot): a
    step then updates a run's momentum with one op on its region and blends it into the
    payload without concatenating the buffers, and a backup copies them with one operand.
    Call it before anything keeps a view of the buffers (it moves their storage).

    Args:
        bufs: The group's momentum buffers, in prepared order.
        runs: The group's payload runs (:func:`payload_runs`).
        last: The group's last home and its buffers (:attr:`HomedRuns.last`): those left
            out of this one and still in it get storages of their own
            (:func:`~canzona.optim.flat_homes.evict`), so that none keeps it alive.
    """
    chosen = [run for run in runs if flat_blend(run.out, len(run.positions))]
    homed = in_runs(bufs, chosen)
    flat = home(homed)
    if last is not None:
        kept = set(map(id, homed)) if flat is not None else set()
        evict([t for t in last[1] if id(t) not in kept], last[0])
    if flat is None:
        return HomedRuns(tuple((run, None) for run in runs), _taker(tuple(range(len(bufs)))))
    places: dict[int, Tensor] = {}
    offset = 0
    for run in chosen:
        places[id(run)] = flat.narrow(0, offset, run.out.numel()).view(run.out.shape)
        offset += run.out.numel()
    inside = {k for run in chosen for k in run.positions}
    loose = _taker(tuple(k for k in range(len(bufs)) if k not in inside))
    runs_out = tuple((run, places.get(id(run))) for run in runs)
    ptrs = tuple(map(Tensor.data_ptr, homed))
    return HomedRuns(runs_out, loose, flat, tuple(homed), ptrs)
