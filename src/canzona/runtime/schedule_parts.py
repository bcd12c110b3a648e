"""The parts of a precomputed step: runs to place, pieces to send, deliveries, schedules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from canzona.runtime.buffers import FlatBuffer, Selector
from canzona.runtime.layout import Fragment
from canzona.runtime.routing import Item, Runs

if TYPE_CHECKING:
    from canzona.runtime.assembled import Assembled
    from canzona.runtime.scatter_index import ScatterSend

BatchKey = tuple[int, int, int, torch.dtype]  # (param group, m, n, payload dtype)


@dataclass(frozen=True, slots=True)
class Indexed:
    """Small sent fragments of one payload buffer, one after the other, read by one index."""

    buffer: torch.Tensor
    index: torch.Tensor

    def read(self) -> torch.Tensor:
        """The fragments' elements, in order."""
        return self.buffer.index_select(0, self.index)


SendView = torch.Tensor | tuple[torch.Tensor, Selector] | Indexed
"""A sent fragment: a flat range, a strided 2-D view, (a matrix, the fragment's runs), or
many small ones read by one index."""


def common_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype every member of ``dtypes`` converts to and from exactly."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    if out in (torch.bfloat16, torch.float16) and len(set(dtypes)) > 1:
        out = torch.float32
    return out


@dataclass(frozen=True, slots=True)
class Assembly:
    """A run of fragments from one source, placed into the owner's full stack.

    Attributes:
        offset: Element offset of the run in the micro-group's gather receive buffer.
        start: Position of the run's first matrix in the batch.
        count: Matrices in the run.
        selector: Where the fragment sits in each full matrix.
    """

    offset: int
    start: int
    count: int
    selector: Selector


@dataclass(slots=True)
class OwnerBatch:
    """Matrices one rank computes in one call.

    Attributes:
        items: The matrices, in stack order.
        key: Their param group.
        m: Rows.
        n: Columns.
        dtype: Dtype of the stacked payload.
        assembly: Runs that fill the stack from the gather receive buffer.
        inputs: Local batches: the payload view of each matrix (no communication).
        index: Where each element of the stack lies in the gather receive buffer, when it
            is read by one index instead of placed run by run (see
            :func:`~canzona.runtime.owner_index.gather_index`).
    """

    items: tuple[Item, ...]
    key: int
    m: int
    n: int
    dtype: torch.dtype
    assembly: list[Assembly] = field(default_factory=list)
    inputs: tuple[torch.Tensor, ...] = ()
    index: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of direction fragments read from a computed stack (sent, or kept).

    Attributes:
        batch: Index of the owner batch.
        start: First matrix of the run in the batch.
        count: Matrices in the run.
        selector: The fragment to read from each matrix.
    """

    batch: int
    start: int
    count: int
    selector: Selector

    @property
    def numel(self) -> int:
        """Elements of the run."""
        return self.count * self.selector.shape[0] * self.selector.shape[1]


@dataclass(frozen=True, slots=True)
class Target:
    """Where consecutive matrices of a delivery run land in one parameter's local shard.

    Attributes:
        param: The parameter.
        pos: For a 3-D stack, the first matrix's position in the local shard's leading dim.
        count: Matrices covered (consecutive in the run).
        rows: Blocks along the rows filling local rows ``[start, stop)`` at full width
            (the target is that row range viewed as ``(count, rows // count, cols)``).
        rects: One block in several pieces: per piece ``(fragment rows, fragment columns,
            local rows, local columns)`` as ``(start, stop)`` pairs.
        flat: The parameter is an N-D weight updated as its ``(rows, rest)`` matrix.
    """

    param: int
    pos: int | None = None
    count: int = 1
    rows: tuple[int, int] | None = None
    rects: tuple[tuple[tuple[int, int], ...], ...] | None = None
    flat: bool = False


@dataclass(frozen=True, slots=True)
class Delivery:
    """A run of this rank's direction fragments, each for one local target.

    Attributes:
        offset: Element offset in the scatter receive buffer (unused for kept runs).
        shape: Local fragment shape ``(fr, fc)`` of every matrix in the run.
        key: Param group.
        full: ``(m, n)`` of the full matrices.
        dtype: Direction dtype the apply receives.
        targets: The run's targets in order (each updated at once).
        count: Matrices in the run.
        whole: The targets' parameters when each is one whole 2-D parameter (one matrix
            each, the common case the apply takes without looking at every target), else None.
    """

    offset: int
    shape: tuple[int, int]
    key: int
    full: tuple[int, int]
    dtype: torch.dtype
    targets: tuple[Target, ...]
    count: int
    whole: tuple[int, ...] | None = field(init=False)

    def __post_init__(self) -> None:
        plain = len(self.targets) == self.count and all(
            t.pos is None and t.rects is None and t.rows is None and not t.flat
            for t in self.targets
        )
        object.__setattr__(self, "whole", tuple(t.param for t in self.targets) if plain else None)


@dataclass(slots=True)
class GroupSchedule:
    """One micro-group's exchanges, batches and deliveries on this rank.

    With ``status`` (the step's last scatter), every segment of the scatter starts with one
    element saying whether its sender has failed so far in the step, so every rank learns
    every rank's outcome without another collective; ``status_index[s]`` is where sender ``s``'s
    flag sits in the receive buffer (an index tensor on the buffers' device, built once so
    that reading the flags copies nothing to the device). ``assembled`` reads, in one
    call, the directions of the parameters whose shards arrive in many small pieces (taken
    out of ``deliveries``); ``scatter_send`` is the scatter's send in wire order (per target
    its flag, with ``status``, then its pieces), runs of small pieces and flags read by one
    index. ``nbytes`` is the payload bytes of
    the group's whole matrices over the number of ranks (all of them for a replicated plan,
    where every rank receives every matrix), the same number on every rank: it decides
    which exchanges travel together
    (:attr:`~canzona.runtime.config.PipelineConfig.fuse_bytes`).

    ``compute_order`` lists the batches lightest first (by ``k m n min(m, n)``): on a CPU a
    call right after a heavy one runs slower (the core slows down after heavy matrix-unit
    work: a 384 x 768 bf16 Newton–Schulz took 16-20% longer after a 2 x 768 x 768 one on the
    Xeon with AMX), so the heavy calls go last, where nothing of the group follows them.

    The step's first micro-group reserves, at the start of every gather segment, a slot
    for the step's header (``header``: the slot this rank sends, in the gather dtype;
    ``header_slots``: where its copies lie in the payload buffers when the schedule laid
    them out there, one per destination; ``header_index``: where every sender's slot sits
    in the receive buffer), so that in a
    steady step the cross-rank check rides the first gather instead of a collective of
    its own (see :meth:`~canzona.runtime.engine.MatrixRuntime.begin_step`).
    """

    index: int
    nbytes: int
    gather_dtype: torch.dtype
    send: tuple[SendView, ...]
    gather_in: list[int]
    gather_out: list[int]
    batches: list[OwnerBatch]
    scatter_dtype: torch.dtype
    scatter_in: list[int]
    scatter_out: list[int]
    deliveries: list[Delivery]
    kept: list[tuple[Piece, Delivery]]
    assembled: Assembled | None = None
    scatter_send: ScatterSend | None = None
    status: bool = False
    status_index: torch.Tensor | None = None
    header: torch.Tensor | None = None
    header_slots: tuple[torch.Tensor, ...] = ()
    header_index: torch.Tensor | None = None
    compute_order: list[int] = field(default_factory=list)


def light_first(batches: Sequence[OwnerBatch]) -> list[int]:
    """Indices of ``batches``, lightest first (``k m n min(m, n)``; ties in plan order)."""
    return sorted(
        range(len(batches)),
        key=lambda b: (
            len(batches[b].items) * batches[b].m * batches[b].n * min(batches[b].m, batches[b].n)
        ),
    )


@dataclass(slots=True)
class Schedule:
    """A step's precomputed work on this rank.

    Attributes:
        buffers: Flat buffers: per (param dtype, payload dtype) the prepared payloads, and
            their cast to the payload dtype when it differs.
        casts: (prepared, payload) buffer pairs to cast after the optimizer's prepare.
        payload: Per active matrix parameter with local data: where the optimizer writes
            its prepared payload (a view shaped like the parameter's local shard).
        local: Batches of matrices this rank holds whole and updates alone.
        local_kept: Deliveries of the local batches' results.
        micro_groups: The micro-groups with active matrices, in plan order.
        replicated: Every computing rank keeps its own fragment (no scatter).
        held: Every buffer is allocated (:meth:`acquire` succeeded and nothing freed them
            since); while it is unset no view of them may be read or written.
    """

    buffers: list[FlatBuffer]
    casts: list[tuple[FlatBuffer, FlatBuffer]]
    payload: dict[int, torch.Tensor]
    local: list[OwnerBatch]
    local_kept: list[tuple[Piece, Delivery]]
    micro_groups: list[GroupSchedule]
    replicated: bool
    held: bool = False

    def acquire(self) -> None:
        """Allocate the step buffers; when one fails, free them all and raise its error."""
        self.held = False
        try:
            for buf in self.buffers:
                buf.acquire()
        except BaseException:
            self.free()  # the memory goes back: the step fails everywhere, the next retries
            raise
        self.held = True

    def release(self) -> None:
        """Free the step buffers that are not kept between steps."""
        for buf in self.buffers:
            buf.release()
        self.held = self.held and all(buf.keep for buf in self.buffers)

    def free(self) -> None:
        """Free every step buffer, kept or not."""
        self.held = False
        for buf in self.buffers:
            buf.free()


def rects(rows: Runs, cols: Runs) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The rectangles of a fragment made of index runs: fragment and local coordinates."""
    out = []
    fr = 0
    for r0, r1 in rows:
        fc = 0
        for c0, c1 in cols:
            out.append(((fr, fr + r1 - r0), (fc, fc + c1 - c0), (r0, r1), (c0, c1)))
            fc += c1 - c0
        fr += r1 - r0
    return tuple(out)


def merge_targets(last: Target, new: Target) -> Target | None:
    """One target for two consecutive ones when they are adjacent in the local shard."""
    if last.param != new.param or last.rects is not None or new.rects is not None:
        return None
    if last.rows is None and new.rows is None:  # consecutive matrices of a 3-D stack
        if last.pos is not None and new.pos is not None and last.pos + last.count == new.pos:
            return Target(last.param, last.pos, last.count + 1)
        return None
    if last.rows is not None and new.rows is not None and last.pos == new.pos:
        height = (last.rows[1] - last.rows[0]) // last.count
        if last.rows[1] == new.rows[0] and new.rows[1] - new.rows[0] == height:
            rows = (last.rows[0], new.rows[1])
            return Target(last.param, last.pos, last.count + 1, rows, flat=last.flat)
    return None


class Selectors:
    """One :class:`Selector` per distinct fragment (index tensors built once)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cache: dict[Fragment, Selector] = {}

    def __call__(self, frag: Fragment) -> Selector:
        """The fragment's selector (made at its first request)."""
        sel = self._cache.get(frag)
        if sel is None:
            sel = Selector(frag, self.device)
            self._cache[frag] = sel
        return sel


def fragment_runs(
    entries: Sequence[tuple[int, Fragment]],
) -> list[tuple[int, int, Fragment]]:
    """(start, count, fragment) runs of consecutive positions sharing a fragment."""
    runs: list[tuple[int, int, Fragment]] = []
    for pos, frag in entries:
        if runs and runs[-1][0] + runs[-1][1] == pos and runs[-1][2] == frag:
            start, count, _ = runs[-1]
            runs[-1] = (start, count + 1, frag)
        else:
            runs.append((pos, 1, frag))
    return runs
