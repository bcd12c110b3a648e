"""State tensors laid back to back in one flat buffer, so that a list of them is one tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["evict", "home", "span", "spans"]


def _adjacent(prev: Tensor, this: Tensor) -> bool:
    """Whether contiguous ``this`` starts in ``prev``'s storage right where ``prev`` ends."""
    return (
        this.dtype == prev.dtype
        and this.is_contiguous()
        and this.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
        and this.storage_offset() == prev.storage_offset() + prev.numel()
    )


def _flat_view(first: Tensor, numel: int) -> Tensor:
    """A 1-D view of ``numel`` elements of ``first``'s storage, from where ``first`` starts."""
    out = torch.empty(0, dtype=first.dtype, device=first.device)
    return out.set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def span(tensors: Sequence[Tensor]) -> Tensor | None:
    """A 1-D view of the storage covering ``tensors`` when they lie back to back, in order.

    None when there is none, or one is not contiguous, or their dtypes differ.
    """
    if not tensors or not tensors[0].is_contiguous():
        return None
    if not all(map(_adjacent, tensors, tensors[1:])):
        return None
    return _flat_view(tensors[0], sum(t.numel() for t in tensors))


def spans(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The contiguous ``tensors`` as 1-D views, each run of back-to-back ones merged into one.

    ``torch.cat(spans(ts))`` equals ``torch.cat([t.view(-1) for t in ts])`` with one
    operand per run instead of one per tensor.
    """
    out: list[Tensor] = []
    start = 0
    for i in range(1, len(tensors) + 1):
        if i < len(tensors) and _adjacent(tensors[i - 1], tensors[i]):
            continue
        run = tensors[start:i]
        numel = sum(t.numel() for t in run)
        out.append(run[0].view(-1) if len(run) == 1 else _flat_view(run[0], numel))
        start = i
    return out


def home(tensors: Sequence[Tensor]) -> Tensor | None:
    """Move ``tensors`` into one new flat buffer, back to back in order; that buffer (1-D).

    Each tensor keeps its identity, shape, strides and values (``set_`` points it at its
    slot): references to it (``optimizer.state``, a DTensor holding it as its local shard)
    see the same tensor, now a view of the buffer. Tensors that already lie so are left
    where they are. None when there are none, or one is not contiguous, requires grad or is
    empty, or dtypes or devices differ (nothing moves), or a tensor refuses ``set_`` (an
    inference tensor: those before it keep their values in the buffer).
    """
    if not tensors:
        return None
    already = span(tensors)
    if already is not None:
        return already
    first = tensors[0]
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.requires_grad
            or t.numel() == 0
            or t.dtype != first.dtype
            or t.device != first.device
        ):
            return None
    flat = torch.cat([t.reshape(-1) for t in tensors])
    storage, offset = flat.untyped_storage(), 0
    try:
        for t in tensors:
            t.set_(storage, offset, t.shape, t.stride())
            offset += t.numel()
    except RuntimeError:
        return None
    return flat


def evict(tensors: Sequence[Tensor], flat: Tensor) -> None:
    """Give each of ``tensors`` that still lies in ``flat``'s storage a storage of its own.

    A tensor left out of a new home would otherwise keep the whole old buffer alive.
    """
    ptr = flat.untyped_storage().data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() == ptr:
            own = t.clone()
            t.set_(own.untyped_storage(), 0, own.shape, own.stride())
