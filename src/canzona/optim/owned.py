"""Optimizers whose whole matrix state lives on the owner rank (Shampoo, SOAP)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.optim.base import MatrixOptimizer
from canzona.runtime import Item, local_tensor

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

    def _prepare(
        self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> Tensor:
        return grad

    @staticmethod
    def _state_dtype(p: Tensor) -> torch.dtype:
        return torch.promote_types(p.dtype, torch.float32)

    def _new_state(
        self, item: Item, hp: Any, dtype: torch.dtype, device: torch.device
    ) -> dict[str, Tensor]:
        return type(self).init_fn((item.m, item.n), hp, dtype=dtype, device=device)

    def _fresh_owner_state(self, item: Item, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        hp = self.hparams(group)
        return self._new_state(item, hp, self._state_dtype(p), local_tensor(p).device)

    def _owner_specs(
        self, p: Tensor, group: dict[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        init = type(self).init_fn
        meta = init(
            tuple(p.shape[-2:]), self.hparams(group), dtype=self._state_dtype(p), device="meta"
        )
        return {k: (tuple(v.shape), v.dtype) for k, v in meta.items()}

    def _directions(
        self, items: Sequence[Item], full: Tensor, group: dict[str, Any], steps: list[int]
    ) -> Tensor:
        hp = self.hparams(group)
        direction = type(self).direction_fn
        out = torch.empty_like(full, dtype=torch.promote_types(full.dtype, torch.float32))
        for k, item in enumerate(items):
            state = self._owner_state.get(item.key)
            if state is None:
                state = self._new_state(item, hp, out.dtype, full.device)
                self._owner_state[item.key] = state
            out[k] = direction(full[k].to(out.dtype), state, steps[k], hp)
        return out
