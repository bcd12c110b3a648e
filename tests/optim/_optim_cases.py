"""Shared pieces of the single-device optimizer tests: configurations, parameters, comparisons."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

import canzona

# Each optimizer with a configuration that preconditions within a few steps: Shampoo refreshes
# its roots at steps 2, 4, 6, ...; SOAP computes its bases on step 1 and refreshes them at
# internal steps 2, 4, ... (calls 3, 5, ...). Non-zero weight decay everywhere.
OPTIMIZERS: dict[str, tuple[type[Optimizer], dict[str, Any]]] = {
    "muon": (canzona.Muon, {"lr": 0.02, "weight_decay": 0.05}),
    "normuon": (canzona.NorMuon, {"lr": 0.02, "weight_decay": 0.05}),
    "shampoo": (
        canzona.Shampoo,
        {
            "lr": 0.01,
            "weight_decay": 0.01,
            "precondition_frequency": 2,
            "start_preconditioning_step": 2,
        },
    ),
    "soap": (canzona.SOAP, {"lr": 0.01, "weight_decay": 0.01, "precondition_frequency": 2}),
}
NAMES = list(OPTIMIZERS)

# A square, a tall, a wide matrix, a 3-D stack, and two 1-D parameters for the AdamW group.
SHAPES: dict[str, tuple[int, ...]] = {
    "square": (8, 8),
    "tall": (12, 6),
    "wide": (6, 12),
    "stack": (3, 5, 7),
    "bias": (7,),
    "gain": (12,),
}

Params = dict[str, nn.Parameter]
Grads = dict[str, torch.Tensor]


def initial(
    shapes: Mapping[str, tuple[int, ...]] = SHAPES, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Deterministic initial values, one tensor per name."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def gradients(
    shapes: Mapping[str, tuple[int, ...]] = SHAPES, steps: int = 6, seed: int = 1
) -> list[Grads]:
    """Deterministic gradients for ``steps`` steps."""
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(steps)]


def parameters(values: Mapping[str, torch.Tensor]) -> Params:
    """Fresh leaf parameters holding copies of ``values``."""
    return {n: nn.Parameter(v.detach().clone()) for n, v in values.items()}


def split_groups(
    params: Params, *, named: bool = False, matrix: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """A matrix group (2-D and 3-D parameters) and an ``algorithm="adamw"`` group (the rest)."""

    def entries(keep: Iterable[str]) -> list[Any]:
        return [(n, params[n]) if named else params[n] for n in keep]

    mats = [n for n, p in params.items() if p.ndim in (2, 3)]
    rest = [n for n, p in params.items() if p.ndim not in (2, 3)]
    groups: list[dict[str, Any]] = [{"params": entries(mats), **(matrix or {})}]
    if rest:
        groups.append({"params": entries(rest), "algorithm": "adamw"})
    return groups


def make(
    name: str,
    values: Mapping[str, torch.Tensor] | None = None,
    *,
    named: bool = False,
    **overrides: Any,
) -> tuple[Params, Optimizer]:
    """Parameters (copies of ``values``) and the optimizer ``name`` over the two groups."""
    cls, kwargs = OPTIMIZERS[name]
    params = parameters(initial() if values is None else values)
    return params, cls(split_groups(params, named=named), **{**kwargs, **overrides})


def set_grads(params: Params, grads: Grads) -> None:
    """Give every parameter (a copy of) its gradient."""
    for n, p in params.items():
        p.grad = grads[n].clone()


def train(params: Params, opt: Optimizer, grads: Sequence[Grads]) -> None:
    """One ``opt.step()`` per entry of ``grads``."""
    for g in grads:
        set_grads(params, g)
        opt.step()


def flat_state(sd: Mapping[str, Any]) -> dict[tuple[Any, str], torch.Tensor]:
    """``{(param id, key): tensor}`` of a state dict."""
    return {(pid, key): v for pid, entry in sd["state"].items() for key, v in entry.items()}


def assert_state_dicts_equal(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Same param groups, same state keys, every state tensor bitwise equal (and same dtype)."""
    assert got["param_groups"] == want["param_groups"]
    a, b = flat_state(got), flat_state(want)
    assert sorted(a, key=repr) == sorted(b, key=repr)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), f"state {key} differs"


def assert_params_equal(got: Params, want: Mapping[str, torch.Tensor]) -> None:
    """Every parameter bitwise equal to its counterpart."""
    assert list(got) == list(want)
    for n in got:
        assert torch.equal(got[n].detach(), want[n].detach()), f"parameter {n!r} differs"


def snapshot(params: Params) -> dict[str, torch.Tensor]:
    """Detached copies of the parameters."""
    return {n: p.detach().clone() for n, p in params.items()}
