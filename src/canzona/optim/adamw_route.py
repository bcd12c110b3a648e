"""The AdamW route of a matrix optimizer: moments before the vote, parameters after it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor

from canzona.optim.prepare import GroupWork
from canzona.optim.transaction import Backup, StepTransaction
from canzona.runtime import local_tensor
from canzona.updates.batched import adamw_moments_, adamw_params_


def scalar(value: float | Tensor) -> float:
    """A learning rate given as a float or a 1-element tensor, as a float."""
    return float(lr_value(value))


def lr_value(value: float | Tensor) -> float | Tensor:
    """A learning rate as torch.optim uses it: a float, or a 0-dim tensor.

    The arithmetic on a tensor learning rate (``1 - lr * weight_decay``, the shape-adjusted
    rate) then runs in the tensor's dtype, as torch.optim's does: a float32 ``lr`` gives
    float32 products, bit for bit torch's. A NumPy scalar is returned as it is, for the
    same reason.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"a tensor learning rate must have one element, got {value.shape}")
        return value.detach().reshape(())
    if not isinstance(value, float | int) and hasattr(value, "dtype"):
        # a NumPy scalar (np.float32, np.float16) is kept: the arithmetic on it is NumPy's,
        # in its dtype, as in torch.optim
        return cast(float, value)
    return float(value)


#: What torch's ``OneCycleLR`` and ``CyclicLR`` write into every param group when they cycle
#: momentum (``cycle_momentum=True``).
CYCLED_MOMENTUM = ("base_momentum", "max_momentum")


def adamw_betas(group: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[Any, Any]:
    """An AdamW group's ``(beta1, beta2)``: its ``adamw_betas``, with a cycled momentum as beta1.

    Where torch's ``OneCycleLR`` or ``CyclicLR`` cycles momentum, it writes the value into
    ``betas[0]`` when the optimizer's defaults have ``betas`` (Shampoo, SOAP), else into
    ``momentum`` (Muon, NorMuon), in every group; ``torch.optim.AdamW``'s beta1 would follow
    it, so an AdamW group's does too. Otherwise the matrix algorithm's entries are ignored.
    """
    beta1, beta2 = group["adamw_betas"]
    if all(k in group for k in CYCLED_MOMENTUM):
        beta1 = group["betas"][0] if "betas" in defaults else group["momentum"]
    return beta1, beta2


def real_view(t: Tensor) -> Tensor:
    """A complex tensor as its real pairs (``torch.view_as_real``, as torch.optim.AdamW)."""
    return torch.view_as_real(t) if t.is_complex() else t


class AdamWRouteMixin:
    """AdamW for the param groups with ``algorithm="adamw"`` (embeddings, norms, biases)."""

    state: Any
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]

    def _backup(self, tensors: list[Tensor]) -> Backup:
        raise NotImplementedError

    def _adamw_moments(self, w: GroupWork, grads: list[Tensor], txn: StepTransaction) -> None:
        """AdamW's moment updates of one group (before the vote; saved for a rollback)."""
        if "exp_avgs" not in w.cache:
            states = [self.state[p] for p in w.params]
            # complex parameters as real pairs: each second moment a real square
            w.cache["exp_avgs"] = [real_view(local_tensor(s["exp_avg"])) for s in states]
            w.cache["exp_avg_sqs"] = [real_view(local_tensor(s["exp_avg_sq"])) for s in states]
            w.cache["complex"] = any(p.is_complex() for p in w.params)
            w.cache["backup"] = self._backup(w.cache["exp_avgs"] + w.cache["exp_avg_sqs"])
        txn.save(w.cache["backup"])
        betas = adamw_betas(self.param_groups[w.gid], self.defaults)
        if w.cache["complex"]:
            grads = [real_view(g) for g in grads]
        adamw_moments_(grads, w.cache["exp_avgs"], w.cache["exp_avg_sqs"], betas=betas)

    def _adamw_params(self, w: GroupWork, hp: Mapping[str, Any]) -> None:
        """AdamW's parameter update of one group (after the vote), by step count.

        ``hp``: the group as the step read it (its learning rate on the host).
        """
        group = self.param_groups[w.gid]
        by_step: dict[int, list[int]] = {}
        for k, p in enumerate(w.params):
            by_step.setdefault(int(self.state[p]["step"]), []).append(k)
        # the parameters' local tensors as they are now: one replaced since the last step
        # (``p.data = ...``, ``swap_tensors``, FSDP2's re-padding) is the one updated
        params = [local_tensor(p) for p in w.params]
        every = [params, w.cache["exp_avgs"], w.cache["exp_avg_sqs"]]
        if w.cache["complex"]:  # the parameters' real views, and the parameters
            every = [[real_view(t) for t in params], *every[1:], params]
        for step, ks in by_step.items():
            lists = every if len(ks) == len(w.params) else [[xs[k] for k in ks] for xs in every]
            adamw_params_(
                lists[0],
                lists[1],
                lists[2],
                step,
                lr=lr_value(hp["lr"]),
                betas=adamw_betas(group, self.defaults),
                eps=group["adamw_eps"],
                weight_decay=group["weight_decay"],
                originals=lists[3] if w.cache["complex"] else None,
            )
