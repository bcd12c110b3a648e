"""Shampoo with Adam grafting on full matrices ``(..., m, n)``: state, direction and apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from canzona.defaults import SHAMPOO_DEFAULTS
from canzona.updates.common import (
    State,
    check_beta,
    check_positive,
    check_step,
    eye_like,
    matrix_shape,
    state_dtype,
)

__all__ = [
    "ShampooHParams",
    "inverse_fourth_root",
    "shampoo_apply_",
    "shampoo_direction",
    "shampoo_init",
    "shampoo_refresh_due",
]

_ROOT_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShampooHParams:
    """Hyper-parameters of the Shampoo direction (the learning rate and weight decay live in apply).

    Attributes:
        betas: ``(beta1, beta2)``: EMA of the gradient (the filtered gradient; 0 disables it)
            and EMA of the Kronecker factors (1 makes them running sums).
        epsilon: Added to the factors' diagonal, and lower clamp of their eigenvalues.
        precondition_frequency: Steps between two refreshes of the inverse roots.
        start_preconditioning_step: First step that computes and uses the roots (at least 1).
        max_precond_dim: A side longer than this gets no factor (identity preconditioner).
        grafting: ``"adam"`` (Shampoo's direction rescaled to the norm of Adam's) or ``"none"``.
        grafting_beta2: EMA coefficient of the squared gradient of the Adam grafting.
        grafting_epsilon: Denominator term of the Adam grafting.
        root_dtype: Dtype of the eigendecomposition: ``torch.float32`` or ``torch.float64``.
        bias_correction: Divide the EMAs by ``1 - beta^t`` (the factors only when ``beta2 < 1``).
    """

    betas: tuple[float, float] = SHAMPOO_DEFAULTS.betas
    epsilon: float = SHAMPOO_DEFAULTS.epsilon
    precondition_frequency: int = SHAMPOO_DEFAULTS.precondition_frequency
    start_preconditioning_step: int = SHAMPOO_DEFAULTS.start_preconditioning_step
    max_precond_dim: int = SHAMPOO_DEFAULTS.max_precond_dim
    grafting: Literal["adam", "none"] = SHAMPOO_DEFAULTS.grafting
    grafting_beta2: float = SHAMPOO_DEFAULTS.grafting_beta2
    grafting_epsilon: float = SHAMPOO_DEFAULTS.grafting_epsilon
    root_dtype: torch.dtype = torch.float32
    bias_correction: bool = SHAMPOO_DEFAULTS.bias_correction

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ValueError(f"betas must be (beta1, beta2), got {self.betas!r}")
        check_beta("betas[0]", self.betas[0])
        check_beta("betas[1]", self.betas[1], allow_one=True)
        check_positive("epsilon", self.epsilon)
        if self.precondition_frequency < 1:
            raise ValueError(
                f"precondition_frequency must be >= 1, got {self.precondition_frequency!r}"
            )
        if self.start_preconditioning_step < 1:
            raise ValueError(
                f"start_preconditioning_step must be >= 1, got {self.start_preconditioning_step!r}"
            )
        if self.max_precond_dim < 0:
            raise ValueError(f"max_precond_dim must be >= 0, got {self.max_precond_dim!r}")
        if self.grafting not in ("adam", "none"):
            raise ValueError(f"grafting must be 'adam' or 'none', got {self.grafting!r}")
        check_beta("grafting_beta2", self.grafting_beta2)
        check_positive("grafting_epsilon", self.grafting_epsilon)
        if self.root_dtype not in _ROOT_DTYPES:
            raise ValueError(f"root_dtype must be float32 or float64, got {self.root_dtype!r}")


def shampoo_init(
    shape: tuple[int, ...] | torch.Size,
    hp: ShampooHParams,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> State:
    """Allocate the state of one matrix (or a stack) of ``shape`` ``(..., m, n)``.

    Keys, all present from the start and unchanged afterwards: ``exp_avg`` (shape, if
    ``beta1 > 0``), ``graft_exp_avg_sq`` (shape, if ``grafting == "adam"``), ``factor_left`` and
    ``inv_root_left`` (``(..., m, m)``, if ``m <= max_precond_dim``), ``factor_right`` and
    ``inv_root_right`` (``(..., n, n)``, if ``n <= max_precond_dim``). Moments and factors start
    at zero, the inverse roots at the identity (they are not read before the first refresh).

    Args:
        shape: Shape of the full matrix or stack.
        hp: Hyper-parameters.
        dtype: Dtype of every state tensor and of the direction's arithmetic.
        device: Device of the state.

    Returns:
        The state dict.
    """
    batch, m, n = matrix_shape(shape)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    full = (*batch, m, n)
    state: State = {}
    if hp.betas[0] > 0:
        state["exp_avg"] = torch.zeros(full, dtype=dtype, device=dev)
    if hp.grafting == "adam":
        state["graft_exp_avg_sq"] = torch.zeros(full, dtype=dtype, device=dev)
    for side, size in (("left", m), ("right", n)):
        if size <= hp.max_precond_dim:
            state[f"factor_{side}"] = torch.zeros((*batch, size, size), dtype=dtype, device=dev)
            state[f"inv_root_{side}"] = eye_like(batch, size, dtype=dtype, device=dev)
    return state


def shampoo_refresh_due(step: int, hp: ShampooHParams) -> bool:
    """Whether ``step`` recomputes the inverse roots.

    Args:
        step: 1-based count of this update.
        hp: Hyper-parameters.

    Returns:
        True at ``start_preconditioning_step`` and, after it, at every multiple of
        ``precondition_frequency`` (Distributed Shampoo's schedule).
    """
    start = hp.start_preconditioning_step
    return step == start or (step > start and step % hp.precondition_frequency == 0)


def inverse_fourth_root(
    factor: Tensor, *, epsilon: float, scale: float = 1.0, root_dtype: torch.dtype = torch.float32
) -> Tensor:
    r"""Inverse 4th root of symmetric PSD matrices ``(..., k, k)`` by eigendecomposition.

    With :math:`A = F / s + \epsilon I` in ``root_dtype`` and :math:`A = Q \Lambda Q^\top`
    (``torch.linalg.eigh``, which reads the lower triangle), returns
    :math:`Q \max(\Lambda, \epsilon)^{-1/4} Q^\top`. In exact arithmetic every eigenvalue is
    already at least :math:`\epsilon`; the clamp only removes round-off below it (negative
    eigenvalues of a rank-deficient factor), so a zero factor maps to :math:`\epsilon^{-1/4} I`.
    A stack's powers are taken a matrix at a time (each matrix's root equals its own alone).

    Args:
        factor: Kronecker factors.
        epsilon: Diagonal shift and eigenvalue floor.
        scale: Divisor :math:`s` of the factor (the bias correction).
        root_dtype: Dtype of the decomposition.

    Returns:
        The roots, in ``factor``'s dtype.
    """
    work = factor.to(root_dtype)
    if scale != 1.0:
        work = work / scale
    eye = torch.eye(work.size(-1), dtype=root_dtype, device=work.device)
    eigenvalues, eigenvectors = torch.linalg.eigh(work + epsilon * eye)
    clamped = eigenvalues.clamp_min(epsilon)
    if clamped.dim() > 1:  # a matrix at a time: a vectorised pow rounds an element by where
        # it falls in the tensor, and a stack must equal its matrices alone
        rows = clamped.reshape(-1, clamped.size(-1)).unbind(0)
        powers = torch.stack([r.clone().pow(-0.25) for r in rows]).view(clamped.shape)
    else:
        powers = clamped.pow(-0.25)
    root: Tensor = (eigenvectors * powers.unsqueeze(-2)) @ eigenvectors.mT
    return root.to(factor.dtype)


def shampoo_direction(grad: Tensor, state: State, step: int, hp: ShampooHParams) -> Tensor:
    r"""Owner-side Shampoo direction of full matrices ``(..., m, n)``; updates ``state`` in place.

    With :math:`t` = ``step`` and :math:`G` the gradient in the state's dtype:

    * factors :math:`L \leftarrow \beta_2 L + (1-\beta_2) G G^\top`,
      :math:`R \leftarrow \beta_2 R + (1-\beta_2) G^\top G` (plain sums when :math:`\beta_2 = 1`);
    * at refresh steps (:func:`shampoo_refresh_due`) the inverse roots
      :math:`\hat L^{-1/4}, \hat R^{-1/4}` with :math:`\hat L = L / (1-\beta_2^t)` (see
      :func:`inverse_fourth_root`);
    * filtered gradient :math:`M = m / (1-\beta_1^t)` with :math:`m \leftarrow \beta_1 m +
      (1-\beta_1) G` (:math:`M = G` when :math:`\beta_1 = 0`);
    * Adam grafting :math:`D = M / (\sqrt{v / (1-\beta_{2g}^t)} + \epsilon_g)` with
      :math:`v \leftarrow \beta_{2g} v + (1-\beta_{2g}) G^2`;
    * from ``start_preconditioning_step`` on, :math:`P = \hat L^{-1/4} M \hat R^{-1/4}` (identity
      for a side without factor), rescaled per matrix to :math:`P \|D\|_F / \max(\|P\|_F,
      \text{tiny})` with Adam grafting; before, :math:`D` (Adam grafting) or :math:`M` (none).

    Bias corrections apply only when ``hp.bias_correction``. A zero gradient gives a zero
    (finite) direction. The result never aliases ``grad`` or the state.

    Args:
        grad: Full gradient ``(..., m, n)``; cast to the state's dtype.
        state: Output of :func:`shampoo_init` for this shape and ``hp``.
        step: 1-based count of this update (incremented by the caller before the call).
        hp: Hyper-parameters.

    Returns:
        The direction, in the state's dtype; the parameter moves by ``-lr`` times it.
    """
    check_step(step)
    dtype = state_dtype(state, grad.dtype if grad.is_floating_point() else torch.float32)
    g = grad.to(dtype)
    beta1, beta2 = hp.betas

    if beta1 > 0:
        exp_avg = state["exp_avg"]
        exp_avg.lerp_(g, 1 - beta1)
        filtered = exp_avg.div(1 - beta1**step if hp.bias_correction else 1.0)
    else:
        filtered = g

    refresh = shampoo_refresh_due(step, hp)
    scale = 1 - beta2**step if hp.bias_correction and beta2 < 1 else 1.0
    for side in ("left", "right"):
        factor = state.get(f"factor_{side}")
        if factor is None:
            continue
        gram = g @ g.mT if side == "left" else g.mT @ g
        if beta2 == 1:
            factor.add_(gram)
        else:
            factor.mul_(beta2).add_(gram, alpha=1 - beta2)
        if refresh:
            root = inverse_fourth_root(
                factor, epsilon=hp.epsilon, scale=scale, root_dtype=hp.root_dtype
            )
            state[f"inv_root_{side}"].copy_(root)

    graft: Tensor | None = None
    if hp.grafting == "adam":
        beta2g = hp.grafting_beta2
        exp_avg_sq = state["graft_exp_avg_sq"]
        exp_avg_sq.mul_(beta2g).addcmul_(g, g, value=1 - beta2g)
        corrected = exp_avg_sq.div(1 - beta2g**step if hp.bias_correction else 1.0)
        graft = filtered / corrected.sqrt_().add_(hp.grafting_epsilon)

    if step < hp.start_preconditioning_step:
        if graft is not None:
            return graft
        return filtered.clone() if filtered is grad else filtered

    precond = filtered
    if "inv_root_left" in state:
        precond = state["inv_root_left"] @ precond
    if "inv_root_right" in state:
        precond = precond @ state["inv_root_right"]
    if graft is not None:
        tiny = torch.finfo(precond.dtype).tiny
        precond_norm = torch.linalg.vector_norm(precond, dim=(-2, -1), keepdim=True)
        graft_norm = torch.linalg.vector_norm(graft, dim=(-2, -1), keepdim=True)
        precond = precond * (graft_norm / precond_norm.clamp_min(tiny))
    return precond.clone() if precond is grad else precond


def shampoo_apply_(param: Tensor, direction: Tensor, *, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay, then the step. Element-wise, so it runs on a shard.

    ``param.mul_(1 - lr * weight_decay)`` then ``param.add_(direction, alpha=-lr)``.

    Args:
        param: Parameter (or shard), updated in place.
        direction: Matching direction (or shard) from :func:`shampoo_direction`.
        lr: Learning rate.
        weight_decay: Decoupled weight decay coefficient.
    """
    param.mul_(1 - lr * weight_decay)
    param.add_(direction, alpha=-lr)
