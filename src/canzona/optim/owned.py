"""Optimizers whose whole matrix state lives on the owner rank (Shampoo, SOAP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from canzona.optim.base import MatrixOptimizer
from canzona.optim.prepare import GroupWork
from canzona.optim.transaction import StepTransaction
from canzona.runtime import ComputeBatch, Item, local_tensor

InitFn = Callable[..., dict[str, Tensor]]
DirectionFn = Callable[[Tensor, dict[str, Tensor], int, Any], Tensor]


class OwnerStateOptimizer(MatrixOptimizer):
    """Base of optimizers that keep every state tensor of a matrix on its owner rank.

    Only the gradient travels to the owner and only the direction travels back; the
    owner creates the state lazily with ``init_fn`` and advances it with
    ``direction_fn``. Subclasses set both and ``hparams`` (group -> hyper-parameters).
    """

    init_fn: InitFn
    direction_fn: DirectionFn

    def hparams(self, group: dict[str, Any]) -> Any:
        """The algorithm's hyper-parameter object for a param group."""
        raise NotImplementedError

    def _validate_group(self, group: dict[str, Any]) -> None:
        self.hparams(group)

    def _prepare_group(
        self, group: dict[str, Any], work: GroupWork, grads: list[Tensor], txn: StepTransaction
    ) -> None:
        torch._foreach_copy_(work.payloads, grads)

    def _fresh_item_state(self, item: Item) -> dict[str, Tensor]:
        p = (self._step_params or self._flat()[0])[item.param]
        group = self._group_of(item.param)
        dtype, device = self._state_dtype(p), local_tensor(p).device
        return type(self).init_fn((item.m, item.n), self.hparams(group), dtype=dtype, device=device)

    def _owner_specs(
        self, p: Tensor, group: dict[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        init = type(self).init_fn
        meta = init(
            tuple(p.shape[-2:]), self.hparams(group), dtype=self._state_dtype(p), device="meta"
        )
        return {k: (tuple(v.shape), v.dtype) for k, v in meta.items()}

    def _calibration_step(self, phase: str, hp: Any) -> int:
        """A step of ``phase`` (``"refresh"`` or ``"plain"``) for a calibration call."""
        raise NotImplementedError

    def _directions(self, batch: ComputeBatch, full: Tensor) -> Tensor:
        hp = self.hparams(dict(batch.hparams))  # a group's values (they may change per step)
        direction = type(self).direction_fn
        out = torch.empty_like(full, dtype=torch.promote_types(full.dtype, torch.float32))
        for k, item in enumerate(batch.items):
            if batch.calibrate is not None:  # state kept apart: it belongs to no parameter
                kept: dict[str, dict[str, Tensor]] = self.__dict__.setdefault("_calibrating", {})
                state = kept.get(item.name)
                if state is None:
                    shape = (item.m, item.n)
                    state = type(self).init_fn(shape, hp, dtype=out.dtype, device=full.device)
                    kept[item.name] = state
                step = self._calibration_step(batch.calibrate, hp)
            else:
                state, step = self._owner.get(item), self._item_step(item)
            # a copy: a view's memory alignment (batch, gather buffer) can change the
            # rounding of vectorised kernels; one device hands the math a fresh tensor
            out[k] = direction(full[k].to(out.dtype, copy=True), state, step, hp)
        return out
