"""Muon in three phases (momentum, Newton–Schulz direction, apply), bitwise equal to torch's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from canzona.updates.newton_schulz import DEFAULT_NS_EPS, newton_schulz
from canzona.updates.ns_schedules import DEFAULT_NS_COEFFICIENTS, NSCoefficients

__all__ = ["ADJUST_LR_FNS", "muon_apply_", "muon_direction", "muon_lr", "muon_prepare_"]

#: The learning-rate scale modes :func:`muon_lr` accepts (besides ``None``, = ``"original"``).
ADJUST_LR_FNS: tuple[str, ...] = ("original", "match_rms_adamw", "spectral", "unit_rms", "none")


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
    coefficients: NSCoefficients = DEFAULT_NS_COEFFICIENTS,
    steps: int | None = None,
    eps: float = DEFAULT_NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Orthogonalise the blended momentum of full matrices ``(..., m, n)`` (:func:`newton_schulz`).

    Args:
        blended: Output of :func:`muon_prepare_`, gathered into full matrices.
        coefficients: The optimizer's ``ns_coefficients``: a triple ``(a, b, c)``, a sequence of
            per-iteration triples, or a registered name (``"quintic"``, ``"polar_express"``,
            ...); a name brings its own input-norm margin.
        steps: The optimizer's ``ns_steps``; ``None`` lets the coefficients decide (5 for a
            triple, the schedule's length otherwise).
        eps: Norm clamp.
        dtype: Iteration dtype (bf16 reproduces torch).

    Returns:
        The direction, dtype ``dtype``, shape of ``blended``.
    """
    return newton_schulz(blended, coefficients=coefficients, steps=steps, eps=eps, dtype=dtype)


def _lr_ratio(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """The shape factor of each mode; ``m`` rows (fan-out), ``n`` columns (fan-in)."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr_fn == "spectral":
        return math.sqrt(m / n)
    if adjust_lr_fn == "unit_rms":
        return math.sqrt(max(m, n))
    if adjust_lr_fn == "none":
        return 1.0
    raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def muon_lr(
    lr: float | Tensor, adjust_lr_fn: str | None, shape: Sequence[int], *, scale: float = 1.0
) -> float | Tensor:
    r"""The learning rate of one matrix: ``lr`` times a shape factor times ``scale``.

    With ``(m, n)`` the last two dims of the full matrix (rows = fan-out, columns = fan-in of
    a ``y = x W^T`` weight). For a semi-orthogonal :math:`O` (every singular value 1, what
    Newton–Schulz approximates) the entries have RMS :math:`1/\sqrt{\max(m, n)}`:

    * ``None`` or ``"original"``: :math:`\sqrt{\max(1, m/n)}`, torch's and the original Muon's;
    * ``"match_rms_adamw"``: :math:`0.2\sqrt{\max(m, n)}`, entry RMS 0.2, AdamW's typical update
      RMS ("Muon is Scalable for LLM Training", arXiv 2502.16982);
    * ``"spectral"``: :math:`\sqrt{m/n}`, spectral norm :math:`\sqrt{m/n}` (= unit RMS→RMS
      operator norm), the spectral scaling of "A Spectral Condition for Feature Learning"
      (arXiv 2310.17813) and of Scion's hidden layers ("Training Deep Learning Models with
      Norm-Constrained LMOs", arXiv 2502.07529); unlike ``"original"`` it shrinks wide matrices;
    * ``"unit_rms"``: :math:`\sqrt{\max(m, n)}`, entry RMS 1;
    * ``"none"``: 1, for a direction that carries its own scale (NorMuon's RMS matching).

    The result is ``lr * factor * scale``; with ``scale == 1`` it is bitwise what
    ``torch.optim.Muon`` computes for ``None``, ``"original"`` and ``"match_rms_adamw"``
    (torch reads the first two dims; the same for 2-D parameters).

    Args:
        lr: Learning rate of the param group (a 0-dim tensor gives a tensor computed in its
            dtype, as torch's).
        adjust_lr_fn: One of :data:`ADJUST_LR_FNS` or ``None``.
        shape: Shape of the full (unsharded) matrix.
        scale: Free multiplicative factor, positive and finite (0.2 with ``"unit_rms"`` gives
            the factor of ``"match_rms_adamw"``).

    Returns:
        The adjusted learning rate.

    Raises:
        ValueError: On an unknown ``adjust_lr_fn``, a shape with fewer than two dims or a
            ``scale`` that is not positive and finite.
    """
    if len(shape) < 2:
        raise ValueError(f"muon_lr needs a matrix shape, got {tuple(shape)!r}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be positive and finite, got {scale!r}")
    m, n = int(shape[-2]), int(shape[-1])
    return lr * _lr_ratio(adjust_lr_fn, m, n) * scale


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
