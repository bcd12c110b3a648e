"""canzona.Shampoo and canzona.SOAP against the float64 references, through the optimizer classes.

``tests/updates/`` checks the math; here the question is the wiring: that every hyper-parameter,
the step count, the learning rate (also when a scheduler changes it), the weight decay and the
preconditioner refreshes reach the math as the references define them. With float64 parameters
(and float64 roots for Shampoo) both sides compute the same formulas in float64 and round-off
stays below 1e-12, far under what a wiring error causes (measured: a wrong ``epsilon`` moves the
parameters by 1e-10, a wrong beta, frequency, weight decay or schedule by 1e-4 or more).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import canzona
from canzona.testing import ReferenceShampoo, ReferenceSOAP

STEPS = 8
SQUARES = [(8, 8), (12, 12), (2, 6, 6)]
NON_SQUARE = [(12, 6), (6, 12), (2, 5, 9)]

# Roots refreshed at steps 2, 3, 6 and 9: both fresh and stale roots are used.
SHAMPOO_BASE: dict[str, Any] = {
    "lr": 0.05,
    "weight_decay": 0.01,
    "betas": (0.9, 0.99),
    "epsilon": 1e-10,
    "precondition_frequency": 3,
    "start_preconditioning_step": 2,
}
SHAMPOO_VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "no_grafting": {"grafting": "none"},
    "no_bias_correction": {"bias_correction": False},
    "running_sums_no_momentum": {"betas": (0.0, 1.0)},
    "max_precond_dim": {"max_precond_dim": 10},  # 8x8 and 6x6 preconditioned, 12x12 not
    "grafting_hparams": {"grafting_beta2": 0.9, "grafting_epsilon": 1e-3},
    "late_start": {"start_preconditioning_step": 5, "precondition_frequency": 1},
    "start_off_the_frequency": {"start_preconditioning_step": 3, "precondition_frequency": 2},
}

# Bases refreshed at internal steps 3 and 6 (calls 4 and 7).
SOAP_BASE: dict[str, Any] = {
    "lr": 0.05,
    "weight_decay": 0.01,
    "betas": (0.9, 0.99),
    "eps": 1e-8,
    "precondition_frequency": 3,
}
SOAP_VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "normalize_grads": {"normalize_grads": True},
    "no_correct_bias": {"correct_bias": False},
    "shampoo_beta": {"shampoo_beta": 0.5},
    "max_precond_dim": {"max_precond_dim": 10},
    "no_weight_decay": {"weight_decay": 0.0, "precondition_frequency": 1},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def _compare(
    cls: type[torch.optim.Optimizer],
    ref_cls: type[Any],
    shapes: Sequence[tuple[int, ...]],
    hparams: dict[str, Any],
    *,
    dtype: torch.dtype,
    extra: dict[str, Any] | None = None,
    lr_factors: Sequence[float] | None = None,
) -> tuple[float, list[nn.Parameter], torch.optim.Optimizer, Any]:
    """Worst relative parameter error over the steps (``lr_factors``: a LambdaLR schedule)."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    params = [nn.Parameter(v.to(dtype)) for v in start]
    opt = cls(params, **hparams, **(extra or {}))
    ref = ref_cls(start, **hparams)
    scheduler = None
    if lr_factors is not None:
        scheduler = LambdaLR(opt, lambda t: lr_factors[min(t, len(lr_factors) - 1)])
    worst = 0.0
    for t in range(STEPS):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        lr = hparams["lr"] * lr_factors[t] if lr_factors is not None else None
        ref.step(grads, lr=lr)
        if scheduler is not None:
            scheduler.step()
        worst = max(worst, *(_rel(p.detach(), r) for p, r in zip(params, ref.params, strict=True)))
    return worst, params, opt, ref


# ------------------------------------------------------------------ Shampoo
@pytest.mark.parametrize("variant", list(SHAMPOO_VARIANTS))
@pytest.mark.parametrize("shapes", [SQUARES, NON_SQUARE], ids=["square", "non_square"])
def test_shampoo_float64_matches_reference(variant: str, shapes: list[tuple[int, ...]]) -> None:
    hparams = {**SHAMPOO_BASE, **SHAMPOO_VARIANTS[variant]}
    worst, *_ = _compare(
        canzona.Shampoo,
        ReferenceShampoo,
        shapes,
        hparams,
        dtype=torch.float64,
        extra={"root_dtype": torch.float64},
    )
    assert worst < 1e-12


@pytest.mark.parametrize("variant", list(SHAMPOO_VARIANTS))
def test_shampoo_float32_matches_reference(variant: str) -> None:
    """fp32 state and roots on square matrices: at most 4e-7 measured (fp32 round-off over 8
    steps and a few ``eigh`` calls); the bound of 2e-5 keeps a margin of about 50 and still
    catches a wrong beta, frequency, weight decay or schedule (1e-4 or more)."""
    hparams = {**SHAMPOO_BASE, **SHAMPOO_VARIANTS[variant]}
    worst, *_ = _compare(canzona.Shampoo, ReferenceShampoo, SQUARES, hparams, dtype=torch.float32)
    assert worst < 2e-5


def test_shampoo_factors_in_the_state_dict() -> None:
    _, params, opt, ref = _compare(
        canzona.Shampoo,
        ReferenceShampoo,
        SQUARES,
        SHAMPOO_BASE,
        dtype=torch.float64,
        extra={"root_dtype": torch.float64},
    )
    state = opt.state_dict()["state"]
    for i in range(len(params)):
        left, right = ref.factors(i)
        torch.testing.assert_close(state[i]["factor_left"], left, rtol=1e-12, atol=0)
        torch.testing.assert_close(state[i]["factor_right"], right, rtol=1e-12, atol=0)
        assert int(state[i]["step"]) == STEPS


def test_shampoo_lr_schedule() -> None:
    factors = [1.0, 0.5, 0.0, 2.0, 1.0, 0.25, 0.0, 1.5]
    hparams = {**SHAMPOO_BASE}
    worst, *_ = _compare(
        canzona.Shampoo,
        ReferenceShampoo,
        SQUARES,
        hparams,
        dtype=torch.float64,
        extra={"root_dtype": torch.float64},
        lr_factors=factors,
    )
    assert worst < 1e-12


# ------------------------------------------------------------------ SOAP
@pytest.mark.parametrize("variant", list(SOAP_VARIANTS))
@pytest.mark.parametrize("shapes", [SQUARES, NON_SQUARE], ids=["square", "non_square"])
def test_soap_float64_matches_reference(variant: str, shapes: list[tuple[int, ...]]) -> None:
    """Non-square matrices only in float64: there the first eigenbasis of the long side is
    arbitrary in its null space, and only identical arithmetic picks the same one."""
    hparams = {**SOAP_BASE, **SOAP_VARIANTS[variant]}
    worst, *_ = _compare(canzona.SOAP, ReferenceSOAP, shapes, hparams, dtype=torch.float64)
    assert worst < 1e-12


@pytest.mark.parametrize("variant", list(SOAP_VARIANTS))
def test_soap_float32_matches_reference(variant: str) -> None:
    """fp32 on square matrices: at most 6e-7 measured; the bound of 2e-5 keeps a margin of about
    30 and still catches a wrong beta, frequency or weight decay (1e-3 or more)."""
    hparams = {**SOAP_BASE, **SOAP_VARIANTS[variant]}
    worst, *_ = _compare(canzona.SOAP, ReferenceSOAP, SQUARES, hparams, dtype=torch.float32)
    assert worst < 2e-5


def test_soap_first_step_changes_nothing() -> None:
    """The first call only sets the eigenbases (no update, no weight decay)."""
    params = [nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(2, 4, 5))]
    start = [p.detach().clone() for p in params]
    opt = canzona.SOAP(params, lr=0.1, weight_decay=0.5)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p, v in zip(params, start, strict=True):
        assert torch.equal(p.detach(), v)


def test_soap_statistics_in_the_state_dict() -> None:
    _, params, opt, ref = _compare(
        canzona.SOAP, ReferenceSOAP, SQUARES, SOAP_BASE, dtype=torch.float64
    )
    state = opt.state_dict()["state"]
    for i in range(len(params)):
        left, right = ref.statistics(i)
        torch.testing.assert_close(state[i]["gg_left"], left, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(state[i]["gg_right"], right, rtol=1e-12, atol=1e-15)
        assert int(state[i]["step"]) == STEPS


def test_soap_lr_schedule() -> None:
    factors = [1.0, 0.5, 0.0, 2.0, 1.0, 0.25, 0.0, 1.5]
    worst, *_ = _compare(
        canzona.SOAP, ReferenceSOAP, SQUARES, SOAP_BASE, dtype=torch.float64, lr_factors=factors
    )
    assert worst < 1e-12
