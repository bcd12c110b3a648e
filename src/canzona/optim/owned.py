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
from canzona.updates.stacked import stack_states, stacked_direction_exact, unstack_states_

InitFn = Callable[..., dict[str, Tensor]]

#: Most bytes of owner-held state a batch stacks into one direction call: the stack is a copy
#: of the states for the call's duration. Above it (large matrices, whose math outweighs a
#: call's host work anyway) the matrices go one by one.
STACK_STATE_BYTES = 64 << 20
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

    def _probe_hparams(self, hp: Any) -> Any:
        """Hyper-parameters under which a stack probe's few steps take every branch."""
        return hp

    def _stacks_step(self, step: int, hp: Any) -> bool:
        """Whether a step of this count may run stacked.

        False where the math falls back matrix by matrix inside (a decomposition retried).
        """
        return True

    def _directions(self, batch: ComputeBatch, full: Tensor) -> Tensor:
        hp = self.hparams(dict(batch.hparams))  # a group's values (they may change per step)
        direction = type(self).direction_fn
        out = torch.empty_like(full, dtype=torch.promote_types(full.dtype, torch.float32))
        states: list[dict[str, Tensor]] = []
        steps: list[int] = []
        for item in batch.items:
            if batch.calibrate is not None:  # state kept apart: it belongs to no parameter
                kept: dict[str, dict[str, Tensor]] = self.__dict__.setdefault("_calibrating", {})
                state = kept.get(item.name)
                if state is None:
                    shape = (item.m, item.n)
                    state = type(self).init_fn(shape, hp, dtype=out.dtype, device=full.device)
                    kept[item.name] = state
                states.append(state)
                steps.append(self._calibration_step(batch.calibrate, hp))
            else:
                states.append(self._owner.get(item))
                steps.append(self._item_step(item))
        if self._stacked(states, steps, hp, full):
            # one call for the stack: probed equal, bit for bit, to the loop below
            stacked = stack_states(states)
            out.copy_(direction(full.to(out.dtype, copy=True), stacked, steps[0], hp))
            unstack_states_(stacked, states)
            return out
        for k, (state, step) in enumerate(zip(states, steps, strict=True)):
            # a copy: a view's memory alignment (batch, gather buffer) can change the
            # rounding of vectorised kernels; one device hands the math a fresh tensor
            out[k] = direction(full[k].to(out.dtype, copy=True), state, step, hp)
        return out

    def _stacked(
        self, states: list[dict[str, Tensor]], steps: list[int], hp: Any, full: Tensor
    ) -> bool:
        """Whether the batch runs as one stack (one step count, a probe that passed)."""
        if len(states) < 2 or not states[0] or len(set(steps)) != 1:
            return False
        if not self._stacks_step(steps[0], hp):
            return False
        dtype = next(iter(states[0].values())).dtype
        if any(next(iter(s.values())).dtype != dtype for s in states):
            return False
        one = sum(v.numel() * v.element_size() for v in states[0].values())
        if one * len(states) > STACK_STATE_BYTES:  # the stack is a copy of the states
            return False
        cls = type(self)
        return stacked_direction_exact(
            cls.direction_fn,
            cls.init_fn,
            self._probe_hparams(hp),
            (full.shape[-2], full.shape[-1]),
            len(states),
            dtype,
            full.device,
        )
