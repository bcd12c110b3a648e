"""The float64 reference optimizers' own contracts: checked inputs and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _adjust_lr

from canzona.testing.reference import (
    ReferenceNorMuon,
    ReferenceShampoo,
    ReferenceSOAP,
    _lr_factor,
)

REFERENCES = (ReferenceShampoo, ReferenceSOAP, ReferenceNorMuon)


@pytest.mark.parametrize("reference", REFERENCES)
def test_inputs_are_checked(reference: type) -> None:
    """Catches: a vector taken as a matrix, gradients missing or of another shape."""
    with pytest.raises(ValueError, match=r"reference optimizers take matrices, got shape \(4,\)"):
        reference([torch.zeros(4)])
    opt = reference([torch.zeros(4, 8), torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="expected 2 gradients, got 1"):
        opt.step([torch.ones(4, 8)])
    with pytest.raises(ValueError, match=r"gradient shape \(8, 4\) != parameter \(4, 8\)"):
        opt.step([torch.ones(8, 4), torch.ones(2, 3)])


def test_shampoo_grafts_a_zero_gradient_to_zero() -> None:
    """Catches: the grafting norm's guard dropped (0/0: NaN parameters)."""
    opt = ReferenceShampoo(
        [torch.ones(4, 8)], start_preconditioning_step=1, precondition_frequency=1
    )
    opt.step([torch.randn(4, 8, generator=torch.Generator().manual_seed(0))])
    (p,) = opt.step([torch.zeros(4, 8)])
    assert torch.isfinite(p).all()
    (p,) = ReferenceShampoo([torch.ones(4, 8)], start_preconditioning_step=1).step(
        [torch.zeros(4, 8)]
    )
    assert torch.equal(p, torch.ones(4, 8, dtype=torch.float64))


def test_a_side_of_exactly_max_precond_dim_is_preconditioned() -> None:
    opt = ReferenceShampoo([torch.zeros(4, 8)], max_precond_dim=4)
    opt.step([torch.ones(4, 8)])
    left, right = opt.factors(0)
    assert left is not None and left.shape == (4, 4) and right is None


def test_soap_with_shampoo_beta_zero_keeps_the_last_gram() -> None:
    """Catches: ``shampoo_beta=0.0`` read as "unset" (falling back to ``betas[1]``)."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(2)]
    opt = ReferenceSOAP([torch.zeros(4, 6)], shampoo_beta=0.0)
    for g in grads:
        opt.step([g])
    left, right = opt.statistics(0)
    assert left is not None and right is not None
    # x + (1 - 0) * (gram - x): the gram up to the rounding of that update
    torch.testing.assert_close(left, grads[1] @ grads[1].T, rtol=0, atol=1e-14)
    torch.testing.assert_close(right, grads[1].T @ grads[1], rtol=0, atol=1e-14)


def test_soap_takes_no_step_at_its_first_call() -> None:
    """Catches: the step size's first-call case missed (a division by zero there)."""
    opt = ReferenceSOAP([torch.zeros(4, 6)])
    opt.step([torch.ones(4, 6)])
    assert opt.step_size() == 0.0
    opt.step([torch.ones(4, 6)])
    assert opt.step_size() > 0.0


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(4, 8), (8, 4), (6, 6)])
def test_lr_factors_are_torchs(fn: str | None, shape: tuple[int, int]) -> None:
    """The shape factors torch.optim.Muon defines, on wide, tall and square matrices."""
    assert _lr_factor(fn, *shape) == _adjust_lr(1.0, fn, torch.Size(shape))
    assert math.isfinite(_lr_factor(fn, *shape))
