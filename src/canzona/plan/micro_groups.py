"""Micro-groups: the order in which owned matrices travel, in capacity-bounded rounds."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from canzona.plan.assign import Assignment, call_class, call_parts, call_piece
from canzona.plan.cost import CostModel, GroupedCost, in_flight, resolve_cost_model
from canzona.plan.measured import MeasuredCost
from canzona.plan.spec import MatrixSpec

__all__ = ["MicroGroup", "micro_groups"]

#: How far down its queue a full rank looks for a smaller matrix (first fit).
LOOKAHEAD = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroGroup:
    """One round of gather -> compute -> scatter.

    Attributes:
        index: Position of the group in the schedule.
        names: The matrices of the group, by descending cost then name.
        owners: The owner of each matrix, aligned with ``names`` (nominal for replicated plans).
        rank_bytes: Per-rank bytes in flight (the assembled payloads the rank computes).
        rank_loads: Per-rank FLOPs of the matrices the rank computes in this group.
    """

    index: int
    names: tuple[str, ...]
    owners: tuple[int, ...]
    rank_bytes: tuple[int, ...]
    rank_loads: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.owners):
            raise ValueError(
                f"names and owners must align, got {len(self.names)} and {len(self.owners)}"
            )
        if len(self.rank_bytes) != len(self.rank_loads):
            raise ValueError(
                "rank_bytes and rank_loads need one entry per rank, "
                f"got {len(self.rank_bytes)} and {len(self.rank_loads)}"
            )

    @property
    def balance_ratio(self) -> float:
        """Max over mean of the per-rank loads of this group (1.0 if all zero)."""
        mean = math.fsum(self.rank_loads) / len(self.rank_loads) if self.rank_loads else 0.0
        return 1.0 if mean == 0 else max(self.rank_loads) / mean


def _finish(
    index: int,
    chosen: Sequence[int],
    specs: Sequence[MatrixSpec],
    assignment: Assignment,
    flops: Sequence[float],
    memory: Sequence[int],
) -> MicroGroup:
    order = sorted(chosen, key=lambda i: (-flops[i], specs[i].name))
    p = assignment.num_ranks
    # matrices every rank computes (unrestricted, replicated) are summed once
    common: list[float] = []
    common_bytes = 0
    loads: list[list[float]] = [[] for _ in range(p)]
    nbytes = [0] * p
    for i in order:
        if assignment.replicated and specs[i].ranks is None:
            common.append(flops[i])
            common_bytes += memory[i]
            continue
        for rank in assignment.computing_ranks(specs[i].name):
            loads[rank].append(flops[i])
            nbytes[rank] += memory[i]
    base = math.fsum(common)
    return MicroGroup(
        index=index,
        names=tuple(specs[i].name for i in order),
        owners=tuple(assignment.owner[specs[i].name] for i in order),
        rank_bytes=tuple(common_bytes + b for b in nbytes),
        rank_loads=tuple(math.fsum([base, *x]) if x else base for x in loads),
    )


def _sort_class(spec: MatrixSpec) -> tuple[str, int, int, int]:
    """:func:`call_class` with a sortable cost key."""
    key, m, n, size = call_class(spec)
    return key or "", m, n, size


def _owned_groups(
    specs: Sequence[MatrixSpec],
    assignment: Assignment,
    capacity: int,
    flops: Sequence[float],
    memory: Sequence[int],
    classes: Sequence[tuple[str, int, int, int]] = (),
    *,
    first_fit: bool = False,
) -> list[list[int]]:
    """Fill groups from per-rank queues, always serving the rank that is furthest behind.

    With ``first_fit`` a rank whose next matrix does not fit in the open group takes the
    costliest of its next :data:`LOOKAHEAD` queued matrices that does, before it is full.

    Given ``classes`` (each matrix's call class: what its owner stacks into one call), a rank
    keeps the matrices of a class together. Equal costs queue by class, and a rank that
    already holds matrices in the open group does not start a class whose queued run would
    not fit in the group's remaining capacity but fits in an empty group: it is full for
    this group instead.
    """
    p = assignment.num_ranks
    coherent = bool(classes)
    queues: list[list[int]] = [[] for _ in range(p)]
    for i, spec in enumerate(specs):
        queues[assignment.owner[spec.name]].append(i)
    for queue in queues:
        # served from the end of the list: costliest first, ties by bytes (then class) then name
        if coherent:
            queue.sort(key=lambda i: (-flops[i], -memory[i], classes[i], specs[i].name))
        else:
            queue.sort(key=lambda i: (-flops[i], -memory[i], specs[i].name))
        queue.reverse()
    done = [0.0] * p
    groups: list[list[int]] = []
    while any(queues):
        heap = [(done[r], r) for r in range(p) if queues[r]]
        heapq.heapify(heap)
        in_flight = [0] * p
        held: list[set[tuple[str, int, int, int]]] = [set() for _ in range(p)]
        chosen: list[int] = []
        full_floor = math.inf  # lowest cumulative load of a rank that ran out of capacity
        while heap:
            load, rank = heapq.heappop(heap)
            if load > full_floor:
                break  # everyone left is ahead of a rank that is already full
            queue = queues[rank]
            at = len(queue) - 1
            i = queue[at]
            if in_flight[rank] and in_flight[rank] + memory[i] > capacity and first_fit:
                at = _fitting(queue, memory, capacity - in_flight[rank])
                i = queue[at] if at >= 0 else i
            if in_flight[rank] and (
                in_flight[rank] + memory[i] > capacity
                or (
                    coherent
                    and classes[i] not in held[rank]
                    and _defers(queue, classes, memory, in_flight[rank], capacity)
                )
            ):
                full_floor = min(full_floor, load)
                continue
            queue.pop(at)
            if coherent:
                held[rank].add(classes[i])
            in_flight[rank] += memory[i]
            done[rank] += flops[i]
            chosen.append(i)
            if queue:
                heapq.heappush(heap, (done[rank], rank))
        groups.append(chosen)
    return groups


def _fitting(queue: Sequence[int], memory: Sequence[int], room: int) -> int:
    """Position of the costliest of the queue's next :data:`LOOKAHEAD` that fits, else -1."""
    for at in range(len(queue) - 1, max(-1, len(queue) - 1 - LOOKAHEAD), -1):
        if memory[queue[at]] <= room:
            return at
    return -1


def _defers(
    queue: Sequence[int],
    classes: Sequence[tuple[str, int, int, int]],
    memory: Sequence[int],
    in_flight: int,
    capacity: int,
) -> bool:
    """Whether the run of the queue's next class should wait for an empty group."""
    cls = classes[queue[-1]]
    run = 0
    for i in reversed(queue):
        if classes[i] != cls:
            break
        run += memory[i]
    return run <= capacity < in_flight + run


def _finish_time(
    groups: Sequence[Sequence[int]],
    owners: Sequence[int],
    classes: Sequence[tuple[str, int, int, int]] | None,
    parts: Sequence[tuple[float, float]],
    pieces: Sequence[int | None] = (),
) -> float:
    """Sum over groups of the busiest owner's cost, each call class's fixed part once.

    Once per piece where a class's calls run in pieces (``pieces``: per matrix, its class's
    piece size or None). ``classes`` None: no fixed parts (only the matrices' own costs).
    """
    total = 0.0
    for chosen in groups:
        loads: dict[int, float] = {}
        calls: dict[tuple[int, tuple[str, int, int, int]], int] = {}
        for i in chosen:
            fixed, own = parts[i]
            if classes is not None:
                call = (owners[i], classes[i])
                seen = calls.get(call, 0)
                calls[call] = seen + 1
                size = pieces[i] if pieces else None
                if seen == 0 or (size is not None and seen % size == 0):
                    own += fixed
            loads[owners[i]] = loads.get(owners[i], 0.0) + own
        total += max(loads.values(), default=0.0)
    return total


def _call_parts(
    model: CostModel, specs: Sequence[MatrixSpec], flops: Sequence[float]
) -> list[tuple[float, float]]:
    """Per matrix, a call's fixed part and its own cost (no fixed part without measured costs)."""
    if not isinstance(model, MeasuredCost | GroupedCost):
        return [(0.0, f) for f in flops]
    seen: dict[tuple[str | None, tuple[int, ...], int, bool], tuple[float, float]] = {}
    out = []
    for s in specs:  # measured costs price a matrix by its key, shape, payload size and
        # whether ranks hold it (no transfer then) alone
        key = (s.cost_key, s.shape, s.itemsize, s.holders is not None)
        parts = seen.get(key)
        if parts is None:
            parts = seen[key] = call_parts(model, s)
        out.append(parts)
    return out


def _best_grouping(
    chosen: list[list[int]],
    specs: Sequence[MatrixSpec],
    assignment: Assignment,
    capacity: int,
    flops: Sequence[float],
    memory: Sequence[int],
    model: CostModel,
) -> list[list[int]]:
    """The cost-order grouping, or another with no more groups that finishes no later.

    Candidates: call classes kept together (where calls have a fixed part; taken on a tie,
    since it makes fewer calls), then first fit (taken only when it finishes strictly
    earlier). A grouping's finish time is :func:`_finish_time`.
    """
    parts = _call_parts(model, specs, flops)
    pieces = [call_piece(model, s) for s in specs]
    owners = [assignment.owner[s.name] for s in specs]
    priced = any(fixed > 0 for fixed, _ in parts)
    classes = [_sort_class(s) for s in specs] if priced else None
    best = _finish_time(chosen, owners, classes, parts, pieces)
    count = len(chosen)
    if classes is not None:
        kept = _owned_groups(specs, assignment, capacity, flops, memory, classes)
        if kept != chosen and len(kept) <= count:
            finish = _finish_time(kept, owners, classes, parts, pieces)
            if finish <= best:
                chosen, best = kept, finish
    fitted = _owned_groups(specs, assignment, capacity, flops, memory, first_fit=True)
    if fitted != chosen and len(fitted) <= count:
        finish = _finish_time(fitted, owners, classes, parts, pieces)
        if finish < best:
            chosen = fitted
    return chosen


def _replicated_groups(
    specs: Sequence[MatrixSpec],
    assignment: Assignment,
    capacity: int,
    flops: Sequence[float],
    memory: Sequence[int],
) -> list[list[int]]:
    """Every eligible rank receives every matrix: pack them in descending cost order."""
    order = sorted(range(len(specs)), key=lambda i: (-flops[i], -memory[i], specs[i].name))
    groups: list[list[int]] = []
    chosen: list[int] = []
    common = 0  # bytes every rank holds (unrestricted matrices)
    extra = [0] * assignment.num_ranks  # bytes of restricted matrices, per rank
    top_extra = 0
    for i in order:
        ranks = specs[i].ranks
        if ranks is None:
            fits = common + top_extra + memory[i] <= capacity
        else:
            fits = all(common + extra[r] + memory[i] <= capacity for r in ranks)
        if chosen and not fits:
            groups.append(chosen)
            chosen, common, top_extra = [], 0, 0
            extra = [0] * assignment.num_ranks
        chosen.append(i)
        if ranks is None:
            common += memory[i]
        else:
            for r in ranks:
                extra[r] += memory[i]
                top_extra = max(top_extra, extra[r])
        if common + top_extra > capacity:  # an oversized matrix: a group of its own
            groups.append(chosen)
            chosen, common, top_extra = [], 0, 0
            extra = [0] * assignment.num_ranks
    if chosen:
        groups.append(chosen)
    return groups


def micro_groups(
    specs: Sequence[MatrixSpec],
    assignment: Assignment,
    *,
    capacity_bytes: int,
    optimizer: str | CostModel = "muon",
) -> list[MicroGroup]:
    """Split the matrices into micro-groups that travel and are computed together.

    Micro-grouping respects the assignment (it never moves an owner); it only decides the
    order in which matrices travel. Each rank queues its matrices by descending cost (ties by
    bytes, then name). The open group repeatedly takes the next matrix of the rank with the
    smallest cumulative load over all groups so far (ties to the lowest rank). If the owner's
    bytes in flight in the group would exceed ``capacity_bytes``, the matrix stays queued and
    the rank is full for this group; a rank holding nothing in the group always accepts its
    next matrix, so a single oversized matrix is never split but sits alone on its owner. A
    rank whose cumulative load is above that of a full rank stops as well, and the group is
    sealed once no rank can take more.

    Consequence: at every group boundary, every rank's cumulative load minus the cost of the
    last matrix it took is at most the cumulative load of any rank with work left, so the
    cumulative loads of ranks with work left differ by at most one matrix and a pipeline that
    keeps a group in flight never stalls for more than one matrix.

    An owner stacks the matrices of one call class (param group, shape, payload size) that
    a group gives it into one call, and each call has a fixed part (measured costs price
    it: :meth:`~canzona.plan.MeasuredCost.call_parts`). A second grouping keeps classes
    together: equal costs queue by class, and a rank that already holds matrices in the open
    group is full when its next class's queued run would not fit in the group but fits in
    an empty one. Where calls have a fixed part, it is used when it needs no more groups
    and its groups finish no later: the sum over groups of the busiest rank's cost, each
    call's fixed part counted once, is at most the first grouping's. A third grouping lets
    a rank whose next matrix does not fit take the costliest of its next few that does
    (first fit); it is used when it needs no more groups and finishes strictly earlier.
    Stopping early is stopping full and every rank still takes only when it is furthest
    behind, so the consequence above holds for all three.

    For a replicated assignment every eligible rank receives every matrix: matrices are added
    in descending cost order and a group is sealed when one more would exceed the capacity on
    some rank (a single oversized matrix again forms its own group).

    Args:
        specs: The matrices of the assignment.
        assignment: Owners from :func:`~canzona.plan.assign.assign_owners`.
        capacity_bytes: Bytes in flight allowed per rank and group.
        optimizer: The cost model used for loads and bytes in flight.

    Returns:
        The groups in schedule order; every matrix is in exactly one.

    Raises:
        ValueError: On a non-positive capacity, or specs that do not match the assignment.
    """
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise ValueError(f"capacity_bytes must be an integer, got {capacity_bytes!r}")
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes!r}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate matrix names, got {len(names) - len(set(names))} duplicates")
    if set(names) != set(assignment.owner):
        missing = sorted(set(names) ^ set(assignment.owner))[:3]
        raise ValueError(f"specs and assignment cover different matrices, e.g. {missing!r}")
    model = resolve_cost_model(optimizer)
    flops = [model.flops(s) for s in specs]
    memory = in_flight(specs, model)
    if assignment.replicated:
        chosen = _replicated_groups(specs, assignment, capacity_bytes, flops, memory)
    else:
        chosen = _owned_groups(specs, assignment, capacity_bytes, flops, memory)
        if len(chosen) > 1:
            chosen = _best_grouping(chosen, specs, assignment, capacity_bytes, flops, memory, model)
    return [
        _finish(index, group, specs, assignment, flops, memory)
        for index, group in enumerate(chosen)
    ]
