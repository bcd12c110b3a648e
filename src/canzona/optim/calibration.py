"""``canzona calibrate``: time a model's owner math on this machine into a cost table file."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from canzona.plan import GroupedCost, MatrixSpec, cost_model
from canzona.plan.measured import MeasuredCost, owner_stack, save_cost_table
from canzona.runtime import calibrate as runtime_calibrate
from canzona.runtime.calibration_cache import DiskCache
from canzona.runtime.calibration_keys import device_name
from canzona.runtime.watchdog import Watchdog

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _optimizer(name: str, device: torch.device, ns_dtype: torch.dtype) -> Any:
    """An optimizer of class ``name`` with default hyper-parameters (one tiny matrix)."""
    import canzona

    p = nn.Parameter(torch.zeros(2, 2, device=device))
    if name == "muon":
        return canzona.Muon([p], ns_dtype=ns_dtype)
    if name == "normuon":
        return canzona.NorMuon([p], ns_dtype=ns_dtype)
    if name == "shampoo":
        return canzona.Shampoo([p])
    if name == "soap":
        return canzona.SOAP([p])
    raise ValueError(f"canzona calibrate times muon, normuon, shampoo or soap, got {name!r}")


def _stack(count: int, world: int | None) -> int:
    """Matrices per timed call: 1, or the stack an owner over ``world`` ranks forms."""
    if world is None:
        return 1
    return owner_stack(count, world)


def calibrate_model(
    specs: Sequence[MatrixSpec],
    *,
    optimizer: str,
    out: Path,
    device: str = "cpu",
    ns_dtype: str = "bfloat16",
    budget_s: float = 60.0,
    cache: Path | None = None,
    world: int | None = None,
) -> dict[str, Any]:
    """Time the owner math of every distinct shape of ``specs`` and write a cost table.

    The timing is the runtime's own calibration (the optimizer's compute on random
    payloads, every phase of its math weighted per step), one matrix at a time, within
    ``budget_s``; shapes beyond it are predicted by the table's fit. The file feeds
    ``canzona plan --cost``. With a ``cache`` directory (the format of
    ``PipelineConfig(calibration_cache=...)``), the entries it holds for these shapes, batch
    and settings stand in for timings, and the ones timed here are added. With ``world``,
    each shape is timed on the stack an owner of a plan over that many ranks forms (its
    count / world matrices, at least 1, at most ``MAX_BATCH``; the runtime's calibration
    does the same) instead of one matrix per call: on a GPU small matrices are launch-bound
    alone and cost far less per matrix in a stack.

    Returns:
        A summary: shapes, how many are in the table, how many of those came from the
        cache, seconds spent, the device.

    Raises:
        ValueError: for an unknown optimizer or dtype, a world below 1, or a device this
            torch build does not have.
    """
    if ns_dtype not in _DTYPES:
        raise ValueError(f"ns_dtype must be one of {sorted(_DTYPES)}, got {ns_dtype!r}")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise ValueError(f"world must be a positive int or None, got {world!r}")
    dev = torch.device(device)
    available = getattr(getattr(torch, dev.type, None), "is_available", None)
    if dev.type != "cpu" and not (callable(available) and available()):
        raise ValueError(f"device {device!r} is not available to this torch build")
    out.parent.mkdir(parents=True, exist_ok=True)  # before the timing, not after it
    opt = _optimizer(optimizer, dev, _DTYPES[ns_dtype])
    params, _, gids = opt._flat()
    table = opt._step_table(params, gids)
    payload = table.row(0).payload_dtype
    counts: Counter[tuple[int, int]] = Counter()
    for s in specs:  # matrices, not specs: a 3-D stack is `batch` of them
        counts[s.m, s.n] += s.batch
    shapes = sorted(counts)
    wanted = [
        runtime_calibrate.Shape(0, m, n, _stack(counts[m, n], world), payload, counts[m, n])
        for m, n in shapes
    ]
    base = cost_model(opt.cost_model, **opt._cost_params(opt.param_groups[0]))
    disk = None if cache is None else DiskCache(cache, device_name(dev))
    held = disk.load(warn=False) if disk is not None else {}  # calibrate() warns once
    cached = sum(runtime_calibrate.entry_key(s, table, dev) in held for s in wanted)
    start = time.perf_counter()
    cost: GroupedCost = runtime_calibrate.calibrate(
        wanted,
        table,
        opt._directions,
        {0: base},
        watchdog=Watchdog(None, 0, 1, 600.0, device=dev),
        device=dev,
        budget_s=budget_s,
        shape_cap_s=budget_s / 4,
        cache=disk,
    )
    seconds = time.perf_counter() - start
    model = cost.models["0"]
    assert isinstance(model, MeasuredCost)
    timed = len(model.table)
    meta = {
        "optimizer": optimizer,
        "ns_dtype": ns_dtype,
        "device": device_name(dev),
        "torch": torch.__version__,
        "seconds": seconds,
        "world": world,
        "stacks": [[s.m, s.n, s.k] for s in wanted],
    }
    save_cost_table(out, cost, meta)
    return {
        "shapes": len(shapes),
        "timed": timed,
        "cached": cached,
        "seconds": seconds,
        "device": meta["device"],
    }
