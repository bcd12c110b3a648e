"""An owner's scatter send with its many small pieces (and status flags) read by one index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from canzona.runtime.buffers import block_pattern, expand
from canzona.runtime.exchanges import piece_of
from canzona.runtime.payload_layout import INDEXED_NUMEL
from canzona.runtime.schedule_parts import OwnerBatch, Piece

__all__ = ["FLAG", "ScatterRead", "scatter_parts", "scatter_send"]

FLAG = None
"""A part of the scatter send: the sender's status flag (one element)."""


@dataclass(frozen=True, slots=True)
class ScatterRead:
    """Consecutive small parts of the scatter send, read by one index from the step's source.

    The source is the flag (when the group carries one) followed by the outputs of
    ``batches``, each flattened row-major.
    """

    index: torch.Tensor


SendItem = Piece | ScatterRead | None


@dataclass(frozen=True, slots=True)
class ScatterSend:
    """The scatter send in wire order and the batches the index source holds."""

    items: tuple[SendItem, ...]
    batches: tuple[int, ...]


def scatter_send(
    pieces: Sequence[Piece],
    bounds: Sequence[int],
    batches: Sequence[OwnerBatch],
    status: bool,
    device: torch.device,
) -> ScatterSend:
    """The send of :func:`scatter_parts`: per target its flag (with ``status``), its pieces.

    Runs of two or more small parts (pieces under :data:`INDEXED_NUMEL` elements, flags)
    become one :class:`ScatterRead`; larger pieces stay views of their batch's output.
    """
    order: list[SendItem] = []
    for t in range(len(bounds) - 1):
        if status:
            order.append(FLAG)
        order += pieces[bounds[t] : bounds[t + 1]]
    if not bounds:
        order = list(pieces)
    small = [it is FLAG or (isinstance(it, Piece) and it.numel < INDEXED_NUMEL) for it in order]
    used = sorted(
        {it.batch for it, s in zip(order, small, strict=True) if s and isinstance(it, Piece)}
    )
    base: dict[int, int] = {}
    at = 1 if status else 0
    for b in used:
        base[b] = at
        batch = batches[b]
        at += len(batch.items) * batch.m * batch.n
    out: list[SendItem] = []
    run: list[SendItem] = []

    def close() -> None:
        if len(run) > 1:
            out.append(ScatterRead(_index(run, base, batches).to(device)))
        else:
            out.extend(run)
        run.clear()

    for it, s in zip(order, small, strict=True):
        if s:
            run.append(it)
        else:
            close()
            out.append(it)
    close()
    return ScatterSend(tuple(out), tuple(used))


def _index(
    run: Sequence[SendItem], base: dict[int, int], batches: Sequence[OwnerBatch]
) -> torch.Tensor:
    """Where each element of the run lies in the source (a flag at 0).

    Parts of one pattern (blocks of one shape in matrices of one width) share their
    offsets from their first element: the index is filled once per pattern, not per part.
    """
    groups: dict[object, tuple[torch.Tensor, list[int], list[int]]] = {}
    at = 0
    for it in run:
        if it is None:
            key: object = None
            firsts, size = [0], 1
            if key not in groups:
                groups[key] = (torch.zeros(1, dtype=torch.int64), [], [])
        else:
            assert isinstance(it, Piece)
            batch = batches[it.batch]
            step = batch.m * batch.n
            key, offset, pattern = it.selector.pattern(batch.n)
            if key not in groups:
                if pattern is None:
                    pattern = block_pattern(it.selector.shape, batch.n)
                groups[key] = (pattern, [], [])
            first = base[it.batch] + it.start * step + offset
            firsts = [first + j * step for j in range(it.count)]
            size = it.selector.shape[0] * it.selector.shape[1]
        pattern, starts, places = groups[key]
        starts += firsts
        places += range(at, at + size * len(firsts), size)
        at += size * len(firsts)
    index = torch.empty(at, dtype=torch.int64)
    for pattern, starts, places in groups.values():
        index[expand(places, torch.arange(pattern.numel()))] = expand(starts, pattern)
    return index


def scatter_parts(
    send: ScatterSend, outs: Sequence[torch.Tensor], flag: torch.Tensor | None
) -> list[torch.Tensor]:
    """The scatter send's parts for this step's outputs ``outs`` and status ``flag``."""
    source = None
    if any(isinstance(it, ScatterRead) for it in send.items):
        head = [] if flag is None else [flag]
        source = torch.cat(head + [outs[b].reshape(-1) for b in send.batches])
    parts: list[torch.Tensor] = []
    for it in send.items:
        if it is None:
            assert flag is not None
            parts.append(flag)
        elif isinstance(it, ScatterRead):
            assert source is not None
            parts.append(source.index_select(0, it.index))
        else:
            parts.append(piece_of(outs, it))
    return parts
