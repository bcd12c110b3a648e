"""The one home of owner-held optimizer state: store, create, protect, migrate, export, import."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from canzona.optim.prepare import ADAMW
from canzona.runtime import (
    Item,
    Snapshot,
    StateEntry,
    export_state,
    import_state,
    param_mesh,
    positions_in,
)

Key = tuple[int, int | None, int | None, int]  # Item.key: (param, lead, block, first unit rank)
State = dict[str, Tensor]
FreshFn = Callable[[Item], State]
"""A new, zero-step owner state for one matrix."""
SpecsFn = Callable[[Tensor, dict[str, Any]], dict[str, tuple[tuple[int, ...], torch.dtype]]]
"""The owner-held state of one matrix (a meta tensor) of a param group: key -> (shape, dtype)."""
Specs = dict[str, tuple[tuple[int, ...], torch.dtype, int | None]]


def is_stack(p: Tensor, group: dict[str, Any]) -> bool:
    """A 3-D parameter of a matrix group is a stack of matrices unless matricised."""
    return p.ndim == 3 and not group.get("flatten")


def matrix_shape(p: Tensor, group: dict[str, Any]) -> tuple[int, int]:
    """Rows and columns of one matrix of ``p`` (a matricised weight: first dim by the rest).

    From the shape alone: indexing a sharded DTensor would gather it.
    """
    if group.get("flatten") and p.ndim > 2:
        return p.shape[0], math.prod(p.shape[1:])
    return p.shape[-2], p.shape[-1]


class OwnerState:
    """Owner-held state of every matrix this rank computes (Shampoo's factors, SOAP's bases).

    The state of a matrix lives on the rank(s) that compute it, keyed by
    :attr:`~canzona.runtime.Item.key`. This object creates it lazily, protects it during a
    step (a copy before its first in-place change, restored if the step fails), moves it
    to new owners after a re-plan, and converts it to and from the checkpoint layout.

    It also knows which keys a parameter's matrices hold (:meth:`specs`), so that the
    optimizer's ``state`` lists them and checkpoints carry them.

    Args:
        fresh: Builds a new state for an item.
        specs: The keys, shapes and dtypes of one matrix's state (empty for an optimizer
            without owner-held state).
    """

    def __init__(self, fresh: FreshFn, specs: SpecsFn) -> None:
        self.fresh = fresh
        self.matrix_specs = specs
        self.states: dict[Key, State] = {}
        self._atomic = False
        self._keep = False
        self._touched: dict[Key, State | None] = {}
        self._dropped: dict[Key, State] = {}  # forgotten in this step, until it commits
        self._spare: dict[Key, State] = {}  # last step's copies, refilled in place
        self.backup_bytes = 0  # what the copies of this step hold

    # ------------------------------------------------------------------ step
    def begin(self, *, atomic: bool, keep: bool = False) -> None:
        """Start protecting state changes (copies are taken only when ``atomic``).

        With ``keep`` the copies stay allocated between steps and the next step refills
        them in place (``PipelineConfig.keep_buffers``: on the CPU a freed large block goes
        back to the operating system and the next allocation faults its pages in again);
        those of the matrices a step does not touch are released at its end.
        """
        self._atomic = atomic
        self._keep = keep
        self._touched = {}
        self._dropped = {}
        self.backup_bytes = 0
        if not keep:
            self._spare = {}

    def get(self, item: Item) -> State:
        """The state of ``item`` for this step's computation (created when missing)."""
        key = item.key
        state = self.states.get(key)
        if key not in self._touched:
            if state is None:
                self._touched[key] = None
            elif self._atomic:
                copy = self._copy(key, state)
                self._touched[key] = copy
                self.backup_bytes += sum(v.numel() * v.element_size() for v in copy.values())
        if state is None:
            state = self.fresh(item)
            self.states[key] = state
        return state

    def _copy(self, key: Key, state: State) -> State:
        """A copy of ``state``: last step's kept copy refilled when it matches, else a clone."""
        spare = self._spare.get(key) if self._keep else None
        if (
            spare is not None
            and spare.keys() == state.keys()
            and all(
                spare[k].shape == v.shape
                and spare[k].dtype == v.dtype
                and spare[k].device == v.device
                for k, v in state.items()
            )
        ):
            for k, v in state.items():
                spare[k].copy_(v)
            return spare
        copy = {k: v.clone() for k, v in state.items()}
        if self._keep:
            self._spare[key] = copy
        return copy

    def forget(self, params: set[int]) -> None:
        """Forget the state of the matrices of ``params`` (until a rollback puts it back).

        For parameters whose ``optimizer.state`` entry the user cleared: they start afresh,
        as in torch.optim.
        """
        if not params or not self.states:
            return
        for key in [k for k in self.states if k[0] in params]:
            self._dropped[key] = self.states.pop(key)

    def _end(self) -> None:
        """Keep only the copies this step used (all of them go without ``keep``)."""
        if self._keep:
            self._spare = {k: v for k, v in self._spare.items() if self._touched.get(k)}
        else:
            self._spare = {}
        self._touched = {}
        self._dropped = {}

    def commit(self) -> None:
        """Forget the copies (the step succeeded)."""
        self._end()

    def rollback(self) -> None:
        """Put back the state as it was before the step (states created in it are removed)."""
        for key, before in self._touched.items():
            if before is None:
                self.states.pop(key, None)
            else:
                state = self.states[key]
                for name, value in before.items():
                    state[name].copy_(value)
        self.states.update(self._dropped)
        self._end()

    # ------------------------------------------------------------------ keys
    def specs(self, p: Tensor, group: dict[str, Any], *, name: str = "the parameter") -> Specs:
        """Owner-held state of ``p``'s matrices: key -> (shape, dtype, block).

        A split parameter has one state per block, under ``"<key>#<block>"``; a
        matricised N-D weight (``flatten``) the state of its ``(shape[0], rest)`` matrix.
        ``name`` names ``p`` in the error of a split that does not tile its matrix.
        """
        m, n = matrix_shape(p, group)
        split = group.get("split")
        if split is None:
            mat = torch.empty((m, n), dtype=p.dtype, device="meta")
            return {
                k: (shape, dt, None) for k, (shape, dt) in self.matrix_specs(mat, group).items()
            }
        out: Specs = {}
        for j, shape in enumerate(split.shapes(m, n, name=name)):
            block = torch.empty(shape, dtype=p.dtype, device="meta")
            for k, (s, dt) in self.matrix_specs(block, group).items():
                out[f"{k}#{j}"] = (s, dt, j)
        return out

    def kind(
        self, p: Tensor, group: dict[str, Any], *, name: str = "the parameter"
    ) -> tuple[object, ...]:
        """What state ``p`` has in ``group``: its algorithm and owner-held keys and shapes.

        ``name`` names ``p`` in the error of a split that does not tile its matrix.
        """
        if group["algorithm"] == ADAMW or p.numel() == 0:
            return (group["algorithm"],)
        return (group["algorithm"], *sorted(self.specs(p, group, name=name).items()))

    def add_placeholders(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """List ``p``'s owner-held keys in its ``optimizer.state`` entry, as empty tensors.

        The values live on the owner ranks and ``state_dict()`` materialises them; the keys
        are listed on every rank so that code that walks ``optimizer.state`` (e.g. DCP's
        flattened optimizer state dicts) sees the same structure as ``state_dict()``.
        """
        for key, (_, dtype, _) in self.specs(p, group).items():
            state[key] = torch.empty(0, dtype=dtype)  # the dtype state_dict() gives it

    def entries(
        self, params: Sequence[Tensor], groups: Sequence[dict[str, Any]], stepped: set[int]
    ) -> list[StateEntry]:
        """The state tensors of the stepped matrix parameters (``groups``: one per param)."""
        out: list[StateEntry] = []
        for i in sorted(stepped):
            p, group = params[i], groups[i]
            if group["algorithm"] == ADAMW or p.numel() == 0:
                continue
            stack = p.shape[0] if is_stack(p, group) else 0
            for key, (shape, dtype, block) in self.specs(p, group).items():
                out.append(StateEntry(i, key, shape, dtype, block, stack))
        return out

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
        """Replace the state with checkpoint values (collective when distributed).

        A load that raises (on any rank: every rank raises) keeps the state as it was.
        """
        old, self.states = self.states, {}
        if entries:
            try:
                import_state(snap, entries, values, self._put)
            except BaseException:
                self.states = old
                raise

    def migrate(
        self,
        previous: Snapshot,
        current: Snapshot,
        params: Sequence[Tensor],
        entries: Sequence[StateEntry],
    ) -> None:
        """Move the state from the owners of ``previous`` to those of ``current`` (collective).

        ``entries`` are by the current positions of ``params``; each parameter's state is
        read at the position the previous plan had it in (by identity: param groups
        reordered or with parameters removed keep every parameter's own state). Only
        parameters that the previous plan knew move (one added since has no state yet).
        """
        old_at = _previous_positions(previous, params)
        entries = [e for e in entries if e.param in old_at]
        if not entries:
            self.states = {}
            return
        before = [replace(e, param=old_at[e.param]) for e in entries]
        meshes = {old_at[e.param]: param_mesh(params[e.param]) for e in entries}
        old = self.states
        values = export_state(
            previous,
            before,
            get=lambda item, key: self.lookup(item, old)[_own(item, key)],
            meshes=meshes,
        )
        moved = {
            (e.param, e.key): values[(b.param, b.key)] for e, b in zip(entries, before, strict=True)
        }
        self.states = {}
        try:
            import_state(current, entries, moved, self._put)
        except BaseException:
            self.states = old  # still where ``previous`` holds it
            raise

    def _put(self, item: Item, key: str, value: Tensor) -> None:
        self.states.setdefault(item.key, {})[_own(item, key)] = value

    def clear(self) -> None:
        """Drop every state."""
        self.states = {}
        self._touched = {}
        self._dropped = {}


def _previous_positions(previous: Snapshot, params: Sequence[Tensor]) -> dict[int, int]:
    """Current position -> position in ``previous``'s plan, of the parameters it knew."""
    if previous.param_ids is None:  # a copy's first plan: as recorded when it was made
        if previous.positions is None:
            return {i: i for i in range(min(len(params), len(previous.topology.layouts)))}
        pairs = zip(range(len(params)), previous.positions, strict=False)
        return {i: at for i, at in pairs if at is not None}
    moved = positions_in(previous.param_ids, map(id, params))
    return {i: at for i, at in enumerate(moved) if at is not None}


def _own(item: Item, key: str) -> str:
    """The key of a matrix's own state for a checkpoint key (``"<key>#<block>"`` for blocks)."""
    return key if item.block is None else key.rsplit("#", 1)[0]
