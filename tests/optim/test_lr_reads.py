"""A learning rate given as a tensor is read on the host once per param group and step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

import canzona

#: Tensor methods that bring a value to the host: on a GPU each waits for the device.
_READS = frozenset({"__float__", "__int__", "__bool__", "__index__", "item", "tolist", "cpu"})


class DeviceLR(torch.Tensor):
    """A learning rate standing in for one on a GPU (this machine has none).

    What is computed from it stays a ``DeviceLR`` (on the device); each read of a value on
    the host counts, ``.to("cpu")`` included, and gives a plain tensor (on the host).
    """

    reads: ClassVar[int] = 0

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        if name in _READS or to_host:
            DeviceLR.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _lr(value: float) -> DeviceLR:
    return torch.tensor(value).as_subclass(DeviceLR)  # type: ignore[return-value]


SHAPES = ((8, 8), (12, 8), (8, 12), (6, 10))  # four apply calls a step (one per shape)


@pytest.mark.parametrize("cls", [canzona.Muon, canzona.NorMuon, canzona.Shampoo, canzona.SOAP])
def test_a_tensor_learning_rate_is_read_once_per_group_and_step(cls: type) -> None:
    """Catches: the apply (per shape, or per step count on the AdamW route) computing its
    factors from the group's tensor and reading each on the host (on a GPU: a device sync
    per call, and the host waits for the step's kernels in the middle of the apply), and a
    larger tensor the job keeps in a group (no hyper-parameter) copied to the host too."""
    gen = torch.Generator().manual_seed(0)
    mats = [nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]
    vecs = [nn.Parameter(torch.randn(5, generator=gen)) for _ in range(3)]
    opt = cls(
        [
            {"params": mats, "lr": _lr(0.02), "mask": torch.ones(64).as_subclass(DeviceLR)},
            {"params": vecs, "lr": _lr(0.01), "algorithm": "adamw"},
        ]
    )
    scheduler = StepLR(opt, step_size=2, gamma=0.5)  # a new rate every other step
    reads = []
    for step in range(5):
        for p in (*mats, *vecs):
            p.grad = torch.randn(p.shape, generator=gen)
        if step == 3:  # a parameter with a step count of its own on the AdamW route
            vecs[0].grad = None
        DeviceLR.reads = 0
        opt.step()
        reads.append(DeviceLR.reads)
        scheduler.step()
    assert reads == [2] * 5
