"""What optimizer classes rely on: fixed state keys, in-place state, finite zero-gradient steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from canzona.updates import (
    NorMuonHParams,
    ShampooHParams,
    SOAPHParams,
    normuon_direction,
    normuon_init,
    shampoo_direction,
    shampoo_init,
    soap_direction,
    soap_init,
)

Init = Callable[..., dict[str, torch.Tensor]]
Direction = Callable[[torch.Tensor, dict[str, torch.Tensor], int, Any], torch.Tensor]

ALGORITHMS: dict[str, tuple[Init, Direction, Any]] = {
    "shampoo": (
        shampoo_init,
        shampoo_direction,
        ShampooHParams(precondition_frequency=2, start_preconditioning_step=2),
    ),
    "shampoo_plain": (
        shampoo_init,
        shampoo_direction,
        ShampooHParams(
            betas=(0.0, 1.0),
            precondition_frequency=2,
            start_preconditioning_step=1,
            grafting="none",
        ),
    ),
    "shampoo_over_max_dim": (
        shampoo_init,
        shampoo_direction,
        ShampooHParams(precondition_frequency=2, start_preconditioning_step=2, max_precond_dim=12),
    ),
    "soap": (soap_init, soap_direction, SOAPHParams(precondition_frequency=2)),
    "soap_normalized": (
        soap_init,
        soap_direction,
        SOAPHParams(precondition_frequency=2, normalize_grads=True),
    ),
    "soap_over_max_dim": (
        soap_init,
        soap_direction,
        SOAPHParams(precondition_frequency=2, max_precond_dim=12),
    ),
    # NorMuon's direction takes Muon's orthogonalised update; any matrix exercises the contract
    "normuon": (normuon_init, normuon_direction, NorMuonHParams()),
    "normuon_preserve_norm": (
        normuon_init,
        normuon_direction,
        NorMuonHParams(rescale="preserve_norm"),
    ),
}
SHAPES = [(8, 20), (20, 8), (2, 8, 20)]
EXPECTED_KEYS = {
    "shampoo": {
        "exp_avg",
        "graft_exp_avg_sq",
        "factor_left",
        "inv_root_left",
        "factor_right",
        "inv_root_right",
    },
    "soap": {"exp_avg", "exp_avg_sq", "gg_left", "q_left", "gg_right", "q_right"},
    "normuon": {"second_momentum_buffer"},
}


def test_documented_keys() -> None:
    for family, init, hp in (
        ("shampoo", shampoo_init, ShampooHParams()),
        ("soap", soap_init, SOAPHParams()),
    ):
        state = init((2, 8, 20), hp)
        assert set(state) == EXPECTED_KEYS[family]
        assert state["exp_avg"].shape == (2, 8, 20)
        left = "factor_left" if family == "shampoo" else "gg_left"
        right = "factor_right" if family == "shampoo" else "gg_right"
        assert state[left].shape == (2, 8, 8) and state[right].shape == (2, 20, 20)
    plain = shampoo_init((8, 20), ShampooHParams(betas=(0.0, 0.9), grafting="none"))
    assert set(plain) == {"factor_left", "inv_root_left", "factor_right", "inv_root_right"}
    narrow = soap_init((8, 20), SOAPHParams(max_precond_dim=12))
    assert set(narrow) == {"exp_avg", "exp_avg_sq", "gg_left", "q_left"}
    rows = normuon_init((2, 8, 20), NorMuonHParams())
    assert set(rows) == EXPECTED_KEYS["normuon"]
    assert rows["second_momentum_buffer"].shape == (2, 8, 1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_state_is_fixed_and_updated_in_place(name: str, shape: tuple[int, ...]) -> None:
    init, direction_fn, hp = ALGORITHMS[name]
    state = init(shape, hp, dtype=torch.float32)
    layout = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in state.items()}
    objects = {k: id(v) for k, v in state.items()}
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 6):
        grad = torch.randn(shape, generator=gen).bfloat16()  # half-precision grads are cast
        direction = direction_fn(grad, state, step, hp)
        assert direction.shape == shape and direction.dtype == torch.float32
        assert all(direction.data_ptr() != v.data_ptr() for v in state.values())
        assert {k: (v.shape, v.dtype, v.data_ptr()) for k, v in state.items()} == layout
        assert {k: id(v) for k, v in state.items()} == objects


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_zero_gradients_give_finite_directions(name: str, shape: tuple[int, ...]) -> None:
    # From a fresh state across several refreshes, and after real steps (what a checkpoint
    # loader does: one step with zero gradients and lr = 0; NaN * 0 would corrupt parameters).
    init, direction_fn, hp = ALGORITHMS[name]
    fresh = init(shape, hp)
    for step in range(1, 6):
        out = direction_fn(torch.zeros(shape), fresh, step, hp)
        assert torch.equal(out, torch.zeros(shape)), step
        assert all(bool(v.isfinite().all()) for v in fresh.values())
    warm = init(shape, hp)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        direction_fn(torch.randn(shape, generator=gen), warm, step, hp)
    for step in range(4, 7):
        assert bool(direction_fn(torch.zeros(shape), warm, step, hp).isfinite().all())
        assert all(bool(v.isfinite().all()) for v in warm.values())


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_direction_never_aliases_the_gradient(name: str) -> None:
    init, direction_fn, hp = ALGORITHMS[name]
    state = init((8, 20), hp)
    for step in range(1, 4):
        grad = torch.randn(8, 20)
        before = grad.clone()
        out = direction_fn(grad, state, step, hp)
        assert out.data_ptr() != grad.data_ptr()
        assert torch.equal(grad, before)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_step_must_be_positive(name: str) -> None:
    init, direction_fn, hp = ALGORITHMS[name]
    with pytest.raises(ValueError, match="step"):
        direction_fn(torch.zeros(8, 20), init((8, 20), hp), 0, hp)


def test_init_needs_a_matrix_shape() -> None:
    with pytest.raises(ValueError, match="matrix shape"):
        shampoo_init((8,), ShampooHParams())
    with pytest.raises(ValueError, match="matrix shape"):
        soap_init((8,), SOAPHParams())
    with pytest.raises(ValueError, match="matrix shape"):
        normuon_init((8,), NorMuonHParams())
