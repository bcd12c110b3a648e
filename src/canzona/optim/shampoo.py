"""canzona.Shampoo: Kronecker-factored preconditioning with Adam grafting, on owner ranks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from canzona.defaults import ADAMW_DEFAULTS, SHAMPOO_DEFAULTS
from canzona.optim.adamw_route import lr_value
from canzona.optim.owned import OwnerStateOptimizer
from canzona.plan import PlanConfig
from canzona.runtime import ApplyBatch, PipelineConfig
from canzona.updates import ShampooHParams, shampoo_direction, shampoo_init
from canzona.updates.batched import decay_and_step_


def _hparams(group: dict[str, Any]) -> ShampooHParams:
    return ShampooHParams(
        betas=tuple(group["betas"]),
        epsilon=group["epsilon"],
        precondition_frequency=group["precondition_frequency"],
        start_preconditioning_step=group["start_preconditioning_step"],
        max_precond_dim=group["max_precond_dim"],
        grafting=group["grafting"],
        grafting_beta2=group["grafting_beta2"],
        grafting_epsilon=group["grafting_epsilon"],
        root_dtype=group["root_dtype"],
        bias_correction=group["bias_correction"],
    )


class Shampoo(OwnerStateOptimizer):
    r"""Shampoo (Gupta et al. 2018) with Adam grafting; every matrix on one owner rank.

    .. math::
        \begin{aligned}
            & L_t \leftarrow \beta_2 L_{t-1} + (1-\beta_2) G_t G_t^\top, \quad
              R_t \leftarrow \beta_2 R_{t-1} + (1-\beta_2) G_t^\top G_t \\
            & M_t \leftarrow \beta_1 M_{t-1} + (1-\beta_1) G_t, \quad
              \hat M_t = M_t / (1-\beta_1^t) \\
            & P_t = \hat L^{-1/4} \hat M_t \hat R^{-1/4}
              \quad\text{(roots refreshed at step } s \text{, then at multiples of } f\text{)} \\
            & D_t = \hat M_t / (\sqrt{\hat v_t} + \epsilon_g), \quad
              v_t \leftarrow \beta_g v_{t-1} + (1-\beta_g) G_t^2 \\
            & \theta_t \leftarrow (1 - \gamma\lambda)\theta_{t-1}
              - \gamma\, P_t \,\|D_t\|_F / \|P_t\|_F
        \end{aligned}

    All state lives on the matrix's owner rank; only the gradient travels to it and
    only the direction travels back. Sides longer than ``max_precond_dim`` are not
    preconditioned. See ``docs/optimizers.md`` for every detail.

    Args:
        params: Parameters, named parameters or param groups (``algorithm="adamw"``
            groups use AdamW with ``adamw_betas``/``adamw_eps``).
        lr: Learning rate :math:`\gamma`.
        betas: :math:`(\beta_1, \beta_2)`: gradient EMA (0 disables) and factor EMA
            (1 makes the factors running sums).
        epsilon: Added to the factors before their inverse roots.
        weight_decay: Decoupled weight decay :math:`\lambda`.
        precondition_frequency: Steps between inverse-root refreshes :math:`f`.
        start_preconditioning_step: First preconditioned step :math:`s`.
        max_precond_dim: Longest side that gets a factor.
        grafting: ``"adam"`` or ``"none"``.
        grafting_beta2: :math:`\beta_g` of the Adam grafting.
        grafting_epsilon: :math:`\epsilon_g` of the Adam grafting.
        root_dtype: Dtype of the eigendecompositions (float32 or float64).
        bias_correction: Bias-correct the EMAs.
        adamw_betas: AdamW betas for ``algorithm="adamw"`` groups.
        adamw_eps: AdamW epsilon for ``algorithm="adamw"`` groups.
        plan: Owner assignment and micro-group configuration.
        pipeline: Gather/compute/scatter pipeline configuration.
    """

    algorithm = "shampoo"
    cost_model = "shampoo"
    storage_keys = ()
    init_fn = staticmethod(shampoo_init)
    direction_fn = staticmethod(shampoo_direction)

    def _state_shape(self, group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        # a first moment only with betas[0] > 0, a grafting moment only with "adam", a
        # factor only for sides up to max_precond_dim
        return (
            ("betas[0] > 0", group["betas"][0] > 0),
            ("grafting", group["grafting"]),
            ("max_precond_dim", group["max_precond_dim"]),
        )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = SHAMPOO_DEFAULTS.lr,
        betas: tuple[float, float] = SHAMPOO_DEFAULTS.betas,
        epsilon: float = SHAMPOO_DEFAULTS.epsilon,
        weight_decay: float = SHAMPOO_DEFAULTS.weight_decay,
        precondition_frequency: int = SHAMPOO_DEFAULTS.precondition_frequency,
        start_preconditioning_step: int = SHAMPOO_DEFAULTS.start_preconditioning_step,
        max_precond_dim: int = SHAMPOO_DEFAULTS.max_precond_dim,
        grafting: str = SHAMPOO_DEFAULTS.grafting,
        *,
        grafting_beta2: float = SHAMPOO_DEFAULTS.grafting_beta2,
        grafting_epsilon: float = SHAMPOO_DEFAULTS.grafting_epsilon,
        root_dtype: torch.dtype = torch.float32,
        bias_correction: bool = SHAMPOO_DEFAULTS.bias_correction,
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS.betas,
        adamw_eps: float = ADAMW_DEFAULTS.eps,
        plan: PlanConfig | None = None,
        pipeline: PipelineConfig | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "epsilon": epsilon,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "max_precond_dim": max_precond_dim,
            "grafting": grafting,
            "grafting_beta2": grafting_beta2,
            "grafting_epsilon": grafting_epsilon,
            "root_dtype": root_dtype,
            "bias_correction": bias_correction,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
        }
        super().__init__(params, defaults, plan=plan, pipeline=pipeline)

    def hparams(self, group: dict[str, Any]) -> Any:
        """The hyper-parameters of a param group."""
        return _hparams(group)

    def _calibration_phases(self, group: dict[str, Any]) -> tuple[tuple[str, float], ...]:
        f = group["precondition_frequency"]  # the roots are refreshed every f steps
        return (("refresh", 1.0),) if f == 1 else (("refresh", 1 / f), ("plain", 1 - 1 / f))

    def _probe_hparams(self, hp: Any) -> Any:
        # roots from the first step on, refreshed at every step: the probe meets every kernel
        return replace(hp, precondition_frequency=1, start_preconditioning_step=1)

    def _calibration_step(self, phase: str, hp: Any) -> int:
        start: int = hp.start_preconditioning_step
        if phase == "refresh":
            return start
        return start + 1 if (start + 1) % hp.precondition_frequency else start + 2

    def _cost_params(self, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "precondition_frequency": group["precondition_frequency"],
            "max_precond_dim": group["max_precond_dim"],
        }

    def _apply_batch(self, batch: ApplyBatch) -> None:
        hp = batch.hparams
        lr = lr_value(hp["lr"])
        decay_and_step_(
            batch.targets,
            batch.directions,
            decay=float(1 - lr * hp["weight_decay"]),
            alpha=-float(lr),
        )
