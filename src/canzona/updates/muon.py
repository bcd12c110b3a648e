"""Muon in three phases (momentum, Newton–Schulz direction, apply), bitwise equal to torch's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from canzona.updates.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    newton_schulz,
)

__all__ = ["ADJUST_LR_FNS", "muon_apply_", "muon_direction", "muon_lr", "muon_prepare_"]

ADJUST_LR_FNS: tuple[str, ...] = ("original", "match_rms_adamw")


def muon_prepare_(buf: Tensor, grad: Tensor, *, momentum: float, nesterov: bool) -> Tensor:
    r"""Update the momentum buffer and return the tensor that Newton–Schulz orthogonalises.

    :math:`B \leftarrow \mu B + (1 - \mu) G` (as ``lerp``), then :math:`G + \mu (B - G)` with
    Nesterov, else :math:`B`; the ops of ``torch.optim.Muon``. Element-wise, so it runs on a shard.

    Args:
        buf: Momentum buffer, updated in place.
        grad: Gradient (or the matching shard of it).
        momentum: Momentum factor :math:`\mu`.
        nesterov: Whether to use the Nesterov blend.

    Returns:
        The blended momentum (a new tensor with Nesterov; ``buf`` itself without).
    """
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def muon_direction(
    blended: Tensor,
    *,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalise the blended momentum of full matrices ``(..., m, n)`` (:func:`newton_schulz`).

    Args:
        blended: Output of :func:`muon_prepare_`, gathered into full matrices.
        coefficients: Quintic coefficients ``(a, b, c)`` (torch's ``ns_coefficients``).
        steps: Newton–Schulz iterations (torch's ``ns_steps``).
        eps: Norm clamp.
        dtype: Iteration dtype (bf16 reproduces torch).

    Returns:
        The direction, dtype ``dtype``, shape of ``blended``.
    """
    return newton_schulz(blended, coefficients=coefficients, steps=steps, eps=eps, dtype=dtype)


def muon_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Scale the learning rate by the matrix shape as torch's Muon does.

    ``None`` or ``"original"``: ``lr * sqrt(max(1, m / n))``; ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(m, n))``. ``(m, n)`` are the last two dims of the full matrix (torch
    reads the first two; the same for 2-D parameters).

    Args:
        lr: Learning rate of the param group.
        adjust_lr_fn: Name of the adjustment or ``None``.
        shape: Shape of the full (unsharded) matrix.

    Returns:
        The adjusted learning rate.

    Raises:
        ValueError: On an unknown ``adjust_lr_fn`` or a shape with fewer than two dims.
    """
    if len(shape) < 2:
        raise ValueError(f"muon_lr needs a matrix shape, got {tuple(shape)!r}")
    m, n = int(shape[-2]), int(shape[-1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, m / n))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(m, n))
    else:
        raise ValueError(
            f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}"
        )
    return lr * ratio


def muon_apply_(
    param: Tensor, direction: Tensor, *, lr: float, weight_decay: float, adjusted_lr: float
) -> None:
    """Decoupled weight decay, then the step; the op order of torch's Muon. Element-wise.

    ``param.mul_(1 - lr * weight_decay)`` then ``param.add_(direction, alpha=-adjusted_lr)``.

    Args:
        param: Parameter (or shard), updated in place.
        direction: Matching direction (or shard) from :func:`muon_direction`; any dtype, it is
            promoted by the in-place add exactly as in torch.
        lr: Learning rate of the param group (drives the weight decay).
        weight_decay: Decoupled weight decay coefficient.
        adjusted_lr: Output of :func:`muon_lr` for the full matrix shape.
    """
    param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-adjusted_lr)
