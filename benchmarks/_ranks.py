"""A benchmark's ranks: ``fn(rank, world, *args)`` on ``world`` ranks of :mod:`canzona.launch`.

``results = launch(my_body, 4, config)`` runs ``my_body(rank, world, config)`` on every rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from canzona.launch import RankFailure, run_ranks
from canzona.runtime import PipelineConfig
from canzona.runtime.repricing import ROUNDS, SKIPPED_STEPS

__all__ = ["WARMUP", "RankFailure", "launch"]

#: Untimed steps before a measurement, until a measured plan is final: the first step
#: plans (and calibrates); in each of the ``ROUNDS`` re-pricings, the plan's first step is
#: not recorded, the next ``reprice_steps`` record the owner calls, and the step after them
#: re-plans on their prices (and makes its new batches' first calls).
WARMUP = 1 + ROUNDS * (SKIPPED_STEPS + PipelineConfig().reprice_steps)


def launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; results in rank order.

    ``fn`` must return picklable values. Raises :class:`~canzona.launch.RankFailure` with
    each failing rank's traceback when a rank raises or dies, or when ``timeout`` seconds
    pass first.
    """
    return run_ranks(world, lambda _: fn(dist.get_rank(), world, *args), timeout_s=timeout)
