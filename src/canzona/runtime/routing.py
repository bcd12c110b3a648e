"""Matrices of the plan and, for one rank, where each fragment travels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from canzona.plan import MatrixSpec, Plan
from canzona.runtime.layout import Fragment, LayoutError, fragment_for
from canzona.runtime.topology import ParamLayout, Topology


@dataclass(frozen=True, slots=True)
class Item:
    """One matrix the optimizer updates: a 2-D parameter, or one matrix of a 3-D stack.

    Attributes:
        name: Unique name, also the plan spec's name.
        param: Index of the parameter in the optimizer.
        lead: Index along the leading dimension of a 3-D stack (None for 2-D).
        m: Rows.
        n: Columns.
        copy: The mesh copy holding this matrix (group ranks, row-major mesh order).
        unit: The ranks of ``copy`` that take part in this matrix's update: the whole
            copy, or one replica group of it when replicas compute separately.
    """

    name: str
    param: int
    lead: int | None
    m: int
    n: int
    copy: tuple[int, ...]
    unit: tuple[int, ...]

    @property
    def key(self) -> tuple[int, int | None, int]:
        """Identifies the matrix's owner-side state: (param, lead, first unit rank)."""
        return (self.param, self.lead, self.unit[0])

    @property
    def is_local(self) -> bool:
        """True when a single rank holds and updates the whole matrix."""
        return len(self.unit) == 1


def _unravel(position: int, shape: Sequence[int]) -> tuple[int, ...]:
    coord = []
    for size in reversed(shape):
        coord.append(position % size)
        position //= size
    return tuple(reversed(coord))


def _units(layout: ParamLayout, copy: tuple[int, ...], dedup: bool) -> list[tuple[int, ...]]:
    rep = layout.replicate_dims()
    if dedup or not rep or not layout.mesh_shape:
        return [copy]
    groups: dict[tuple[int, ...], list[int]] = {}
    for pos, rank in enumerate(copy):
        coord = _unravel(pos, layout.mesh_shape)
        groups.setdefault(tuple(coord[d] for d in rep), []).append(rank)
    return [tuple(groups[k]) for k in sorted(groups)]


def build_items(
    topology: Topology, matrix_params: Sequence[int], *, replica_dedup: bool
) -> list[Item]:
    """List every matrix of the given parameters, for every copy and replica unit.

    The list is identical on every rank (it depends only on agreed information).
    """
    items: list[Item] = []
    for index in matrix_params:
        layout = topology.layouts[index]
        units = [
            (copy, unit)
            for copy in topology.param_copies(index)
            for unit in _units(layout, copy, replica_dedup)
        ]
        leads: list[int | None] = list(range(layout.shape[0])) if len(layout.shape) == 3 else [None]
        m, n = layout.shape[-2], layout.shape[-1]
        for u, (copy, unit) in enumerate(units):
            for lead in leads:
                name = layout.name + (f"[{lead}]" if lead is not None else "")
                if len(units) > 1:
                    name += f"@{u}"
                items.append(Item(name, index, lead, m, n, copy, unit))
    return items


def plan_specs(
    items: Sequence[Item],
    itemsize: Callable[[int], int],
    cost_key: Callable[[int], str | None] = lambda p: None,
) -> list[MatrixSpec]:
    """Plan specs for the items that need communication (local items are not planned)."""
    return [
        MatrixSpec(
            it.name, (it.m, it.n), itemsize(it.param), tuple(sorted(it.unit)), cost_key(it.param)
        )
        for it in items
        if not it.is_local
    ]


@dataclass(slots=True)
class Route:
    """What one rank does for one item.

    Attributes:
        item: The matrix.
        computing: Ranks that compute the full update (the owner, or all for replicated).
        frag: This rank's 2-D fragment of the matrix (None when it holds none of it).
        pos: Position of the matrix in the local tensor's leading dim (3-D stacks).
        send_to: Computing ranks this rank sends its fragment to.
        sources: When this rank computes: (rank, fragment) for each distinct fragment.
        targets: When this rank owns (non-replicated): (rank, fragment) to scatter to.
    """

    item: Item
    computing: tuple[int, ...]
    frag: Fragment | None = None
    pos: int | None = None
    send_to: tuple[int, ...] = ()
    sources: tuple[tuple[int, Fragment], ...] = ()
    targets: tuple[tuple[int, Fragment], ...] = ()

    @property
    def computes(self) -> bool:
        """True when this rank computes the matrix's full update."""
        return bool(self.sources)


def _item_part(
    layout: ParamLayout, coord: tuple[int, ...], lead: int | None
) -> tuple[Fragment | None, int | None]:
    """A rank's 2-D fragment of one matrix, and for a 3-D stack its position in dim 0."""
    frag = fragment_for(layout.shape, layout.mesh_shape, layout.placements, coord)
    pos = None
    if lead is not None:
        pos = frag.position(lead)
        if pos is None:
            return None, None
        frag = Fragment(frag.runs[1:])
    return (frag, pos) if frag.numel else (None, pos)


def route_item(
    item: Item,
    layout: ParamLayout,
    computing: tuple[int, ...],
    rank: int,
    replicated: bool,
    positions: dict[int, int] | None = None,
) -> Route | None:
    """This rank's route for ``item`` (None when the rank takes no part in it).

    Args:
        item: The matrix.
        layout: Its parameter's layout.
        computing: Ranks that compute the full update.
        rank: This rank.
        replicated: Every unit rank computes (no scatter).
        positions: Optional cached map rank -> position in ``item.copy``.
    """
    if rank not in item.unit:
        return None
    mesh_shape = layout.mesh_shape or (1,)
    pos_of = positions if positions is not None else {r: i for i, r in enumerate(item.copy)}
    rep = layout.replicate_dims()

    def coord_of(r: int) -> tuple[int, ...]:
        return _unravel(pos_of[r], mesh_shape) if layout.mesh_shape else ()

    def rep_coord(r: int) -> tuple[int, ...]:
        c = coord_of(r)
        return tuple(c[d] for d in rep)

    frag, pos = _item_part(layout, coord_of(rank), item.lead)
    route = Route(item, computing, frag, pos)
    if frag is not None:
        route.send_to = tuple(c for c in computing if rep_coord(c) == rep_coord(rank))
    if rank in computing:
        sources: list[tuple[int, Fragment]] = []
        targets: list[tuple[int, Fragment]] = []
        covered = 0
        for r in item.unit:
            f, _ = _item_part(layout, coord_of(r), item.lead)
            if f is None:
                continue
            targets.append((r, f))
            if rep_coord(r) == rep_coord(rank):
                sources.append((r, f))
                covered += f.numel
        if covered != item.m * item.n:
            raise LayoutError(
                f"the fragments of {item.name!r} cover {covered} of {item.m * item.n} elements; "
                f"placements {layout.placements!r} on mesh {layout.mesh_shape} are not supported"
            )
        route.sources = tuple(sources)
        if not replicated:
            route.targets = tuple(targets)
    return route


def route_all(
    items: Sequence[Item], topology: Topology, plan: Plan | None, rank: int
) -> dict[str, Route]:
    """Routes of this rank for all items it takes part in (local items included)."""
    routes: dict[str, Route] = {}
    replicated = plan is not None and plan.assignment.replicated
    position_cache: dict[tuple[int, ...], dict[int, int]] = {}
    for item in items:
        if rank not in item.unit:
            continue
        layout = topology.layouts[item.param]
        if item.is_local:
            computing: tuple[int, ...] = item.unit
            is_rep = False
        else:
            assert plan is not None
            computing = tuple(plan.assignment.computing_ranks(item.name))
            is_rep = replicated
        positions = position_cache.get(item.copy)
        if positions is None:
            positions = {r: i for i, r in enumerate(item.copy)}
            position_cache[item.copy] = positions
        route = route_item(item, layout, computing, rank, is_rep, positions)
        if route is not None:
            routes[item.name] = route
    return routes
