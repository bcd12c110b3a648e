"""A step's changes to optimizer state, kept revertible until every rank has voted success."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from canzona.optim.flat_homes import spans
from canzona.runtime import FlatBuffer


class _Part(NamedTuple):
    """The copies of one dtype's tensors."""

    buf: FlatBuffer
    tensors: list[Tensor]
    #: Per tensor, its copy (a view of ``buf``).
    views: list[Tensor]
    #: The tensors' flat views when all are contiguous, those back to back in one storage
    #: merged (one concatenation copies them: one operand for a homed run).
    flat: list[Tensor] | None


class Backup:
    """A copy of a fixed list of tensors, in flat buffers whose views are cut once.

    Built once for a list of state tensors that a step changes in place (e.g. the
    momentum buffers of a param group); each step then copies them with one op per dtype
    (a concatenation of their flat views when all are contiguous, else a foreach copy).
    The memory is held from the first :meth:`take`; unless ``keep``, only until the next
    :meth:`drop`.

    Args:
        tensors: The tensors (any shapes and dtypes, one device).
        keep: Hold the copies' memory between steps (see :class:`FlatBuffer`).
    """

    def __init__(self, tensors: Sequence[Tensor], *, keep: bool = False) -> None:
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        self._parts: list[_Part] = []
        for dtype, ts in by_dtype.items():
            buf = FlatBuffer(sum(t.numel() for t in ts), dtype, ts[0].device, keep=keep)
            views, offset = [], 0
            for t in ts:
                views.append(buf.view(offset, t.shape))
                offset += t.numel()
            buf.free()  # nothing to hold before the first take
            flat = spans(ts) if all(t.is_contiguous() for t in ts) else None
            self._parts.append(_Part(buf, ts, views, flat))

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold."""
        return sum(p.buf.tensor.numel() * p.buf.tensor.element_size() for p in self._parts)

    @property
    def held_bytes(self) -> int:
        """Bytes of memory the copies hold now (0 between steps unless kept)."""
        return sum(p.buf.tensor.untyped_storage().nbytes() for p in self._parts)

    def take(self) -> None:
        """Copy the tensors."""
        for buf, ts, views, flat in self._parts:
            buf.acquire()
            if flat is not None:
                torch.cat(flat, out=buf.tensor)
            else:
                torch._foreach_copy_(views, ts)

    def restore(self) -> None:
        """Write the copies back."""
        for _, ts, views, _ in self._parts:
            torch._foreach_copy_(ts, views)

    def drop(self) -> None:
        """Free the copies' memory (unless kept)."""
        for p in self._parts:
            p.buf.release()


class StepTransaction:
    """Records what a step changed before its success vote, so that a failure can undo it.

    Parameters are only written after the vote; what changes before it is optimizer
    state: step counters (undone exactly by subtracting the increment), state created in
    this step (removed), and tensors updated in place (restored from a copy taken just
    before, when ``atomic``). Without ``atomic`` no copy is taken: a failed step then
    leaves those tensors advanced (parameters still untouched).

    Args:
        atomic: Keep copies of tensors updated in place before the vote.
    """

    def __init__(self, *, atomic: bool) -> None:
        self.atomic = atomic
        self._created: list[tuple[dict[Any, Any], Any]] = []
        self._steps: list[Tensor] = []
        self._saved: list[Backup] = []
        self._undo: list[Callable[[], None]] = []
        self.backup_bytes = 0

    def created(self, container: dict[Any, Any], key: Any) -> None:
        """``container[key]`` was created in this step (removed on rollback)."""
        self._created.append((container, key))

    def bump(self, steps: Tensor) -> None:
        """Add one to every step counter of ``steps`` (subtracted again on rollback)."""
        if steps.numel():
            steps.add_(1)
            self._steps.append(steps)

    def save(self, backup: Backup) -> None:
        """Tensors about to change in place: copy them (when ``atomic``) to restore them."""
        if self.atomic:
            backup.take()
            self._saved.append(backup)
            self.backup_bytes += backup.nbytes

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` on rollback (e.g. the owner-held state's own restore)."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo everything recorded, newest first."""
        for undo in reversed(self._undo):
            undo()
        for backup in reversed(self._saved):
            backup.restore()
        for steps in self._steps:
            steps.sub_(1)
        for container, key in reversed(self._created):
            container.pop(key, None)
        self.commit()

    def commit(self) -> None:
        """Forget what was recorded (the step succeeded)."""
        for backup in self._saved:
            backup.drop()
        self._created.clear()
        self._steps.clear()
        self._saved.clear()
        self._undo.clear()
