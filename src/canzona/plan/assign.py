"""Owner assignment: which rank computes each matrix, under five strategies, with load metrics."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from canzona.plan.consolidate import CallCosts, consolidate_owners
from canzona.plan.cost import (
    CostModel,
    GroupedCost,
    in_flight,
    priced,
    resolve_cost_model,
    total_of,
)
from canzona.plan.held import held_loads, held_objective, move_seconds, settle_held
from canzona.plan.measured import MeasuredCost
from canzona.plan.refine import refine_owners
from canzona.plan.spec import MatrixSpec, check_specs

__all__ = ["STRATEGIES", "Assignment", "assign_owners", "lower_bound", "pinned_ranks"]

#: Owner-assignment strategies, the first being the default.
STRATEGIES = ("canzona", "numel", "round_robin", "count", "replicated")


def _ratio(values: Sequence[float]) -> float:
    """Max over mean; 1.0 when everything is zero."""
    if not values:
        return 1.0
    mean = math.fsum(values) / len(values)
    return 1.0 if mean == 0 else max(values) / mean


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """The owner rank of every matrix, with per-rank loads.

    Attributes:
        strategy: The strategy that produced it (one of ``STRATEGIES``).
        num_ranks: Number of ranks.
        owner: Matrix name -> owner rank. For ``replicated`` the lowest eligible rank (nominal:
            every eligible rank computes the matrix).
        replicated: Whether every eligible rank computes every matrix.
        loads: Per-rank compute, in FLOPs, of the matrices the rank computes.
        comm_bytes: Per-rank bytes received: the payload of the matrices the rank computes.
        lower_bound: A lower bound on the makespan of any assignment of this instance (FLOPs).
        total: Total FLOPs of the instance (each matrix counted once).
        restricted: Eligible ranks of the matrices that have a restriction.
    """

    strategy: str
    num_ranks: int
    owner: Mapping[str, int]
    replicated: bool = False
    loads: tuple[float, ...]
    comm_bytes: tuple[int, ...]
    lower_bound: float
    total: float
    restricted: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if len(self.loads) != self.num_ranks or len(self.comm_bytes) != self.num_ranks:
            raise ValueError(
                f"loads and comm_bytes need one entry per rank ({self.num_ranks}), "
                f"got {len(self.loads)} and {len(self.comm_bytes)}"
            )
        for name, rank in self.owner.items():
            if not 0 <= rank < self.num_ranks:
                raise ValueError(f"owner of {name!r} outside [0, {self.num_ranks}), got {rank!r}")
        object.__setattr__(self, "owner", MappingProxyType(dict(self.owner)))
        object.__setattr__(self, "restricted", MappingProxyType(dict(self.restricted)))

    def computing_ranks(self, name: str) -> tuple[int, ...]:
        """The ranks that compute ``name``: its owner, or every eligible rank if replicated."""
        owner = self.owner[name]
        if not self.replicated:
            return (owner,)
        return self.restricted.get(name) or tuple(range(self.num_ranks))

    @property
    def makespan(self) -> float:
        """The largest per-rank load (FLOPs)."""
        return max(self.loads, default=0.0)

    @property
    def balance_ratio(self) -> float:
        """Max load over mean load (1.0 is perfect balance)."""
        return _ratio(self.loads)

    @property
    def comm_balance_ratio(self) -> float:
        """Max bytes received over mean bytes received."""
        return _ratio([float(b) for b in self.comm_bytes])

    @property
    def makespan_ratio(self) -> float:
        """Makespan over the lower bound (1.0 when both are zero).

        At least 1 for the strategies that keep pinned matrices on their holders, as the
        bound does; ``round_robin`` and ``count`` ignore pins and may go below it.
        """
        return 1.0 if self.lower_bound == 0 else self.makespan / self.lower_bound


def lower_bound(
    costs: Sequence[float], num_ranks: int, pinned: Sequence[int | None] | None = None
) -> float:
    """Classic makespan lower bound for identical machines, with items pinned to one rank.

    The largest of the mean load ``total / num_ranks``, the largest load pinned to one rank,
    and, for every ``k >= 0`` with ``k * num_ranks + 1`` free items, the sum of the ``k + 1``
    smallest among the ``k * num_ranks + 1`` costliest free items plus the smallest pinned
    load of a rank: by pigeonhole one rank receives ``k + 1`` of them on top of what is pinned
    to it (``k = 0`` gives the costliest free item). ``pinned[i]`` is the only rank item ``i``
    may go to (None: free); other eligibility is ignored, so it stays a valid bound.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if pinned is not None and (
        len(pinned) != len(costs) or any(r is not None and not 0 <= r < num_ranks for r in pinned)
    ):
        raise ValueError(
            f"pinned needs one rank in [0, {num_ranks}) or None per cost ({len(costs)}), "
            f"got {list(pinned)!r}"
        )
    fixed = [0.0] * num_ranks
    free: list[float] = []
    for i, cost in enumerate(costs):
        rank = None if pinned is None else pinned[i]
        if rank is None:
            free.append(cost)
        else:
            fixed[rank] += cost
    if not costs:
        return 0.0
    best = max(math.fsum(costs) / num_ranks, max(fixed))
    ordered = sorted(free, reverse=True)
    if not ordered:
        return best
    floor = min(fixed)
    best = max(best, ordered[0] + floor)
    prefix = list(itertools.accumulate(ordered, initial=0.0))
    k = 1
    while k * num_ranks + 1 <= len(ordered):
        hi = k * num_ranks + 1
        best = max(best, prefix[hi] - prefix[hi - k - 1] + floor)
        k += 1
    return best


def pinned_ranks(specs: Sequence[MatrixSpec]) -> list[int | None]:
    """Per spec, the one rank it is pinned to (None: it may move, or has several holders)."""
    return [
        s.holders[0] if s.pinned and s.holders is not None and len(s.holders) == 1 else None
        for s in specs
    ]


def _lpt(
    order: Iterable[int],
    costs: Sequence[float],
    eligible: Sequence[tuple[int, ...] | None],
    num_ranks: int,
) -> list[int]:
    """Longest processing time first: each item (in ``order``) to the least-loaded eligible rank.

    Ties go to the lowest rank. Each distinct eligibility set keeps a heap of (load, rank)
    with one entry per rank; an entry whose rank has since taken more work is stale (its
    load is too low), so it surfaces early and is refreshed before the top is trusted.
    """
    loads = [0.0] * num_ranks
    heaps: dict[tuple[int, ...] | None, list[tuple[float, int]]] = {}
    owners = [-1] * len(costs)
    for i in order:
        key = eligible[i]
        heap = heaps.get(key)
        if heap is None:
            heap = [(loads[r], r) for r in (range(num_ranks) if key is None else key)]
            heapq.heapify(heap)
            heaps[key] = heap
        while heap[0][0] != loads[heap[0][1]]:
            heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
        rank = heap[0][1]
        loads[rank] += costs[i]
        heapq.heapreplace(heap, (loads[rank], rank))
        owners[i] = rank
    return owners


def _round_robin(specs: Sequence[MatrixSpec], num_ranks: int) -> list[int]:
    """Each set of eligible ranks deals its matrices to its ranks in turn.

    One cursor per set: matrices alternating between disjoint sets (the replicas of an
    HSDP mesh without deduplication) keep every rank of each set busy.
    """
    owners: list[int] = []
    cursors: dict[tuple[int, ...] | None, int] = {}
    for spec in specs:
        start = cursors.get(spec.ranks, 0) % num_ranks
        if spec.ranks is None:
            rank = start
        else:
            pos = bisect.bisect_left(spec.ranks, start)
            rank = spec.ranks[pos % len(spec.ranks)]
        owners.append(rank)
        cursors[spec.ranks] = rank + 1
    return owners


def _count(specs: Sequence[MatrixSpec], num_ranks: int) -> list[int]:
    seen: dict[tuple[tuple[int, ...], tuple[int, ...] | None], int] = {}
    owners = []
    for spec in specs:
        key = (spec.shape, spec.ranks)
        j = seen.get(key, 0)
        seen[key] = j + 1
        owners.append(j % num_ranks if spec.ranks is None else spec.ranks[j % len(spec.ranks)])
    return owners


def _replicated(
    specs: Sequence[MatrixSpec],
    num_ranks: int,
    flops: Sequence[float],
    nbytes: Sequence[int],
    bound: float,
    total: float,
    restricted: Mapping[str, tuple[int, ...]],
) -> Assignment:
    """Every rank computes the unrestricted matrices; restricted ones only where eligible."""
    extra: list[list[float]] = [[] for _ in range(num_ranks)]
    received = [0] * num_ranks
    common = [f for s, f in zip(specs, flops, strict=True) if s.ranks is None]
    common_bytes = sum(b for s, b in zip(specs, nbytes, strict=True) if s.ranks is None)
    for spec, f, b in zip(specs, flops, nbytes, strict=True):
        for rank in spec.ranks or ():
            extra[rank].append(f)
            received[rank] += b
    base = math.fsum(common)
    return Assignment(
        strategy="replicated",
        num_ranks=num_ranks,
        owner={s.name: s.ranks[0] if s.ranks else 0 for s in specs},
        replicated=True,
        loads=tuple(math.fsum([base, *x]) if x else base for x in extra),
        comm_bytes=tuple(common_bytes + b for b in received),
        lower_bound=bound,
        total=total,
        restricted=restricted,
    )


def call_parts(model: CostModel, spec: MatrixSpec) -> tuple[float, float]:
    """``(fixed part of one stacked call on the spec's class, the spec's own cost)``.

    Measured models split a call (:meth:`MeasuredCost.call_parts`); others give ``(0, flops)``.
    """
    if isinstance(model, GroupedCost):
        model = model.model_of(spec)
    if isinstance(model, MeasuredCost):
        return model.call_parts(spec)
    return 0.0, model.flops(spec)


def call_piece(model: CostModel, spec: MatrixSpec) -> int | None:
    """Most matrices of the spec's class that one piece of a call runs (None: any number).

    Measured models know it per shape (:meth:`MeasuredCost.piece_size`); others never limit.
    """
    if isinstance(model, GroupedCost):
        model = model.model_of(spec)
    if isinstance(model, MeasuredCost):
        return model.piece_size(spec.m, spec.n)
    return None


def call_class(spec: MatrixSpec) -> tuple[str | None, int, int, int]:
    """What the runtime stacks into one call: param group (cost key), shape, payload size."""
    return spec.cost_key, spec.m, spec.n, spec.itemsize


def _stack_sizes(
    specs: Sequence[MatrixSpec],
    memory: Sequence[int],
    capacity: int | None,
    pieces: Sequence[int | None] = (),
) -> list[int]:
    """Per matrix, how many of its class share one fixed part of a call on a rank.

    The capacity over the class's largest bytes in flight (at least 1: what one micro-group
    holds per rank), every matrix of the instance when the capacity is unlimited (None);
    at most the class's piece size where its calls run in pieces (``pieces``).
    """
    largest: dict[tuple[str | None, int, int, int], int] = {}
    for spec, nbytes in zip(specs, memory, strict=True):
        key = call_class(spec)
        largest[key] = max(largest.get(key, 0), nbytes)
    everything = max(1, len(specs))
    out = []
    for i, spec in enumerate(specs):
        size = largest[call_class(spec)]
        stack = everything if capacity is None or size <= 0 else max(1, capacity // size)
        piece = pieces[i] if pieces else None
        out.append(stack if piece is None else min(stack, piece))
    return out


def _greedy(
    specs: Sequence[MatrixSpec],
    num_ranks: int,
    strategy: str,
    flops: Sequence[float],
    nbytes: Sequence[int],
    alpha: float,
    refine: bool,
    parts: Sequence[tuple[float, float]] = (),
    memory: Sequence[int] = (),
    capacity: int | None = None,
    pieces: Sequence[int | None] = (),
    seconds_moved: Sequence[float] = (),
) -> list[int]:
    """Owners by LPT on element counts (``numel``) or the blended cost (``canzona``).

    A held matrix starts on its least loaded holder (it moves no bytes there); a pinned one
    is eligible on its holders only. ``canzona`` then refines, gives back to their holders
    the held matrices whose move does not pay for itself (``seconds_moved``: per matrix,
    what owning it off its holders costs the owner and each holder, :func:`settle_held`),
    and keeps the greedy result unless that is at least as good on the blended objective
    with those costs; where ``parts`` gives calls a fixed part (measured costs), it then
    gathers same-class matrices on fewer owners without raising the makespan
    (``consolidate_owners``).
    """
    eligible = [s.holders if s.pinned else s.ranks for s in specs]
    # data already in place starts there: the greedy places a held matrix on its least
    # loaded holder; the refinement may still move it when that strictly lowers the makespan
    # with the move's price (see settle_held)
    start_on = [s.holders if s.holders is not None else s.ranks for s in specs]
    if strategy == "numel":
        costs = [float(s.numel) for s in specs]
    else:
        moved = [0 if s.holders is not None else b for s, b in zip(specs, nbytes, strict=True)]
        total_bytes = math.fsum(moved)
        total = math.fsum(flops)
        w_bytes = (1.0 - alpha) / total_bytes if total_bytes else 0.0
        w_flops = alpha / total if total else 0.0
        costs = [w_bytes * b + w_flops * f for f, b in zip(flops, moved, strict=True)]
    order = sorted(range(len(specs)), key=lambda i: (-costs[i], -nbytes[i], specs[i].name))
    ordered_costs = [costs[i] for i in order]
    ordered_elig = [eligible[i] for i in order]
    ordered_start = [start_on[i] for i in order]
    chosen = _lpt(range(len(order)), ordered_costs, ordered_start, num_ranks)
    if strategy == "canzona" and refine:
        held = [specs[i].holders for i in order]
        # what owning a held matrix off its holders costs its owner and each holder
        seconds = seconds_moved or [0.0] * len(specs)
        moves = [
            w_flops * seconds[i] + w_bytes * nbytes[i] if held[pos] is not None else 0.0
            for pos, i in enumerate(order)
        ]
        refined = refine_owners(ordered_costs, ordered_elig, chosen, num_ranks, holders=held)
        refined = settle_held(ordered_costs, moves, held, refined, num_ranks)
        before = held_objective(ordered_costs, moves, held, chosen, num_ranks)
        if held_objective(ordered_costs, moves, held, refined, num_ranks) <= before:
            chosen = refined
        if any(fixed > 0 for fixed, _ in parts):
            # a held matrix off its holders stays there: its move is a fixed load
            away = held_loads([0.0] * len(order), moves, held, chosen, num_ranks)
            calls = CallCosts(
                costs=[w_bytes * moved[i] + w_flops * parts[i][1] for i in order],
                fixed=[w_flops * parts[i][0] for i in order],
                classes=[call_class(specs[i]) for i in order],
                stack=_stack_sizes(
                    [specs[i] for i in order],
                    [memory[i] for i in order],
                    capacity,
                    [pieces[i] for i in order] if pieces else (),
                ),
                base=away if any(away) else (),
            )
            movable = [() if specs[i].holders is not None else specs[i].ranks for i in order]
            chosen = consolidate_owners(calls, movable, chosen, num_ranks)
    owners = [0] * len(specs)
    for pos, i in enumerate(order):
        owners[i] = chosen[pos]
    return owners


def assign_owners(
    specs: Sequence[MatrixSpec],
    num_ranks: int,
    *,
    strategy: str = "canzona",
    optimizer: str | CostModel = "muon",
    alpha: float = 1.0,
    refine: bool = True,
    capacity_bytes: int | None = None,
) -> Assignment:
    """Give every matrix an owner rank that computes its update.

    Strategies:

    A matrix that some ranks already hold whole (:attr:`MatrixSpec.holders`) starts on the
    least loaded of them under ``canzona`` and ``numel``, where it moves no bytes; only the
    ``canzona`` refinement moves it elsewhere, and only when that strictly lowers the
    makespan, counting what the move costs the new owner and each holder where the cost
    model measured a transfer rate (:func:`~canzona.plan.held.move_seconds`; ties keep it
    on its holder); a ``pinned`` one never leaves its holders.

    * ``canzona``: longest-processing-time-first greedy on the blended cost
      ``(1 - alpha) * bytes / total_bytes + alpha * flops / total_flops``, in the order
      ``(-cost, -bytes, name)`` (deterministic and independent of the input order), each matrix
      whole to the least-loaded eligible rank (ties to the lowest rank); then, if ``refine``,
      local search (:func:`~canzona.plan.refine.refine_owners`). The result is never worse than
      plain LPT on the blended objective. Where the cost model measured a fixed part per
      call (:class:`~canzona.plan.MeasuredCost` with batch lines), owners are then
      consolidated: same-class matrices gathered on fewer ranks and rebalanced, pricing one
      fixed part per call (:func:`~canzona.plan.consolidate.consolidate_owners`), never
      raising that makespan.
    * ``numel``: the same greedy on element counts, without refinement.
    * ``round_robin``: matrices in the given order dealt to eligible ranks in turn.
    * ``count``: within each same-shape batch, matrices dealt in order from rank 0, so that
      every rank gets the same number.
    * ``replicated``: every eligible rank computes every matrix.

    Args:
        specs: The matrices; names must be unique.
        num_ranks: Number of ranks.
        strategy: One of ``STRATEGIES``.
        optimizer: A cost model or the name of a built-in one.
        alpha: Weight of compute against communication in the blended cost, in [0, 1].
        refine: Run the refinement and consolidation passes (``canzona`` only).
        capacity_bytes: Bytes in flight per rank and micro-group (None: unlimited), which
            bounds how many matrices of a class one call stacks (``canzona`` with measured
            costs, whose calls have a fixed part).

    Returns:
        The assignment with per-rank FLOPs and bytes.

    Raises:
        ValueError: On an unknown strategy, ``alpha`` outside [0, 1], or invalid specs.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    check_specs(specs, num_ranks)
    model = resolve_cost_model(optimizer)
    flops, nbytes = priced(specs, model)
    total = total_of(flops, "the matrices' costs")
    bound = lower_bound(flops, num_ranks, pinned_ranks(specs))
    restricted = {s.name: s.ranks for s in specs if s.ranks is not None}

    if strategy == "replicated":
        return _replicated(specs, num_ranks, flops, nbytes, bound, total, restricted)
    if strategy == "round_robin":
        owners = _round_robin(specs, num_ranks)
    elif strategy == "count":
        owners = _count(specs, num_ranks)
    else:
        parts, memory, pieces, seconds_moved = [], [], [], []
        if strategy == "canzona":
            parts = [call_parts(model, s) for s in specs]
            memory = in_flight(specs, model)
            pieces = [call_piece(model, s) for s in specs]
            seconds_moved = [move_seconds(model, s) for s in specs]
        owners = _greedy(
            specs,
            num_ranks,
            strategy,
            flops,
            nbytes,
            alpha,
            refine,
            parts,
            memory,
            capacity_bytes,
            pieces,
            seconds_moved,
        )

    per_rank: list[list[float]] = [[] for _ in range(num_ranks)]
    received = [0] * num_ranks
    for spec, rank, f, b in zip(specs, owners, flops, nbytes, strict=True):
        per_rank[rank].append(f)
        received[rank] += spec.comm_bytes_on(rank, b)
    return Assignment(
        strategy=strategy,
        num_ranks=num_ranks,
        owner={s.name: r for s, r in zip(specs, owners, strict=True)},
        loads=tuple(math.fsum(x) for x in per_rank),
        comm_bytes=tuple(received),
        lower_bound=bound,
        total=total,
        restricted=restricted,
    )
