"""Parameters whose directions arrive in many small pieces, assembled by one index per group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from canzona.runtime.schedule_parts import Delivery, Target

__all__ = ["PIECE_NUMEL", "Assembled", "Whole", "assemble_deliveries"]

#: A parameter is assembled when its local shard arrives in pieces of fewer elements than
#: this on average: below it a piece costs more host time as a target of its own (views,
#: list entries, a ``foreach`` operand) than the index's elements cost, and the index
#: (8 bytes per element) stays small next to the number of pieces.
PIECE_NUMEL = 4096


@dataclass(frozen=True, slots=True)
class Whole:
    """One parameter's local shard of directions, a range of an :class:`Assembled` read.

    Attributes:
        param: The parameter (a 2-D shard, updated as one target).
        offset: Where its elements start in the assembled directions.
        shape: Its local shard's shape.
        key: Param group.
        full: ``(m, n)`` of each of its blocks (the same for all of them).
        dtype: Direction dtype the apply receives.
    """

    param: int
    offset: int
    shape: tuple[int, int]
    key: int
    full: tuple[int, int]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class Assembled:
    """The directions of a micro-group's :class:`Whole` parameters, read in one call.

    ``index[j]`` is where element ``j`` of the parameters' local shards (one after the
    other, each row-major) lies in the scatter receive buffer.
    """

    index: torch.Tensor
    params: tuple[Whole, ...]


def _area(t: Target, width: int) -> int:
    if t.rows is not None:
        return (t.rows[1] - t.rows[0]) * width
    assert t.rects is not None
    return sum((r1 - r0) * (c1 - c0) for _, _, (r0, r1), (c0, c1) in t.rects)


def _candidates(
    deliveries: Sequence[Delivery],
    local_shapes: dict[int, tuple[int, ...]],
    itemsize: Callable[[int], int],
) -> dict[int, list[tuple[Delivery, int, Target]]]:
    """Per parameter that qualifies, its pieces: (delivery, first matrix in it, target).

    A parameter qualifies when it is a 2-D shard of a dtype wider than two bytes (a half
    precision element rounds by its place in the tensor the kernel is given, see
    :mod:`canzona.runtime.apply`), every piece of it is a block of rows or rectangles of
    one param group and block shape, the pieces cover its whole shard (nothing of it is
    kept or comes in another group) and they are small (:data:`PIECE_NUMEL`). A delivery
    that mixes a qualifying parameter with another disqualifies both: a delivery is
    either read whole by the index or applied piece by piece.
    """
    pieces: dict[int, list[tuple[Delivery, int, Target]]] = {}
    for d in deliveries:
        i = 0
        for t in d.targets:
            pieces.setdefault(t.param, []).append((d, i, t))
            i += t.count
    ok: dict[int, list[tuple[Delivery, int, Target]]] = {}
    for p, entries in pieces.items():
        shape = local_shapes.get(p, ())
        if len(entries) < 2 or len(shape) != 2 or itemsize(p) <= 2:
            continue
        numel = shape[0] * shape[1]
        if numel >= PIECE_NUMEL * len(entries):
            continue
        if len({(d.key, d.full, d.dtype) for d, _, _ in entries}) != 1:
            continue
        if any(t.pos is not None or t.flat or (t.rows is None and t.rects is None)
               for _, _, t in entries):  # fmt: skip
            continue
        if sum(_area(t, shape[1]) for _, _, t in entries) == numel:
            ok[p] = entries
    changed = True
    while changed:
        changed = False
        for d in deliveries:
            params = {t.param for t in d.targets}
            if any(p in ok for p in params) and not all(p in ok for p in params):
                for p in params:
                    ok.pop(p, None)
                changed = True
    return ok


def assemble_deliveries(
    deliveries: Sequence[Delivery],
    local_shapes: dict[int, tuple[int, ...]],
    itemsize: Callable[[int], int],
    device: torch.device,
) -> tuple[list[Delivery], Assembled | None]:
    """Take the parameters that arrive in many small pieces out of ``deliveries``.

    Returns the deliveries still applied piece by piece and, when some parameter
    qualifies (see :func:`_candidates`), the index that reads the others' directions
    from the scatter receive buffer in one call, each parameter's shard whole.
    """
    ok = _candidates(deliveries, local_shapes, itemsize)
    if not ok:
        return list(deliveries), None
    wholes: list[Whole] = []
    # per rectangle size (h, w): source start, source row stride, destination start, width
    rects: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    offset = 0
    for p, entries in ok.items():
        lm, ln = local_shapes[p][0], local_shapes[p][1]
        d0 = entries[0][0]
        wholes.append(Whole(p, offset, (lm, ln), d0.key, d0.full, d0.dtype))
        for d, i, t in entries:
            fr, fc = d.shape
            base = d.offset + i * fr * fc
            if t.rows is not None:  # (count, fr, ln) row-major: the rows' elements in order
                r0, r1 = t.rows
                rects.setdefault((r1 - r0, ln), []).append((base, ln, offset + r0 * ln, ln))
                continue
            assert t.rects is not None
            for (f0, f1), (g0, g1), (r0, _), (c0, _) in t.rects:
                start = base + f0 * fc + g0
                rects.setdefault((f1 - f0, g1 - g0), []).append(
                    (start, fc, offset + r0 * ln + c0, ln)
                )
        offset += lm * ln
    index = torch.full((offset,), -1, dtype=torch.int64)
    for (h, w), rows in rects.items():
        src, src_stride, dst, dst_stride = torch.tensor(rows, dtype=torch.int64).unbind(1)
        down, across = torch.arange(h).view(1, h, 1), torch.arange(w).view(1, 1, w)
        to = dst.view(-1, 1, 1) + down * dst_stride.view(-1, 1, 1) + across
        index[to.reshape(-1)] = (
            src.view(-1, 1, 1) + down * src_stride.view(-1, 1, 1) + across
        ).reshape(-1)
    if bool((index < 0).any()):  # a piece missing: apply them all piece by piece
        return list(deliveries), None
    rest = [d for d in deliveries if d.targets[0].param not in ok]
    return rest, Assembled(index.to(device), tuple(wholes))
