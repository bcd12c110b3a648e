"""OwnerState's copies during a step: taken before the first change, kept or not, restored."""

from __future__ import annotations

import torch

from canzona.optim.owner_state import OwnerState
from canzona.runtime.routing import Item

A = Item("a", 0, None, 4, 3, (0,), (0,))
B = Item("b", 1, None, 3, 3, (0,), (0,))


def _owner() -> OwnerState:
    return OwnerState(lambda it: {"f": torch.zeros(it.m, it.m)}, lambda p, g: {})


def _step(owner: OwnerState, items: tuple[Item, ...], value: float, *, keep: bool) -> None:
    owner.begin(atomic=True, keep=keep)
    for it in items:
        owner.get(it)["f"].add_(value)


def test_kept_copies_are_refilled_in_place_and_restore_exactly() -> None:
    """Catches: a kept copy reused without being refilled (a rollback would restore the
    state of an older step), and copies cloned again at every step despite ``keep``."""
    owner = _owner()
    _step(owner, (A, B), 1.0, keep=True)
    owner.commit()
    _step(owner, (A, B), 2.0, keep=True)
    first = owner._touched[A.key]
    assert first is not None
    owner.commit()
    _step(owner, (A, B), 4.0, keep=True)
    second = owner._touched[A.key]
    assert second is first  # the same tensors, refilled
    assert torch.equal(second["f"], torch.full((4, 4), 3.0))  # the state before this step
    owner.rollback()
    assert torch.equal(owner.states[A.key]["f"], torch.full((4, 4), 3.0))
    assert torch.equal(owner.states[B.key]["f"], torch.full((3, 3), 3.0))
    _step(owner, (A,), 1.0, keep=True)
    owner.commit()
    assert set(owner._spare) == {A.key}  # B was not touched: its copy is released


def test_without_keep_every_step_clones_and_keeps_nothing() -> None:
    owner = _owner()
    _step(owner, (A,), 1.0, keep=False)
    owner.commit()
    _step(owner, (A,), 2.0, keep=False)
    first = owner._touched[A.key]
    owner.commit()
    assert owner._spare == {}
    _step(owner, (A,), 4.0, keep=False)
    assert owner._touched[A.key] is not first
    owner.rollback()
    assert torch.equal(owner.states[A.key]["f"], torch.full((4, 4), 3.0))
    assert owner._spare == {}


def test_a_copy_of_another_shape_is_not_reused() -> None:
    owner = _owner()
    _step(owner, (A,), 1.0, keep=True)
    owner.commit()
    owner.states[A.key]["f"] = torch.ones(5, 5)  # the state was rebuilt with another shape
    _step(owner, (A,), 1.0, keep=True)
    copy = owner._touched[A.key]
    assert copy is not None and copy["f"].shape == (5, 5)
    owner.rollback()
    assert torch.equal(owner.states[A.key]["f"], torch.ones(5, 5))
