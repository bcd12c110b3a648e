"""The gather -> compute -> scatter pipeline over micro-groups, with overlap."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.checks import wait
from canzona.runtime.config import PipelineConfig
from canzona.runtime.layout import Fragment
from canzona.runtime.routing import Item, Route

ComputeFn = Callable[[Sequence[Item], torch.Tensor], torch.Tensor]
"""Owner side: full payloads ``(k, m, n)`` of same-shape items -> directions ``(k, m, n)``."""

ApplyFn = Callable[[int, torch.Tensor], None]
"""Storage side: (parameter index, this rank's fragment of its direction) -> None."""


@dataclass
class StepStats:
    """What one rank did in one step (exposed as ``optimizer.last_step_stats``)."""

    rank: int = 0
    micro_groups: int = 0
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    matrices_computed: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    total_s: float = 0.0
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
            "wait_s": self.wait_s,
            "total_s": self.total_s,
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
    work: Any
    out: torch.Tensor
    plan: list[tuple[int, list[tuple[Route, Fragment]]]]
    what: str
    group_index: int


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
    ) -> None:
        self.replicated = replicated
        self._payload_dtype: Callable[[int], torch.dtype] = lambda p: torch.float32
        self.routes = routes
        self.groups = [list(g) for g in groups]
        self.local_items = list(local_items)
        self.group = group
        self.rank = rank
        self.world = world
        self.config = config

    # ------------------------------------------------------------------ helpers
    def _wait(self, pending: _Pending, stats: StepStats) -> None:
        start = time.perf_counter()
        wait(
            pending.work,
            timeout_s=self.config.timeout_s,
            what=f"the {pending.what} of micro-group {pending.group_index}",
            rank=self.rank,
        )
        stats.wait_s += time.perf_counter() - start

    def _exchange(
        self,
        sends: dict[int, list[torch.Tensor]],
        recvs: dict[int, list[tuple[Route, Fragment]]],
        dtype: torch.dtype,
        what: str,
        group_index: int,
        stats: StepStats,
    ) -> _Pending:
        in_splits = [sum(t.numel() for t in sends.get(r, ())) for r in range(self.world)]
        out_splits = [sum(f.numel for _, f in recvs.get(r, ())) for r in range(self.world)]
        chunks = [t.reshape(-1).to(dtype) for r in range(self.world) for t in sends.get(r, ())]
        inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype)
        out = torch.empty(sum(out_splits), dtype=dtype)
        work = dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=self.group, async_op=True
        )
        stats.collectives += 1
        size = torch.empty((), dtype=dtype).element_size()
        stats.bytes_sent += (inp.numel() - in_splits[self.rank]) * size
        stats.bytes_received += (out.numel() - out_splits[self.rank]) * size
        plan = [(r, recvs[r]) for r in range(self.world) if recvs.get(r)]
        return _Pending(work, out, plan, what, group_index)

    @staticmethod
    def _segments(pending: _Pending) -> list[tuple[Route, Fragment, torch.Tensor]]:
        out: list[tuple[Route, Fragment, torch.Tensor]] = []
        offset = 0
        for _, entries in pending.plan:
            for route, frag in entries:
                n = frag.numel
                out.append((route, frag, pending.out[offset : offset + n].view(frag.shape)))
                offset += n
        return out

    # ------------------------------------------------------------------ step
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
    ) -> StepStats:
        """Update every active matrix; ``apply`` is called once per local active parameter."""
        stats = StepStats(rank=self.rank)
        self._payload_dtype = payload_dtype
        t0 = time.perf_counter()
        dirs: dict[int, torch.Tensor] = {}
        pending_count: dict[int, int] = {}
        applied: set[int] = set()
        for p in active:
            if p in local_shapes:
                dirs[p] = torch.empty(local_shapes[p], dtype=direction_dtype(p))
                pending_count[p] = 0
        for route in self.routes.values():
            p = route.item.param
            if p in active and route.frag is not None:
                pending_count[p] += 1

        def deliver(route: Route, data: torch.Tensor) -> None:
            p = route.item.param
            target = dirs[p] if route.pos is None else dirs[p][route.pos]
            target.copy_(data.view(target.shape))
            pending_count[p] -= 1
            if pending_count[p] == 0:
                applied.add(p)
                apply(p, dirs[p])

        def local_view(route: Route) -> torch.Tensor:
            data = payloads[route.item.param]
            return data if route.pos is None else data[route.pos]

        groups = [[it for it in g if it.param in active] for g in self.groups]
        groups = [g for g in groups if g]
        stats.micro_groups = len(groups)

        def start_gather(k: int) -> _Pending:
            items = groups[k]
            dtype = common_dtype([payload_dtype(it.param) for it in items])
            sends: dict[int, list[torch.Tensor]] = {}
            recvs: dict[int, list[tuple[Route, Fragment]]] = {}
            for it in items:
                route = self.routes.get(it.name)
                if route is None:
                    continue
                for c in route.send_to:
                    sends.setdefault(c, []).append(local_view(route))
                for s, f in route.sources:
                    recvs.setdefault(s, []).append((route, f))
            return self._exchange(sends, recvs, dtype, "gather", k, stats)

        def run_compute(batches: dict[tuple[int, int, torch.dtype], list[Route]], fill: Any) -> Any:
            results = []
            for (m, n, dtype), members in batches.items():
                full = torch.empty((len(members), m, n), dtype=dtype)
                fill(members, full)
                start = time.perf_counter()
                out = compute([r.item for r in members], full)
                stats.compute_s += time.perf_counter() - start
                stats.matrices_computed += len(members)
                results.append((members, out))
            return results

        # local items first: they need no communication
        local = [self.routes[it.name] for it in self.local_items if it.param in active]
        if local:
            batches: dict[tuple[int, int, torch.dtype], list[Route]] = {}
            for r in local:
                batches.setdefault((r.item.m, r.item.n, payload_dtype(r.item.param)), []).append(r)

            def fill_local(members: list[Route], full: torch.Tensor) -> None:
                for i, r in enumerate(members):
                    full[i].copy_(local_view(r))

            for members, out in run_compute(batches, fill_local):
                for i, r in enumerate(members):
                    deliver(r, out[i])

        if groups and self.group is not None:
            self._run_groups(groups, start_gather, run_compute, deliver, direction_dtype, stats)
        for p, count in pending_count.items():
            if p not in applied:
                assert count == 0, f"parameter {p}: {count} fragments never arrived"
                apply(p, dirs[p])
        stats.total_s = time.perf_counter() - t0
        return stats

    def _run_groups(
        self,
        groups: list[list[Item]],
        start_gather: Callable[[int], _Pending],
        run_compute: Callable[..., Any],
        deliver: Callable[[Route, torch.Tensor], None],
        direction_dtype: Callable[[int], torch.dtype],
        stats: StepStats,
    ) -> None:
        overlap = self.config.overlap
        gathers: dict[int, _Pending] = {0: start_gather(0)}
        scatter_pending: list[_Pending] = []

        def finish_scatter(pending: _Pending) -> None:
            self._wait(pending, stats)
            for route, _, data in self._segments(pending):
                deliver(route, data)

        for k in range(len(groups)):
            if overlap and k + 1 < len(groups):
                gathers[k + 1] = start_gather(k + 1)
            pending = gathers.pop(k)
            self._wait(pending, stats)
            frags: dict[str, list[tuple[Fragment, torch.Tensor]]] = {}
            for route, frag, data in self._segments(pending):
                frags.setdefault(route.item.name, []).append((frag, data))
            items = groups[k]
            batches: dict[tuple[int, int, torch.dtype], list[Route]] = {}
            for it in items:
                if it.name in frags:
                    dt = self._payload_dtype(it.param)
                    batches.setdefault((it.m, it.n, dt), []).append(self.routes[it.name])

            def fill(
                members: list[Route],
                full: torch.Tensor,
                frags: dict[str, list[tuple[Fragment, torch.Tensor]]] = frags,
            ) -> None:
                for i, r in enumerate(members):
                    for frag, data in frags[r.item.name]:
                        frag.write_(full[i], data)

            start = time.perf_counter()
            results = run_compute(batches, fill)
            stats.group_compute_s.append(time.perf_counter() - start)
            sends = self._order_sends(items, results, deliver)
            if not self.replicated:  # replicated: every rank computed everything itself
                dtype = common_dtype([direction_dtype(it.param) for it in items])
                recvs: dict[int, list[tuple[Route, Fragment]]] = {}
                for it in items:
                    mine = self.routes.get(it.name)
                    if mine is None or mine.frag is None or mine.replicated:
                        continue
                    recvs.setdefault(mine.computing[0], []).append((mine, mine.frag))
                scatter = self._exchange(sends, recvs, dtype, "scatter", k, stats)
                if overlap:
                    if scatter_pending:
                        finish_scatter(scatter_pending.pop())
                    scatter_pending.append(scatter)
                else:
                    finish_scatter(scatter)
            if not overlap and k + 1 < len(groups):
                gathers[k + 1] = start_gather(k + 1)
        while scatter_pending:
            finish_scatter(scatter_pending.pop(0))

    @staticmethod
    def _order_sends(
        items: list[Item], results: list[Any], deliver: Callable[[Route, torch.Tensor], None]
    ) -> dict[int, list[torch.Tensor]]:
        """Owner side of a scatter, in the group's item order (the receivers' order).

        With the replicated strategy every rank computed the matrix itself: it keeps
        its own fragment and nothing is sent.
        """
        by_name: dict[str, tuple[Route, torch.Tensor]] = {}
        for members, out in results:
            for i, r in enumerate(members):
                by_name[r.item.name] = (r, out[i])
        sends: dict[int, list[torch.Tensor]] = {}
        for it in items:
            entry = by_name.get(it.name)
            if entry is None:
                continue
            route, direction = entry
            if route.replicated:
                if route.frag is not None:
                    deliver(route, route.frag.read(direction))
                continue
            for t, f in route.targets:
                sends.setdefault(t, []).append(f.read(direction))
        return sends
