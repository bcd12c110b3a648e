"""An owner's stack read from the gather by one index when its matrices arrive in small pieces."""

from __future__ import annotations

import torch

from canzona.runtime.assembled import PIECE_NUMEL
from canzona.runtime.buffers import block_pattern, expand
from canzona.runtime.schedule_parts import OwnerBatch

__all__ = ["gather_index"]


def gather_index(batch: OwnerBatch, device: torch.device) -> torch.Tensor | None:
    """Where each element of the batch's stack ``(k, m, n)`` lies in the gather receive buffer.

    None unless the stack arrives in runs of fewer than :data:`PIECE_NUMEL` elements on
    average (a matrix of a large job comes in one small piece per rank that holds part of
    it: placing each run costs a view and a copy, the index one read) and the runs fill it.
    """
    k, m, n = len(batch.items), batch.m, batch.n
    if not batch.assembly or k * m * n >= PIECE_NUMEL * len(batch.assembly):
        return None
    groups: dict[object, tuple[torch.Tensor, list[int], list[int]]] = {}  # by pattern
    for run in batch.assembly:
        key, offset, pattern = run.selector.pattern(n)
        group = groups.get(key)
        if group is None:
            if pattern is None:
                pattern = block_pattern(run.selector.shape, n)
            group = groups[key] = (pattern, [], [])
        size = group[0].numel()
        first = run.start * m * n + offset
        group[1].extend(range(first, first + run.count * m * n, m * n))
        group[2].extend(range(run.offset, run.offset + run.count * size, size))
    index = torch.full((k * m * n,), -1, dtype=torch.int64)
    for pattern, places, starts in groups.values():
        index[expand(places, pattern)] = expand(starts, torch.arange(pattern.numel()))
    if bool((index < 0).any()):
        return None
    return index.to(device)
