"""`PipelineConfig(pause_gc=True)`: no collection inside a step; the collector restored after."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import pytest
import torch
from torch import nn

import canzona
from canzona.optim.base import MatrixOptimizer

BODY = MatrixOptimizer._step.__code__


def _in_step_body(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code is BODY:
            return True
        frame = frame.f_back
    return False


@contextmanager
def _eager_collector() -> Iterator[list[int]]:
    """Collections started inside a step's body, with a threshold that starts them often."""
    seen: list[int] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and _in_step_body(sys._getframe(1)):
            seen.append(info["generation"])

    threshold = gc.get_threshold()
    gc.set_threshold(5)
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)


def _optimizer(pause: bool) -> tuple[canzona.Muon, list[nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(32)]
    for p in params:
        p.grad = torch.randn(8, 8, generator=gen)
    opt = canzona.Muon(params, pipeline=canzona.PipelineConfig(pause_gc=pause))
    opt.step()  # the first step builds the plan and the state
    return opt, params


@pytest.mark.parametrize("pause", [True, False])
def test_no_collection_runs_inside_a_step(pause: bool) -> None:
    """Catches: a step that leaves the collector on (the ``pause=False`` case shows they run)."""
    opt, _ = _optimizer(pause)
    with _eager_collector() as seen:
        opt.step()
    assert gc.isenabled()
    if pause:
        assert seen == []
    else:
        assert len(seen) > 0


def test_a_disabled_collector_stays_disabled() -> None:
    """Catches: a step that turns the collector on when the job had turned it off (TorchTitan)."""
    opt, _ = _optimizer(True)
    gc.disable()
    try:
        opt.step()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failing_step_turns_the_collector_back_on() -> None:
    """Catches: a step that raises and leaves the collector off for the rest of the job."""
    opt, params = _optimizer(True)
    params[3].grad = params[3].grad.to_sparse()  # type: ignore[union-attr]
    with pytest.raises(canzona.UpdateFailedError, match="sparse gradients"):
        opt.step()
    assert gc.isenabled()
