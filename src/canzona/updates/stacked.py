"""Owner-state directions of a stack of matrices in one call, where it equals the loop bitwise."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.updates.common import PROBED_DTYPES, State

__all__ = ["PROBE_STEPS", "stack_states", "stacked_direction_exact", "unstack_states_"]

#: Steps a probe runs (from fresh states): the first step's branch, then plain and refresh
#: steps under the probe's hyper-parameters (which refresh at every step).
PROBE_STEPS = 3

DirectionFn = Callable[[Tensor, State, int, Any], Tensor]
InitFn = Callable[..., State]

_EXACT: dict[tuple[object, ...], bool] = {}


def stack_states(states: Sequence[State]) -> State:
    """The states of several matrices of one shape as one state of stacked tensors (copies)."""
    return {key: torch.stack([s[key] for s in states]) for key in states[0]}


def unstack_states_(stacked: State, states: Sequence[State]) -> None:
    """Copy each matrix's slice of ``stacked`` back into its own state, one call per key."""
    for key, value in stacked.items():
        torch._foreach_copy_([s[key] for s in states], list(value.unbind(0)))


def stacked_direction_exact(
    direction: DirectionFn,
    init: InitFn,
    probe_hp: Any,
    shape: tuple[int, int],
    count: int,
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether ``direction`` on a stack of ``count`` matrices equals it matrix by matrix.

    Probed once per (functions, hyper-parameters, shape, count, dtype, device) and cached:
    :data:`PROBE_STEPS` steps from fresh states (``init``) on random gradients, the stack
    against a loop over fresh contiguous copies, every direction and every state tensor
    compared bit for bit. Only for dtypes whose kernels a probe can clear
    (:data:`~canzona.updates.common.PROBED_DTYPES`: there a different accumulation order
    shows on nearly every input, so a probe that passes means the kernels agree); half
    precision always runs the loop.

    Args:
        direction: The direction function (``(grad, state, step, hp) -> direction``).
        init: Its state initialiser (``(shape, hp, dtype=, device=) -> state``).
        probe_hp: Hyper-parameters that take every branch within the probe's steps (e.g. a
            refresh at every step).
        shape: Rows and columns of one matrix.
        count: Matrices in the stack.
        dtype: Dtype of the states and gradients.
        device: Where they live.
    """
    if dtype not in PROBED_DTYPES or count < 2:
        return False
    key = (direction, init, probe_hp, shape, count, dtype, device.type)
    known = _EXACT.get(key)
    if known is None:
        known = _EXACT[key] = _probe(direction, init, probe_hp, shape, count, dtype, device)
    return known


def _probe(
    direction: DirectionFn,
    init: InitFn,
    hp: Any,
    shape: tuple[int, int],
    count: int,
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    gen = torch.Generator().manual_seed(0)
    loop = [init(shape, hp, dtype=dtype, device=device) for _ in range(count)]
    stacked = stack_states([init(shape, hp, dtype=dtype, device=device) for _ in range(count)])
    for step in range(1, PROBE_STEPS + 1):
        grads = torch.randn((count, *shape), generator=gen, dtype=torch.float64)
        grads = grads.to(dtype=dtype, device=device)
        try:
            want = [direction(grads[k].clone(), loop[k], step, hp) for k in range(count)]
            got = direction(grads.clone(), stacked, step, hp)
        except RuntimeError:
            return False
        if not all(torch.equal(got[k], w) for k, w in enumerate(want)):
            return False
    return all(
        torch.equal(value[k], loop[k][name])
        for name, value in stacked.items()
        for k in range(count)
    )
