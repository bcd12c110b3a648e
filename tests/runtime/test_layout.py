"""Fragments of a global tensor: runs, positions, reads and writes off the contiguous path."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from canzona.runtime.layout import Fragment, LayoutError, check_placements, fragment_for

# rows 0-1 and 4-5 of a 6 x 3 tensor, all columns: what _StridedShard leaves a rank
ROWS = Fragment((((0, 2), (4, 6)), ((0, 3),)))


def test_strided_shard_runs_and_their_merge() -> None:
    """Catches: _StridedShard read as Shard, and adjacent runs left apart (a slice then
    takes the indexed path)."""
    # 8 rows, split_factor 2 over 2 ranks: rank 1 holds rows 2-3 and 6-7
    frag = fragment_for((8, 4), (2,), [_StridedShard(0, split_factor=2)], (1,))
    assert frag.runs == (((2, 4), (6, 8)), ((0, 4),))
    assert not frag.contiguous and frag.shape == (4, 4)
    # one rank along the strided dim: the two halves meet again
    whole = fragment_for((8, 4), (1,), [_StridedShard(0, split_factor=2)], (0,))
    assert whole.runs == (((0, 8),), ((0, 4),)) and whole.contiguous
    # FSDP2 over TP (mesh (dp 2, tp 2)): TP rank t holds rows 4t-4t+3, and FSDP rank f two
    # rows of those, 4t + 2f and 4t + 2f + 1
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    for f, t in ((0, 0), (0, 1), (1, 0), (1, 1)):
        frag = fragment_for((8, 4), (2, 2), placements, (f, t))
        assert frag.runs == (((4 * t + 2 * f, 4 * t + 2 * f + 2),), ((0, 4),))


def test_position_counts_the_runs_before() -> None:
    """Catches: the position of a global index taken within its run only."""
    assert [ROWS.position(i) for i in range(6)] == [0, 1, None, None, 2, 3]


@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 2)])
def test_reads_and_writes_off_the_contiguous_path(shape: tuple[int, ...]) -> None:
    """Catches: a write of a non-contiguous fragment that loses its data (2-D and N-D)."""
    frag = ROWS if len(shape) == 2 else Fragment((*ROWS.runs, ((0, 2),)))
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    rows = torch.tensor([0, 1, 4, 5])
    assert torch.equal(frag.read(full), full[rows])
    target = torch.zeros(shape)
    frag.write_(target, full[rows] + 1)
    want = torch.zeros(shape)
    want[rows] = full[rows] + 1
    assert torch.equal(target, want)


def test_placements_canzona_cannot_reconstruct_raise() -> None:
    """Catches: a negative or too large shard dim let through (it names no dimension)."""
    check_placements("w", [Shard(1), Replicate(), _StridedShard(0, split_factor=2)], 2)
    for bad in (Shard(-1), Shard(2), _StridedShard(2, split_factor=2)):
        with pytest.raises(LayoutError, match=r"parameter 'w': placement .* out of range"):
            check_placements("w", [bad], 2)
    with pytest.raises(LayoutError, match="Partial placement"):
        check_placements("w", [Partial()], 2)
    with pytest.raises(LayoutError, match="do not match mesh shape"):
        fragment_for((4, 4), (2, 2), [Shard(0)], (0, 0))


@pytest.mark.parametrize(("dp", "tp"), [(2, 2), (3, 2), (2, 3), (3, 3), (4, 2), (5, 2)])
def test_fsdp_over_tp_holds_fsdps_chunks_of_tps_chunks(dp: int, tp: int) -> None:
    """FSDP2 over tensor parallelism stores, at mesh coordinate ``(d, t)``, chunk ``d`` of
    TP's chunk ``t`` (``torch.chunk`` both times); its placements are ``(_StridedShard(0,
    split_factor=tp), Shard(0))``.

    Catches: those placements split left to right as DTensor's ``_StridedShard`` does: on
    uneven sizes (7 rows on (3, 2), 11 on (3, 3), 9 on (4, 2), ...) other rows."""
    placements = (_StridedShard(0, split_factor=tp), Shard(0))
    for rows in range(1, 31):
        for d in range(dp):
            for t in range(tp):
                tp_piece = torch.arange(rows).chunk(tp)
                piece = tp_piece[t] if t < len(tp_piece) else torch.arange(0)
                chunks = piece.chunk(dp)
                want = chunks[d].tolist() if d < len(chunks) else []
                frag = fragment_for((rows, 4), (dp, tp), placements, (d, t))
                got = [i for a, b in frag.runs[0] for i in range(a, b)]
                assert got == want, (rows, d, t)


def _dtensor_rows(
    n: int, mesh: tuple[int, ...], placements: tuple[Any, ...], coord: Any
) -> list[int]:
    """The rows ``distribute_tensor`` gives a coordinate: its left-to-right split replayed."""
    local = torch.arange(n)
    for size, p, c in zip(mesh, placements, coord, strict=True):
        shards, _ = p._split_tensor(local, size, with_padding=False, contiguous=True)
        local = shards[c]
    return [int(i) for i in local.tolist()]


@pytest.mark.parametrize(
    ("mesh", "placements"),
    [
        ((2, 2, 2), (_StridedShard(0, split_factor=4), _StridedShard(0, split_factor=2), Shard(0))),
        ((4, 3, 2), (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2), Shard(0))),
    ],
)
def test_two_strided_shards_on_one_dim_hold_dtensors_rows(
    mesh: tuple[int, ...], placements: tuple[Any, ...]
) -> None:
    """Catches: FSDP2's rule (the plain shardings after a ``_StridedShard`` cut first)
    applied to the last ``_StridedShard`` of a dimension that an earlier one cuts too
    (DTensor's encoding of a sharding order): each rank's rows were taken from another
    rank's, with the right shapes, so nothing refused it and the owners assembled
    row-permuted matrices."""
    n = 2 * math.prod(mesh)
    for coord in itertools.product(*(range(s) for s in mesh)):
        frag = fragment_for((n, 3), mesh, placements, coord)
        got = [i for a, b in frag.runs[0] for i in range(a, b)]
        assert got == _dtensor_rows(n, mesh, placements, coord), coord
