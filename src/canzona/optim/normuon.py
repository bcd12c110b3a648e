"""canzona.NorMuon: Muon with a per-row second-moment normalisation, its state on owner ranks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from canzona.defaults import ADAMW_DEFAULTS, NORMUON_DEFAULTS
from canzona.optim.adamw_route import lr_value
from canzona.optim.muon import Muon, as_tuples, check_positive_finite
from canzona.plan import PlanConfig
from canzona.plan.cost import NORMUON_ELEMENTWISE
from canzona.runtime import ApplyBatch, ComputeBatch, Item, PipelineConfig, local_tensor
from canzona.updates import (
    DEFAULT_NS_COEFFICIENTS,
    NorMuonHParams,
    NSCoefficients,
    muon_lr,
    normuon_direction,
    normuon_init,
)
from canzona.updates.batched import decay_and_step_
from canzona.updates.stacked import stack_states, unstack_states_

_KEY = "second_momentum_buffer"


def _hparams(group: dict[str, Any]) -> NorMuonHParams:
    """NorMuon's hyper-parameters of a param group (validated, naming the offending value)."""
    check_positive_finite("normuon_eps", group["normuon_eps"])
    return NorMuonHParams(
        beta2=group["beta2"], eps=group["normuon_eps"], rescale=group["rescale"], rms=group["rms"]
    )


class NorMuon(Muon):
    r"""NorMuon (arXiv 2510.05491): Muon, then a per-row second-moment normalisation.

    Muon's momentum stays in the storage layout (per shard); the orthogonalisation, the
    per-row (output neuron) second moment :math:`v` and the normalisation run on the
    matrix's owner rank, on the full matrix, where :math:`v` lives (owner-held state like
    Shampoo's factors: checkpointed, resharded and moved to new owners like it). On any
    mesh the parameters are bit for bit those of one device.

    .. math::
        \begin{aligned}
            & B_t \leftarrow \mu B_{t-1} + (1-\mu) g_t, \quad
              \widetilde B_t \leftarrow g_t + \mu (B_t - g_t)
              \ \text{(Nesterov)} \ \text{or}\ B_t \quad\text{(per shard)} \\
            & O_t \leftarrow \mathrm{NS}^{(a_i,b_i,c_i)_{i=1}^{k}}(\widetilde B_t)
              \quad\text{(owner rank, full matrix)} \\
            & v_t \leftarrow \beta_2 v_{t-1} + (1-\beta_2)\,
              \mathrm{mean}_{\text{cols}}(O_t \odot O_t), \quad
              \hat O_t = O_t \oslash (\sqrt{v_t} + \epsilon) \quad\text{(owner rank)} \\
            & D_t = \frac{s_t}{\max(\|\hat O_t\|_F, \epsilon)}\,\hat O_t, \quad
              s_t = \rho\sqrt{mn}\ (\texttt{"rms"})\ \text{or}\ \|O_t\|_F
              \ (\texttt{"preserve\_norm"}) \\
            & \theta_t \leftarrow (1 - \gamma\lambda)\,\theta_{t-1}
              - \gamma\,\sigma\,\mathrm{AdjustLR}(m, n)\, D_t \quad\text{(per shard)}
        \end{aligned}

    With the defaults (``rescale="rms"``, ``rms=0.2``, ``adjust_lr_fn="none"``) this is
    Algorithm 1 of the paper: each step has entry RMS :math:`0.2\gamma`, AdamW's scale.
    ``rescale="preserve_norm"`` with ``adjust_lr_fn="original"`` is the authors' reference
    code, whose steps have Muon's size (Muon's learning rates carry over).

    Args:
        params: Parameters, named parameters or param groups (``algorithm="adamw"`` groups
            use AdamW with ``adamw_betas``/``adamw_eps``).
        lr: Learning rate :math:`\gamma` (float or 1-element tensor).
        weight_decay: Decoupled weight decay :math:`\lambda`.
        momentum: Momentum :math:`\mu`.
        nesterov: Use the Nesterov blend.
        ns_coefficients: As :class:`Muon`: a triple, per-iteration triples or a name.
        eps: Clamp of the Frobenius norm in Newton–Schulz (:class:`Muon`'s ``eps``).
        ns_steps: As :class:`Muon` (``None``: 5 for a triple, else the schedule's length).
        adjust_lr_fn: As :class:`Muon`; ``"none"`` by default (the direction carries its
            own size).
        beta2: EMA coefficient :math:`\beta_2` of the per-row second moment, in ``[0, 1)``.
        normuon_eps: :math:`\epsilon` added to :math:`\sqrt{v}` and floor of
            :math:`\|\hat O\|_F` (the authors' code's ``1e-10``).
        rescale: ``"rms"`` (:math:`s_t = \rho\sqrt{mn}`) or ``"preserve_norm"``
            (:math:`s_t = \|O_t\|_F`).
        rms: Target entry RMS :math:`\rho` of ``"rms"``.
        scale: Free factor :math:`\sigma > 0` of the adjusted learning rate.
        adamw_betas: AdamW betas for ``algorithm="adamw"`` groups.
        adamw_eps: AdamW epsilon for ``algorithm="adamw"`` groups.
        ns_dtype: Dtype of the Newton–Schulz iteration; the normalisation runs in the
            state's dtype (float32, or float64 for float64 parameters).
        plan: Owner assignment and micro-group configuration.
        pipeline: Gather/compute/scatter pipeline configuration.

    Raises:
        ValueError: Naming the value, for every error :class:`Muon` raises, a ``beta2``
            outside ``[0, 1)``, a ``normuon_eps`` or ``rms`` that is not positive and
            finite, and an unknown ``rescale``.
    """

    algorithm = "normuon"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = NORMUON_DEFAULTS.lr,
        weight_decay: float = NORMUON_DEFAULTS.weight_decay,
        momentum: float = NORMUON_DEFAULTS.momentum,
        nesterov: bool = NORMUON_DEFAULTS.nesterov,
        ns_coefficients: NSCoefficients = DEFAULT_NS_COEFFICIENTS,
        eps: float = NORMUON_DEFAULTS.eps,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = "none",
        beta2: float = NORMUON_DEFAULTS.beta2,
        *,
        normuon_eps: float = NORMUON_DEFAULTS.normuon_eps,
        rescale: str = NORMUON_DEFAULTS.rescale,
        rms: float = NORMUON_DEFAULTS.rms,
        scale: float = 1.0,
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS.betas,
        adamw_eps: float = ADAMW_DEFAULTS.eps,
        ns_dtype: torch.dtype = torch.bfloat16,
        plan: PlanConfig | None = None,
        pipeline: PipelineConfig | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": as_tuples(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "beta2": beta2,
            "normuon_eps": normuon_eps,
            "rescale": rescale,
            "rms": rms,
            "scale": scale,
            "ns_dtype": ns_dtype,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
        }
        # MatrixOptimizer's constructor: Muon's takes Muon's arguments
        super(Muon, self).__init__(params, defaults, plan=plan, pipeline=pipeline)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        _hparams(group)

    def _cost_params(self, group: dict[str, Any]) -> dict[str, Any]:
        return {**super()._cost_params(group), "extra_elementwise": NORMUON_ELEMENTWISE}

    # ------------------------------------------------------------------ owner state
    def _owner_specs(
        self, p: Tensor, group: dict[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        meta = normuon_init(
            tuple(p.shape[-2:]), _hparams(group), dtype=self._state_dtype(p), device="meta"
        )
        return {k: (tuple(v.shape), v.dtype) for k, v in meta.items()}

    def _fresh_item_state(self, item: Item) -> dict[str, Tensor]:
        p = (self._step_params or self._flat()[0])[item.param]
        return normuon_init(
            (item.m, item.n),
            _hparams(self._group_of(item.param)),
            dtype=self._state_dtype(p),
            device=local_tensor(p).device,
        )

    def _directions(self, batch: ComputeBatch, full: Tensor) -> Tensor:
        orthogonalised = super()._directions(batch, full)
        hp = _hparams(dict(batch.hparams))
        if batch.calibrate is not None:  # timed on random payloads: no state may change
            dtype = self._state_dtype(full)
            return normuon_direction(
                orthogonalised, normuon_init(full.shape, hp, dtype=dtype, device=full.device), 1, hp
            )
        states = [self._owner.get(item) for item in batch.items]
        step = min(self._item_step(item) for item in batch.items)
        dtypes = {s[_KEY].dtype for s in states}
        if len(dtypes) == 1:
            # one call over the stacked states: normuon_direction batches its reductions
            # only where that is bitwise a loop over the matrices, and loops otherwise
            stacked = stack_states(states)
            out = normuon_direction(orthogonalised, stacked, step, hp)
            unstack_states_(stacked, states)
            return out
        widest = max(dtypes, key=lambda d: d.itemsize)  # float32 and float64 in one group
        return torch.stack(
            [
                normuon_direction(o, state, step, hp).to(widest)
                for o, state in zip(orthogonalised, states, strict=True)
            ]
        )

    def _direction_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        return self._state_dtype(p)

    def _apply_batch(self, batch: ApplyBatch) -> None:
        hp = batch.hparams
        lr = lr_value(hp["lr"])
        decay_and_step_(
            batch.targets,
            batch.directions,
            decay=float(1 - lr * hp["weight_decay"]),
            alpha=-float(muon_lr(lr, hp["adjust_lr_fn"], batch.shape, scale=hp["scale"])),
        )
