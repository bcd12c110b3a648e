"""Shampoo against the float64 reference, plus its published one-step behaviour."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from canzona.testing import ReferenceShampoo
from canzona.updates import (
    ShampooHParams,
    inverse_fourth_root,
    shampoo_apply_,
    shampoo_direction,
    shampoo_init,
    shampoo_refresh_due,
)

STEPS, LR, WD = 8, 0.1, 0.01
# frequency 3 from step 3: roots are computed at steps 3 and 6 and used stale in between
BASE = ShampooHParams(precondition_frequency=3, start_preconditioning_step=3)
SHAPES = {
    "tall": ((24, 8), BASE),
    "wide": ((8, 24), BASE),
    "square": ((16, 16), BASE),
    "batched": ((3, 16, 24), BASE),
    "over_max_dim": ((12, 40), dataclasses.replace(BASE, max_precond_dim=32)),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-300)).item()


def _reference(p0: torch.Tensor, hp: ShampooHParams) -> ReferenceShampoo:
    fields = {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp)}
    fields.pop("root_dtype")
    return ReferenceShampoo([p0], lr=LR, weight_decay=WD, **fields)


def _compare(shape: tuple[int, ...], hp: ShampooHParams, dtype: torch.dtype) -> tuple[float, float]:
    """Max relative error of the directions over the steps, and of the final parameter."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    ref = _reference(p0, hp)
    param, state = p0.to(dtype), shampoo_init(shape, hp, dtype=dtype)
    worst = 0.0
    for step in range(1, STEPS + 1):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        direction = shampoo_direction(g.to(dtype), state, step, hp)
        shampoo_apply_(param, direction, lr=LR, weight_decay=WD)
        ref.step([g])
        worst = max(worst, _rel(direction, ref.directions[0]))
    return worst, _rel(param, ref.params[0])


@pytest.mark.parametrize("grafting", ["adam", "none"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_matches_reference(name: str, grafting: str) -> None:
    # fp32 state and fp32 eigendecompositions against float64. Every factor is full rank by the
    # first refresh (three gradients of rank 8 fill a 24 x 24 factor), so the roots are
    # well-defined; their error is about u * cond(L) with u = 6e-8 and cond(L) ~ 1e3, i.e.
    # ~1e-4 relative on the least-conditioned (tall) case (measured 1.2e-4; square ~1e-6).
    shape, hp = SHAPES[name]
    direction_err, param_err = _compare(
        shape, dataclasses.replace(hp, grafting=grafting), torch.float32
    )
    assert direction_err < 1e-3
    assert param_err < 1e-4


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp64_matches_reference_tightly(name: str) -> None:
    # With float64 state and roots the only differences are the order of float64 operations.
    shape, hp = SHAPES[name]
    hp = dataclasses.replace(hp, root_dtype=torch.float64)
    direction_err, param_err = _compare(shape, hp, torch.float64)
    assert direction_err < 1e-10 and param_err < 1e-12


def test_fp64_rank_deficient_factors_and_variants() -> None:
    # Roots from step 1 on a rank-8 24 x 24 factor (epsilon does the work), no filtering,
    # running-sum factors, no bias correction.
    hp = ShampooHParams(
        betas=(0.0, 1.0),
        precondition_frequency=3,
        start_preconditioning_step=1,
        bias_correction=False,
        root_dtype=torch.float64,
    )
    for grafting in ("adam", "none"):
        direction_err, _ = _compare(
            (24, 8), dataclasses.replace(hp, grafting=grafting), torch.float64
        )
        assert direction_err < 1e-10


@pytest.mark.parametrize("shape", [(16, 16), (24, 8), (8, 24)])
def test_one_step_is_the_polar_factor(shape: tuple[int, int]) -> None:
    # With L = G G^T and R = G^T G, L^{-1/4} G R^{-1/4} = U V^T for G = U S V^T (Gupta et al.,
    # and the reason Muon and Shampoo without accumulation coincide).
    hp = ShampooHParams(
        betas=(0.0, 1.0),
        start_preconditioning_step=1,
        grafting="none",
        root_dtype=torch.float64,
        bias_correction=False,
    )
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    direction = shampoo_direction(g, shampoo_init(shape, hp, dtype=torch.float64), 1, hp)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.allclose(direction, u @ vh, atol=1e-6)


def test_grafting_norm_before_and_after_preconditioning() -> None:
    hp = ShampooHParams(betas=(0.0, 0.999), precondition_frequency=1, start_preconditioning_step=2)
    state = shampoo_init((12, 20), hp)
    gen = torch.Generator().manual_seed(2)
    g1, g2 = torch.randn(12, 20, generator=gen), torch.randn(12, 20, generator=gen)
    # step 1: Adam's direction with bias correction, G / (|G| + eps)
    assert torch.allclose(shampoo_direction(g1, state, 1, hp), g1 / (g1.abs() + 1e-8), atol=1e-6)
    v = 0.999 * 0.001 * g1**2 + 0.001 * g2**2
    graft = g2 / ((v / (1 - 0.999**2)).sqrt() + 1e-8)
    d2 = shampoo_direction(g2, state, 2, hp)
    assert torch.allclose(d2.norm(), graft.norm(), rtol=1e-5)


@pytest.mark.parametrize(
    ("frequency", "start", "steps"),
    [
        (3, 2, [2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39]),
        (20, 30, [30, 40]),
        (4, 6, [6, 8, 12, 16, 20, 24, 28, 32, 36, 40]),
        (8, 3, [3, 8, 16, 24, 32, 40]),
        (5, 5, [5, 10, 15, 20, 25, 30, 35, 40]),
        (1, 37, [37, 38, 39, 40]),
    ],
)
def test_refresh_schedule_is_distributed_shampoos(
    frequency: int, start: int, steps: list[int]
) -> None:
    """Catches: roots refreshed every f steps counted from the start (30, 50, ... for f=20
    and a start of 30) instead of Distributed Shampoo's start and multiples of f after it."""
    hp = ShampooHParams(precondition_frequency=frequency, start_preconditioning_step=start)
    assert [t for t in range(1, 41) if shampoo_refresh_due(t, hp)] == steps


def test_inverse_fourth_root() -> None:
    a = torch.diag(torch.tensor([16.0, 1.0, 0.0], dtype=torch.float64))
    root = inverse_fourth_root(a, epsilon=1e-12, root_dtype=torch.float64)
    expected = torch.diag(torch.tensor([0.5, 1.0, 1e3], dtype=torch.float64))
    assert torch.allclose(root, expected, rtol=1e-9)
    scaled = inverse_fourth_root(16 * a[:2, :2].float(), epsilon=1e-12, scale=16.0)
    assert scaled.dtype == torch.float32
    assert torch.allclose(scaled, torch.diag(torch.tensor([0.5, 1.0])))


def test_apply_is_decoupled() -> None:
    p = torch.full((2, 3), 2.0)
    shampoo_apply_(p, torch.ones(2, 3), lr=0.5, weight_decay=0.1)
    assert torch.allclose(p, torch.full((2, 3), 2.0 * 0.95 - 0.5))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"betas": (0.9, 1.5)}, "betas"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"precondition_frequency": 0}, "precondition_frequency"),
        ({"start_preconditioning_step": 0}, "start_preconditioning_step"),
        ({"grafting": "adagrad"}, "grafting"),
        ({"grafting_beta2": 1.0}, "grafting_beta2"),
        ({"root_dtype": torch.float16}, "root_dtype"),
    ],
)
def test_invalid_hyper_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShampooHParams(**kwargs)  # type: ignore[arg-type]
