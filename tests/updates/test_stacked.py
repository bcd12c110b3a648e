"""A stack of matrices through one owner-state direction call equals them one by one, bitwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from canzona.updates import (
    ShampooHParams,
    SOAPHParams,
    inverse_fourth_root,
    shampoo_direction,
    shampoo_init,
    soap_direction,
    soap_init,
)
from canzona.updates.common import State
from canzona.updates.stacked import stack_states, stacked_direction_exact, unstack_states_

CPU = torch.device("cpu")
CASES = {
    "shampoo": (
        shampoo_direction,
        shampoo_init,
        ShampooHParams(precondition_frequency=2, start_preconditioning_step=2),
    ),
    "shampoo-fp64-roots": (
        shampoo_direction,
        shampoo_init,
        ShampooHParams(precondition_frequency=3, root_dtype=torch.float64, grafting="none"),
    ),
    "soap": (soap_direction, soap_init, SOAPHParams(precondition_frequency=2)),
}


@pytest.mark.parametrize("root_dtype", [torch.float32, torch.float64])
def test_the_inverse_root_of_a_stack_equals_each_matrix_alone(root_dtype: torch.dtype) -> None:
    """Catches: the eigenvalues' ``pow(-1/4)`` taken over the whole stack at once (a
    vectorised pow rounds an element by where it falls: some matrices differ)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(32, 8, 8, generator=gen)
    factors = x @ x.mT
    stack = inverse_fourth_root(factors, epsilon=1e-6, root_dtype=root_dtype)
    for k in range(32):
        alone = inverse_fourth_root(factors[k].clone(), epsilon=1e-6, root_dtype=root_dtype)
        assert torch.equal(stack[k], alone), k


@pytest.mark.parametrize("shape", [(8, 8), (16, 8), (24, 40)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_probed_stack_equals_the_loop_through_refreshes(
    case: str, shape: tuple[int, int]
) -> None:
    """Five steps (first step, plain steps, refreshes) of a stack of 6 matrices under the
    optimizers' own hyper-parameters: every direction and state tensor equal to the loop's,
    bit for bit, and the probe clears the stack. Catches: a state slice not written back
    (``unstack_states_``), a probe that refuses what runs exactly (no stack ever taken)."""
    direction, init, hp = CASES[case]
    count = 6
    assert stacked_direction_exact(direction, init, hp, shape, count, torch.float32, CPU)
    gen = torch.Generator().manual_seed(4)
    loop = [init(shape, hp, dtype=torch.float32, device=CPU) for _ in range(count)]
    states = [init(shape, hp, dtype=torch.float32, device=CPU) for _ in range(count)]
    for step in range(1, 6):
        grads = torch.randn((count, *shape), generator=gen)
        want = [direction(grads[k].clone(), loop[k], step, hp) for k in range(count)]
        stacked = stack_states(states)
        got = direction(grads.clone(), stacked, step, hp)
        unstack_states_(stacked, states)
        for k in range(count):
            assert torch.equal(got[k], want[k]), (step, k)
            for name, value in loop[k].items():
                assert torch.equal(states[k][name], value), (step, k, name)


def _differs_when_stacked(grad: Tensor, state: State, step: int, hp: object) -> Tensor:
    out = grad * 2
    if grad.dim() == 3:  # a stacked call rounds its last matrix differently
        out[-1] = out[-1].nextafter(torch.full_like(out[-1], float("inf")))
    return out


def _no_state(shape: tuple[int, int], hp: object, *, dtype: torch.dtype, device: object) -> State:
    return {"seen": torch.zeros(shape, dtype=dtype)}


def test_the_probe_refuses_what_it_cannot_clear() -> None:
    """Catches: a probe that passes a stack whose last matrix differs from the loop, or that
    stacks half precision (where a probe can pass on inputs that later differ) or a stack
    of one."""
    direction, init, hp = CASES["soap"]
    assert not stacked_direction_exact(
        _differs_when_stacked, _no_state, None, (4, 4), 5, torch.float32, CPU
    )
    assert not stacked_direction_exact(direction, init, hp, (8, 8), 4, torch.bfloat16, CPU)
    assert not stacked_direction_exact(direction, init, hp, (8, 8), 1, torch.float32, CPU)
    assert stacked_direction_exact(
        direction, init, dataclasses.replace(hp), (8, 8), 4, torch.float32, CPU
    )
