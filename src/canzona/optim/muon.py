"""canzona.Muon: torch.optim.Muon's update, computed once per matrix on its owner rank."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from canzona.defaults import ADAMW_DEFAULTS, MUON_DEFAULTS
from canzona.optim.adamw_route import lr_value
from canzona.optim.base import MatrixOptimizer
from canzona.optim.payload_runs import LastHome, home_runs, in_runs, payload_runs
from canzona.optim.prepare import GroupWork
from canzona.optim.step_table import grad_dtype
from canzona.optim.transaction import StepTransaction
from canzona.plan import PlanConfig
from canzona.runtime import ApplyBatch, ComputeBatch, PipelineConfig, local_tensor
from canzona.updates import (
    ADJUST_LR_FNS,
    DEFAULT_NS_COEFFICIENTS,
    NSCoefficients,
    batched,
    muon_direction,
    muon_lr,
    resolve_ns_coefficients,
)
from canzona.updates.batched import (
    PrepareRun,
    decay_and_step_,
    muon_prepare_batch_,
    muon_prepare_runs_,
)


def as_tuples(value: Any) -> Any:
    """``ns_coefficients`` with every list made a tuple (a name and other values unchanged).

    Param groups keep what the user gave; tuples print, compare and hash alike everywhere.
    """
    if isinstance(value, list | tuple):
        return tuple(as_tuples(v) for v in value)
    return value


@lru_cache(maxsize=64)
def _iterations_cached(value: Any, ns_steps: int | None) -> int:
    return len(resolve_ns_coefficients(value, ns_steps))


def ns_iterations(group: dict[str, Any]) -> int:
    """How many Newton–Schulz iterations a validated param group's schedule runs.

    Asked at every step (the plan's cost parameters), so the answer is cached by value; a
    list given in a param group is not hashable and is resolved every time.
    """
    value, steps = group["ns_coefficients"], group["ns_steps"]
    try:
        return _iterations_cached(value, steps)
    except TypeError:
        return len(resolve_ns_coefficients(value, steps))


def check_positive_finite(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``value`` unless it is a positive finite real number."""
    is_number = isinstance(value, Real) and not isinstance(value, bool)
    if not (is_number and math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def check_muon_group(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the value for an invalid Muon hyper-parameter of a group."""
    momentum, dtype = group["momentum"], group["ns_dtype"]
    if not momentum >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    adjust = group["adjust_lr_fn"]
    if adjust is not None and adjust not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust!r}")
    check_positive_finite("scale", group["scale"])
    resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"ns_dtype must be a floating torch.dtype, got {dtype!r}")
    if not group["eps"] > 0:
        raise ValueError(f"eps must be > 0, got {group['eps']!r}")


class Muon(MatrixOptimizer):
    r"""Muon (momentum + Newton–Schulz orthogonalisation) for sharded matrices.

    On one device, and with the same arguments, it produces the parameters of
    ``torch.optim.Muon``. On a DeviceMesh (FSDP2, TP, FSDP×TP, HSDP) every matrix's
    Newton–Schulz runs once, on its owner rank, and the result is the same.

    .. math::
        \begin{aligned}
            & B_t \leftarrow \mu B_{t-1} + (1-\mu) g_t \quad\text{(lerp, per shard)} \\
            & \widetilde B_t \leftarrow g_t + \mu (B_t - g_t)
              \ \text{(Nesterov)} \quad\text{or}\quad B_t \\
            & O_t \leftarrow \mathrm{NS}^{(a_i,b_i,c_i)_{i=1}^{k}}(\widetilde B_t)
              \quad\text{(owner rank, full matrix)} \\
            & \theta_t \leftarrow (1 - \gamma\lambda)\,\theta_{t-1}
              - \gamma\,\sigma\,\mathrm{AdjustLR}(m, n)\, O_t \quad\text{(per shard)}
        \end{aligned}

    Args:
        params: Parameters, named parameters or param groups. Groups with
            ``algorithm="adamw"`` are updated by AdamW (``lr``, ``weight_decay``,
            ``adamw_betas``, ``adamw_eps``); see :func:`canzona.param_groups`.
        lr: Learning rate :math:`\gamma` (float or 1-element tensor).
        weight_decay: Decoupled weight decay :math:`\lambda`.
        momentum: Momentum :math:`\mu`.
        nesterov: Use the Nesterov blend.
        ns_coefficients: Newton–Schulz coefficients: one triple :math:`(a, b, c)` used at
            every iteration (torch's form), a sequence of per-iteration triples, or a
            registered name (``"quintic"``, ``"polar_express"``, ``"tuned_quintic"``,
            ``"qwen_express"``; a name brings its own input-norm margin, 1.01 for Polar
            Express). See ``docs/optimizers.md``.
        eps: Clamp of the Frobenius norm in Newton–Schulz.
        ns_steps: Newton–Schulz iterations :math:`k`, in ``[0, 100)``. ``None`` (the default)
            runs 5 for a triple (torch's default) and the schedule's own length for a
            sequence or a name. With a name, the first ``ns_steps`` triples (the last one
            repeated past the published length); with a sequence it must equal its length.
        adjust_lr_fn: Shape factor of the learning rate, one of ``None``/``"original"``
            (:math:`\sqrt{\max(1, m/n)}`), ``"match_rms_adamw"`` (:math:`0.2\sqrt{\max(m, n)}`),
            ``"spectral"`` (:math:`\sqrt{m/n}`), ``"unit_rms"`` (:math:`\sqrt{\max(m, n)}`) or
            ``"none"`` (1); see :data:`canzona.updates.ADJUST_LR_FNS`.
        scale: Free factor :math:`\sigma > 0` of the adjusted learning rate (a group entry,
            so schedulers and param groups may set it).
        adamw_betas: AdamW betas for ``algorithm="adamw"`` groups.
        adamw_eps: AdamW epsilon for ``algorithm="adamw"`` groups.
        ns_dtype: Dtype of the Newton–Schulz iteration (bf16 as ``torch.optim.Muon``;
            fp32 is much faster on CPUs without bf16 matmul units).
        plan: Owner assignment and micro-group configuration.
        pipeline: Gather/compute/scatter pipeline configuration.

    Raises:
        ValueError: Naming the value, for an empty schedule, a triple that is not three
            finite real numbers, an unknown name, ``ns_steps`` outside ``[0, 100)`` or
            contradicting an explicit schedule, an unknown ``adjust_lr_fn``, a ``scale``
            that is not positive and finite, and the checks of ``torch.optim.Muon``.
    """

    algorithm = "muon"
    cost_model = "muon"
    storage_keys = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = MUON_DEFAULTS.lr,
        weight_decay: float = MUON_DEFAULTS.weight_decay,
        momentum: float = MUON_DEFAULTS.momentum,
        nesterov: bool = MUON_DEFAULTS.nesterov,
        ns_coefficients: NSCoefficients = DEFAULT_NS_COEFFICIENTS,
        eps: float = MUON_DEFAULTS.eps,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = None,
        *,
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
            "scale": scale,
            "ns_dtype": ns_dtype,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
        }
        super().__init__(params, defaults, plan=plan, pipeline=pipeline)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_muon_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (see :class:`~canzona.optim.checkpoint.CheckpointMixin`).

        A param group saved before ``scale`` existed gets the optimizer's default for it, as
        ``add_param_group`` would give it.
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("scale", self.defaults["scale"])

    def _storage_dtype(self, p: Tensor, key: str, saved: Tensor) -> torch.dtype | None:
        # the momentum keeps the gradients' dtype (``p.grad_dtype``: fp32 gradients of bf16
        # weights) through a checkpoint, where torch.optim's load would cast it to the
        # weight's; ``grad_dtype=None`` admits any gradient dtype: the saved one is kept
        if key != "momentum_buffer" or not hasattr(p, "grad_dtype"):
            return None
        dtype: torch.dtype | None = p.grad_dtype
        return saved.dtype if dtype is None and saved.is_floating_point() else dtype

    def _init_storage_state(
        self, p: Tensor, state: dict[str, Any], group: dict[str, Any], grad: Tensor | None
    ) -> None:
        # the gradient's dtype, as torch's (a bf16 weight may have fp32 gradients)
        dtype = grad.dtype if grad is not None else p.dtype
        state["momentum_buffer"] = torch.zeros_like(
            p, dtype=dtype, memory_format=torch.preserve_format
        )

    def _row_signature(self, group: dict[str, Any]) -> tuple[object, ...]:
        return (group.get("ns_dtype"),)

    def _cost_params(self, group: dict[str, Any]) -> dict[str, Any]:
        # a schedule's length is the number of iterations the plan costs
        return {"ns_steps": ns_iterations(group)}

    def _prepare_group(
        self, group: dict[str, Any], work: GroupWork, grads: list[Tensor], txn: StepTransaction
    ) -> None:
        cache = work.cache
        if "bufs" in cache and cache["runs"] is not None and cache["runs"].moved():
            cache.clear()  # a homed buffer was moved since (its lists would miss it)
        if "bufs" not in cache:
            params = [work.params[k] for k in work.prepared]
            bufs = [local_tensor(self.state[p]["momentum_buffer"]) for p in params]
            same = all(b.dtype == v.dtype for b, v in zip(bufs, work.payloads, strict=True))
            runs = payload_runs(work.payloads) if same else None
            cache["bufs"] = bufs
            cache["runs"] = None
            homes: dict[int, LastHome | None] = self.__dict__.setdefault("_homes", {})
            if runs is not None:  # homed before anything keeps a view of them (the backup)
                cache["runs"] = home_runs(bufs, runs, homes.get(work.gid))
                homes[work.gid] = cache["runs"].last  # the home alone: no payload views
            cache["backup"] = self._backup(bufs if runs is None else in_runs(bufs, runs))
        txn.save(work.cache["backup"])
        bufs, homed = work.cache["bufs"], work.cache["runs"]
        if homed is None:
            muon_prepare_batch_(
                bufs,
                grads,
                work.payloads,
                momentum=group["momentum"],
                nesterov=group["nesterov"],
            )
            return
        loose = homed.loose
        muon_prepare_runs_(
            loose(bufs),
            loose(grads),
            [
                PrepareRun(run.take(bufs), run.take(grads), run.out, run.views, place)
                for run, place in homed.runs
            ],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
        )

    def _payload_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        # Newton–Schulz starts by casting to ns_dtype: casting each fragment before it
        # travels gives the owner the very same matrix, in fewer bytes (bf16: half). The
        # blend is in the gradients' dtype (fp32 gradients of fp16 weights: cast once, as
        # torch's, not through the weight's fp16)
        ns: torch.dtype = group["ns_dtype"]
        blend = grad_dtype(p)
        return ns if ns.itemsize < blend.itemsize else blend

    def _prepared_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        # a CPU shard of at least LERP_OUT_NUMEL elements gets its blend written straight in
        # the payload's dtype, rounded on store as the cast rounds (muon_prepare_batch_):
        # no full-precision copy staged and cast. Smaller ones, and other devices, stage it:
        # a run of payloads then costs a few calls, not one per tensor
        if p.device.type == "cpu" and local_tensor(p).numel() >= batched.LERP_OUT_NUMEL:
            return self._payload_dtype(p, group)
        return super()._prepared_dtype(p, group)

    def _directions(self, batch: ComputeBatch, full: Tensor) -> Tensor:
        hp = batch.hparams
        return muon_direction(
            full,
            coefficients=hp["ns_coefficients"],
            steps=hp["ns_steps"],
            eps=hp["eps"],
            dtype=hp["ns_dtype"],
        )

    def _direction_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        dtype: torch.dtype = group["ns_dtype"]
        return dtype

    def _apply_batch(self, batch: ApplyBatch) -> None:
        hp = batch.hparams
        lr = lr_value(hp["lr"])
        m, n = batch.shape
        directions = batch.directions
        if m > n and hp["ns_steps"] != 0:
            # torch adds the transposed (column-major) Newton–Schulz output of a tall
            # matrix, and a same-dtype low-precision add_ rounds by memory layout; without
            # an iteration its two transposes give back the row-major normalised input
            directions = [
                d.mT.contiguous().mT if d.dtype == t.dtype else d
                for t, d in zip(batch.targets, directions, strict=True)
            ]
        decay_and_step_(
            batch.targets,
            directions,
            decay=float(1 - lr * hp["weight_decay"]),
            alpha=-float(muon_lr(lr, hp["adjust_lr_fn"], batch.shape, scale=hp["scale"])),
        )
