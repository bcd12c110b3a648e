"""The gather -> compute -> scatter pipeline over micro-groups, with overlap."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.checks import failing_ranks
from canzona.runtime.config import PipelineConfig, UpdateFailedError
from canzona.runtime.layout import Fragment
from canzona.runtime.routing import Item, Route
from canzona.runtime.watchdog import Watchdog

ComputeFn = Callable[[Sequence[Item], torch.Tensor], torch.Tensor]
"""Owner side: full payloads ``(k, m, n)`` of same-shape items -> directions ``(k, m, n)``."""

ApplyFn = Callable[[int, torch.Tensor], None]
"""Storage side: (parameter index, this rank's fragment of its direction) -> None."""

Batches = dict[tuple[int, int, torch.dtype, object], list[Route]]


@dataclass
class StepStats:
    """What one rank did in one step (exposed as ``optimizer.last_step_stats``).

    ``compute_s`` is the wall time of the owner-side math and ``compute_cpu_s`` its CPU
    time on this thread (they differ when processes share cores); ``wait_s`` is time
    blocked on collectives; ``total_s`` is the whole matrix phase of the step.
    """

    rank: int = 0
    micro_groups: int = 0
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    matrices_computed: int = 0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
    skipped: bool = False
    group_compute_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict view (JSON-friendly)."""
        return {
            "rank": self.rank,
            "micro_groups": self.micro_groups,
            "collectives": self.collectives,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "matrices_computed": self.matrices_computed,
            "compute_s": self.compute_s,
            "compute_cpu_s": self.compute_cpu_s,
            "wait_s": self.wait_s,
            "total_s": self.total_s,
            "skipped": self.skipped,
        }


def common_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype every member of ``dtypes`` converts to and from exactly."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    if out in (torch.bfloat16, torch.float16) and len(set(dtypes)) > 1:
        out = torch.float32
    return out


@dataclass
class _Pending:
    """An all-to-all in flight and how to read what it receives."""

    work: Any
    out: torch.Tensor
    plan: list[tuple[int, list[tuple[Route, Fragment]]]]
    what: str
    group_index: int
    status: bool  # each source segment starts with one status element

    def segments(self) -> tuple[list[int], list[tuple[Route, Fragment, torch.Tensor]]]:
        """(ranks that reported a failure, [(route, fragment, received data)])."""
        failed: list[int] = []
        out: list[tuple[Route, Fragment, torch.Tensor]] = []
        offset = 0
        for src, entries in self.plan:
            if self.status:
                if self.out[offset].item() != 0:
                    failed.append(src)
                offset += 1
            for route, frag in entries:
                n = frag.numel
                out.append((route, frag, self.out[offset : offset + n].view(frag.shape)))
                offset += n
        return failed, out


@dataclass
class _Step:
    """Per-step inputs and bookkeeping of :meth:`Pipeline.run`."""

    active: set[int]
    payloads: dict[int, torch.Tensor]
    payload_dtype: Callable[[int], torch.dtype]
    direction_dtype: Callable[[int], torch.dtype]
    compute: ComputeFn
    apply: ApplyFn
    stats: StepStats
    dirs: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)
    applied: set[int] = field(default_factory=set)
    error: BaseException | None = None
    error_where: str = ""
    remote: list[tuple[int, list[int]]] = field(default_factory=list)
    device: torch.device | None = None
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    batch_key: Callable[[int], object] = lambda p: None

    def key(self, item: Item) -> tuple[int, int, torch.dtype, object]:
        """Matrices computed in one call: same shape, payload dtype and batch key."""
        return (item.m, item.n, self.payload_dtype(item.param), self.batch_key(item.param))

    def local_view(self, route: Route) -> torch.Tensor:
        data = self.payloads[route.item.param]
        return data if route.pos is None else data[route.pos]

    def deliver(self, route: Route, data: torch.Tensor) -> None:
        p = route.item.param
        if route.pos is None:  # a 2-D parameter: one fragment is its whole direction
            self.pending[p] -= 1
            self.applied.add(p)
            self.apply(p, data.view(self.shapes[p]).to(self.direction_dtype(p)))
            return
        if p not in self.dirs:
            self.dirs[p] = self.empty_direction(p)
        self.dirs[p][route.pos].copy_(data.view(self.dirs[p].shape[1:]))
        self.pending[p] -= 1
        if self.pending[p] == 0:
            self.applied.add(p)
            self.apply(p, self.dirs[p])

    def empty_direction(self, p: int) -> torch.Tensor:
        return torch.empty(self.shapes[p], dtype=self.direction_dtype(p), device=self.device)

    def run_compute(
        self, batches: Batches, fill: Callable[[list[Route], torch.Tensor], None], where: str
    ) -> list[tuple[list[Route], torch.Tensor]]:
        """Compute every batch; an exception is recorded and zeros stand in for the result."""
        results = []
        for (m, n, dtype, _), members in batches.items():
            if self.error is None:
                try:
                    full = torch.empty((len(members), m, n), dtype=dtype, device=self.device)
                    fill(members, full)
                    start, cpu = time.perf_counter(), time.thread_time()
                    out = self.compute([r.item for r in members], full)
                    self.stats.compute_s += time.perf_counter() - start
                    self.stats.compute_cpu_s += time.thread_time() - cpu
                    self.stats.matrices_computed += len(members)
                    results.append((members, out))
                    continue
                except Exception as exc:  # every rank must still enter the collectives
                    self.error, self.error_where = exc, where
            dt = common_dtype([self.direction_dtype(r.item.param) for r in members])
            zeros = torch.zeros((len(members), m, n), dtype=dt, device=self.device)
            results.append((members, zeros))
        return results


class Pipeline:
    """Runs one optimizer step's matrix updates for one rank.

    Args:
        routes: This rank's routes by item name (from :func:`route_all`).
        groups: Global micro-groups, each a list of items in canonical order.
        local_items: Items this rank updates alone (no communication).
        group: Process group of the collectives (None: single process).
        rank: This rank in ``group``.
        world: Size of ``group``.
        config: Pipeline configuration.
        replicated: The plan's strategy is ``replicated`` (no scatter phase).
        watchdog: Deadline and progress markers of the collectives.
        device: Device of the communication buffers (the parameters' device).
    """

    def __init__(
        self,
        *,
        routes: dict[str, Route],
        groups: Sequence[Sequence[Item]],
        local_items: Sequence[Item],
        group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        config: PipelineConfig,
        replicated: bool = False,
        watchdog: Watchdog | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.routes = routes
        self.groups = [list(g) for g in groups]
        self.local_items = list(local_items)
        self.group = group
        self.rank = rank
        self.world = world
        self.config = config
        self.replicated = replicated
        self.watchdog = watchdog or Watchdog(group, rank, world, config.timeout_s)
        self.device = device or torch.device("cpu")

    def _exchange(
        self,
        sends: dict[int, list[torch.Tensor]],
        recvs: dict[int, list[tuple[Route, Fragment]]],
        dtype: torch.dtype,
        what: str,
        group_index: int,
        stats: StepStats,
        status: float | None = None,
    ) -> _Pending:
        """Issue one packed all_to_all_single; with ``status``, every pair exchanges a flag."""
        extra = 0 if status is None else 1
        in_splits = [extra + sum(t.numel() for t in sends.get(r, ())) for r in range(self.world)]
        out_splits = [extra + sum(f.numel for _, f in recvs.get(r, ())) for r in range(self.world)]
        chunks: list[torch.Tensor] = []
        for r in range(self.world):
            if status is not None:
                chunks.append(torch.full((1,), status, dtype=dtype, device=self.device))
            chunks += [t.reshape(-1).to(dtype) for t in sends.get(r, ())]
        inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=self.device)
        out = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        phase = 10 + 2 * group_index + (1 if what == "scatter" else 0)
        self.watchdog.mark(phase, f"the {what} of micro-group {group_index}")
        work = dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=self.group, async_op=True
        )
        stats.collectives += 1
        size = out.element_size()
        stats.bytes_sent += (inp.numel() - in_splits[self.rank]) * size
        stats.bytes_received += (out.numel() - out_splits[self.rank]) * size
        if status is None:
            plan = [(r, recvs[r]) for r in range(self.world) if recvs.get(r)]
        else:
            plan = [(r, recvs.get(r, [])) for r in range(self.world)]
        return _Pending(work, out, plan, what, group_index, status is not None)

    def _wait(self, pending: _Pending, stats: StepStats) -> None:
        start = time.perf_counter()
        self.watchdog.wait(pending.work, f"the {pending.what} of micro-group {pending.group_index}")
        stats.wait_s += time.perf_counter() - start

    def run(
        self,
        *,
        active: set[int],
        payloads: dict[int, torch.Tensor],
        payload_dtype: Callable[[int], torch.dtype],
        direction_dtype: Callable[[int], torch.dtype],
        local_shapes: dict[int, tuple[int, ...]],
        compute: ComputeFn,
        apply: ApplyFn,
        batch_key: Callable[[int], object] = lambda p: None,
    ) -> StepStats:
        """Update every active matrix; ``apply`` is called once per local active parameter.

        ``compute`` receives same-shape matrices that share ``batch_key`` (the optimizer's
        param group: one set of hyper-parameters per call).

        Raises:
            UpdateFailedError: on every rank, when the computation of some matrix raised
                on some rank. The collectives still complete; the micro-group where the
                failure happened, and every later one, is not applied on any rank.
        """
        step = _Step(active, payloads, payload_dtype, direction_dtype, compute, apply, StepStats())
        step.device = self.device
        step.stats.rank = self.rank
        t0 = time.perf_counter()
        step.shapes = local_shapes
        step.batch_key = batch_key
        for p in active:
            if p in local_shapes:
                step.pending[p] = 0
        for route in self.routes.values():
            if route.item.param in active and route.frag is not None:
                step.pending[route.item.param] += 1
        local = [self.routes[it.name] for it in self.local_items if it.param in active]
        if local:
            batches: Batches = {}
            for r in local:
                batches.setdefault(step.key(r.item), []).append(r)

            def fill_local(members: list[Route], full: torch.Tensor) -> None:
                for i, r in enumerate(members):
                    full[i].copy_(step.local_view(r))

            results = step.run_compute(batches, fill_local, "a local matrix")
            if step.error is None:
                for members, out in results:
                    for i, r in enumerate(members):
                        step.deliver(r, out[i])
        groups = [[it for it in g if it.param in active] for g in self.groups]
        groups = [g for g in groups if g]
        step.stats.micro_groups = len(groups)
        if groups and self.group is not None:
            self._run_groups(groups, step)
        self._finish(step)
        step.stats.total_s = time.perf_counter() - t0
        return step.stats

    def _finish(self, step: _Step) -> None:
        if step.error is not None:
            raise UpdateFailedError(
                f"rank {self.rank}: computing {step.error_where} raised "
                f"{type(step.error).__name__}: {step.error}; the step stopped on every rank"
            ) from step.error
        if step.remote:
            k, ranks = step.remote[0]
            what = "the step" if self.replicated else f"micro-group {k}"
            raise UpdateFailedError(
                f"rank {self.rank}: the update of {what} failed on ranks {ranks} "
                "(see their errors); it and the later micro-groups were not applied"
            )
        for p, count in step.pending.items():
            if p not in step.applied:
                assert count == 0, f"parameter {p}: {count} fragments never arrived"
                assert not math.prod(step.shapes[p]), f"parameter {p}: local data but no matrix"
                step.apply(p, step.empty_direction(p))  # holds nothing of the matrix

    def _gather(self, items: list[Item], step: _Step, k: int) -> _Pending:
        dtype = common_dtype([step.payload_dtype(it.param) for it in items])
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[tuple[Route, Fragment]]] = {}
        for it in items:
            route = self.routes.get(it.name)
            if route is None:
                continue
            for c in route.send_to:
                sends.setdefault(c, []).append(step.local_view(route))
            for s, f in route.sources:
                recvs.setdefault(s, []).append((route, f))
        return self._exchange(sends, recvs, dtype, "gather", k, step.stats)

    def _compute_group(
        self, items: list[Item], pending: _Pending, step: _Step, k: int
    ) -> list[tuple[list[Route], torch.Tensor]]:
        _, segments = pending.segments()
        frags: dict[str, list[tuple[Fragment, torch.Tensor]]] = {}
        for route, frag, data in segments:
            frags.setdefault(route.item.name, []).append((frag, data))
        batches: Batches = {}
        for it in items:
            if it.name in frags:
                batches.setdefault(step.key(it), []).append(self.routes[it.name])

        def fill(members: list[Route], full: torch.Tensor) -> None:
            for i, r in enumerate(members):
                for frag, data in frags[r.item.name]:
                    frag.write_(full[i], data)

        start = time.perf_counter()
        results = step.run_compute(batches, fill, f"micro-group {k}")
        step.stats.group_compute_s.append(time.perf_counter() - start)
        return results

    def _scatter(
        self,
        items: list[Item],
        results: list[tuple[list[Route], torch.Tensor]],
        step: _Step,
        k: int,
    ) -> _Pending:
        by_name = {r.item.name: out[i] for members, out in results for i, r in enumerate(members)}
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[tuple[Route, Fragment]]] = {}
        for it in items:  # owners send and holders receive in the group's item order
            route = self.routes.get(it.name)
            if route is None:
                continue
            direction = by_name.get(it.name)
            if direction is not None:
                for t, f in route.targets:
                    sends.setdefault(t, []).append(f.read(direction))
            if route.frag is not None:
                recvs.setdefault(route.computing[0], []).append((route, route.frag))
        dtype = common_dtype([step.direction_dtype(it.param) for it in items])
        failed = 1.0 if step.error is not None else 0.0
        return self._exchange(sends, recvs, dtype, "scatter", k, step.stats, status=failed)

    def _apply_scatter(self, pending: _Pending, step: _Step) -> None:
        self._wait(pending, step.stats)
        failed, segments = pending.segments()
        if failed or step.remote:
            if failed and not step.remote:
                step.remote.append((pending.group_index, failed))
            return
        for route, _, data in segments:
            step.deliver(route, data)

    def _run_groups(self, groups: list[list[Item]], step: _Step) -> None:
        lookahead = self.config.depth if self.config.overlap else 0
        gathers: dict[int, _Pending] = {}
        issued = 0  # gathers issued so far, in group order
        in_flight: list[_Pending] = []
        kept: list[tuple[Route, torch.Tensor]] = []  # replicated: own fragments, applied last
        for k, items in enumerate(groups):
            while issued <= min(k + lookahead, len(groups) - 1):
                gathers[issued] = self._gather(groups[issued], step, issued)
                issued += 1
            pending = gathers.pop(k)
            self._wait(pending, step.stats)
            results = self._compute_group(items, pending, step, k)
            if self.replicated:  # every rank computed every matrix: keep its own fragment
                for members, out in results:
                    kept += [
                        (r, r.frag.read(out[i]).clone()) for i, r in enumerate(members) if r.frag
                    ]
            else:
                in_flight.append(self._scatter(items, results, step, k))
                while len(in_flight) > lookahead:
                    self._apply_scatter(in_flight.pop(0), step)
        while in_flight:
            self._apply_scatter(in_flight.pop(0), step)
        if self.replicated:
            # no scatter carries a status: one small all-gather decides for every rank
            failed = failing_ranks(
                step.error is None, watchdog=self.watchdog, what="the step's success check"
            )
            if failed:
                step.remote.append((len(groups) - 1, failed))
                return
            for route, data in kept:
                step.deliver(route, data)
