"""The apply after the vote: delivered directions grouped into batches of local targets."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from canzona.runtime.assembled import Assembled
from canzona.runtime.schedule_parts import Delivery, Target
from canzona.runtime.table import ApplyBatch, ApplyFn, StepTable
from canzona.runtime.tensors import local_tensor

__all__ = ["apply_runs"]


def apply_runs(
    runs: Sequence[tuple[torch.Tensor, Delivery | Assembled]],
    table: StepTable,
    tensors: Sequence[torch.Tensor],
    apply: ApplyFn,
) -> None:
    """Group the delivered runs by (param group, shape) and hand each batch to ``apply``.

    A 3-D stack whose matrices arrive in several runs is applied whole, from one assembled
    direction, so that the update does not depend on which owners sent which matrices
    (a half-precision one matrix by matrix: :func:`_add_stack`). An assembled read gives
    each of its parameters' shards as one target.
    """
    batches: dict[tuple[int, int, int], ApplyBatch] = {}
    stacks: dict[int, tuple[ApplyBatch, list[tuple[Target, torch.Tensor, int]]]] = {}
    flats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (block view, contiguous copy)
    for data, d in runs:
        if isinstance(d, Assembled):
            _add_wholes(batches, table, tensors, data, d)
            continue
        key = (d.key, *d.full)
        batch = batches.get(key)
        if batch is None:
            batch = ApplyBatch(d.key, table.hparams[d.key], d.full)
            batches[key] = batch
        if data.dtype != d.dtype:
            data = data.to(d.dtype)
        if d.whole is not None:  # whole 2-D parameters: one matrix each
            batch.directions += data.unbind(0)
            batch.params += d.whole
            batch.targets += [
                t._local_tensor if isinstance(t, DTensor) else t
                for t in map(tensors.__getitem__, d.whole)
            ]
            continue
        if len(d.targets) == d.count and all(
            t.pos is None and t.rects is None and t.rows is None for t in d.targets
        ):
            batch.directions += data.unbind(0)  # matricised N-D weights: one matrix each
            batch.params += [t.param for t in d.targets]
            batch.targets += [_local(tensors, t, flats) for t in d.targets]
            continue
        i = 0
        for t in d.targets:
            if t.pos is not None and t.rows is None and t.rects is None:
                stacks.setdefault(t.param, (batch, []))[1].append((t, data, i))
            else:
                _add_target(batch, t, _local(tensors, t, flats), data, i, copies)
            i += t.count
    for p, (batch, parts) in stacks.items():
        local = local_tensor(tensors[p])
        if len(parts) == 1 or sum(t.count for t, _, _ in parts) != local.shape[0]:
            for t, data, i in parts:
                _add_target(batch, t, local, data, i, copies)
            continue
        whole = torch.empty(local.shape, dtype=parts[0][1].dtype, device=local.device)
        for t, data, i in parts:
            whole.narrow(0, t.pos or 0, t.count).copy_(data.narrow(0, i, t.count))
        _add_stack(batch, local, whole, p)
    for batch in batches.values():
        apply(batch)
    for view, copy in copies:
        view.copy_(copy)
    for local, matrix in flats.values():
        if matrix.data_ptr() != local.data_ptr():  # a copy: written back
            local.copy_(matrix.view(local.shape))


def _add_wholes(
    batches: dict[tuple[int, int, int], ApplyBatch],
    table: StepTable,
    tensors: Sequence[torch.Tensor],
    data: torch.Tensor,
    assembled: Assembled,
) -> None:
    """Append each parameter of an assembled read, its local shard one target."""
    for w in assembled.params:
        key = (w.key, *w.full)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = ApplyBatch(w.key, table.hparams[w.key], w.full)
        direction = data.narrow(0, w.offset, w.shape[0] * w.shape[1]).view(w.shape)
        batch.directions.append(direction if direction.dtype == w.dtype else direction.to(w.dtype))
        batch.targets.append(local_tensor(tensors[w.param]))
        batch.params.append(w.param)


def _add_stack(batch: ApplyBatch, target: torch.Tensor, directions: torch.Tensor, p: int) -> None:
    """Append a 3-D target of consecutive matrices and its directions.

    CPU element-wise kernels round a half-precision element by where it falls in the tensor
    they are given (the vectorised body or the scalar tail: ``add_(alpha=...)`` differs
    between them), so a half-precision stack goes in as its matrices (views): each then
    rounds as the same matrix alone, which is what experts and head blocks must equal.
    Wider dtypes round alike in both paths and stay one target.
    """
    if target.element_size() > 2:
        batch.targets.append(target)
        batch.directions.append(directions)
        batch.params.append(p)
        return
    batch.targets += target.unbind(0)
    batch.directions += directions.unbind(0)
    batch.params += [p] * target.shape[0]


def _local(
    tensors: Sequence[torch.Tensor],
    t: Target,
    flats: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """A target parameter's local shard (a matricised N-D weight as its ``(rows, rest)``).

    A weight whose memory has no such view (``channels_last``) is updated in a contiguous
    copy, written back after the apply; ``flats`` keeps each weight's matrix.
    """
    local = local_tensor(tensors[t.param])
    if not t.flat:
        return local
    seen = flats.get(t.param)
    if seen is None:
        try:
            matrix = local.view(local.shape[0], -1)
        except RuntimeError:
            matrix = local.contiguous().view(local.shape[0], -1)
        seen = flats[t.param] = (local, matrix)
    return seen[1]


def _add_target(
    batch: ApplyBatch,
    t: Target,
    local: torch.Tensor,
    data: torch.Tensor,
    i: int,
    copies: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Append one target (and its directions) of a delivered run ``data`` from matrix ``i``.

    A half-precision block that is no contiguous view (columns of a ``Split(dim=1)``) is
    updated in a contiguous copy, written back after the apply (``copies``): the CPU
    kernels round such an element by its place in the rows they are given (see
    :func:`_add_stack`), and the block must equal the same block as a parameter alone.
    """
    if t.pos is not None and t.rows is None and t.rects is None:  # consecutive stack matrices
        _add_stack(batch, local.narrow(0, t.pos, t.count), data.narrow(0, i, t.count), t.param)
        return
    mat = local if t.pos is None else local[t.pos]
    if t.rows is not None:  # consecutive row blocks at full width
        r0, r1 = t.rows
        rows = mat[r0:r1].view(t.count, (r1 - r0) // t.count, mat.shape[-1])
        _add_stack(batch, rows, data.narrow(0, i, t.count), t.param)
        return
    if t.rects is None:
        batch.targets.append(mat)
        batch.directions.append(data[i])
        batch.params.append(t.param)
        return
    for (f0, f1), (g0, g1), (r0, r1), (c0, c1) in t.rects:
        block = mat[r0:r1, c0:c1]
        if block.element_size() <= 2 and not block.is_contiguous():
            copies.append((block, block.contiguous()))
            block = copies[-1][1]
        batch.targets.append(block)
        batch.directions.append(data[i, f0:f1, g0:g1])
        batch.params.append(t.param)
