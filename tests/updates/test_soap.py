"""SOAP direction and apply against the float64 reference, across eigenbasis refreshes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from canzona.testing import ReferenceSOAP
from canzona.updates import SOAPHParams, soap_apply_, soap_direction, soap_init, soap_step_size

STEPS, LR, WD = 8, 0.1, 0.01
# frequency 3: bases refreshed after internal steps 3 and 6 (calls 4 and 7)
BASE = SOAPHParams(precondition_frequency=3)
SMALL_MAX = dataclasses.replace(BASE, max_precond_dim=16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-300)).item()


def _run(
    shape: tuple[int, ...], hp: SOAPHParams, dtype: torch.dtype
) -> tuple[float, float, dict[str, torch.Tensor], ReferenceSOAP]:
    """Max relative direction error over calls 2.., final parameter error, both states."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    fields = {f.name: getattr(hp, f.name) for f in dataclasses.fields(hp)}
    ref = ReferenceSOAP([p0], lr=LR, weight_decay=WD, **fields)
    param, state = p0.to(dtype), soap_init(shape, hp, dtype=dtype)
    worst = 0.0
    for step in range(1, STEPS + 1):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        direction = soap_direction(g.to(dtype), state, step, hp)
        soap_apply_(param, direction, lr=LR, weight_decay=WD, step=step, hp=hp)
        ref.step([g])
        if step == 1:
            assert torch.equal(direction, torch.zeros_like(direction))
            assert torch.equal(param, p0.to(dtype))
        else:
            worst = max(worst, _rel(direction, ref.directions[0]))
    return worst, _rel(param, ref.params[0]), state, ref


# Shapes whose every preconditioned side has a full-rank statistic from the first call: the
# eigenbases are then unique up to column signs, which the direction does not see.
WELL_POSED = {
    "square": ((16, 16), BASE),
    "batched_square": ((3, 16, 16), BASE),
    "tall_long_side_over_max": ((24, 8), SMALL_MAX),
    "wide_long_side_over_max": ((8, 24), SMALL_MAX),
}
# The long side's first statistic G G^T has rank min(m, n): eigh may return any orthonormal
# basis of its null space, and Adam's per-coordinate moments in that basis depend on the choice.
RANK_DEFICIENT = {"tall": (24, 8), "wide": (8, 24), "batched": (3, 16, 24)}


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("name", list(WELL_POSED))
def test_fp32_matches_reference(name: str, normalize: bool) -> None:
    # fp32 eigh/QR on well-separated spectra: ~1e-5 relative (measured 8e-6).
    shape, hp = WELL_POSED[name]
    hp = dataclasses.replace(hp, normalize_grads=normalize)
    direction_err, param_err, _, _ = _run(shape, hp, torch.float32)
    assert direction_err < 1e-4 and param_err < 1e-5


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("name", list(RANK_DEFICIENT))
def test_fp64_matches_reference_on_rank_deficient_sides(name: str, normalize: bool) -> None:
    # In float64 both sides build the first statistic with the same single product, so eigh sees
    # the same bits and picks the same null-space basis; from there on only float64 rounding
    # separates them (measured ~3e-15). This pins the semantics on tall and wide matrices.
    hp = dataclasses.replace(BASE, normalize_grads=normalize)
    direction_err, param_err, _, _ = _run(RANK_DEFICIENT[name], hp, torch.float64)
    assert direction_err < 1e-10 and param_err < 1e-12


@pytest.mark.parametrize("name", list(RANK_DEFICIENT))
def test_fp32_statistics_match_reference_on_rank_deficient_sides(name: str) -> None:
    # In fp32 the null-space basis is a rounding choice, so only basis-free quantities are
    # compared: the statistics L and R, and the finiteness of what was produced.
    shape = RANK_DEFICIENT[name]
    _, _, state, ref = _run(shape, BASE, torch.float32)
    left, right = ref.statistics(0)
    assert left is not None and right is not None
    assert _rel(state["gg_left"], left) < 1e-5 and _rel(state["gg_right"], right) < 1e-5
    assert all(bool(t.isfinite().all()) for t in state.values())


def test_shampoo_beta_and_no_bias_correction() -> None:
    hp = dataclasses.replace(BASE, shampoo_beta=0.8, correct_bias=False, betas=(0.9, 0.99))
    direction_err, param_err, _, _ = _run((16, 16), hp, torch.float64)
    assert direction_err < 1e-10 and param_err < 1e-12
    assert hp.statistics_beta == 0.8 and BASE.statistics_beta == BASE.betas[1]


def test_step_size() -> None:
    hp = SOAPHParams(betas=(0.9, 0.99))
    assert soap_step_size(1.0, 1, hp) == 0.0
    assert soap_step_size(1.0, 3, hp) == pytest.approx((1 - 0.99**2) ** 0.5 / (1 - 0.9**2))
    assert soap_step_size(0.5, 3, dataclasses.replace(hp, correct_bias=False)) == 0.5


def test_apply_orders_weight_decay_after_the_step() -> None:
    hp = SOAPHParams(correct_bias=False)
    p = torch.full((2, 2), 2.0)
    soap_apply_(p, torch.ones(2, 2), lr=0.5, weight_decay=0.1, step=1, hp=hp)
    assert torch.equal(p, torch.full((2, 2), 2.0))  # nothing on the first call
    soap_apply_(p, torch.ones(2, 2), lr=0.5, weight_decay=0.1, step=2, hp=hp)
    assert torch.allclose(p, torch.full((2, 2), (2.0 - 0.5) * (1 - 0.05)))


def test_refresh_keeps_bases_orthogonal() -> None:
    shape = (2, 12, 20)
    hp = SOAPHParams(precondition_frequency=1)
    state = soap_init(shape, hp)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 5):
        soap_direction(torch.randn(shape, generator=gen), state, step, hp)
    for side, k in (("left", 12), ("right", 20)):
        q = state[f"q_{side}"]
        assert torch.allclose(q.mT @ q, torch.eye(k).expand(2, k, k), atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"shampoo_beta": 1.0}, "shampoo_beta"),
        ({"eps": -1.0}, "eps"),
        ({"precondition_frequency": 0}, "precondition_frequency"),
        ({"max_precond_dim": -1}, "max_precond_dim"),
    ],
)
def test_invalid_hyper_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SOAPHParams(**kwargs)  # type: ignore[arg-type]
