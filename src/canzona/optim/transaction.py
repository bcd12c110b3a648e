"""A step's changes to optimizer state, kept revertible until every rank has voted success."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


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
        self._saved: list[tuple[list[Tensor], Tensor]] = []
        self._undo: list[Callable[[], None]] = []

    def created(self, container: dict[Any, Any], key: Any) -> None:
        """``container[key]`` was created in this step (removed on rollback)."""
        self._created.append((container, key))

    def bump(self, steps: Sequence[Tensor]) -> None:
        """Add one to every step counter (subtracted again on rollback)."""
        if steps:
            torch._foreach_add_(list(steps), 1)
            self._steps += steps

    def save(self, tensors: Sequence[Tensor]) -> None:
        """Tensors about to change in place: copy them (when ``atomic``) to restore them."""
        if not self.atomic:
            return
        live = [t for t in tensors if t.numel()]
        if live:
            flat = torch.cat([t.reshape(-1) for t in live])
            self._saved.append((live, flat))

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` on rollback (e.g. the owner-held state's own restore)."""
        self._undo.append(undo)

    def rollback(self) -> None:
        """Undo everything recorded, newest first."""
        for undo in reversed(self._undo):
            undo()
        for tensors, flat in reversed(self._saved):
            pieces = torch.split(flat, [t.numel() for t in tensors])
            for t, piece in zip(tensors, pieces, strict=True):
                t.copy_(piece.view(t.shape))
        if self._steps:
            torch._foreach_sub_(self._steps, 1)
        for container, key in reversed(self._created):
            container.pop(key, None)
        self.commit()

    def commit(self) -> None:
        """Forget what was recorded (the step succeeded)."""
        self._created.clear()
        self._steps.clear()
        self._saved.clear()
        self._undo.clear()
