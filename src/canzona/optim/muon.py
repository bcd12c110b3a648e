"""canzona.Muon: torch.optim.Muon's update, computed once per matrix on its owner rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from canzona.optim.base import MatrixOptimizer, scalar
from canzona.optim.prepare import GroupWork
from canzona.optim.transaction import Backup, StepTransaction
from canzona.plan import PlanConfig
from canzona.runtime import ApplyBatch, ComputeBatch, PipelineConfig, local_tensor
from canzona.updates import muon_direction, muon_lr
from canzona.updates.batched import decay_and_step_, muon_prepare_batch_

_ADJUST = (None, "original", "match_rms_adamw")


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
            & O_t \leftarrow \mathrm{NS}^{(a,b,c)}_k(\widetilde B_t)
              \quad\text{(owner rank, full matrix)} \\
            & \theta_t \leftarrow (1 - \gamma\lambda)\,\theta_{t-1}
              - \gamma\,\mathrm{AdjustLR}(m, n)\, O_t \quad\text{(per shard)}
        \end{aligned}

    Args:
        params: Parameters, named parameters or param groups. Groups with
            ``algorithm="adamw"`` are updated by AdamW (``lr``, ``weight_decay``,
            ``adamw_betas``, ``adamw_eps``); see :func:`canzona.param_groups`.
        lr: Learning rate :math:`\gamma` (float or 1-element tensor).
        weight_decay: Decoupled weight decay :math:`\lambda`.
        momentum: Momentum :math:`\mu`.
        nesterov: Use the Nesterov blend.
        ns_coefficients: Quintic coefficients :math:`(a, b, c)`.
        eps: Clamp of the Frobenius norm in Newton–Schulz.
        ns_steps: Newton–Schulz iterations :math:`k`.
        adjust_lr_fn: ``None``/``"original"`` (:math:`\sqrt{\max(1, m/n)}`) or
            ``"match_rms_adamw"`` (:math:`0.2\sqrt{\max(m, n)}`).
        adamw_betas: AdamW betas for ``algorithm="adamw"`` groups.
        adamw_eps: AdamW epsilon for ``algorithm="adamw"`` groups.
        ns_dtype: Dtype of the Newton–Schulz iteration (bf16 as ``torch.optim.Muon``;
            fp32 is much faster on CPUs without bf16 matmul units).
        plan: Owner assignment and micro-group configuration.
        pipeline: Gather/compute/scatter pipeline configuration.
    """

    algorithm = "muon"
    cost_model = "muon"
    storage_keys = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        ns_dtype: torch.dtype = torch.bfloat16,
        plan: PlanConfig | None = None,
        pipeline: PipelineConfig | None = None,
    ) -> None:
        self._check_common(lr, weight_decay, adamw_betas, adamw_eps)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
        }
        self._validate_group(defaults)
        super().__init__(params, defaults, plan=plan, pipeline=pipeline)

    def _validate_group(self, group: dict[str, Any]) -> None:
        momentum, steps, dtype = group["momentum"], group["ns_steps"], group["ns_dtype"]
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if group["adjust_lr_fn"] not in _ADJUST:
            raise ValueError(
                f"Adjust learning rate function {group['adjust_lr_fn']} is not supported"
            )
        if len(tuple(group["ns_coefficients"])) != 3:
            raise ValueError(
                f"ns_coefficients must hold 3 values, got {group['ns_coefficients']!r}"
            )
        if not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"ns_steps must be an int in [0, 100), got {steps!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"ns_dtype must be a floating torch.dtype, got {dtype!r}")
        if not group["eps"] > 0:
            raise ValueError(f"eps must be > 0, got {group['eps']!r}")

    def _init_storage_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _row_signature(self, group: dict[str, Any]) -> tuple[object, ...]:
        return (group.get("ns_dtype"),)

    def _cost_params(self, group: dict[str, Any]) -> dict[str, Any]:
        return {"ns_steps": group["ns_steps"]}

    def _prepare_group(
        self, group: dict[str, Any], work: GroupWork, grads: list[Tensor], txn: StepTransaction
    ) -> None:
        if "bufs" not in work.cache:
            params = [work.params[k] for k in work.prepared]
            bufs = [local_tensor(self.state[p]["momentum_buffer"]) for p in params]
            work.cache["bufs"] = bufs
            work.cache["backup"] = Backup(bufs)
        txn.save(work.cache["backup"])
        muon_prepare_batch_(
            work.cache["bufs"],
            grads,
            work.payloads,
            momentum=group["momentum"],
            nesterov=group["nesterov"],
        )

    def _payload_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        # Newton–Schulz starts by casting to ns_dtype: casting each fragment before it
        # travels gives the owner the very same matrix, in fewer bytes (bf16: half)
        ns: torch.dtype = group["ns_dtype"]
        return ns if ns.itemsize < p.dtype.itemsize else p.dtype

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
        lr = scalar(hp["lr"])
        m, n = batch.shape
        directions = batch.directions
        if m > n:
            # torch adds the transposed (column-major) Newton–Schulz output of a tall
            # matrix, and a same-dtype low-precision add_ rounds by memory layout
            directions = [
                d.mT.contiguous().mT if d.dtype == t.dtype else d
                for t, d in zip(batch.targets, directions, strict=True)
            ]
        decay_and_step_(
            batch.targets,
            directions,
            decay=1 - lr * hp["weight_decay"],
            alpha=-muon_lr(lr, hp["adjust_lr_fn"], batch.shape),
        )
