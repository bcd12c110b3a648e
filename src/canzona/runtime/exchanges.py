"""A step's all-to-alls: the exchanges they carry, packing, and the layout of fused ones."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from canzona.runtime.schedule_parts import SendView


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


@dataclass
class Wire:
    """An all-to-all in flight, the buffers it holds and the exchanges it carries."""

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
    wire.out = wire.inp = torch.empty(0)


def pack(views: Sequence[SendView], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A gather's send buffer: the sent fragments in wire order, in the payload dtype."""
    if not views:
        return torch.empty(0, dtype=dtype, device=device)
    if len(views) == 1 and isinstance(views[0], torch.Tensor) and views[0].dim() == 1:
        return views[0].to(dtype)
    flat = [_flat(v) for v in views]
    return torch.cat(flat).to(dtype)


def _flat(view: SendView) -> torch.Tensor:
    """A sent fragment as a 1-D tensor (a copy for a strided or selected block)."""
    if isinstance(view, tuple):
        mat, selector = view
        return selector.read(mat.unsqueeze(0)).reshape(-1)
    return view if view.dim() == 1 else view.reshape(-1)


def concat(parts: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scatter's send buffer: the parts one after the other, in the direction dtype."""
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(list(parts)).to(dtype)
