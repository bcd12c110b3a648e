"""Flat step buffers whose views live across steps and whose memory may be freed between them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from canzona.runtime.layout import Fragment

__all__ = ["FlatBuffer", "Selector"]


class FlatBuffer:
    """One 1-D tensor with views cut once, whose storage may be freed between steps.

    Views into a tensor keep pointing at its storage when the storage is resized, so the
    views (and any list of them) are cut once per plan, while the storage is allocated (a
    new buffer is). Unless the buffer is kept, :meth:`release` then gives the memory back
    between steps (forward and backward can use it) and :meth:`acquire` allocates it again
    at the next step; a kept buffer holds its memory from :meth:`acquire` on. The contents
    are undefined at every :meth:`acquire`.

    A buffer whose first allocation fails (out of memory on this rank) is cut on the meta
    device instead, and :meth:`acquire` raises that error: the schedule exists on every
    rank, so the failing one still enters the step's collectives (with zeros) and every
    rank raises the failure; such a schedule is never used again (:attr:`broken`).

    Args:
        numel: Number of elements.
        dtype: Element dtype.
        device: Device.
        keep: Hold the memory between steps (:meth:`release` leaves it allocated).
    """

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, *, keep: bool = False
    ) -> None:
        self.error: Exception | None = None
        try:
            self.tensor = allocate(numel, dtype, device)
        except Exception as exc:  # raised by acquire(), inside the step's failure handling
            self.tensor = torch.empty(numel, dtype=dtype, device="meta")
            self.error = exc
        self.keep = keep
        self._nbytes = numel * self.tensor.element_size()

    @property
    def broken(self) -> bool:
        """Whether the first allocation failed (the views are on the meta device)."""
        return self.error is not None

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype."""
        return self.tensor.dtype

    def view(self, offset: int, shape: Sequence[int]) -> torch.Tensor:
        """A view of ``prod(shape)`` elements from ``offset``, shaped ``shape`` (kept valid)."""
        numel = 1
        for s in shape:
            numel *= s
        return self.tensor.narrow(0, offset, numel).view(tuple(shape))

    def acquire(self) -> None:
        """Allocate the storage (its contents are undefined)."""
        if self.error is not None:
            raise self.error
        storage = self.tensor.untyped_storage()
        if storage.nbytes() != self._nbytes:
            storage.resize_(self._nbytes)

    def release(self) -> None:
        """Free the storage unless the buffer is kept; views stay valid objects either way."""
        if not self.keep:
            self.free()

    def free(self) -> None:
        """Free the storage, kept or not (views stay valid objects until :meth:`acquire`)."""
        if self.error is None:
            self.tensor.untyped_storage().resize_(0)


def strided_pattern(shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """Offsets of a strided view's elements (row-major) from its first, as int64."""
    pattern = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(shape, strides, strict=True):
        pattern = pattern.unsqueeze(-1) + torch.arange(size) * stride
    return pattern.view(-1)


def block_pattern(shape: tuple[int, int], width: int) -> torch.Tensor:
    """Offsets of a block's elements from its first, in a matrix of ``width`` columns."""
    return strided_pattern(shape, (width, 1))


def expand(starts: Sequence[int], pattern: torch.Tensor) -> torch.Tensor:
    """Each start plus ``pattern``, one after the other (parts of one layout, flattened)."""
    return (torch.tensor(starts, dtype=torch.int64).view(-1, 1) + pattern.view(1, -1)).view(-1)


def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A step buffer's memory (uninitialised)."""
    return torch.empty(numel, dtype=dtype, device=device)


class Selector:
    """Reads one fragment of every matrix of a stack ``(k, m, n)``, item-major ``(k, fr, fc)``.

    A fragment made of one block is a strided view; one made of several index runs per
    dimension (``_StridedShard``) is gathered with two cached index tensors.

    Args:
        frag: The 2-D fragment.
        device: Device of the index tensors.
    """

    __slots__ = ("_cols", "_rows", "_slices", "shape")

    def __init__(self, frag: Fragment, device: torch.device) -> None:
        self.shape: tuple[int, int] = (frag.shape[0], frag.shape[1])
        self._slices: tuple[slice, slice] | None = None
        self._rows: torch.Tensor | None = None
        self._cols: torch.Tensor | None = None
        if frag.contiguous:
            rows, cols = frag.runs
            r0, r1 = rows[0] if rows else (0, 0)
            c0, c1 = cols[0] if cols else (0, 0)
            self._slices = (slice(r0, r1), slice(c0, c1))
        else:
            self._rows, self._cols = frag.index_tensors(device)

    def read(self, stack: torch.Tensor) -> torch.Tensor:
        """This fragment of every matrix of ``stack`` (a view when it is one block)."""
        if self._slices is not None:
            return stack[:, self._slices[0], self._slices[1]]
        assert self._rows is not None and self._cols is not None
        return stack.index_select(1, self._rows).index_select(2, self._cols)

    def origin(self) -> tuple[int, int] | None:
        """The fragment's first row and column when it is one block, else None."""
        if self._slices is None:
            return None
        return self._slices[0].start, self._slices[1].start

    def pattern(self, width: int) -> tuple[object, int, torch.Tensor | None]:
        """Where the fragment's elements lie in a row-major matrix of ``width`` columns.

        ``(key, offset, pattern)``: element ``j`` of the fragment (row-major) lies at
        ``offset + pattern[j]``. Every block of one shape shares its key and pattern (its
        offset is where it starts), so the pattern is made once per key: ``pattern`` is None
        for a key of a block, which :func:`block_pattern` makes.
        """
        if self._slices is not None:
            rows, cols = self._slices
            return (self.shape, width), rows.start * width + cols.start, None
        rows_t, cols_t = self.indices()
        return id(self), 0, (rows_t.view(-1, 1) * width + cols_t.view(1, -1)).view(-1)

    def indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fragment's rows and columns in the matrix, as int64 tensors on the CPU."""
        if self._slices is not None:
            rows, cols = self._slices
            return torch.arange(rows.start, rows.stop), torch.arange(cols.start, cols.stop)
        assert self._rows is not None and self._cols is not None
        return self._rows.cpu(), self._cols.cpu()

    def write_(self, stack: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` ``(k, fr, fc)`` into this fragment of every matrix of ``stack``."""
        if self._slices is not None:
            stack[:, self._slices[0], self._slices[1]].copy_(data)
            return
        assert self._rows is not None and self._cols is not None
        stack[:, self._rows.unsqueeze(1), self._cols.unsqueeze(0)] = data.to(stack.dtype)
