"""Each optimizer trains a small MLP past what tuned SGD with momentum reaches in the same budget.

The task: regress the output of a fixed random teacher (16 -> 32 tanh -> 8) on 256 Gaussian inputs
whose 16 coordinates have scales from 1 down to 0.01, with a student 16 -> 64 tanh -> 8, full
batch, 200 steps, mean squared error. The spread of input scales makes the first layer's curvature
ill-conditioned (about 1e4 between directions): a first-order method has to keep its step below the
stiffest direction and then crawls along the flat ones, while a matrix optimizer rescales (Shampoo,
SOAP) or orthogonalises (Muon) the update of each weight matrix.

The target's variance is 0.377. Measured final losses on the reference CPU: SGD with momentum 0.9
0.137, 0.077, 0.053, 0.065 and 0.104 at lr 0.1, 0.3, 0.5, 0.7 and 1.0 (Nesterov is no better);
Muon 0.013, Shampoo 0.007 and SOAP 0.004 at lr 0.05, and NorMuon 0.015 at the same lr in the
authors' convention (``rescale="preserve_norm"``, ``adjust_lr_fn="original"``: steps of Muon's
size). ``THRESHOLD = 0.025`` sits about a factor of two from both sides: every matrix optimizer
must beat it and the best SGD run must not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import canzona

THRESHOLD = 0.025
STEPS = 200
SGD_LRS = (0.1, 0.3, 0.5, 0.7, 1.0)  # the best (0.5) is inside the grid

MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]

OPTIMIZERS: dict[str, MakeOptimizer] = {
    "muon": lambda m: canzona.Muon(canzona.param_groups(m), lr=0.05, weight_decay=0.0),
    "normuon": lambda m: canzona.NorMuon(
        canzona.param_groups(m),
        lr=0.05,
        weight_decay=0.0,
        rescale="preserve_norm",
        adjust_lr_fn="original",
    ),
    "shampoo": lambda m: canzona.Shampoo(
        canzona.param_groups(m), lr=0.05, precondition_frequency=10, start_preconditioning_step=10
    ),
    "soap": lambda m: canzona.SOAP(canzona.param_groups(m), lr=0.05, weight_decay=0.0),
}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(0, -2, 16)
    x = torch.randn(256, 16, generator=gen) * scales
    w1 = torch.randn(16, 32, generator=gen) / scales[:, None] / 4.0
    w2 = torch.randn(32, 8, generator=gen) / 32**0.5
    return x, torch.tanh(x @ w1) @ w2


def _final_loss(make: MakeOptimizer) -> float:
    x, y = _data()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = make(model)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x), y).item()
    return loss if loss == loss else float("inf")  # a diverged run counts as infinitely bad


@pytest.fixture(scope="module")
def best_sgd() -> float:
    return min(
        _final_loss(lambda m, lr=lr: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9))
        for lr in SGD_LRS
    )


def test_tuned_sgd_stays_above_the_threshold(best_sgd: float) -> None:
    assert best_sgd > THRESHOLD


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_beats_the_threshold(name: str, best_sgd: float) -> None:
    """Final loss below ``THRESHOLD`` (0.025, 6.6% of the target's variance) after 200 steps,
    which tuned SGD with momentum does not reach (0.053); see the module docstring."""
    loss = _final_loss(OPTIMIZERS[name])
    assert loss < THRESHOLD < best_sgd, f"{name}: {loss:.4f}, best SGD {best_sgd:.4f}"
