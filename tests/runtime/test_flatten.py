"""Opt-in matricisation: an N-D weight updated as its (shape[0], rest) matrix, exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Placement, Shard

import canzona

from _cases import set_grads, sharded_params
from _dist import mesh

KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
SHAPES = {"conv": (12, 3, 3, 3), "conv1d": (10, 4, 5), "linear": (12, 9)}


def _fulls(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _reference(steps: int) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the matrices ``w.view(w.shape[0], -1)``."""
    fulls = _fulls(0)
    ps = {n: nn.Parameter(t.reshape(t.shape[0], -1).clone()) for n, t in fulls.items()}
    opt = torch.optim.Muon(list(ps.values()), **KW)
    for s in range(steps):
        grads = _fulls(s + 1)
        for n, p in ps.items():
            p.grad = grads[n].reshape(p.shape).clone()
        opt.step()
    return {n: p.detach().reshape(SHAPES[n]) for n, p in ps.items()}


def _case(placements: dict[str, tuple[Placement, ...]]) -> dict[str, bool]:
    params = sharded_params(_fulls(0), mesh(), placements)
    opt = canzona.Muon([{"params": params, "flatten": True}], **KW)
    for s in range(3):
        set_grads(params, _fulls(s + 1))
        opt.step()
    want = _reference(3)
    return {n: bool(torch.equal(p.full_tensor(), want[n])) for n, p in params}


def test_matricised_weights_on_one_device_match_torch_muon() -> None:
    params = [(n, nn.Parameter(t.clone())) for n, t in _fulls(0).items()]
    opt = canzona.Muon([{"params": params, "flatten": True}], **KW)
    for s in range(3):
        set_grads(params, _fulls(s + 1))
        opt.step()
    want = _reference(3)
    assert {n: torch.equal(p.detach(), want[n]) for n, p in params} == dict.fromkeys(SHAPES, True)


@pytest.mark.parametrize("world", [2, 4])
def test_matricised_weights_sharded_by_rows_match_torch_muon(dist: Any, world: int) -> None:
    rows = {n: (Shard(0),) for n in SHAPES}
    for out in dist(world).run(_case, rows):
        assert out == dict.fromkeys(SHAPES, True)


OWNER_HELD: dict[str, dict[str, Any]] = {
    "NorMuon": {"lr": 0.02, "beta2": 0.9},
    "Shampoo": {"lr": 0.01, "precondition_frequency": 2, "start_preconditioning_step": 2},
    "SOAP": {"lr": 0.01, "precondition_frequency": 2, "max_precond_dim": 10},
}


def _owner_held_case() -> dict[str, dict[str, bool]]:
    """Each owner-held optimizer on the matricised weights, against itself on one process
    on the matrices ``w.view(w.shape[0], -1)``."""
    out = {}
    for name, kwargs in OWNER_HELD.items():
        cls = getattr(canzona, name)
        params = sharded_params(_fulls(0), mesh(), {n: (Shard(0),) for n in SHAPES})
        opt = cls([{"params": params, "flatten": True}], **kwargs)
        local = {n: nn.Parameter(t.reshape(t.shape[0], -1).clone()) for n, t in _fulls(0).items()}
        ref = cls(list(local.values()), **kwargs)
        for s in range(4):
            grads = _fulls(s + 1)
            set_grads(params, grads)
            set_grads(list(local.items()), {n: g.reshape(local[n].shape) for n, g in grads.items()})
            opt.step()
            ref.step()
        want = {n: p.detach().reshape(SHAPES[n]) for n, p in local.items()}
        out[name] = {n: bool(torch.equal(p.full_tensor(), want[n])) for n, p in params}
    return out


def test_matricised_weights_with_owner_held_state_match_one_process(dist: Any) -> None:
    """NorMuon, Shampoo and SOAP (their state on the owner, shaped by the matrix): the
    preconditioners of the ``(shape[0], rest)`` matrix, bitwise, through a refresh."""
    for out in dist(2).run(_owner_held_case):
        assert out == {name: dict.fromkeys(SHAPES, True) for name in OWNER_HELD}


def _sharded_inner() -> str:
    params = sharded_params(_fulls(0), mesh(), {n: (Shard(1),) for n in SHAPES})
    opt = canzona.Muon([{"params": params, "flatten": True}], **KW)
    set_grads(params, _fulls(1))
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_inner_dimension_sharded_is_refused_on_every_rank(dist: Any) -> None:
    for msg in dist(2).run(_sharded_inner):
        assert "'conv'" in msg and "every dimension but the first unsharded" in msg, msg


def test_without_the_flag_an_nd_weight_is_refused() -> None:
    p = nn.Parameter(torch.randn(4, 3, 3, 3))
    with pytest.raises(ValueError, match="4-D"):
        canzona.Muon([p])
    with pytest.raises(ValueError, match="flatten must be a bool"):
        canzona.Muon([{"params": [p], "flatten": "yes"}])
