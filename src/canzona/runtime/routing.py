"""Matrices of the plan and, for one rank, where each fragment travels."""

from __future__ import annotations

import bisect
import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

from canzona.plan import MatrixSpec, Plan, Split
from canzona.plan.spec import Ranks
from canzona.runtime.layout import Fragment, LayoutError, fragment_for
from canzona.runtime.topology import ParamLayout, Topology

Runs = tuple[tuple[int, int], ...]
LocalPart = tuple[Runs, Runs]  # local (row, column) index runs of a fragment in its shard
Part = tuple[Fragment | None, int | None, LocalPart | None]  # a rank's fragment, lead, local


@dataclass(frozen=True, slots=True)
class Item:
    """One matrix the optimizer updates: a 2-D parameter, a matrix of a 3-D stack, a block.

    A block is one matrix of a parameter declared as several (a :class:`~canzona.plan.Split`).

    Attributes:
        name: Unique name, also the plan spec's name.
        param: Index of the parameter in the optimizer.
        lead: Index along the leading dimension of a 3-D stack (None for 2-D).
        m: Rows.
        n: Columns.
        copy: The mesh copy holding this matrix (group ranks, row-major mesh order).
        unit: The ranks of ``copy`` that take part in this matrix's update: the whole
            copy, or one replica group of it when replicas compute separately.
        block: Index of the block when the parameter is split (None otherwise).
        span: ``(start, stop)`` of the block along the split dimension.
        dim: The split dimension of the matrix (0 rows, 1 columns).
        flat: The parameter is an N-D weight updated as its ``(shape[0], rest)``
            matricisation (e.g. a convolution's ``(out, in·kh·kw)``).
    """

    name: str
    param: int
    lead: int | None
    m: int
    n: int
    copy: tuple[int, ...]
    unit: tuple[int, ...]
    block: int | None = None
    span: tuple[int, int] | None = None
    dim: int = 0
    flat: bool = False

    @property
    def key(self) -> tuple[int, int | None, int | None, int]:
        """Identifies the matrix's owner-side state: (param, lead, block, first unit rank)."""
        return (self.param, self.lead, self.block, self.unit[0])

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
    return [Ranks(groups[k]) for k in sorted(groups)]


def build_items(
    topology: Topology,
    matrix_params: Sequence[int],
    *,
    replica_dedup: bool,
    splits: Mapping[int, Split] | None = None,
    flatten: frozenset[int] = frozenset(),
) -> list[Item]:
    """List every matrix of the given parameters, for every copy, replica unit and block.

    The list is identical on every rank (it depends only on agreed information).
    Parameters in ``flatten`` are matrices ``(shape[0], rest)`` whatever their rank.
    """
    items: list[Item] = []
    splits = splits or {}
    for index in matrix_params:
        layout = topology.layouts[index]
        flat = index in flatten
        units = [
            (copy, unit)
            for copy in topology.param_copies(index)
            for unit in _units(layout, copy, replica_dedup)
        ]
        stack = len(layout.shape) == 3 and not flat
        leads: list[int | None] = list(range(layout.shape[0])) if stack else [None]
        m, n = (layout.shape[0], math.prod(layout.shape[1:])) if flat else layout.shape[-2:]
        split = splits.get(index)
        blocks: list[tuple[int | None, tuple[int, int] | None, int, int]] = [(None, None, m, n)]
        if split is not None:
            spans = split.spans(m if split.dim == 0 else n, name=repr(layout.name))
            blocks = [
                (j, span, span[1] - span[0], n)
                if split.dim == 0
                else (j, span, m, span[1] - span[0])
                for j, span in enumerate(spans)
            ]
        for u, (copy, unit) in enumerate(units):
            for lead in leads:
                for block, span, bm, bn in blocks:
                    name = layout.name + (f"[{lead}]" if lead is not None else "")
                    name += f"#{block}" if block is not None else ""
                    if len(units) > 1:
                        name += f"@{u}"
                    dim = split.dim if split is not None else 0
                    items.append(
                        Item(name, index, lead, bm, bn, copy, unit, block, span, dim, flat)
                    )
    return _unique_names(items)


def _unique_names(items: list[Item]) -> list[Item]:
    """``items`` with names that key the plan uniquely.

    A matrix's name is its parameter's name with suffixes (``[lead]``, ``#block``, ``@unit``);
    a parameter whose own name looks like one (``w[0]`` beside a stack ``w``) would share
    it. Colliding names take ``~`` and their parameter's index, until none collide (the
    names of one parameter never collide with each other): the same names on every rank.
    """
    while True:
        counts = Counter(it.name for it in items)
        if len(counts) == len(items):
            return items
        items = [
            replace(it, name=f"{it.name}~{it.param}") if counts[it.name] > 1 else it for it in items
        ]


def plan_specs(
    items: Sequence[Item],
    itemsize: Callable[[int], int],
    cost_key: Callable[[int], str | None] = lambda p: None,
    holders: Mapping[str, tuple[int, ...]] | None = None,
) -> list[MatrixSpec]:
    """Plan specs for the items that need communication (local items are not planned)."""
    holders = holders or {}
    ranks: dict[tuple[int, ...], Ranks] = {}  # one object per unit (see MatrixSpec)
    return [
        MatrixSpec(
            it.name,
            (it.m, it.n),
            itemsize(it.param),
            ranks.get(it.unit) or ranks.setdefault(it.unit, Ranks(sorted(it.unit))),
            cost_key(it.param),
            holders.get(it.name),
            it.name in holders and it.lead is not None,  # experts stay where they are placed
        )
        for it in items
        if not it.is_local
    ]


def item_holders(items: Sequence[Item], topology: Topology) -> dict[str, tuple[int, ...]]:
    """Per item held whole by some but not all of its unit's ranks: those ranks, sorted.

    An expert of a stack sharded over the expert dimension, a head block inside one tensor
    parallel rank's rows, a small matrix that row sharding leaves on one rank. Identical
    on every rank (agreed information only). The ranks' fragments are read once per kind
    of matrix (:class:`_Cover`): the blocks of a parameter look their holders up by position.
    """
    out: dict[str, tuple[int, ...]] = {}
    covers: dict[tuple[object, ...], _Cover] = {}
    for item in items:
        if item.is_local:
            continue
        layout = topology.layouts[item.param]
        if not any(isinstance(p, Shard | _StridedShard) for p in layout.placements):
            continue  # replicated: every rank holds it whole (_StridedShard is no Shard)
        blocked = item.span is not None
        # the size along the split dimension is the span's business, not the kind's
        sizes = (
            None if blocked and item.dim == 0 else item.m,
            None if blocked and item.dim == 1 else item.n,
        )
        kind: tuple[object, ...] = (
            *(layout.shape, layout.mesh_shape, layout.placements, item.flat, item.lead),
            *(item.copy, item.unit, item.dim if blocked else None, sizes),
        )
        cover = covers.get(kind)
        if cover is None:
            cover = covers[kind] = _Cover.of(item, layout)
        found = cover.holders(item)
        if found and len(found) < len(item.unit):
            out[item.name] = found
    return out


@dataclass(frozen=True, slots=True)
class _Cover:
    """Where one kind of matrix lies on its unit's ranks, indexed for the holders' search.

    Attributes:
        whole: Ranks whose fragment holds the whole matrix (the lead included), sorted
            (a kind of whole matrices).
        runs: Per dimension, ``(start, stop, rank)`` of every run along it of the ranks
            whose fragment holds the whole of the other dimension, by start (a kind of
            blocks: along their split dimension, the other one empty).
        starts: The runs' starts, per dimension (for bisection).
        longest: Per dimension, the longest of those runs (0 without runs).
    """

    whole: tuple[int, ...]
    runs: tuple[tuple[tuple[int, int, int], ...], ...]
    starts: tuple[tuple[int, ...], ...]
    longest: tuple[int, ...]

    @classmethod
    def of(cls, item: Item, layout: ParamLayout) -> _Cover:
        """The cover of ``item``'s kind: every rank of its unit's fragment, read once."""
        pos_of = {r: i for i, r in enumerate(item.copy)}
        sizes = (item.m, item.n)  # along a block's split dimension, the block's: not read
        matrix = item if item.span is None else replace(item, span=None)  # the whole matrix
        whole: list[int] = []
        runs: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] = ([], [])
        for r in item.unit:
            coord = _unravel(pos_of[r], layout.mesh_shape) if layout.mesh_shape else ()
            frag, _, _ = _item_part(layout, coord, matrix)
            if frag is None:  # none of it here (or not the lead)
                continue
            held = frag.runs
            covers = [_covers(runs_, 0, size) for runs_, size in zip(held, sizes, strict=True)]
            if item.span is None:
                if all(covers):
                    whole.append(r)
                continue
            other = 1 - item.dim
            if covers[other]:
                runs[item.dim].extend((a, b, r) for a, b in held[item.dim])
        ordered = tuple(tuple(sorted(x)) for x in runs)
        return cls(
            tuple(sorted(whole)),
            ordered,
            tuple(tuple(a for a, _, _ in x) for x in ordered),
            tuple(max((b - a for a, b, _ in x), default=0) for x in ordered),
        )

    def holders(self, item: Item) -> tuple[int, ...]:
        """The ranks that hold ``item`` whole, sorted: all of it, or its block's span."""
        if item.span is None:
            return self.whole
        a, b = item.span
        dim = item.dim
        runs, starts = self.runs[dim], self.starts[dim]
        # a run starting before a - longest ends before a: only these can hold the span
        lo = bisect.bisect_left(starts, a - self.longest[dim])
        hi = bisect.bisect_right(starts, a)
        return tuple(sorted({r for _, stop, r in runs[lo:hi] if b <= stop}))


def _covers(runs: Runs, a: int, b: int) -> bool:
    """Whether one of ``runs`` holds all of ``[a, b)``."""
    return any(start <= a and b <= stop for start, stop in runs)


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
        local: For a block, where its fragment sits in this rank's local matrix (row and
            column index runs); None when the fragment is the whole local matrix.
    """

    item: Item
    computing: tuple[int, ...]
    frag: Fragment | None = None
    pos: int | None = None
    local: LocalPart | None = None
    send_to: tuple[int, ...] = ()
    sources: tuple[tuple[int, Fragment], ...] = ()
    targets: tuple[tuple[int, Fragment], ...] = ()

    @property
    def computes(self) -> bool:
        """True when this rank computes the matrix's full update."""
        return bool(self.sources)


def _restrict(frag: Fragment, dim: int, span: tuple[int, int]) -> tuple[Fragment, LocalPart]:
    """The part of a 2-D fragment inside a block, in block coordinates, and its local runs."""
    a, b = span
    inside: list[tuple[int, int]] = []
    local: list[tuple[int, int]] = []
    pos = 0
    for start, stop in frag.runs[dim]:
        lo, hi = max(start, a), min(stop, b)
        if lo < hi:
            inside.append((lo - a, hi - a))
            local.append((pos + lo - start, pos + hi - start))
        pos += stop - start
    runs = list(frag.runs)
    runs[dim] = tuple(inside)
    other = 1 - dim
    whole: Runs = ((0, frag.shape[other]),) if frag.shape[other] else ()
    parts: list[Runs] = [(), ()]
    parts[dim], parts[other] = tuple(local), whole
    return Fragment(tuple(runs)), (parts[0], parts[1])


def _flattened(frag: Fragment, shape: tuple[int, ...]) -> Fragment | None:
    """An N-D weight's fragment as one of its ``(shape[0], rest)`` matrix.

    None when a dimension past the first is cut (the rows of the matrix would not be whole
    runs of columns).
    """
    rest = math.prod(shape[1:])
    for size, runs in zip(shape[1:], frag.runs[1:], strict=True):
        if runs != ((0, size),):
            return None
    return Fragment((frag.runs[0], ((0, rest),) if frag.runs[0] else ()))


def _not_a_matrix(layout: ParamLayout) -> LayoutError:
    return LayoutError(
        f"parameter {layout.name!r} ({layout.shape}, placements {layout.placements}) is "
        "updated as a matrix of its first dimension by the rest; that needs every "
        "dimension but the first unsharded"
    )


class _NotAMatrix(Exception):
    """A matricised weight's fragment cut past its first dimension (named by the caller)."""


def _item_part(layout: ParamLayout, coord: tuple[int, ...], item: Item) -> Part:
    """A rank's 2-D fragment of one matrix, its lead position and its local part.

    For a block the fragment is in block coordinates and the local part says where it sits
    in the rank's local matrix; for a 3-D stack the position is the lead's local index.
    Remembered per kind of matrix and coordinate (a part never changes): the routing of a
    large job asks for the same parts in every layer.
    """
    shape, mesh, placements = layout.shape, layout.mesh_shape, layout.placements
    key = (shape, mesh, placements, coord, item.flat, item.lead, item.span, item.dim)
    try:
        try:
            return _remembered_part(*key)
        except TypeError:  # an unhashable placement of another kind: not remembered
            return _part(*key)
    except _NotAMatrix:
        raise _not_a_matrix(layout) from None


def _part(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    coord: tuple[int, ...],
    flat: bool,
    lead: int | None,
    span: tuple[int, int] | None,
    dim: int,
) -> Part:
    frag = fragment_for(shape, mesh_shape, placements, coord)
    if flat and len(frag.runs) != 2:
        matrix = _flattened(frag, shape)
        if matrix is None:
            raise _NotAMatrix
        frag = matrix
    pos = None
    if lead is not None:
        pos = frag.position(lead)
        if pos is None:
            return None, None, None
        frag = Fragment(frag.runs[1:])
    local = None
    if span is not None:
        frag, local = _restrict(frag, dim, span)
    return (frag, pos, local) if frag.numel else (None, pos, None)


_remembered_part = functools.lru_cache(maxsize=1 << 16)(_part)


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

    frag, pos, local = _item_part(layout, coord_of(rank), item)
    route = Route(item, computing, frag, pos, local)
    if frag is not None:
        route.send_to = tuple(c for c in computing if rep_coord(c) == rep_coord(rank))
    if rank in computing:
        sources: list[tuple[int, Fragment]] = []
        targets: list[tuple[int, Fragment]] = []
        covered = 0
        for r in item.unit:
            f, _, _ = _item_part(layout, coord_of(r), item)
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
