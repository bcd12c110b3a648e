"""Calibration: time the owner math on this device once, agree on one cost table across ranks."""

from __future__ import annotations

import hashlib
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from canzona.plan import CostModel, GroupedCost, MatrixSpec, PlanConfig
from canzona.plan.measured import (
    MAX_BATCH,
    MeasuredCost,
    batch_line,
    class_fits,
    fit_loglog,
    owner_stack,
    owner_transfer_share,
    piece_size,
)
from canzona.runtime import timing
from canzona.runtime.calibration_cache import DiskCache, Entry
from canzona.runtime.calibration_keys import device_name, group_settings, kernel_settings
from canzona.runtime.routing import Item
from canzona.runtime.table import ComputeBatch, ComputeFn, StepTable
from canzona.runtime.watchdog import Watchdog

#: Seconds of timing a calibration may spend in all (shapes beyond it are predicted).
BUDGET_S = 1.5
#: A shape whose closed-form work predicts more than this many seconds is predicted, not timed.
SHAPE_CAP_S = timing.SHAPE_CAP_S
#: Most elements of the stack a calibration times at twice the owners' batch (pieces).
PIECE_MAX_ELEMENTS = 1 << 26
#: Bytes per rank of the all-to-all that measures the transfer rate.
PROBE_BYTES = 1 << 22
#: Two middle timings further apart than this ratio: the higher one is taken for a stall.
STALL_RATIO = 1.25
#: The watchdog phase of the calibration's collectives: with the step's checks, before the
#: plan digest's (phase 1).
PHASE = 0

_CACHE: dict[tuple[object, ...], float] = {}
_RATES: dict[tuple[object, ...], float] = {}


@dataclass(frozen=True, slots=True)
class Shape:
    """One distinct owner computation: a param group's ``m x n`` matrices, ``k`` at a time."""

    key: int
    m: int
    n: int
    k: int
    dtype: torch.dtype
    #: Matrices of this shape in the model (what orders the timing; not part of the key).
    count: int = field(default=1, compare=False)


def shapes_of(items: Sequence[Item], table: StepTable, world: int) -> list[Shape]:
    """The distinct (group, shape) computations of the planned items.

    Each with the batch an owner is expected to stack: ``count / world``, at least 1, at
    most :data:`MAX_BATCH`.
    """
    counts: dict[tuple[int, int, int, torch.dtype], int] = {}
    for it in items:
        if it.is_local:
            continue
        row = table.row(it.param)
        key = (row.batch_key, it.m, it.n, row.payload_dtype)
        counts[key] = counts.get(key, 0) + 1
    out = []
    for (gid, m, n, dtype), count in sorted(counts.items(), key=lambda kv: repr(kv[0])):
        out.append(Shape(gid, m, n, owner_stack(count, world), dtype, count))
    return out


def _key_fields(shape: Shape, table: StepTable, device: torch.device) -> tuple[object, ...]:
    """What prices ``shape`` besides its phases: device, torch, configuration, settings, shape.

    The device's name comes first (tests read it from the process cache's keys).
    """
    return (
        device_name(device),
        torch.__version__,
        kernel_settings(),
        table.config,
        group_settings(table.hparams[shape.key]),
        shape.key,
        shape.m,
        shape.n,
        shape.k,
        str(shape.dtype),
    )


def entry_key(shape: Shape, table: StepTable, device: torch.device) -> str:
    """The digest that keys one shape's timings in a :class:`DiskCache`.

    It covers the device, the torch version, the process-wide settings that choose the
    kernels (:func:`kernel_settings`), the optimizer's configuration, the param group's
    settings, the shape, the batch, the payload dtype, and the phases timed and their
    weights.
    """
    fields = (*_key_fields(shape, table, device), table.calibration[shape.key])
    return hashlib.sha256(repr(fields).encode()).hexdigest()


@dataclass(slots=True)
class _Timing:
    """One shape's calibration: its phases' calls (those not in the process cache), warmed up."""

    shape: Shape
    #: ``(process-cache key, weight, call)`` per phase still to time.
    calls: list[tuple[tuple[object, ...], float, timing.Call]]
    #: Seconds per matrix of the phases found in the process cache (weighted).
    cached: float
    failed: bool = False

    def estimate(self) -> float:
        """Seconds per matrix from the calls timed after the warm-ups (-1: the math raised)."""
        if self.failed:
            return -1.0
        return self.cached + sum(w * c.first / c.k for _, w, c in self.calls)

    def cost(self, evict_s: float) -> float:
        """Seconds of the warm-up calls, the timed calls to come and their cache evictions."""
        return sum(_cost(c.first, evict_s) for _, _, c in self.calls)

    def warm_s(self) -> float:
        """Seconds of the calls timed after the warm-ups."""
        return sum(c.first for _, _, c in self.calls)

    def seconds(self) -> float:
        """Seconds per matrix, every phase (-1 when the math raised); fills the process cache."""
        if self.failed or any(c.failed for _, _, c in self.calls):
            return -1.0
        total = self.cached
        for key, weight, call in self.calls:
            seconds = call.seconds() / call.k
            _CACHE[key] = seconds
            total += weight * seconds
        return total


def _start(
    shape: Shape, table: StepTable, compute: ComputeFn, device: torch.device, rank: int
) -> _Timing:
    """The shape's calls for every phase not in the process cache, each run once."""
    fields = _key_fields(shape, table, device)
    calls: list[tuple[tuple[object, ...], float, timing.Call]] = []
    cached = 0.0
    for phase, weight in table.calibration[shape.key]:
        cache_key = (*fields, phase)
        seconds = _CACHE.get(cache_key)
        if seconds is not None:
            cached += weight * seconds
            continue
        gen = torch.Generator(device=device).manual_seed(shape.m * 131 + shape.n)
        full = torch.randn((shape.k, shape.m, shape.n), generator=gen, device=device).to(
            shape.dtype
        )
        name = f"calibration/{shape.key}/{shape.m}x{shape.n}/{shape.dtype}/{phase}"
        items = tuple(
            Item(f"{name}/{j}", -1, None, shape.m, shape.n, (rank,), (rank,))
            for j in range(shape.k)
        )
        batch = ComputeBatch(items, shape.key, table.hparams[shape.key], phase)
        calls.append((cache_key, weight, timing.Call(compute, batch, full, shape.k)))
    out = _Timing(shape, calls, cached)
    try:
        timing.warm_up([c for _, _, c in calls])
    except Exception:  # an untimeable shape is predicted; ranks must stay in step
        out.failed = True
    return out


def time_shape(
    shape: Shape, table: StepTable, compute: ComputeFn, device: torch.device, rank: int
) -> float:
    """Seconds per matrix of the owner math for ``shape`` (every calibration phase)."""
    one = _start(shape, table, compute, device, rank)
    if not one.failed:
        timing.time_rounds([c for _, _, c in one.calls])
    return one.seconds()


def _eviction_seconds(device: torch.device) -> float:
    """Seconds of one cache eviction (0 on a GPU, which does not evict)."""
    if device.type == "cuda":
        return 0.0
    timing.evict_caches()  # the first one allocates
    tick = timing.clock()
    t0 = tick()
    timing.evict_caches()
    return tick() - t0


def median_over_ranks(timed: list[float], watchdog: Watchdog, device: torch.device) -> list[float]:
    """Per timing, the median of the ranks that took it (-1 when none did).

    One all-gather; the same numbers on every rank. Of an even count the two middle timings
    are averaged, unless the higher exceeds the lower by more than :data:`STALL_RATIO`:
    interference only adds time (another process on the core, a stalled page, a virtual CPU
    descheduled while its thread's clock runs on), so then the lower one is taken: with two
    ranks, a stall on one of them is outvoted by the other (a one-rank stall once priced a
    2304 x 768 call at 5.6 times its time and the plan on it was wrong by as much), while
    ordinary noise is averaged instead of always taking the faster rank's timing.
    """
    mine = torch.tensor(timed, dtype=torch.float64, device=device)
    rows = torch.empty(watchdog.world * len(timed), dtype=torch.float64, device=device)
    watchdog.collective(
        PHASE,
        "the calibration's agreement on timings",
        lambda: dist.all_gather_single(rows, mine, group=watchdog.process_group, async_op=True),
    )
    table = rows.view(watchdog.world, len(timed)).tolist()
    return [
        _robust_median([row[i] for row in table if 0 <= row[i] < math.inf])
        for i in range(len(timed))
    ]


def _robust_median(values: list[float]) -> float:
    """The median of the valid timings of one shape (see :func:`median_over_ranks`); -1 if none."""
    if not values:
        return -1.0
    values = sorted(values)
    half = len(values) // 2
    if len(values) % 2:
        return values[half]
    low, high = values[half - 1], values[half]
    if high > STALL_RATIO * low:
        return low
    mean = (low + high) / 2
    return mean if mean < math.inf else low / 2 + high / 2  # the sum past a float's range


def measure_transfer(watchdog: Watchdog, device: torch.device) -> float:
    """Bytes per second of an all-to-all between the ranks (the slowest rank's view).

    Collective: every rank calls it (:func:`calibrate` agrees on whether to).
    """
    world = watchdog.world
    # equal parts: each rank's input split for a peer is that peer's output split
    numel = PROBE_BYTES // 4 // world * world
    inp = torch.zeros(numel, dtype=torch.float32, device=device)
    out = torch.empty_like(inp)
    splits = [numel // world] * world
    what = "the calibration's transfer-rate probe"

    def probe() -> Any:
        pg = watchdog.process_group
        return dist.all_to_all_single(out, inp, splits, splits, group=pg, async_op=True)

    watchdog.collective(PHASE, what, probe)  # warm-up
    t0 = time.perf_counter()
    watchdog.collective(PHASE, what, probe)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    watchdog.collective(
        PHASE,
        what,
        lambda: dist.all_reduce(
            elapsed, op=dist.ReduceOp.MAX, group=watchdog.process_group, async_op=True
        ),
    )
    moved = numel * 4 * (world - 1) / world  # the same number on every rank
    return moved / max(float(elapsed.item()), 1e-9)


def _companion(shape: Shape) -> Shape:
    """The same computation at a second batch size (1, or 2 for a shape timed alone)."""
    return replace(shape, k=1 if shape.k > 1 else 2)


def _doubled(shape: Shape) -> Shape | None:
    """The shape at twice its batch, where owners stack a full batch and it stays small.

    Its timing shows whether a longer stack still saves fixed parts (:func:`piece_size`).
    """
    if shape.k != MAX_BATCH or 2 * shape.k * shape.m * shape.n > PIECE_MAX_ELEMENTS:
        return None
    return replace(shape, k=2 * shape.k)


def _cost(call_s: float, evict_s: float = 0.0) -> float:
    """Seconds that timing a call of ``call_s`` takes.

    The warm-up, the timed calls and, for a short call, a cache eviction before each.
    """
    n = timing.repeats(call_s)
    return call_s * (1 + n) + (n * evict_s if call_s < timing.SHORT_CALL_S else 0.0)


def timing_order(
    shapes: Sequence[Shape], flops: Sequence[float], device: torch.device
) -> list[int]:
    """The order in which :func:`calibrate` times ``shapes`` (indices).

    The shapes that carry most of the model's owner work (``count`` times FLOPs) first: what
    the budget cannot time is fitted. On the CPU the cheapest shape comes before them all:
    its rate, the highest seconds per FLOP there, prices the others before they are timed
    (a call predicted past the cap is fitted, not timed). On an accelerator the cheapest
    shape is launch-bound, dearer per FLOP than a large matrix by two orders of magnitude
    (the H200: a 128x5120 head block against 25600x5120), and priced at its rate every large
    shape would look past the cap; there the first shape, with no rate to price it yet, is
    the one with the most owner work, and its rate prices the rest.
    """
    cheap = sorted(range(len(shapes)), key=lambda i: flops[i])
    if device.type != "cpu":
        return sorted(cheap, key=lambda i: -shapes[i].count * flops[i])
    return cheap[:1] + sorted(cheap[1:], key=lambda i: -shapes[i].count * flops[i])


def _stored(hits: Mapping[int, Entry], n: int) -> tuple[list[float], list[float], list[float]]:
    """The three timings of every shape as the cache holds them (-1 where it does not)."""
    return (
        [hits[i][0] if i in hits else -1.0 for i in range(n)],
        [hits[i][1] if i in hits else -1.0 for i in range(n)],
        [hits[i][2] if i in hits else -1.0 for i in range(n)],
    )


def _time_here(
    shapes: Sequence[Shape],
    flops: Sequence[float],
    order: Sequence[int],
    hits: Mapping[int, Entry],
    table: StepTable,
    compute: ComputeFn,
    device: torch.device,
    rank: int,
    limits: tuple[float, float],
    pieces: bool,
) -> tuple[list[float], list[float], list[float]]:
    """This rank's timings of every shape at its batch, its companion and twice its batch.

    -1 where not timed (the cache's where it has them); see :func:`calibrate`. ``limits``:
    ``(budget_s, shape_cap_s)``.
    """
    budget_s, shape_cap_s = limits
    timed, second, third = _stored(hits, len(shapes))
    evict_s = _eviction_seconds(device) if len(hits) < len(shapes) else 0.0
    spent = 0.0  # seconds of the warm-ups so far and of the timed calls they will need
    rate = 0.0  # seconds per FLOP of one call, the largest seen so far
    extra = 0.0  # seconds a shape's start spends besides its calls (inputs, one-off costs)
    started: list[tuple[list[float], int, _Timing]] = []

    def start(shape: Shape, into: list[float], i: int) -> None:
        nonlocal spent, extra
        t0 = time.perf_counter()
        one = _start(shape, table, compute, device, rank)
        # the warm-up is priced as one more call: what it took besides (fresh pages, the
        # inputs) counts here, and the largest such part prices the shapes to come
        besides = max(time.perf_counter() - t0 - 2 * one.warm_s(), 0.0)
        extra = max(extra, besides)
        spent += besides + one.cost(evict_s)
        into[i] = one.estimate()  # provisional: the timed calls replace it
        if not one.failed:
            started.append((into, i, one))

    for i in order:
        s = shapes[i]
        work = flops[i] * s.k
        if i not in hits:
            call = work * rate
            if rate and (call > shape_cap_s or spent + _cost(call, evict_s) + extra > budget_s):
                continue  # a timing that would end past the budget: predicted instead
            start(s, timed, i)
        if work > 0 and timed[i] > 0:
            rate = max(rate, timed[i] * s.k / work)
    # with what is left, each timed shape at a second batch size: a call's fixed cost, and
    # the per-matrix path of a single matrix (the batched kernels need two or more); the
    # cheapest first: a small shape's fixed part is a larger share of its calls, and its
    # timing leaves budget for more lines than a large shape's does
    companions = sorted(order, key=lambda i: timed[i] * _companion(shapes[i]).k)
    for i in companions:
        other = _companion(shapes[i])
        if i in hits or not timed[i] > 0:
            continue
        if spent + _cost(timed[i] * other.k, evict_s) + extra > budget_s:
            continue
        start(other, second, i)
    # then, with what is still left, twice the full batches: do longer stacks save more?
    for i in companions if pieces else ():
        doubled = _doubled(shapes[i])
        if i in hits or doubled is None or not timed[i] > 0:
            continue
        if spent + _cost(timed[i] * doubled.k, evict_s) + extra > budget_s:
            continue
        start(doubled, third, i)
    # the timed calls, round by round over every started shape (as a step interleaves them)
    timing.time_rounds([c for _, _, one in started for _, _, c in one.calls])
    for into, i, one in started:
        into[i] = one.seconds()
    return timed, second, third


def calibrate(
    shapes: Sequence[Shape],
    table: StepTable,
    compute: ComputeFn,
    bases: Mapping[int, CostModel],
    *,
    watchdog: Watchdog,
    device: torch.device,
    budget_s: float = BUDGET_S,
    shape_cap_s: float = SHAPE_CAP_S,
    cache: DiskCache | None = None,
    pieces: bool | None = None,
) -> GroupedCost:
    """Time the owner math of every shape (within a budget), agree on one table, fit the rest.

    Every rank times the shapes it can within ``budget_s`` (in :func:`timing_order`: on the
    CPU the cheapest first, then by the owner work the model has of each, ``count`` times
    FLOPs, most first; elsewhere by owner work only; a shape whose
    predicted time exceeds ``shape_cap_s``, whose timing would end past the budget (its
    calls predicted from the shapes timed so far), or whose math raises, is not timed
    there), in CPU time with one intra-op thread; one all-gather gives every rank each
    shape's median over the ranks (:func:`median_over_ranks`), so every rank plans with
    identical numbers. Shapes no rank timed are predicted per param group from a log-log
    fit of time against the closed-form FLOPs of the timed ones of their class (the same
    smaller side, else the same aspect bucket: ``plan.measured.shape_classes``), else of all
    of them. With the budget left, a second pass times each timed shape, the cheapest first,
    at a second batch size (1, or 2 for a shape timed alone), which splits a call into a
    fixed cost and a cost per matrix (``MeasuredCost.batches``): the batches a plan forms
    are then priced as they run, a single matrix included (it runs the per-matrix kernels,
    not the batched ones). With ``pieces`` (default: on accelerators), a shape timed at a
    full batch (:data:`MAX_BATCH`) is also timed at twice it, with the budget then left: a
    call on it that takes about two calls on the batch runs in pieces
    (:func:`~canzona.plan.measured.piece_size`; per-matrix CUDA-graph replays do), and the
    table prices longer stacks as pieces (``MeasuredCost.pieces``). A small all-to-all
    measures the transfer rate (once per process and process group: a rate measured before
    rides the agreement, so every rank probes or none does). A rank whose timings raise
    outside the timed math (out of memory for the inputs) warns and plans with the other
    ranks' timings; every wait has the watchdog's deadline.

    With a ``cache``, a shape whose entry (:func:`entry_key`) the rank finds there is not
    timed: the stored agreed timings stand in for the rank's own (and cost no budget); the
    all-gather then agrees on the table as always, so ranks that find different files (or
    none) still plan with one table. Rank 0 writes the agreed timings back when it timed a
    shape its file lacked; a job whose ranks all find every shape times nothing.

    Returns:
        One :class:`~canzona.plan.measured.MeasuredCost` per param group (keyed by
        ``str(batch_key)``), collective-identical on every rank.
    """
    if device.type == "cpu":
        timing.settle_heap()
    if pieces is None:
        pieces = device.type != "cpu"
    flops = [bases[s.key].flops(MatrixSpec("s", (s.m, s.n))) for s in shapes]
    order = timing_order(shapes, flops, device)
    keys = [entry_key(s, table, device) for s in shapes] if cache is not None else []
    stored: dict[str, Entry] = cache.load() if cache is not None else {}
    hits = {i: stored[k] for i, k in enumerate(keys) if k in stored}
    try:  # this rank's timings
        timed, second, third = _time_here(
            shapes,
            flops,
            order,
            hits,
            table,
            compute,
            device,
            watchdog.rank,
            (budget_s, shape_cap_s),
            pieces,
        )
    except Exception as exc:  # (out of memory for the inputs): the other ranks' stand, and
        # every rank still enters the agreement below
        warnings.warn(
            f"rank {watchdog.rank}: the calibration raised ({type(exc).__name__}: {exc}); "
            "the other ranks' timings price the plan",
            RuntimeWarning,
            stacklevel=2,
        )
        timed, second, third = _stored(hits, len(shapes))
    # the transfer rate this process measured before rides the agreement: whether the
    # probe (a collective) runs is then the same on every rank, whatever each one cached
    rate_key = (id(watchdog.process_group), watchdog.world, str(device))
    known = _RATES.get(rate_key, -1.0)
    agreed = [*timed, *second, *third, known]
    if watchdog.process_group is not None:
        agreed = median_over_ranks(agreed, watchdog, device)
    known = agreed.pop()
    n = len(shapes)
    if cache is not None and watchdog.rank == 0 and len(hits) < n:
        cache.store(
            {
                keys[i]: (agreed[i], agreed[n + i], agreed[2 * n + i])
                for i in range(n)
                if agreed[i] >= 0
            }
        )
    bytes_per_s = 0.0
    if watchdog.process_group is not None:
        bytes_per_s = known if known > 0 else measure_transfer(watchdog, device)
        _RATES[rate_key] = bytes_per_s
    models: dict[str, CostModel] = {}
    rows = list(zip(shapes, agreed[:n], agreed[n : 2 * n], agreed[2 * n :], strict=True))
    # a group without a timed shape (all past the cap, out of the budget, or raising) is
    # priced by every group's timed shapes: in seconds like the others, never in FLOPs
    timed_points = [
        (s.key, ((s.m, s.n), f, t))
        for s, f, t in zip(shapes, flops, agreed[:n], strict=True)
        if t >= 0
    ]
    anyone = [point for _, point in timed_points]
    for key, base in bases.items():
        mine = [(s, t, u, v) for s, t, u, v in rows if s.key == key and t >= 0]
        points = [point for k, point in timed_points if k == key] or anyone
        lines = []
        sizes = []
        for s, t, u, v in mine:
            k2 = _companion(s).k
            line = batch_line((s.k, t * s.k), (k2, u * k2)) if u > 0 else None
            if line is not None:
                lines.append(((s.m, s.n), *line))
                size = piece_size(s.k, line, v * 2 * s.k) if v > 0 else None
                if size is not None:
                    sizes.append(((s.m, s.n), size))
        models[str(key)] = MeasuredCost(
            base=base,
            table=tuple(((s.m, s.n), t) for s, t, _, _ in mine),
            fit=fit_loglog([(work, t) for _, work, t in points]),
            class_fits=class_fits(points),
            bytes_per_s=bytes_per_s,
            transfer_share=owner_transfer_share(watchdog.world),
            batches=tuple(lines),
            pieces=tuple(sizes),
        )
    return GroupedCost(models, name=next(iter(bases.values())).name)


def measures(
    config: PlanConfig, table: StepTable, compute: ComputeFn | None, distributed: bool
) -> bool:
    """Whether a plan of ``config`` balances measured seconds (see ``PlanConfig.cost``)."""
    return (
        config.cost == "measured"
        and config.strategy == "canzona"
        and distributed
        and compute is not None
        and isinstance(table.cost, GroupedCost)
        and bool(table.calibration)
    )
