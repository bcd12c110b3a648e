"""canzona.SOAP: Adam in Shampoo's eigenbasis (Vyas et al. 2024), on owner ranks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from torch import Tensor

from canzona.defaults import ADAMW_DEFAULTS, SOAP_DEFAULTS
from canzona.optim.adamw_route import lr_value
from canzona.optim.owned import OwnerStateOptimizer
from canzona.plan import PlanConfig
from canzona.runtime import ApplyBatch, PipelineConfig
from canzona.updates import SOAPHParams, soap_direction, soap_init
from canzona.updates.batched import soap_apply_batch_


def _hparams(group: dict[str, Any]) -> SOAPHParams:
    return SOAPHParams(
        betas=tuple(group["betas"]),
        shampoo_beta=group["shampoo_beta"],
        eps=group["eps"],
        precondition_frequency=group["precondition_frequency"],
        max_precond_dim=group["max_precond_dim"],
        normalize_grads=group["normalize_grads"],
        correct_bias=group["correct_bias"],
    )


class SOAP(OwnerStateOptimizer):
    r"""SOAP: Adam run in the eigenbasis of Shampoo's preconditioner; one owner per matrix.

    Follows the reference implementation (nikhilvyas/SOAP) for 2-D parameters and
    stacks of them: statistics :math:`L \leftarrow \beta_s L + (1-\beta_s) GG^\top`,
    :math:`R \leftarrow \beta_s R + (1-\beta_s) G^\top G`; eigenbases :math:`Q_L, Q_R`
    from ``eigh`` on the first step (which makes no update) and refreshed every
    ``precondition_frequency`` steps by one power iteration and QR; Adam moments of
    :math:`Q_L^\top G Q_R`; the update projected back,
    :math:`\theta \leftarrow \theta - \eta_t Q_L (m / (\sqrt{v} + \epsilon)) Q_R^\top`
    with :math:`\eta_t = \gamma\sqrt{1-\beta_2^t}/(1-\beta_1^t)`, then
    :math:`\theta \leftarrow \theta - \gamma\lambda\theta`.
    All state lives on the owner rank; only the gradient and the direction travel.

    Args:
        params: Parameters, named parameters or param groups.
        lr: Learning rate :math:`\gamma`.
        betas: Adam's :math:`(\beta_1, \beta_2)`.
        shampoo_beta: :math:`\beta_s` of the statistics (negative: use :math:`\beta_2`).
        eps: Adam's epsilon.
        weight_decay: Weight decay :math:`\lambda` (applied after the step).
        precondition_frequency: Steps between eigenbasis refreshes.
        max_precond_dim: Longest side with a non-identity basis.
        normalize_grads: Normalise each direction to unit RMS.
        correct_bias: Fold Adam's bias corrections into the step size.
        adamw_betas: AdamW betas for ``algorithm="adamw"`` groups.
        adamw_eps: AdamW epsilon for ``algorithm="adamw"`` groups.
        plan: Owner assignment and micro-group configuration.
        pipeline: Gather/compute/scatter pipeline configuration.
    """

    algorithm = "soap"
    cost_model = "soap"
    storage_keys = ()
    init_fn = staticmethod(soap_init)
    direction_fn = staticmethod(soap_direction)

    def _state_shape(self, group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        return (("max_precond_dim", group["max_precond_dim"]),)  # a side's factors, or none

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = SOAP_DEFAULTS.lr,
        betas: tuple[float, float] = SOAP_DEFAULTS.betas,
        shampoo_beta: float = SOAP_DEFAULTS.shampoo_beta,
        eps: float = SOAP_DEFAULTS.eps,
        weight_decay: float = SOAP_DEFAULTS.weight_decay,
        precondition_frequency: int = SOAP_DEFAULTS.precondition_frequency,
        max_precond_dim: int = SOAP_DEFAULTS.max_precond_dim,
        normalize_grads: bool = SOAP_DEFAULTS.normalize_grads,
        correct_bias: bool = SOAP_DEFAULTS.correct_bias,
        *,
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS.betas,
        adamw_eps: float = ADAMW_DEFAULTS.eps,
        plan: PlanConfig | None = None,
        pipeline: PipelineConfig | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "max_precond_dim": max_precond_dim,
            "normalize_grads": normalize_grads,
            "correct_bias": correct_bias,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
        }
        super().__init__(params, defaults, plan=plan, pipeline=pipeline)

    def hparams(self, group: dict[str, Any]) -> Any:
        """The hyper-parameters of a param group."""
        return _hparams(group)

    def _calibration_phases(self, group: dict[str, Any]) -> tuple[tuple[str, float], ...]:
        f = group["precondition_frequency"]  # the bases are refreshed every f steps
        return (("refresh", 1.0),) if f == 1 else (("refresh", 1 / f), ("plain", 1 - 1 / f))

    def _probe_hparams(self, hp: Any) -> Any:
        # the bases refreshed at every step: the probe meets every kernel
        return replace(hp, precondition_frequency=1)

    def _stacks_step(self, step: int, hp: Any) -> bool:
        # the first step's eigendecomposition is retried in float64 where it fails: for the
        # failing matrix alone in a loop, for the whole stack in one call
        return step > 1

    def _calibration_step(self, phase: str, hp: Any) -> int:
        frequency: int = hp.precondition_frequency
        return frequency + 1 if phase == "refresh" else 2

    def _cost_params(self, group: dict[str, Any]) -> dict[str, Any]:
        return {
            "precondition_frequency": group["precondition_frequency"],
            "max_precond_dim": group["max_precond_dim"],
        }

    def _apply_batch(self, batch: ApplyBatch) -> None:
        hp = batch.hparams
        by_step: dict[int, list[int]] = {}
        for k, p in enumerate(batch.params):
            by_step.setdefault(int(self.state[self._step_params[p]]["step"]), []).append(k)
        for step, ks in by_step.items():
            soap_apply_batch_(
                [batch.targets[k] for k in ks],
                [batch.directions[k] for k in ks],
                lr=lr_value(hp["lr"]),
                weight_decay=hp["weight_decay"],
                step=step,
                hp=_hparams(dict(hp)),
            )
