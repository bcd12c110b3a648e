"""SOAP (Adam in Shampoo's eigenbasis) on full matrices ``(..., m, n)``, as in the reference.

The semantics are those of the authors' reference ``soap.py`` (Vyas et al. 2024) on 2-D
parameters, with these differences:

* a leading batch is a stack of independent matrices (the reference would treat a 3-D tensor as
  one tensor with three factors); ``merge_dims``, ``precondition_1d`` and ``data_format`` are not
  offered;
* the first moment, which lives in the eigenbasis, is re-expressed only when a basis changes; the
  reference projects it back and forth at every call (equal in exact arithmetic, and it saves
  four matmuls per call);
* the eigenvalue estimate of a refresh is the column sums of ``Q * (L Q)`` (the reference takes
  ``diag(Q^T L Q)``) and the sort is stable (the reference's is not: only ties differ);
* all arithmetic is in the state's dtype (float32 by default) and gradients are cast to it (the
  reference keeps moments in the gradient's dtype and statistics in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from canzona.defaults import SOAP_DEFAULTS
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
    "SOAPHParams",
    "soap_apply_",
    "soap_direction",
    "soap_init",
    "soap_step_size",
]

_SIDES = ("left", "right")
# Shift of the first eigendecomposition and floor of the normalisation, as in the reference.
_EIGH_SHIFT = 1e-30
_NORM_FLOOR = 1e-30


@dataclass(frozen=True, kw_only=True, slots=True)
class SOAPHParams:
    """Hyper-parameters of the SOAP direction (learning rate and weight decay live in apply).

    Attributes:
        betas: Adam's ``(beta1, beta2)`` in the eigenbasis.
        shampoo_beta: EMA coefficient of the statistics ``L, R``; a negative value means ``beta2``.
        eps: Adam's denominator term.
        precondition_frequency: Internal steps between two refreshes of the eigenbases.
        max_precond_dim: A side longer than this keeps the identity basis (no statistic).
        normalize_grads: Scale each projected-back direction to unit RMS.
        correct_bias: Fold Adam's bias corrections into the step size.
    """

    betas: tuple[float, float] = SOAP_DEFAULTS.betas
    shampoo_beta: float = SOAP_DEFAULTS.shampoo_beta
    eps: float = SOAP_DEFAULTS.eps
    precondition_frequency: int = SOAP_DEFAULTS.precondition_frequency
    max_precond_dim: int = SOAP_DEFAULTS.max_precond_dim
    normalize_grads: bool = SOAP_DEFAULTS.normalize_grads
    correct_bias: bool = SOAP_DEFAULTS.correct_bias

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ValueError(f"betas must be (beta1, beta2), got {self.betas!r}")
        check_beta("betas[0]", self.betas[0])
        check_beta("betas[1]", self.betas[1])
        if self.shampoo_beta >= 0:
            check_beta("shampoo_beta", self.shampoo_beta)
        check_positive("eps", self.eps)
        if self.precondition_frequency < 1:
            raise ValueError(
                f"precondition_frequency must be >= 1, got {self.precondition_frequency!r}"
            )
        if self.max_precond_dim < 0:
            raise ValueError(f"max_precond_dim must be >= 0, got {self.max_precond_dim!r}")

    @property
    def statistics_beta(self) -> float:
        """The EMA coefficient actually used for ``L`` and ``R``."""
        return self.shampoo_beta if self.shampoo_beta >= 0 else self.betas[1]


def soap_init(
    shape: tuple[int, ...] | torch.Size,
    hp: SOAPHParams,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> State:
    """Allocate the state of one matrix (or a stack) of ``shape`` ``(..., m, n)``.

    Keys, all present from the start and unchanged afterwards: ``exp_avg`` and ``exp_avg_sq``
    (shape; both expressed in the eigenbasis), ``gg_left`` and ``q_left`` (``(..., m, m)``, if
    ``m <= max_precond_dim``), ``gg_right`` and ``q_right`` (``(..., n, n)``, if
    ``n <= max_precond_dim``). Statistics start at zero and bases at the identity; step 1
    overwrites the bases.

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
    state: State = {
        "exp_avg": torch.zeros((*batch, m, n), dtype=dtype, device=dev),
        "exp_avg_sq": torch.zeros((*batch, m, n), dtype=dtype, device=dev),
    }
    for side, size in zip(_SIDES, (m, n), strict=True):
        if size <= hp.max_precond_dim:
            state[f"gg_{side}"] = torch.zeros((*batch, size, size), dtype=dtype, device=dev)
            state[f"q_{side}"] = eye_like(batch, size, dtype=dtype, device=dev)
    return state


def _project(x: Tensor, state: State) -> Tensor:
    """Into the eigenbasis: ``Q_L^T x Q_R``."""
    if "q_left" in state:
        x = state["q_left"].mT @ x
    if "q_right" in state:
        x = x @ state["q_right"]
    return x


def _project_back(x: Tensor, state: State) -> Tensor:
    """Back to the parameter's coordinates: ``Q_L x Q_R^T``."""
    if "q_left" in state:
        x = state["q_left"] @ x
    if "q_right" in state:
        x = x @ state["q_right"].mT
    return x


def _accumulate(g: Tensor, state: State, beta: float) -> None:
    """``L <- lerp(L, G G^T, 1 - beta)`` and ``R <- lerp(R, G^T G, 1 - beta)``."""
    if "gg_left" in state:
        state["gg_left"].lerp_(g @ g.mT, 1 - beta)
    if "gg_right" in state:
        state["gg_right"].lerp_(g.mT @ g, 1 - beta)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Decompositions run in at least float32 (the reference promotes half types)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _eigenbasis(gg: Tensor) -> Tensor:
    """Eigenvectors of ``gg + 1e-30 I``, by decreasing eigenvalue (the reference's first basis)."""
    work = gg.to(_work_dtype(gg.dtype))
    eye = torch.eye(work.size(-1), dtype=work.dtype, device=work.device)
    try:
        vectors = torch.linalg.eigh(work + _EIGH_SHIFT * eye)[1]
    except RuntimeError:  # the reference retries a failed decomposition in float64
        wide = work.to(torch.float64)
        vectors = torch.linalg.eigh(wide + _EIGH_SHIFT * eye.to(torch.float64))[1]
    flipped: Tensor = vectors.flip(-1)
    return flipped.to(gg.dtype)


def _refresh_bases(state: State) -> None:
    """One power iteration and a QR per side, re-sorting each basis (and ``exp_avg_sq``).

    The columns of ``Q`` are ordered by decreasing estimated eigenvalue ``diag(Q^T L Q)``
    (stable sort), ``exp_avg_sq`` is permuted along that side to follow them, and ``Q`` becomes
    the orthogonal factor of ``L Q``.
    """
    exp_avg_sq = state["exp_avg_sq"]
    for dim, side in ((-2, "left"), (-1, "right")):
        if f"q_{side}" not in state:
            continue
        q = state[f"q_{side}"]
        work = _work_dtype(q.dtype)
        gg, basis = state[f"gg_{side}"].to(work), q.to(work)
        power = gg @ basis
        estimate = (basis * power).sum(dim=-2)
        order = torch.argsort(estimate, dim=-1, descending=True, stable=True)
        index = order.unsqueeze(-1) if dim == -2 else order.unsqueeze(-2)
        exp_avg_sq.copy_(torch.take_along_dim(exp_avg_sq, index, dim=dim))
        power = torch.take_along_dim(power, order.unsqueeze(-2), dim=-1)
        q.copy_(torch.linalg.qr(power)[0])


def soap_direction(grad: Tensor, state: State, step: int, hp: SOAPHParams) -> Tensor:
    r"""Owner-side SOAP direction of full matrices ``(..., m, n)``; updates ``state`` in place.

    Step 1 sets :math:`L = (1-\beta_s) G G^\top`, :math:`R = (1-\beta_s) G^\top G` and the bases
    :math:`Q_L, Q_R` to their eigenvectors (by decreasing eigenvalue) and returns zeros: the
    reference makes no update on its first call. From step 2 on, with :math:`t` = ``step - 1``:

    * :math:`\tilde G = Q_L^\top G Q_R`; :math:`m \leftarrow \beta_1 m + (1-\beta_1)\tilde G`,
      :math:`v \leftarrow \beta_2 v + (1-\beta_2)\tilde G^2` (both in the eigenbasis);
    * direction :math:`N = Q_L \, (m / (\sqrt v + \epsilon)) \, Q_R^\top`, divided by
      :math:`10^{-30} + \mathrm{RMS}(N)` per matrix when ``normalize_grads``;
    * then the state moves on: :math:`L, R` take the current :math:`G`; when :math:`t` is a
      multiple of ``precondition_frequency`` the bases are refreshed (one power iteration + QR,
      re-sorted, :math:`v` permuted to follow) and :math:`m` is re-expressed in the new bases.

    A zero gradient gives a zero (finite) direction. See the module docstring for the
    differences from the reference.

    Args:
        grad: Full gradient ``(..., m, n)``; cast to the state's dtype.
        state: Output of :func:`soap_init` for this shape and ``hp``.
        step: 1-based count of calls for this matrix.
        hp: Hyper-parameters.

    Returns:
        The direction, in the state's dtype; the parameter moves by ``-soap_step_size`` times it.
    """
    check_step(step)
    g = grad.to(state_dtype(state, torch.float32))
    if step == 1:
        _accumulate(g, state, hp.statistics_beta)
        for side in _SIDES:
            if f"q_{side}" in state:
                state[f"q_{side}"].copy_(_eigenbasis(state[f"gg_{side}"]))
        return torch.zeros_like(g)

    beta1, beta2 = hp.betas
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    projected = _project(g, state)
    exp_avg.mul_(beta1).add_(projected, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).add_(projected.square(), alpha=1 - beta2)
    direction = _project_back(exp_avg / exp_avg_sq.sqrt().add_(hp.eps), state)
    if hp.normalize_grads:
        rms = direction.square().mean(dim=(-2, -1), keepdim=True).sqrt()
        direction = direction / (rms + _NORM_FLOOR)

    _accumulate(g, state, hp.statistics_beta)
    if (step - 1) % hp.precondition_frequency == 0:
        unprojected = _project_back(exp_avg, state)
        _refresh_bases(state)
        exp_avg.copy_(_project(unprojected, state))
    return direction


def soap_step_size(lr: float | Tensor, step: int, hp: SOAPHParams) -> float:
    """Step size of call ``step``: 0 on step 1, else ``lr`` with Adam's bias corrections folded in.

    With ``t = step - 1``: ``lr * sqrt(1 - beta2^t) / (1 - beta1^t)`` when ``correct_bias``,
    else ``lr``.

    Args:
        lr: Learning rate.
        step: 1-based count of calls for this matrix.
        hp: Hyper-parameters.

    Returns:
        The step size.
    """
    check_step(step)
    if step == 1:
        return 0.0
    if not hp.correct_bias:
        return float(lr)
    t = step - 1
    beta1, beta2 = hp.betas
    return float(lr * (1.0 - beta2**t) ** 0.5 / (1.0 - beta1**t))


def soap_apply_(
    param: Tensor, direction: Tensor, *, lr: float, weight_decay: float, step: int, hp: SOAPHParams
) -> None:
    """The step, then the reference's weight decay ``p <- p - lr * wd * p``. Element-wise.

    Nothing happens on step 1.

    Args:
        param: Parameter (or shard), updated in place.
        direction: Matching direction (or shard) from :func:`soap_direction`.
        lr: Learning rate.
        weight_decay: Weight decay coefficient (applied after the step, scaled by ``lr``).
        step: 1-based count of calls for this matrix.
        hp: Hyper-parameters.
    """
    if step == 1:
        return
    param.add_(direction, alpha=-soap_step_size(lr, step, hp))
    if weight_decay > 0:
        param.add_(param, alpha=-lr * weight_decay)
