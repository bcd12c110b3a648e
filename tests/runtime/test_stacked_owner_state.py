"""Shampoo and SOAP matrices stacked on their owners: one call per stack, bitwise the loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import canzona
from canzona.updates import stacked as stacked_module

from _cases import full_of, full_tensors, grad_steps, placements_for, set_grads, sharded_params
from _dist import mesh

TIMEOUT = 90
SHAPES = {f"a{i}": (8, 8) for i in range(6)} | {f"b{i}": (16, 8) for i in range(4)}
# a refresh of the roots (Shampoo) and of the bases (SOAP) within the steps, and SOAP's
# first step (which runs matrix by matrix) before stacked ones
KW: dict[str, dict[str, Any]] = {
    "Shampoo": {"lr": 0.01, "precondition_frequency": 2, "start_preconditioning_step": 2},
    "SOAP": {"lr": 0.01, "precondition_frequency": 2},
}
STEPS = 4


def _per_matrix(name: str) -> dict[str, torch.Tensor]:
    """One process, every matrix in a param group of its own: stacks of one, the loop."""
    params = {n: nn.Parameter(t) for n, t in full_tensors(SHAPES).items()}
    cls = getattr(canzona, name)
    opt = cls([{"params": [(n, p)]} for n, p in params.items()], **KW[name])
    for grads in grad_steps(SHAPES, STEPS):
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def _stacked(name: str, kind: str, cap: int | None = None) -> dict[str, Any]:
    import canzona.optim.owned as owned

    stacked_module._EXACT.clear()
    kept_cap = owned.STACK_STATE_BYTES
    fulls = full_tensors(SHAPES)
    params = sharded_params(fulls, mesh((2,)), {n: placements_for(kind, 2) for n in SHAPES})
    opt = getattr(canzona, name)(params, **KW[name])
    calls = []
    stack = stacked_module.stack_states

    def counted(states: Any) -> Any:
        calls.append(len(states))
        return stack(states)

    owned.stack_states = counted  # type: ignore[assignment]
    owned.STACK_STATE_BYTES = kept_cap if cap is None else cap  # ranks outlive this run
    try:
        for grads in grad_steps(SHAPES, STEPS):
            set_grads(params, grads)
            opt.step()
    finally:
        owned.stack_states = stack  # type: ignore[assignment]
        owned.STACK_STATE_BYTES = kept_cap
    shapes = {key[3] for key, ok in stacked_module._EXACT.items() if ok}
    return {"params": {n: full_of(p) for n, p in params}, "stacked": shapes, "calls": calls}


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_owners_stack_their_matrices_bitwise_as_the_per_matrix_run(dist: Any, name: str) -> None:
    """Catches: a stack whose kernels round differently from the loop (e.g. a vectorised
    ``pow`` over all the stack's eigenvalues at once), a state slice not copied back after
    the stacked call, stacks never taken; on row and column shards over 2 ranks against one
    process running each matrix alone, through refreshes of the roots or the bases."""
    expected = _per_matrix(name)
    for kind in ("row", "col"):
        outs = dist(2).run(_stacked, name, kind, timeout=TIMEOUT)
        for out in outs:
            for matrix, want in expected.items():
                assert torch.equal(out["params"][matrix], want), (name, kind, matrix)
        assert set().union(*(out["stacked"] for out in outs)) == {(8, 8), (16, 8)}, kind
        assert all(out["calls"] and min(out["calls"]) >= 2 for out in outs), (kind, outs)


def test_stacks_above_the_state_byte_cap_go_matrix_by_matrix(dist: Any) -> None:
    """Catches: a stack taken whatever its states' size (the stack copies them for the
    call): with a cap below one matrix's state, no stack, and the same bits."""
    expected = _per_matrix("Shampoo")
    one_state = 4 * (2 * 8 * 8 + 2 * 8 * 8 + 2 * 8 * 8)  # 8 x 8: moments, factors, roots
    for out in dist(2).run(_stacked, "Shampoo", "row", one_state, timeout=TIMEOUT):
        assert out["calls"] == []
        for matrix, want in expected.items():
            assert torch.equal(out["params"][matrix], want), matrix
