"""Loaded DTensor state into its parameters' layouts: all-to-alls with a vote before each."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from canzona.runtime.checks import vote
from canzona.runtime.config import UpdateFailedError
from canzona.runtime.layout import Fragment, Runs, fragment_for, full_fragment, mesh_coordinates
from canzona.runtime.tensors import as_storage_layout, check_loadable
from canzona.runtime.watchdog import Watchdog

#: Bytes of moved state per exchange (per rank): each has its own buffers and vote.
BATCH_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class _Move:
    """One loaded DTensor to rebuild in its parameter's layout on this rank's mesh."""

    value: DTensor
    placements: tuple[Placement, ...] | None  # on the value's mesh; None: the whole, everywhere
    ranks: tuple[int, ...]  # the mesh's ranks (this rank's instance), in coordinate order
    coords: tuple[tuple[int, ...], ...]  # each one's coordinate

    def source(self, k: int) -> Fragment:
        return fragment_for(
            self.value.shape, self.value.device_mesh.shape, self.value.placements, self.coords[k]
        )

    def target(self, k: int) -> Fragment:
        placements = self.placements
        if placements is None:
            return full_fragment(self.value.shape)
        return fragment_for(
            self.value.shape, self.value.device_mesh.shape, placements, self.coords[k]
        )

    def sends_from(self, k: int, j: int) -> bool:
        """Whether position ``k`` sends to ``j``: the copy of ``k``'s data that ``j`` reads.

        Mesh dimensions on which the source is replicated hold the same data; ``j`` reads
        from the positions that share its coordinate there, which hold the tensor once.
        """
        dims = [d for d, pl in enumerate(self.value.placements) if isinstance(pl, Replicate)]
        return all(self.coords[k][d] == self.coords[j][d] for d in dims)

    @property
    def nbytes(self) -> int:
        return math.prod(self.value.shape) * self.value.dtype.itemsize


def _intersect(a: Runs, b: Runs) -> Runs:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _local(frag: Fragment, sub: Fragment) -> Fragment:
    """``sub`` (global indices inside ``frag``) as the part of ``frag``'s local tensor."""
    runs = []
    for held, part in zip(frag.runs, sub.runs, strict=True):
        local: list[tuple[int, int]] = []
        for lo, hi in part:  # each inside one held run: ``sub`` is an intersection with it
            pos = 0
            for start, stop in held:
                if start <= lo < stop:
                    local.append((pos + lo - start, pos + hi - start))
                    break
                pos += stop - start
        runs.append(tuple(local))
    return Fragment(tuple(runs))


def _read(local: torch.Tensor, part: Fragment) -> torch.Tensor:
    """``part`` of ``local``, flat (a piece to send)."""
    return part.read(local).contiguous().reshape(-1)


Pieces = tuple[tuple[int, Fragment, bool], ...]


def _pieces_of(move: _Move, me: int, known: dict[tuple[object, ...], Pieces]) -> Pieces:
    """:func:`_pieces`, once per layout pair (tensors of one shape, mesh shape and placements).

    A load then computes O(mesh) fragments per kind of tensor, not per tensor.
    """
    value = move.value
    key = (value.shape, value.device_mesh.shape, tuple(value.placements), move.placements, me)
    found = known.get(key)
    if found is None:
        found = known[key] = tuple(_pieces(move, me))
    return found


def _pieces(move: _Move, me: int) -> Iterator[tuple[int, Fragment, bool]]:
    """(other position, overlap, whether this position sends it) in a fixed order."""
    source, target = move.source(me), move.target(me)
    for j in range(len(move.ranks)):
        if move.sends_from(me, j):  # what I send to j
            sub = Fragment(tuple(map(_intersect, source.runs, move.target(j).runs)))
            if sub.numel:
                yield j, sub, True
        if move.sends_from(j, me):  # what j sends to me
            sub = Fragment(tuple(map(_intersect, move.source(j).runs, target.runs)))
            if sub.numel:
                yield j, sub, False


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 8: every piece starts where any dtype can view it."""
    return -(-nbytes // 8) * 8


def _batches(moves: Sequence[_Move]) -> Iterator[list[_Move]]:
    batch: list[_Move] = []
    size = 0
    for move in moves:
        if batch and size + move.nbytes > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(move)
        size += move.nbytes
    if batch:
        yield batch


def _exchange(
    batch: Sequence[_Move],
    *,
    watchdog: Watchdog,
    what: str,
    known: dict[tuple[object, ...], Pieces],
    error: Exception | None = None,
) -> list[torch.Tensor]:
    """One batch: allocate and pack everything, vote, exchange, unpack (the new locals).

    ``error``: this rank already failed (it still votes, so that every rank raises).
    ``known``: the pieces of the layout pairs met so far (see :func:`_pieces_of`).
    """
    group, world = watchdog.process_group, watchdog.world
    assert group is not None
    outs: list[torch.Tensor] = []
    recv_plan: list[tuple[torch.Tensor, Fragment, int]] = []
    try:
        sends: dict[int, list[torch.Tensor]] = {}
        recv_sizes = [0] * world
        if error is not None:
            raise error
        for move in batch:
            me = move.ranks.index(dist.get_rank())
            mine = move.value.to_local()
            source, target = move.source(me), move.target(me)
            # on the value's device, as DTensor's redistribution leaves it
            out = torch.empty(target.shape, dtype=mine.dtype, device=mine.device)
            outs.append(out)
            for j, sub, sending in _pieces_of(move, me, known):
                peer = dist.get_group_rank(group, move.ranks[j])
                if sending:
                    piece = _read(mine, _local(source, sub))
                    sends.setdefault(peer, []).append(piece.view(torch.uint8))
                else:
                    recv_plan.append((out, _local(target, sub), peer))
                    recv_sizes[peer] += _aligned(sub.numel * mine.dtype.itemsize)
        in_splits = [sum(_aligned(t.numel()) for t in sends.get(r, ())) for r in range(world)]
        send = torch.empty(sum(in_splits), dtype=torch.uint8, device=watchdog.device)
        receive = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=watchdog.device)
        offset = 0
        for r in range(world):
            for t in sends.get(r, ()):
                send[offset : offset + t.numel()].copy_(t)
                offset += _aligned(t.numel())
    except Exception as exc:  # e.g. out of memory: every rank raises at the vote
        error = exc
    mine_report = None if error is None else f"{type(error).__name__}: {error}"
    reports = vote(mine_report, watchdog=watchdog, what=what)
    if reports:
        text = "; ".join(f"rank {r}: {line}" for r, line in reports)
        raise UpdateFailedError(
            f"{what} failed on ranks {[r for r, _ in reports]} ({text}); nothing was loaded"
        ) from error
    work = dist.all_to_all_single(receive, send, recv_sizes, in_splits, group=group, async_op=True)
    watchdog.wait(work, what)
    starts = [sum(recv_sizes[:r]) for r in range(world)]
    for out, part, peer in recv_plan:
        size = part.numel * out.dtype.itemsize
        data = receive[starts[peer] : starts[peer] + size].view(out.dtype)
        starts[peer] += _aligned(size)
        part.write_(out, data.view(part.shape))
    return outs


def reshard_loaded(
    pairs: Sequence[tuple[DTensor, tuple[Placement, ...] | None]],
    *,
    watchdog: Watchdog,
    what: str,
    error: Exception | None = None,
) -> list[torch.Tensor]:
    """This rank's pieces of loaded DTensors in other placements, by canzona's own exchange.

    DTensor's redistribution is a collective that waits without a deadline: a rank that
    raised in it alone (out of memory) left the others waiting for the process group's
    timeout. Each pair is a loaded DTensor and the placements it is wanted in, on its own
    mesh (None: the whole tensor on every rank). Every rank passes the same pairs (the
    same state dict). Everything that may raise (the outputs, the buffers) is allocated
    before a vote, so that a failure raises the same error on every rank before any
    enters the exchange; each exchange waits with the optimizer's deadline. ``error``:
    this rank already found the pairs wrong (every rank raises it).

    Returns:
        The local tensors, in order.

    Raises:
        UpdateFailedError: on every rank, naming the ranks that failed (a tensor on a mesh
            with ranks outside the optimizer's process group among the reasons); nothing
            changed.
    """
    group = watchdog.process_group
    assert group is not None
    members = set(dist.get_process_group_ranks(group))
    moves = []
    meshes: dict[int, tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]] = {}
    for value, placements in pairs:
        mesh = value.device_mesh
        if id(mesh) not in meshes:  # the pairs keep their meshes alive: ids stay theirs
            ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
            meshes[id(mesh)] = (ranks, tuple(mesh_coordinates(tuple(mesh.shape))))
        ranks, coords = meshes[id(mesh)]
        if not members.issuperset(ranks):
            error = error or ValueError(
                f"loaded state on a mesh with ranks {list(ranks)} that are not all in the "
                "optimizer's process group"
            )
        moves.append(_Move(value, placements, ranks, coords))
    out: list[torch.Tensor] = []
    known: dict[tuple[object, ...], Pieces] = {}
    for batch in _batches(moves):
        out += _exchange(batch, watchdog=watchdog, what=what, error=error, known=known)
    return out


def _moves(value: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``value`` in ``param``'s storage layout needs data from other ranks."""
    if not isinstance(value, DTensor):
        return False
    if not isinstance(param, DTensor):
        return True
    return tuple(value.placements) != tuple(param.placements)


def to_storage_layouts(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, watchdog: Watchdog, what: str
) -> list[torch.Tensor]:
    """:func:`~canzona.runtime.tensors.as_storage_layout` of every (value, parameter) pair.

    In a job, the DTensors that need data from other ranks move in :func:`reshard_loaded`'s
    exchanges (every rank passes the same pairs), not in DTensor's own collectives.
    """
    moving = [i for i, (v, p) in enumerate(pairs) if _moves(v, p)]
    if not moving or watchdog.process_group is None:
        return [as_storage_layout(v, p) for v, p in pairs]  # one process: nothing to wait for
    error = None
    for i in moving:
        try:
            check_loadable(*pairs[i])
        except ValueError as exc:  # raised by every rank, after the vote
            error = error or exc
    wanted = [(cast(DTensor, pairs[i][0]), _placements(pairs[i][1])) for i in moving]
    done = {}
    moved = reshard_loaded(wanted, watchdog=watchdog, what=what, error=error)
    for i, local in zip(moving, moved, strict=True):
        param = pairs[i][1]
        done[i] = (
            DTensor.from_local(
                local,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
            if isinstance(param, DTensor)
            else local
        )
    return [done[i] if i in done else as_storage_layout(v, p) for i, (v, p) in enumerate(pairs)]


def _placements(param: torch.Tensor) -> tuple[Placement, ...] | None:
    return tuple(param.placements) if isinstance(param, DTensor) else None
