"""A step's all-to-alls: the exchanges they carry, packing, and the layout of fused ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from canzona.runtime.schedule_parts import Indexed, OwnerBatch, Piece, SendView


@dataclass(frozen=True, slots=True)
class Exchange:
    """One micro-group's gather or scatter, packed and ready to travel.

    Attributes:
        inp: What this rank sends, segment by destination rank.
        out_splits: Elements received from each rank.
        in_splits: Elements sent to each rank.
        what: ``"gather"`` or ``"scatter"``.
        micro_group: Index of the micro-group.
        phase: The progress marker's phase of the exchange.
        status: Every segment starts with the sender's status flag (the vote).
        header: Every segment starts with this many elements of the header's slot.
    """

    inp: torch.Tensor
    out_splits: list[int]
    in_splits: list[int]
    what: str
    micro_group: int
    phase: int
    status: bool = False
    header: int = 0


@dataclass
class Pending:
    """One exchange of an all-to-all in flight.

    ``out`` is the exchange's receive buffer, valid once the all-to-all was waited for;
    ``wire`` is the all-to-all, shared by the exchanges that travel together.
    """

    wire: Wire
    out: torch.Tensor
    what: str
    micro_group: int


@dataclass(eq=False)  # the identity: a step removes the one it waited for
class Wire:
    """An all-to-all in flight, the buffers it holds and the exchanges it carries.

    Its exchanges refer to it and it to them until the wait (:func:`release`): no cycle
    outlives the all-to-all, so its buffers are freed by reference counting, not left for
    the cyclic garbage collector (which the step holds off).
    """

    work: Any
    out: torch.Tensor
    inp: torch.Tensor
    label: str
    parts: list[Pending] = field(default_factory=list)
    #: For fused exchanges: per part, per source rank, (offset, numel) in ``out``.
    layout: list[list[tuple[int, int]]] = field(default_factory=list)


def labels(exchanges: Sequence[Exchange]) -> str:
    """What travels, for messages: ``"the scatter of micro-group 0 and the gather of ..."``."""
    return " and ".join(f"the {ex.what} of micro-group {ex.micro_group}" for ex in exchanges)


def fused_send(
    exchanges: Sequence[Exchange], world: int, *, zeros: bool = False
) -> tuple[torch.Tensor, list[int], list[int], list[list[tuple[int, int]]]]:
    """One send buffer for several exchanges: per destination, each exchange's segment.

    The exchanges keep their dtypes: they travel as bytes when the dtypes differ.

    Returns:
        The send buffer (zeros of the right size with ``zeros``, after a packing failure),
        the elements sent to and received from each rank, and per exchange and source rank
        where its received segment lies in the receive buffer (see :func:`split_received`).
    """
    dtypes = {ex.inp.dtype for ex in exchanges}
    wire_dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
    scale = [ex.inp.element_size() // wire_dtype.itemsize for ex in exchanges]
    flat = [ex.inp.view(wire_dtype) for ex in exchanges]
    sends: list[torch.Tensor] = []
    in_splits, out_splits = [0] * world, [0] * world
    layout: list[list[tuple[int, int]]] = [[] for _ in exchanges]
    send_at = [0] * len(exchanges)
    offset = 0
    for r in range(world):
        for j, ex in enumerate(exchanges):
            n_in, n_out = ex.in_splits[r] * scale[j], ex.out_splits[r] * scale[j]
            sends.append(flat[j].narrow(0, send_at[j], n_in))
            send_at[j] += n_in
            in_splits[r] += n_in
            out_splits[r] += n_out
            layout[j].append((offset, n_out))
            offset += n_out
    if zeros:
        inp = torch.zeros(sum(in_splits), dtype=wire_dtype, device=exchanges[0].inp.device)
    else:
        inp = torch.cat(sends)
    return inp, in_splits, out_splits, layout


def split_received(wire: Wire) -> None:
    """Copy each exchange's receive buffer out of a fused wire's, in its own dtype."""
    for part, runs in zip(wire.parts, wire.layout, strict=True):
        data = torch.cat([wire.out.narrow(0, o, n) for o, n in runs])
        part.out = data if data.dtype == part.out.dtype else data.view(part.out.dtype)


def release(wire: Wire) -> None:
    """After the wait: hand a fused wire's parts their data, then drop what the wire holds.

    The send buffer is free once the all-to-all completed, the receive buffer lives on in
    its exchanges (a single one's ``out``, or the copies :func:`split_received` made), and
    clearing ``parts`` breaks the wire-exchange reference cycle.
    """
    if wire.layout:
        split_received(wire)
    wire.out = wire.inp = torch.empty(0)
    wire.parts = []
    wire.layout = []


def pack(views: Sequence[SendView], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A gather's send buffer: the sent fragments in wire order, in the payload dtype."""
    if not views:
        return torch.empty(0, dtype=dtype, device=device)
    if len(views) == 1 and isinstance(views[0], torch.Tensor) and views[0].dim() == 1:
        return views[0].to(dtype)
    return concat([_fragment(v) for v in views], dtype, device)


def _fragment(view: SendView) -> torch.Tensor:
    """A sent fragment: the view itself, or a selected block read out of its matrix."""
    if isinstance(view, tuple):
        mat, selector = view
        return selector.read(mat.unsqueeze(0))
    if isinstance(view, Indexed):
        return view.read()
    return view


#: Elements from which a strided matrix or part is copied by its own call: a transposed
#: result's matrices by :func:`row_major`, a strided part straight into its place by
#: :func:`concat`. Below it a call per matrix costs more host time than the copy saves
#: (measured on torch 2.13's CPU kernels: bf16, one thread).
STRIDED_COPY_NUMEL = 1 << 16


def row_major(stack: torch.Tensor) -> torch.Tensor:
    """A CPU stack of transposed matrices ``(k, m, n)`` copied into row-major layout.

    Newton–Schulz hands back a tall matrix as the transpose of its iterate. Reading the
    fragments that go to each rank out of that layout (or adding them to a shard) is a
    strided copy that ATen runs element by element; transposing each matrix whole is a
    2-D copy of an exact transpose, which it runs with a blocked kernel: for four 1536 x 512
    bf16 matrices 2.0 ms against 3.3 for the strided copy of the stack. Stacks of matrices
    of fewer than :data:`STRIDED_COPY_NUMEL` elements, other layouts and other devices
    (where a strided read costs about what a contiguous one does) are returned as they are.
    Values are only copied.
    """
    if stack.device.type != "cpu" or stack.dim() != 3 or stack.is_contiguous():
        return stack
    k, m, n = stack.shape
    if m * n < STRIDED_COPY_NUMEL or stack.stride(1) != 1 or stack.stride(2) != m:
        return stack
    out = torch.empty((k, m, n), dtype=stack.dtype)
    for dst, src in zip(out.unbind(0), stack.unbind(0), strict=True):
        dst.copy_(src)
    return out


def piece_of(outs: Sequence[torch.Tensor], piece: Piece) -> torch.Tensor:
    """A run of direction fragments ``(k, fr, fc)`` read from a batch's computed stack."""
    return piece.selector.read(outs[piece.batch].narrow(0, piece.start, piece.count))


def concat(parts: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The parts' elements one after the other, each in row-major order, in ``dtype``.

    A scatter's send buffer (and a gather's, see :func:`pack`). Parts join one
    ``torch.cat`` (a strided part is flattened first, which copies it); a strided part of
    at least :data:`STRIDED_COPY_NUMEL` elements (the rows of a stack of matrices that go to
    one rank) is copied once, straight into its place, and the parts around it are
    concatenated into theirs.
    """
    if all(p.numel() < STRIDED_COPY_NUMEL or p.is_contiguous() for p in parts):
        if not parts:
            return torch.empty(0, dtype=dtype, device=device)
        return torch.cat([p.reshape(-1) for p in parts]).to(dtype)
    sizes = [p.numel() for p in parts]
    out = torch.empty(sum(sizes), dtype=dtype, device=device)
    run: list[torch.Tensor] = []
    start = offset = 0
    for part, size in zip(parts, sizes, strict=True):
        if size < STRIDED_COPY_NUMEL or part.is_contiguous():
            if not run:
                start = offset
            run.append(part.reshape(-1))
        else:
            _fill(out.narrow(0, start, offset - start), run)
            run = []
            out.narrow(0, offset, size).view(part.shape).copy_(part)
        offset += size
    _fill(out.narrow(0, start, offset - start), run)
    return out


def _fill(region: torch.Tensor, run: list[torch.Tensor]) -> None:
    """Write the flat tensors of ``run`` one after the other into ``region``."""
    if len(run) == 1:
        region.copy_(run[0])
    elif run:
        torch.cat(run, out=region)


def assemble(batch: OwnerBatch, recv: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The batch's full payloads ``(k, m, n)`` from the gather receive buffer."""
    k = len(batch.items)
    if batch.index is not None:
        return recv.index_select(0, batch.index).view(k, batch.m, batch.n).to(batch.dtype)
    if len(batch.assembly) == 1:  # one source holds every matrix whole: no copy
        run = batch.assembly[0]
        if run.count == k and run.selector.shape == (batch.m, batch.n):
            view = recv.narrow(0, run.offset, k * batch.m * batch.n).view(k, batch.m, batch.n)
            return view.to(batch.dtype)
    full = torch.empty((k, batch.m, batch.n), dtype=batch.dtype, device=device)
    for run in batch.assembly:
        fr, fc = run.selector.shape
        data = recv.narrow(0, run.offset, run.count * fr * fc).view(run.count, fr, fc)
        run.selector.write_(full.narrow(0, run.start, run.count), data)
    return full
