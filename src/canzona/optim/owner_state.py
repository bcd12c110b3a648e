"""The one home of owner-held optimizer state: store, create, protect, migrate, export, import."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from canzona.runtime import Item, Snapshot, StateEntry, export_state, import_state

Key = tuple[int, int | None, int | None, int]  # Item.key: (param, lead, block, first unit rank)
State = dict[str, Tensor]
FreshFn = Callable[[Item], State]
"""A new, zero-step owner state for one matrix."""


class OwnerState:
    """Owner-held state of every matrix this rank computes (Shampoo's factors, SOAP's bases).

    The state of a matrix lives on the rank(s) that compute it, keyed by
    :attr:`~canzona.runtime.Item.key`. This object creates it lazily, protects it during a
    step (a copy before its first in-place change, restored if the step fails), moves it
    to new owners after a re-plan, and converts it to and from the checkpoint layout.

    Args:
        fresh: Builds a new state for an item.
    """

    def __init__(self, fresh: FreshFn) -> None:
        self.fresh = fresh
        self.states: dict[Key, State] = {}
        self._atomic = False
        self._touched: dict[Key, State | None] = {}
        self.backup_bytes = 0  # what the copies of this step hold

    # ------------------------------------------------------------------ step
    def begin(self, *, atomic: bool) -> None:
        """Start protecting state changes (copies are taken only when ``atomic``)."""
        self._atomic = atomic
        self._touched = {}
        self.backup_bytes = 0

    def get(self, item: Item) -> State:
        """The state of ``item`` for this step's computation (created when missing)."""
        key = item.key
        state = self.states.get(key)
        if key not in self._touched:
            if state is None:
                self._touched[key] = None
            elif self._atomic:
                copy = {k: v.clone() for k, v in state.items()}
                self._touched[key] = copy
                self.backup_bytes += sum(v.numel() * v.element_size() for v in copy.values())
        if state is None:
            state = self.fresh(item)
            self.states[key] = state
        return state

    def commit(self) -> None:
        """Forget the copies (the step succeeded)."""
        self._touched = {}

    def rollback(self) -> None:
        """Put back the state as it was before the step (states created in it are removed)."""
        for key, before in self._touched.items():
            if before is None:
                self.states.pop(key, None)
            else:
                state = self.states[key]
                for name, value in before.items():
                    state[name].copy_(value)
        self._touched = {}

    # ------------------------------------------------------------------ checkpoints
    def lookup(self, item: Item, store: dict[Key, State] | None = None) -> State:
        """The state of ``item``; a fresh one when it was never computed (e.g. a failed step)."""
        states = self.states if store is None else store
        state = states.get(item.key)
        if state is None:
            state = self.fresh(item)
            states[item.key] = state
        return state

    def export(
        self, snap: Snapshot, entries: Sequence[StateEntry], meshes: dict[int, object]
    ) -> dict[tuple[int, str], Tensor]:
        """Every entry in the checkpoint layout (collective when distributed)."""
        return export_state(
            snap, entries, get=lambda item, key: self.lookup(item)[_own(item, key)], meshes=meshes
        )

    def load(
        self, snap: Snapshot, entries: Sequence[StateEntry], values: dict[tuple[int, str], Tensor]
    ) -> None:
        """Replace the state with checkpoint values (collective when distributed)."""
        self.states = {}
        if entries:
            import_state(snap, entries, values, self._put)

    def migrate(
        self,
        previous: Snapshot,
        current: Snapshot,
        entries: Sequence[StateEntry],
        meshes: dict[int, object],
    ) -> None:
        """Move the state from the owners of ``previous`` to those of ``current`` (collective)."""
        old = self.states
        values = export_state(
            previous,
            entries,
            get=lambda item, key: self.lookup(item, old)[_own(item, key)],
            meshes=meshes,
        )
        self.states = {}
        import_state(current, entries, values, self._put)

    def _put(self, item: Item, key: str, value: Tensor) -> None:
        self.states.setdefault(item.key, {})[_own(item, key)] = value

    def clear(self) -> None:
        """Drop every state."""
        self.states = {}
        self._touched = {}


def _own(item: Item, key: str) -> str:
    """The key of a matrix's own state for a checkpoint key (``"<key>#<block>"`` for blocks)."""
    return key if item.block is None else key.rsplit("#", 1)[0]
