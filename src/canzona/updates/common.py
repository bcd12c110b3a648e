"""Shared pieces of the update math: state typing, argument checks and small tensor utilities."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "PROBED_DTYPES",
    "State",
    "check_beta",
    "check_positive",
    "check_step",
    "eye_like",
    "matrix_shape",
    "state_dtype",
]

State = dict[str, Tensor]
"""Per-matrix optimizer state: fixed keys for a given shape and hyper-parameters."""

PROBED_DTYPES = (torch.float32, torch.float64)
"""Dtypes whose stacked kernels a one-off probe may clear for use at any size: an output this
wide shows a different accumulation order on nearly every input (half precision hides it on
most, so a probe can pass where some inputs differ)."""


def check_beta(name: str, value: float, *, allow_one: bool = False) -> None:
    """Raise unless ``0 <= value < 1`` (or ``<= 1`` when ``allow_one``).

    Args:
        name: Name used in the message.
        value: The coefficient.
        allow_one: Whether 1 is allowed.

    Raises:
        ValueError: When out of range.
    """
    upper_ok = value <= 1 if allow_one else value < 1
    if not (value >= 0 and upper_ok):
        bound = "]" if allow_one else ")"
        raise ValueError(f"{name} must be in [0, 1{bound}, got {value!r}")


def check_positive(name: str, value: float) -> None:
    """Raise unless ``value > 0``.

    Args:
        name: Name used in the message.
        value: The number.

    Raises:
        ValueError: When not positive.
    """
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def check_step(step: int) -> None:
    """Raise unless ``step`` is a 1-based update count.

    Args:
        step: Count of this update, already incremented by the caller.

    Raises:
        ValueError: When ``step < 1``.
    """
    if step < 1:
        raise ValueError(f"step is the 1-based count of this update, got {step!r}")


def matrix_shape(shape: Sequence[int]) -> tuple[tuple[int, ...], int, int]:
    """Split ``(..., m, n)`` into the batch dims, ``m`` and ``n``.

    Args:
        shape: Shape of a matrix or a stack of matrices.

    Returns:
        ``(batch, m, n)``.

    Raises:
        ValueError: On fewer than two dims.
    """
    dims = tuple(int(d) for d in shape)
    if len(dims) < 2:
        raise ValueError(f"expected a matrix shape (..., m, n), got {dims!r}")
    return dims[:-2], dims[-2], dims[-1]


def eye_like(batch: tuple[int, ...], n: int, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Identity matrices ``(*batch, n, n)`` (a fresh, contiguous tensor).

    Args:
        batch: Leading batch dims.
        n: Size of each identity.
        dtype: Dtype.
        device: Device.

    Returns:
        The stack of identities.
    """
    eye = torch.eye(n, dtype=dtype, device=device)
    return eye.expand(*batch, n, n).clone()


def state_dtype(state: State, fallback: torch.dtype) -> torch.dtype:
    """Dtype in which a direction computes: that of the state, or ``fallback`` if it is empty.

    Args:
        state: Per-matrix state.
        fallback: Dtype to use when the state holds no tensor.

    Returns:
        The working dtype.
    """
    for tensor in state.values():
        return tensor.dtype
    return fallback
