"""Storage layout -> fragments: which slice of a global tensor each mesh rank holds."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

# One tensor dimension of a fragment: the ordered global indices it holds, as
# half-open runs ``(start, stop)``. DTensor's left-to-right sharding keeps them
# increasing; ``_StridedShard`` can make a dimension hold several runs.
Runs = tuple[tuple[int, int], ...]


class LayoutError(ValueError):
    """A parameter's placements cannot be turned into fragments."""


def _runs_len(runs: Runs) -> int:
    return sum(stop - start for start, stop in runs)


def _slice_runs(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions ``[lo, hi)`` of the ordered index list described by ``runs``."""
    out: list[tuple[int, int]] = []
    pos = 0
    for start, stop in runs:
        length = stop - start
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((start + a - pos, start + b - pos))
        pos += length
        if pos >= hi:
            break
    return tuple(out)


def _chunk(runs: Runs, num_chunks: int, index: int) -> Runs:
    """Chunk ``index`` of ``num_chunks`` with ``torch.chunk`` semantics (ceil-sized, tail empty)."""
    n = _runs_len(runs)
    size = -(-n // num_chunks) if n else 0
    lo = min(index * size, n)
    hi = min(lo + size, n)
    return _slice_runs(runs, lo, hi)


def _strided_chunk(runs: Runs, split_factor: int, num_chunks: int, index: int) -> Runs:
    """``_StridedShard``: split into ``split_factor`` pieces, take chunk ``index`` of each."""
    pieces = [_chunk(runs, split_factor, j) for j in range(split_factor)]
    return tuple(run for piece in pieces for run in _chunk(piece, num_chunks, index))


def _merge(runs: Runs) -> Runs:
    out: list[tuple[int, int]] = []
    for start, stop in runs:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Fragment:
    """The part of a global tensor held by one rank: per-dimension index runs.

    Attributes:
        runs: Per tensor dimension, the ordered global index runs held.
        shape: Local shape (derived).
        numel: Number of elements held (derived).
        contiguous: Every dimension is a single run, so the fragment is a slice (derived).
    """

    runs: tuple[Runs, ...]
    shape: tuple[int, ...] = field(init=False, compare=False)
    numel: int = field(init=False, compare=False)
    contiguous: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        shape = tuple(_runs_len(r) for r in self.runs)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "numel", math.prod(shape))
        object.__setattr__(self, "contiguous", all(len(r) <= 1 for r in self.runs))

    def position(self, index: int) -> int | None:
        """Where global index ``index`` of dim 0 sits in the local tensor (None: not held)."""
        pos = 0
        for start, stop in self.runs[0]:
            if start <= index < stop:
                return pos + index - start
            pos += stop - start
        return None

    def index_tensors(self, device: torch.device | None = None) -> list[torch.Tensor]:
        """Global indices per dimension, as int64 tensors."""
        return [
            torch.cat([torch.arange(a, b, device=device) for a, b in r])
            if r
            else torch.empty(0, dtype=torch.long, device=device)
            for r in self.runs
        ]

    def read(self, full: torch.Tensor) -> torch.Tensor:
        """Copy this fragment out of ``full`` (shape: the global tensor's trailing dims)."""
        if self.contiguous:
            view = full
            for dim, r in enumerate(self.runs):
                start, stop = r[0] if r else (0, 0)
                view = view.narrow(dim, start, stop - start)
            return view
        out = full
        for dim, idx in enumerate(self.index_tensors(full.device)):
            out = out.index_select(dim, idx)
        return out

    def write_(self, full: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (this fragment's shape) into ``full`` in place."""
        if self.contiguous:
            self.read(full).copy_(data)
            return
        idx = self.index_tensors(full.device)
        if len(idx) == 2:
            full[idx[0].unsqueeze(1), idx[1].unsqueeze(0)] = data.to(full.dtype)
            return
        grids = torch.meshgrid(*idx, indexing="ij")
        full[grids] = data.to(full.dtype)


def full_fragment(shape: Sequence[int]) -> Fragment:
    """The fragment that holds all of a tensor of ``shape``."""
    return Fragment(tuple(((0, s),) if s else () for s in shape))


def fragment_for(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Fragment:
    """The fragment a mesh coordinate holds, replaying DTensor's left-to-right sharding.

    Remembered per arguments (a fragment never changes): the setup of a large job asks
    for the same few layouts at every coordinate of thousands of matrices.

    Args:
        global_shape: Shape of the global (logical) tensor.
        mesh_shape: Shape of the device mesh.
        placements: One placement per mesh dimension.
        coordinate: The rank's coordinate in the mesh.

    Raises:
        LayoutError: for ``Partial`` or unknown placements, or mismatched lengths.
    """
    key = (tuple(global_shape), tuple(mesh_shape), tuple(placements), tuple(coordinate))
    try:
        return _remembered(*key)
    except TypeError:  # an unhashable placement of another kind: not remembered
        return _fragment_for(*key)


def _fragment_for(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Fragment:
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise LayoutError(
            f"placements {tuple(placements)!r} do not match mesh shape {tuple(mesh_shape)!r}"
        )
    runs: list[Runs] = [((0, s),) if s else () for s in global_shape]
    cuts: dict[int, list[tuple[Placement, int, int]]] = {}  # per tensor dim, in mesh order
    for mesh_dim, placement in enumerate(placements):
        size, coord = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(placement, Shard | _StridedShard):
            cuts.setdefault(placement.dim, []).append((placement, size, coord))
        elif isinstance(placement, Replicate):
            continue
        elif isinstance(placement, Partial):
            raise LayoutError(f"Partial placement {placement!r} holds no slice of the tensor")
        else:
            raise LayoutError(f"unsupported placement {placement!r}")
    for d, seq in cuts.items():
        runs[d] = _cut(runs[d], seq)
    return Fragment(tuple(_merge(r) for r in runs))


_remembered = functools.lru_cache(maxsize=1 << 16)(_fragment_for)


def _cut(runs: Runs, seq: list[tuple[Placement, int, int]]) -> Runs:
    """One tensor dimension cut by its placements ``(placement, mesh size, coordinate)``.

    A ``_StridedShard`` whose split factor is the product of the mesh sizes of the plain
    shardings after it is FSDP2 over tensor parallelism: those shardings cut first, then
    the strided one cuts each piece (``torch.chunk``), which is what FSDP2 stores and what
    DTensor's redistribution reads back. On uneven sizes this differs from DTensor's
    left-to-right split of the placements (e.g. 7 rows on a ``(3, 2)`` mesh: rank ``(2,
    0)`` holds no row, rank ``(2, 1)`` row 6). Any other strided placement splits as
    DTensor's ``_StridedShard`` does, left to right: several on one dimension (DTensor's
    encoding of a sharding order, which FSDP2 does not make) among them.
    """
    for k, (placement, size, coord) in enumerate(seq):
        later = seq[k + 1 :]
        if (
            isinstance(placement, _StridedShard)
            and later
            and not any(isinstance(p, _StridedShard) for p, _, _ in (*seq[:k], *later))
            and int(placement.split_factor) == math.prod(s for _, s, _ in later)
        ):
            for _, s, c in (*seq[:k], *later):
                runs = _chunk(runs, s, c)
            return _chunk(runs, size, coord)
    for placement, size, coord in seq:
        if isinstance(placement, _StridedShard):
            runs = _strided_chunk(runs, int(placement.split_factor), size, coord)
        else:
            runs = _chunk(runs, size, coord)
    return runs


def mesh_coordinates(mesh_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """All coordinates of a mesh, row-major (the order of ``mesh.mesh.flatten()``)."""
    return itertools.product(*(range(s) for s in mesh_shape))


def replicate_dims(placements: Sequence[Placement]) -> tuple[int, ...]:
    """Mesh dimensions along which the tensor is replicated."""
    return tuple(i for i, p in enumerate(placements) if isinstance(p, Replicate))


def check_placements(name: str, placements: Sequence[Placement], ndim: int) -> None:
    """Raise a clear error for placements canzona cannot reconstruct.

    Raises:
        LayoutError: naming the parameter, for ``Partial`` or out-of-range shard dims.
    """
    for p in placements:
        if isinstance(p, Partial):
            raise LayoutError(
                f"parameter {name!r} has a Partial placement {p!r}; reduce it before the "
                "optimizer step (e.g. redistribute to Replicate or Shard)"
            )
        if isinstance(p, Shard | _StridedShard) and not 0 <= p.dim < ndim:
            raise LayoutError(f"parameter {name!r}: placement {p!r} is out of range for {ndim}-D")
        if not isinstance(p, Shard | _StridedShard | Replicate):
            raise LayoutError(f"parameter {name!r}: unsupported placement {p!r}")
