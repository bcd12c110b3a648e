"""A step worked out once per plan: buffer layout, exchange sizes, batches and delivery runs.

Everything here depends only on the plan, the routes and the optimizer's table, so it is
built when they change and reused every step; a step then costs a few tensor operations per
micro-group, batch and run of same-layout matrices, not per matrix.

Wire order. Within a micro-group every rank sorts the group's matrices the same way
(:func:`canonical_order`): by compute batch (param group, shape, payload dtype; in order of
first appearance), then by storage layout, then by the plan's order. A segment of an
all-to-all from rank ``s`` to rank ``c`` holds, in that order, every matrix that travels
from ``s`` to ``c``, each as its fragment flattened row-major. Consecutive matrices of one
batch with the same fragment therefore form a *run* ``(k, fr, fc)`` that one copy places
(gather) or one view reads (scatter).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from canzona.runtime.assembled import assemble_deliveries
from canzona.runtime.buffers import FlatBuffer, Selector
from canzona.runtime.checks import RIDE_WORDS
from canzona.runtime.layout import Fragment
from canzona.runtime.owner_index import gather_index
from canzona.runtime.payload_layout import Dtypes, PayloadLayout, SendPart, add_part, indexed
from canzona.runtime.routing import Item, Route
from canzona.runtime.scatter_index import scatter_send
from canzona.runtime.schedule_parts import (
    Assembly,
    BatchKey,
    Delivery,
    GroupSchedule,
    OwnerBatch,
    Piece,
    Schedule,
    Selectors,
    SendView,
    Target,
    common_dtype,
    fragment_runs,
    light_first,
    merge_targets,
    rects,
)
from canzona.runtime.table import StepTable
from canzona.runtime.topology import Topology


def batch_key(item: Item, table: StepTable) -> BatchKey:
    """Matrices computed in one call share their param group, shape and payload dtype."""
    row = table.row(item.param)
    return (row.batch_key, item.m, item.n, row.payload_dtype)


def canonical_order(items: Sequence[Item], topology: Topology, table: StepTable) -> list[Item]:
    """The wire order of one micro-group's matrices (identical on every rank)."""
    first_batch: dict[BatchKey, int] = {}
    first_layout: dict[tuple[object, ...], int] = {}
    keys = []
    for pos, item in enumerate(items):
        bk = batch_key(item, table)
        layout = topology.layouts[item.param]
        sig = (bk, layout.mesh_shape, layout.placements, item.copy, item.unit)
        keys.append((first_batch.setdefault(bk, pos), first_layout.setdefault(sig, pos), pos))
    order = sorted(range(len(items)), key=keys.__getitem__)
    return [items[i] for i in order]


def _split(items: Sequence[Item], table: StepTable) -> list[tuple[BatchKey, list[Item]]]:
    """Consecutive items of equal batch key (canonical order keeps each key contiguous)."""
    out: list[tuple[BatchKey, list[Item]]] = []
    for item in items:
        bk = batch_key(item, table)
        if out and out[-1][0] == bk:
            out[-1][1].append(item)
        else:
            out.append((bk, [item]))
    return out


class ScheduleBuilder:
    """Builds a :class:`Schedule` for one rank from agreed data.

    Args:
        topology: Agreed layouts.
        routes: This rank's routes by item name.
        groups: The plan's micro-groups (items in plan order), active items only.
        local_items: Active items this rank updates alone.
        table: The optimizer's table.
        local_shapes: Per active matrix parameter, this rank's local shard shape.
        rank: This rank.
        world: Ranks in the process group.
        replicated: Every eligible rank computes every matrix (no scatter).
        device: Device of the buffers.
        keep_buffers: Hold the buffers' memory between steps (see :class:`FlatBuffer`).
    """

    def __init__(
        self,
        *,
        topology: Topology,
        routes: dict[str, Route],
        groups: Sequence[Sequence[Item]],
        local_items: Sequence[Item],
        table: StepTable,
        local_shapes: dict[int, tuple[int, ...]],
        rank: int,
        world: int,
        replicated: bool,
        device: torch.device,
        keep_buffers: bool = False,
    ) -> None:
        self.topology = topology
        self.routes = routes
        self.groups = [canonical_order(g, topology, table) for g in groups]
        self.local_items = list(local_items)
        self.table = table
        self.local_shapes = local_shapes
        self.rank = rank
        self.world = world
        self.replicated = replicated
        self.device = device
        self.keep_buffers = keep_buffers
        self.selectors = Selectors(device)
        self.layout = PayloadLayout()
        #: (class, offset) of the header's slot before each destination's segment, when the
        #: slots lie in the payload buffers (see :meth:`_place_payloads`).
        self.header_gaps: list[tuple[int, int]] = []

    def _itemsize(self, param: int) -> int:
        return self.topology.layouts[param].dtype.itemsize

    def _dtypes(self, param: int) -> tuple[torch.dtype, torch.dtype]:
        """The dtypes a parameter's payload is prepared in and travels in."""
        row = self.table.row(param)
        prepared = row.prepared_dtype or self.topology.layouts[param].dtype
        return prepared, row.payload_dtype

    def _place_payloads(self) -> None:
        """Lay payloads out in first-send order, so a group's sends are few long ranges.

        The first micro-group's segments start with the header's slot (see
        :class:`GroupSchedule`): where this rank's sends in it are of one buffer class whose
        payload dtype is the gather's, each slot is reserved in that buffer right before the
        segment, so that a segment, and often the whole send, is one range (sent without a
        copy).
        """
        first = self._header_group()
        for k, items in enumerate(self.groups):
            gap = self._header_gap(items) if k == first else None
            for sent in self._by_destination(items):
                if gap is not None:
                    self.header_gaps.append(self.layout.reserve(*gap))
                for item, _ in sent:
                    p = item.param
                    self.layout.place(p, _numel(self.local_shapes[p]), self._dtypes(p))
        for p in sorted(self.local_shapes):
            if _numel(self.local_shapes[p]):
                self.layout.place(p, _numel(self.local_shapes[p]), self._dtypes(p))

    def _by_destination(self, items: Sequence[Item]) -> list[list[tuple[Item, Route]]]:
        """Per rank, the items (in order) whose fragment this rank sends there, with routes.

        One pass over the items and their destinations, not one per rank: the setup of a
        large job (thousands of matrices, hundreds of ranks) grows with their sum.
        """
        out: list[list[tuple[Item, Route]]] = [[] for _ in range(self.world)]
        for item in items:
            route = self.routes.get(item.name)
            if route is not None and route.frag is not None:
                for dest in dict.fromkeys(route.send_to):
                    out[dest].append((item, route))
        return out

    def _header_group(self) -> int:
        """Index of the micro-group whose gather carries the header (-1: none)."""
        if self.world < 2:
            return -1
        return min((k for k, items in enumerate(self.groups) if items), default=-1)

    def _header_gap(self, items: Sequence[Item]) -> tuple[int, Dtypes] | None:
        """Size and buffer class of the header's slot in the payload buffers (None: apart)."""
        gather = common_dtype([self.table.row(it.param).payload_dtype for it in items])
        sent = {
            self._dtypes(it.param)
            for it in items
            if (route := self.routes.get(it.name)) is not None
            and route.frag is not None
            and route.send_to
        }
        if len(sent) != 1:
            return None
        (dtypes,) = sent
        if dtypes[1] != gather:
            return None
        return RIDE_WORDS * 8 // gather.itemsize, dtypes

    def build(self) -> Schedule:
        """The schedule."""
        self._place_payloads()
        prepared, payloads, buffers, casts = [], [], [], []
        for (prep, pay), cls in sorted(self.layout.classes.items(), key=lambda kv: kv[1]):
            size = self.layout.sizes[cls]
            a = FlatBuffer(size, prep, self.device, keep=self.keep_buffers)
            b = a if prep == pay else FlatBuffer(size, pay, self.device, keep=self.keep_buffers)
            prepared.append(a)
            payloads.append(b)
            buffers.append(a)
            if b is not a:
                buffers.append(b)
                casts.append((a, b))
        self.prepared, self.payloads = prepared, payloads
        payload = {
            p: prepared[cls].view(off, self.local_shapes[p])
            for p, (cls, off) in self.layout.views.items()
        }
        local, local_kept = self._local()
        last = max((k for k, items in enumerate(self.groups) if items), default=-1)
        first = self._header_group()
        status = not self.replicated
        groups = [
            self._group(k, items, status and k == last, k == first)
            for k, items in enumerate(self.groups)
        ]
        schedule = Schedule(
            buffers, casts, payload, local, local_kept, [g for g in groups if g], self.replicated
        )
        schedule.release()  # views are cut: unless kept, the memory is needed only in a step
        return schedule

    # ------------------------------------------------------------------ pieces
    def _local_matrix(self, item: Item) -> tuple[int, int]:
        """Rows and columns of one local matrix of ``item``'s parameter."""
        shape = self.local_shapes[item.param]
        if item.flat:
            return shape[0], _numel(shape[1:])
        return shape[-2], shape[-1]

    def _matrix_view(self, item: Item, route: Route) -> torch.Tensor:
        """This rank's local payload matrix of ``item``'s parameter (the lead for a stack)."""
        cls, off = self.layout.views[item.param]
        shape = self.local_shapes[item.param]
        view = self.payloads[cls].view(off, shape)
        if item.flat:
            return view.view(self._local_matrix(item))
        return view if route.pos is None else view[route.pos]

    def _item_range(self, item: Item, route: Route) -> tuple[int, int, int] | None:
        """(buffer class, offset, numel) of ``item``'s payload fragment on this rank.

        None when the fragment is not one contiguous range of the flat buffer (a block
        along the columns, or one made of several runs).
        """
        assert route.frag is not None
        cls, off = self.layout.views[item.param]
        lm, ln = self._local_matrix(item)
        if route.pos is not None:
            off += route.pos * lm * ln
        if route.local is None:
            return cls, off, lm * ln
        rows, cols = route.local
        if len(rows) == 1 and cols == ((0, ln),):
            return cls, off + rows[0][0] * ln, (rows[0][1] - rows[0][0]) * ln
        return None

    def _item_send(self, item: Item, route: Route) -> SendPart:
        """What this rank sends of ``item``: a flat range, a 2-D view, or a selected part."""
        rng = self._item_range(item, route)
        if rng is not None:
            return rng
        assert route.local is not None
        mat = self._matrix_view(item, route)
        rows, cols = route.local
        if len(rows) == 1 and len(cols) == 1:
            return mat[rows[0][0] : rows[0][1], cols[0][0] : cols[0][1]]
        return (mat, Selector(Fragment((rows, cols)), self.device))

    def _item_view(self, item: Item, route: Route) -> torch.Tensor:
        """The whole local matrix (block) of an item this rank holds alone."""
        mat = self._matrix_view(item, route)
        if route.local is None:
            return mat
        (r0, r1), (c0, c1) = route.local[0][0], route.local[1][0]
        return mat[r0:r1, c0:c1]

    def _delivery(self, offset: int, items: Sequence[Item], shape: tuple[int, int]) -> Delivery:
        first = items[0]
        row = self.table.row(first.param)
        targets: list[Target] = []
        for it in items:
            target = self._target(it, self.routes[it.name])
            last = targets[-1] if targets else None
            merged = merge_targets(last, target) if last is not None else None
            if merged is not None:
                targets[-1] = merged
            else:
                targets.append(target)
        return Delivery(
            offset=offset,
            shape=shape,
            key=row.batch_key,
            full=(first.m, first.n),
            dtype=row.direction_dtype,
            targets=tuple(targets),
            count=len(items),
        )

    def _target(self, item: Item, route: Route) -> Target:
        if route.local is None:
            return Target(item.param, route.pos, flat=item.flat)
        rows, cols = route.local
        ln = self._local_matrix(item)[1]
        if item.dim == 0 and len(rows) == 1 and cols == ((0, ln),):
            return Target(item.param, route.pos, 1, rows[0], flat=item.flat)
        return Target(item.param, route.pos, 1, None, rects(rows, cols), flat=item.flat)

    def _local(self) -> tuple[list[OwnerBatch], list[tuple[Piece, Delivery]]]:
        batches: list[OwnerBatch] = []
        kept: list[tuple[Piece, Delivery]] = []
        by_key: dict[BatchKey, list[Item]] = {}
        for item in self.local_items:
            by_key.setdefault(batch_key(item, self.table), []).append(item)
        for (key, m, n, dtype), items in by_key.items():
            inputs = tuple(self._item_view(it, self.routes[it.name]) for it in items)
            batches.append(OwnerBatch(tuple(items), key, m, n, dtype, inputs=inputs))
            whole = self.selectors(_whole(m, n))
            kept += self._kept_runs(
                len(batches) - 1, items, [(j, whole) for j in range(len(items))]
            )
        return batches, kept

    def _kept_runs(
        self, batch: int, items: Sequence[Item], entries: Sequence[tuple[int, Selector]]
    ) -> list[tuple[Piece, Delivery]]:
        """Runs of results this rank keeps for its own targets (direction dtype breaks runs)."""
        out: list[tuple[Piece, Delivery]] = []
        run: list[tuple[int, Selector]] = []

        def close() -> None:
            if run:
                sel = run[0][1]
                piece = Piece(batch, run[0][0], len(run), sel)
                out.append((piece, self._delivery(0, [items[j] for j, _ in run], sel.shape)))
                run.clear()

        for j, sel in entries:
            if run and (
                run[-1][0] + 1 != j
                or run[-1][1] is not sel
                or self.table.row(items[j].param).direction_dtype
                != self.table.row(items[run[-1][0]].param).direction_dtype
            ):
                close()
            run.append((j, sel))
        close()
        return out

    # ------------------------------------------------------------------ groups
    def _group(
        self, index: int, items: list[Item], status: bool, header: bool
    ) -> GroupSchedule | None:
        if not items:
            return None
        table = self.table
        gather_dtype = common_dtype([table.row(it.param).payload_dtype for it in items])
        scatter_dtype = common_dtype([table.row(it.param).direction_dtype for it in items])
        slot = None
        if header:  # int64 words seen as gather elements: the bytes travel unchanged
            words = torch.zeros(RIDE_WORDS, dtype=torch.int64, device=self.device)
            slot = words.view(gather_dtype)
        gaps = self.header_gaps if slot is not None else []
        send, gather_in = self._sends(items, slot, gaps)
        head = 0 if slot is None else slot.numel()
        batches, gather_out = self._owner_batches(items, head)
        header_index = None
        if slot is not None:
            starts = [0, *accumulate(gather_out[:-1])]  # where each source's segment starts
            header_index = torch.tensor(
                [s + j for s in starts for j in range(head)], dtype=torch.int64, device=self.device
            )
        pieces: list[Piece] = []
        scatter_in = [0] * self.world
        kept: list[tuple[Piece, Delivery]] = []
        assembled = send_back = None
        if self.replicated:
            for b, batch in enumerate(batches):
                entries = [
                    (j, self.selectors(frag))
                    for j, it in enumerate(batch.items)
                    if (frag := self.routes[it.name].frag) is not None
                ]
                kept += self._kept_runs(b, batch.items, entries)
            deliveries: list[Delivery] = []
            scatter_out = [0] * self.world
        else:
            pieces, scatter_in, bounds = self._scatter_pieces(batches, status)
            send_back = scatter_send(pieces, bounds, batches, status, self.device)
            deliveries, scatter_out, flags = self._deliveries(items, status)
            deliveries, assembled = assemble_deliveries(
                deliveries, self.local_shapes, self._itemsize, self.device
            )
        total = sum(it.m * it.n * table.row(it.param).payload_dtype.itemsize for it in items)
        return GroupSchedule(
            index=index,
            # a rank receives its owned share, or everything when every rank computes it all
            nbytes=total if self.replicated else -(-total // self.world),
            gather_dtype=gather_dtype,
            send=send,
            gather_in=gather_in,
            gather_out=gather_out,
            batches=batches,
            scatter_dtype=scatter_dtype,
            scatter_in=scatter_in,
            scatter_out=scatter_out,
            deliveries=deliveries,
            assembled=assembled,
            scatter_send=send_back,
            kept=kept,
            status=status,
            status_index=(
                torch.tensor(flags, dtype=torch.int64, device=self.device)
                if status and not self.replicated
                else None
            ),
            header=slot,
            header_slots=tuple(self.payloads[c].view(o, (head,)) for c, o in gaps),
            compute_order=light_first(batches),
            header_index=header_index,
        )

    def _sends(
        self, items: list[Item], slot: torch.Tensor | None, gaps: Sequence[tuple[int, int]] = ()
    ) -> tuple[tuple[SendView, ...], list[int]]:
        """This rank's payloads in wire order (contiguous ranges merged) and per-rank sizes.

        With ``slot``, every destination's segment starts with it (the header's slot): the
        ranges ``gaps`` reserved for it in the payload buffers, else ``slot`` itself.
        """
        parts: list[SendPart] = []
        classes: list[int | None] = []
        sizes = [0] * self.world
        for dest, sent in enumerate(self._by_destination(items)):
            if slot is not None:
                add_part(parts, (*gaps[dest], slot.numel()) if gaps else slot, classes, None)
                sizes[dest] += slot.numel()
            for item, route in sent:
                assert route.frag is not None
                sizes[dest] += route.frag.numel
                cls = self.layout.views[item.param][0]
                add_part(parts, self._item_send(item, route), classes, cls)
        views: list[SendView] = []
        for part in indexed(parts, classes, [b.tensor for b in self.payloads]):
            if isinstance(part, list):
                cls, off, numel = part
                views.append(self.payloads[cls].view(off, (numel,)))
            else:
                views.append(part)  # type: ignore[arg-type]
        return tuple(views), sizes

    def _owner_batches(
        self, items: list[Item], head: int = 0
    ) -> tuple[list[OwnerBatch], list[int]]:
        """The batches this rank computes and how the gather fills them.

        Every source's segment starts with ``head`` elements (the header's slot).
        """
        mine = [it for it in items if (r := self.routes.get(it.name)) is not None and r.computes]
        batches: list[OwnerBatch] = []
        position: dict[str, tuple[int, int]] = {}
        for (key, m, n, dtype), members in _split(mine, self.table):
            for j, it in enumerate(members):
                position[it.name] = (len(batches), j)
            batches.append(OwnerBatch(tuple(members), key, m, n, dtype))
        sizes = [0] * self.world
        entries: dict[int, list[tuple[int, int, Fragment]]] = {}  # source -> (batch, pos, frag)
        for it in mine:
            b, j = position[it.name]
            for src, frag in self.routes[it.name].sources:
                entries.setdefault(src, []).append((b, j, frag))
        base = 0
        for src in range(self.world):
            offset = base + head
            by_batch: dict[int, list[tuple[int, Fragment]]] = {}
            for b, j, frag in entries.get(src, []):
                by_batch.setdefault(b, []).append((j, frag))
            for b, pairs in by_batch.items():
                for start, count, frag in fragment_runs(pairs):
                    run = Assembly(offset, start, count, self.selectors(frag))
                    batches[b].assembly.append(run)
                    offset += count * frag.numel
            sizes[src] = offset - base
            base = offset
        for batch in batches:
            batch.index = gather_index(batch, self.device)
        return batches, sizes

    def _scatter_pieces(
        self, batches: list[OwnerBatch], status: bool
    ) -> tuple[list[Piece], list[int], list[int]]:
        """Owner side: direction runs for every holder, target-major in wire order."""
        extra = 1 if status else 0
        sizes = [extra] * self.world
        pieces: list[Piece] = []
        bounds: list[int] = []
        per_target: dict[int, list[tuple[int, int, Fragment]]] = {}
        for b, batch in enumerate(batches):
            for j, it in enumerate(batch.items):
                for target, frag in self.routes[it.name].targets:
                    per_target.setdefault(target, []).append((b, j, frag))
        for target in range(self.world):
            bounds.append(len(pieces))
            by_batch: dict[int, list[tuple[int, Fragment]]] = {}
            for b, j, frag in per_target.get(target, []):
                by_batch.setdefault(b, []).append((j, frag))
            for b, pairs in by_batch.items():
                for start, count, frag in fragment_runs(pairs):
                    piece = Piece(b, start, count, self.selectors(frag))
                    pieces.append(piece)
                    sizes[target] += piece.numel
        bounds.append(len(pieces))
        return pieces, sizes, bounds

    def _deliveries(
        self, items: list[Item], status: bool
    ) -> tuple[list[Delivery], list[int], list[int]]:
        """Holder side: runs of this rank's fragments in the scatter receive buffer.

        Returns:
            The deliveries, the elements received from each rank and, with ``status``,
            where each sender's status flag sits.
        """
        sizes = [0] * self.world
        per_owner: dict[int, list[Item]] = {}
        for it in items:
            route = self.routes.get(it.name)
            if route is not None and route.frag is not None:
                per_owner.setdefault(route.computing[0], []).append(it)
        out: list[Delivery] = []
        flags: list[int] = []
        offset = 0
        for owner in range(self.world):
            start = offset
            if status:
                flags.append(offset)
                offset += 1
            for run, shape in self._holder_runs(per_owner.get(owner, [])):
                out.append(self._delivery(offset, run, shape))
                offset += len(run) * shape[0] * shape[1]
            sizes[owner] = offset - start
        return out, sizes, flags

    def _holder_runs(self, items: list[Item]) -> list[tuple[list[Item], tuple[int, int]]]:
        """Consecutive items sharing fragment shape, batch and direction dtype."""
        runs: list[tuple[list[Item], tuple[int, int]]] = []
        for it in items:
            frag = self.routes[it.name].frag
            assert frag is not None
            shape = (frag.shape[0], frag.shape[1])
            if runs:
                run, last = runs[-1]
                first = run[0]
                if (
                    shape == last
                    and batch_key(it, self.table) == batch_key(first, self.table)
                    and self.table.row(it.param).direction_dtype
                    == self.table.row(first.param).direction_dtype
                ):
                    run.append(it)
                    continue
            runs.append(([it], shape))
        return runs


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _whole(m: int, n: int) -> Fragment:
    return Fragment((((0, m),), ((0, n),)))
