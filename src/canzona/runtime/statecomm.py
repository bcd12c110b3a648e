"""Owner-held optimizer state <-> checkpoint layout (DTensors sharded over the mesh)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from canzona.runtime.checks import VOTE, same_everywhere, vote
from canzona.runtime.config import UpdateFailedError
from canzona.runtime.layout import Fragment, fragment_for, full_fragment
from canzona.runtime.reshard import reshard_loaded
from canzona.runtime.routing import Item, Route, _unravel
from canzona.runtime.topology import ParamLayout, Topology, positions_in
from canzona.runtime.watchdog import Watchdog, gather_objects

if TYPE_CHECKING:
    from canzona.runtime.engine import MatrixRuntime

StateKey = tuple[int, str]  # (parameter index, state name)


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One owner-held state tensor of a parameter.

    Attributes:
        param: Parameter index.
        key: State name (e.g. ``"factor_left"``).
        shape: Shape of the state of one matrix (e.g. ``(m, m)``).
        dtype: Its dtype.
        block: For a split parameter, the block this state belongs to (each block has its
            own state and its own checkpoint tensor); None otherwise.
        stack: For a 3-D stack of matrices, how many (the checkpoint tensor gets that leading
            dimension); 0 for a matrix.
    """

    param: int
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: int | None = None
    stack: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What state movement needs from a runtime (kept across a re-plan)."""

    items: tuple[Item, ...]
    routes: dict[str, Route]
    topology: Topology
    process_group: dist.ProcessGroup | None
    rank: int
    world: int
    replica_dedup: bool
    watchdog: Watchdog
    #: ``id()`` of the parameters, in the plan's order (None: see ``positions``)
    param_ids: tuple[int, ...] | None = None
    #: a copy's: per parameter of the copy, its position in the plan (None: not in it;
    #: ``positions`` None too: the same parameters, in order)
    positions: tuple[int | None, ...] | None = None

    by_param: dict[int, list[Item]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for item in self.items:
            self.by_param.setdefault(item.param, []).append(item)

    def items_of(self, param: int) -> list[Item]:
        """The items of one parameter, in plan order."""
        return self.by_param.get(param, [])

    def computing(self, item: Item) -> tuple[int, ...]:
        """Ranks holding the owner state of ``item`` (this rank must take part in it)."""
        return self.routes[item.name].computing


def checkpoint_placements(layout: ParamLayout, dedup: bool) -> tuple[Placement, ...]:
    """Placements of owner-state checkpoint tensors on the parameter's mesh.

    Rows (or, for 3-D stacks, matrices) are split over every mesh dimension; with
    ``replica_dedup=False`` each replica group holds its own copy (``Replicate`` on the
    parameter's replicate dims).
    """
    rep = set(layout.replicate_dims()) if not dedup else set()
    return tuple(Replicate() if d in rep else Shard(0) for d in range(len(layout.mesh_shape)))


def _global_shape(layout: ParamLayout, entry: StateEntry) -> tuple[int, ...]:
    return (entry.stack, *entry.shape) if entry.stack else entry.shape


def _fragment(
    layout: ParamLayout, entry: StateEntry, coord: tuple[int, ...], dedup: bool
) -> Fragment:
    if not layout.mesh_shape:
        return full_fragment(_global_shape(layout, entry))
    return fragment_for(
        _global_shape(layout, entry),
        layout.mesh_shape,
        checkpoint_placements(layout, dedup),
        coord,
    )


def _items(snap: Snapshot, entry: StateEntry) -> list[Item]:
    """The entry's matrices: every item of its parameter, of its block for a split one."""
    return [it for it in snap.items_of(entry.param) if it.block == entry.block]


def _my_items(snap: Snapshot, entry: StateEntry) -> list[Item]:
    return [it for it in _items(snap, entry) if snap.rank in it.unit]


def _coord(layout: ParamLayout, item: Item, rank: int) -> tuple[int, ...]:
    return _unravel(item.copy.index(rank), layout.mesh_shape) if layout.mesh_shape else ()


def _piece(layout: ParamLayout, entry: StateEntry, item: Item, frag: Fragment) -> Fragment | None:
    """The part of ``item``'s state that the checkpoint fragment ``frag`` holds."""
    if item.lead is None:
        return frag if frag.numel else None
    if frag.position(item.lead) is None:
        return None
    return full_fragment(entry.shape)


def _walk(
    snap: Snapshot, entries: Sequence[StateEntry]
) -> Iterator[tuple[StateEntry, ParamLayout, Item]]:
    """(entry, layout, item) for items this rank takes part in, in a rank-independent order."""
    for entry in entries:
        layout = snap.topology.layouts[entry.param]
        for item in _items(snap, entry):
            yield entry, layout, item


def state_buffer(
    what: str, numel: int, dtype: torch.dtype, device: torch.device | str | None
) -> torch.Tensor:
    """An uninitialised flat buffer of a state exchange (``what`` names it in a failure)."""
    return torch.empty(numel, dtype=dtype, device=device)


@dataclass(slots=True)
class _Exchange:
    """One all-to-all of state pieces, its buffers allocated before any rank enters it."""

    send: torch.Tensor
    receive: torch.Tensor
    in_splits: list[int]
    out_splits: list[int]
    recv_sizes: dict[int, list[int]]


def _prepare(
    snap: Snapshot,
    sends: dict[int, list[torch.Tensor]],
    recv_sizes: dict[int, list[int]],
    dtype: torch.dtype,
    what: str,
) -> _Exchange:
    """Pack ``sends`` in rank order and allocate the receive buffer (may raise: no collective)."""
    world, device = snap.world, snap.watchdog.device
    in_splits = [sum(t.numel() for t in sends.get(r, ())) for r in range(world)]
    out_splits = [sum(recv_sizes.get(r, ())) for r in range(world)]
    receive = state_buffer(f"{what}'s receive buffer", sum(out_splits), dtype, device)
    send = state_buffer(f"{what}'s send buffer", sum(in_splits), dtype, device)
    offset = 0
    for r in range(world):
        for t in sends.get(r, ()):
            send[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
    return _Exchange(send, receive, in_splits, out_splits, recv_sizes)


def _exchange(snap: Snapshot, ex: _Exchange, what: str) -> dict[int, list[torch.Tensor]]:
    """Run a prepared exchange: per source rank, the received pieces (views)."""
    work = dist.all_to_all_single(
        ex.receive,
        ex.send,
        ex.out_splits,
        ex.in_splits,
        group=snap.process_group,
        async_op=True,
    )
    snap.watchdog.wait(work, what)
    result: dict[int, list[torch.Tensor]] = {}
    offset = 0
    for r in range(snap.world):
        for size in ex.recv_sizes.get(r, ()):
            result.setdefault(r, []).append(ex.receive[offset : offset + size])
            offset += size
    return result


def _agree(snap: Snapshot, error: Exception | None, what: str) -> None:
    """Raise on every rank when ``what`` raised on any (collective when distributed).

    In one process ``error`` itself is raised; in a job, the same
    :class:`~canzona.UpdateFailedError` on every rank, naming each failing rank and its
    error, so that no rank enters the exchange that a failed one would never reach.
    """
    if snap.process_group is None:
        if error is not None:
            raise error
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    reports = vote(mine, watchdog=snap.watchdog, what=what)
    if reports:
        text = "; ".join(f"rank {r}: {line}" for r, line in reports)
        raise UpdateFailedError(
            f"{what} failed on ranks {[r for r, _ in reports]} ({text}); "
            "the owner-held state stays where it was"
        ) from error


_Sends = dict[int, list[torch.Tensor]]
_Sizes = dict[int, list[int]]
_T = TypeVar("_T")


def _zeros(snap: Snapshot, what: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled state tensor allocated through :func:`state_buffer`."""
    flat = state_buffer(what, math.prod(shape), dtype, snap.watchdog.device)
    return flat.zero_().view(tuple(shape))


def agree_entries(
    entries: Sequence[StateEntry], names: Sequence[str], *, watchdog: Watchdog, what: str
) -> None:
    """Raise the same error on every rank unless all hold the same entries (collective).

    Which parameters have owner-held state is read from each rank's ``optimizer.state``
    (a parameter has it once it stepped): an entry cleared on some ranks only would have
    the ranks exchange different state, a collective mismatch that aborts the job.

    Raises:
        UpdateFailedError: naming the parameters whose state only some ranks hold.
    """
    text = repr([(e.param, e.key, e.shape, str(e.dtype), e.block, e.stack) for e in entries])
    if same_everywhere(text, len(entries), watchdog, f"{what} (its entries)"):
        return
    held: list[list[int]] = gather_objects(
        sorted({e.param for e in entries}), watchdog=watchdog, phase=VOTE, what=f"{what} (params)"
    )
    anywhere, everywhere = set().union(*held), set(held[0]).intersection(*held)
    differ = sorted(anywhere - everywhere)
    detail = "; ".join(
        f"{names[i]!r} on ranks {[r for r, h in enumerate(held) if i in h]} only"
        for i in differ[:3]
    ) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    raise UpdateFailedError(
        f"{what}: the ranks hold owner-held state for different parameters "
        f"({detail or 'the same parameters, different entries'}), as when an optimizer.state "
        "entry is cleared on some ranks only; clear it on every rank, or load a checkpoint on "
        "every rank. Nothing changed"
    )


def _exchange_all_or_none(
    snap: Snapshot,
    build: Callable[[], tuple[_Sends, _Sizes, _T]],
    entries: Sequence[StateEntry],
    what: str,
) -> tuple[_Sends, _T]:
    """``build()`` (what each rank sends, receives and keeps), then the exchange.

    Everything that may raise on one rank (``build``, the buffers) runs before every rank
    votes; a failure anywhere raises on every rank before any enters the exchange.

    Returns:
        Per source rank, the pieces received; and what ``build`` kept.
    """
    error: Exception | None = None
    try:
        sends, recv, kept = build()
        if snap.process_group is not None:
            ex = _prepare(snap, sends, recv, _buffer_dtype(entries), what)
    except Exception as exc:  # e.g. out of memory: every rank raises at the vote
        error = exc
    _agree(snap, error, what)
    if snap.process_group is None:
        return {r: [t.reshape(-1) for t in ts] for r, ts in sends.items()}, kept
    return _exchange(snap, ex, what), kept


def _buffer_dtype(entries: Sequence[StateEntry]) -> torch.dtype:
    return torch.float64 if any(e.dtype == torch.float64 for e in entries) else torch.float32


_Place = tuple[torch.Tensor, Item, StateEntry, ParamLayout]
_Targets = dict[int, list[tuple[Item, StateEntry, Fragment]]]


def export_state(
    snap: Snapshot,
    entries: Sequence[StateEntry],
    get: Callable[[Item, str], torch.Tensor],
    meshes: dict[int, object],
) -> dict[StateKey, torch.Tensor]:
    """Owner-held state -> one checkpoint tensor per entry (collective when distributed).

    Args:
        snap: Runtime snapshot whose owners hold the state.
        entries: State tensors to export, identical on every rank.
        get: ``get(item, key)`` returns the owner's full state tensor.
        meshes: Parameter index -> its DeviceMesh (for DTensor parameters).

    Returns:
        Per (param, key): a plain full tensor (plain parameters) or a DTensor in the
        layout of :func:`checkpoint_placements`.
    """
    dedup = snap.replica_dedup
    what = "exporting the owner-held state"

    def build() -> tuple[
        _Sends, _Sizes, tuple[dict[StateKey, torch.Tensor], dict[int, list[_Place]]]
    ]:
        locals_: dict[StateKey, torch.Tensor] = {}
        for entry in entries:
            layout = snap.topology.layouts[entry.param]
            items = _my_items(snap, entry)
            coord = _coord(layout, items[0], snap.rank) if items else ()
            shape = _fragment(layout, entry, coord, dedup).shape
            locals_[(entry.param, entry.key)] = _zeros(snap, what, shape, entry.dtype)
        sends, recv, places = _export_routes(snap, entries, get, locals_)
        return sends, recv, (locals_, places)

    received, (locals_, places) = _exchange_all_or_none(snap, build, entries, what)
    for owner, targets in places.items():
        for data, (local, item, entry, layout) in zip(
            received.get(owner, []), targets, strict=True
        ):
            if item.lead is None:
                local.copy_(data.view(local.shape))
            else:
                frag = _fragment(layout, entry, _coord(layout, item, snap.rank), dedup)
                local[frag.position(item.lead)].copy_(data.view(entry.shape))
    return {
        (e.param, e.key): _checkpoint_tensor(snap, e, locals_[(e.param, e.key)], meshes)
        for e in entries
    }


def _export_routes(
    snap: Snapshot,
    entries: Sequence[StateEntry],
    get: Callable[[Item, str], torch.Tensor],
    locals_: dict[StateKey, torch.Tensor],
) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[int]], dict[int, list[_Place]]]:
    """What this rank sends to each rank, receives from each owner, and where it lands."""
    dedup = snap.replica_dedup
    sends: dict[int, list[torch.Tensor]] = {}
    recv: dict[int, list[int]] = {}
    places: dict[int, list[_Place]] = {}
    for entry, layout, item in _walk(snap, entries):
        owner = snap.computing(item)[0] if snap.rank in item.unit else None
        if owner is None:
            continue
        if owner == snap.rank:
            state = get(item, entry.key)
            for t in item.unit:
                frag = _fragment(layout, entry, _coord(layout, item, t), dedup)
                piece = _piece(layout, entry, item, frag)
                if piece is not None:
                    sends.setdefault(t, []).append(
                        piece.read(state) if item.lead is None else state
                    )
        frag = _fragment(layout, entry, _coord(layout, item, snap.rank), dedup)
        piece = _piece(layout, entry, item, frag)
        if piece is not None:
            recv.setdefault(owner, []).append(piece.numel)
            places.setdefault(owner, []).append(
                (locals_[(entry.param, entry.key)], item, entry, layout)
            )
    return sends, recv, places


def _checkpoint_tensor(
    snap: Snapshot, entry: StateEntry, local: torch.Tensor, meshes: dict[int, object]
) -> torch.Tensor:
    """This rank's part of an exported state: the tensor, or a DTensor on the param's mesh."""
    mesh = meshes.get(entry.param)
    if mesh is None:
        return local
    layout = snap.topology.layouts[entry.param]
    shape = _global_shape(layout, entry)
    return DTensor.from_local(
        local,
        device_mesh=mesh,  # type: ignore[arg-type]
        placements=checkpoint_placements(layout, snap.replica_dedup),
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def import_state(
    snap: Snapshot,
    entries: Sequence[StateEntry],
    values: dict[StateKey, torch.Tensor],
    put: Callable[[Item, str, torch.Tensor], None],
) -> None:
    """Checkpoint tensors -> owner-held state (collective when distributed).

    ``values`` may hold DTensors in the checkpoint layout (any mesh layout DCP loaded
    them into is redistributed first) or plain full tensors.
    """
    dedup = snap.replica_dedup
    shards: dict[StateKey, torch.Tensor] = {}
    relaid: list[tuple[StateKey, DTensor, tuple[Placement, ...]]] = []
    for entry in entries:
        layout = snap.topology.layouts[entry.param]
        value = values[(entry.param, entry.key)]
        items = _my_items(snap, entry)
        coord = _coord(layout, items[0], snap.rank) if items else ()
        frag = _fragment(layout, entry, coord, dedup)
        if isinstance(value, DTensor):
            target = checkpoint_placements(layout, dedup)
            if tuple(value.placements) != target:
                relaid.append(((entry.param, entry.key), value, target))
            else:
                shards[(entry.param, entry.key)] = value.to_local().to(snap.watchdog.device)
        else:
            shards[(entry.param, entry.key)] = frag.read(value).to(snap.watchdog.device)
    for (state_key, _, _), local in zip(relaid, _relaid(snap, relaid), strict=True):
        shards[state_key] = local.to(snap.watchdog.device)
    what = "moving the owner-held state to its owners"

    def build() -> tuple[_Sends, _Sizes, tuple[dict[tuple[str, str], torch.Tensor], _Targets]]:
        sends, recv, places = _import_routes(snap, entries, shards)
        assembled: dict[tuple[str, str], torch.Tensor] = {}
        for targets in places.values():
            for item, entry, _ in targets:
                if (item.name, entry.key) not in assembled:
                    assembled[(item.name, entry.key)] = _zeros(snap, what, entry.shape, entry.dtype)
        return sends, recv, (assembled, places)

    received, (assembled, places) = _exchange_all_or_none(snap, build, entries, what)
    for src, targets in places.items():
        for data, (item, entry, piece) in zip(received.get(src, []), targets, strict=True):
            piece.write_(assembled[(item.name, entry.key)], data.view(piece.shape))
    by_name = {it.name: it for it in snap.items}
    for (name, key), full in assembled.items():
        put(by_name[name], key, full)


def _relaid(
    snap: Snapshot, relaid: Sequence[tuple[StateKey, DTensor, tuple[Placement, ...]]]
) -> list[torch.Tensor]:
    """This rank's pieces of loaded DTensors in the checkpoint layout (collective).

    In a job they move in :func:`~canzona.runtime.reshard.reshard_loaded`'s exchanges,
    voted before they start, not in DTensor's redistribution (no deadline, and a rank
    that fails there alone leaves the others waiting).
    """
    if not relaid:
        return []
    pairs = [(value, target) for _, value, target in relaid]
    if snap.process_group is None:  # one process: nothing to wait for
        return [v.redistribute(v.device_mesh, target).to_local() for v, target in pairs]
    what = "load_state_dict's move of the loaded owner-held state into the checkpoint layout"
    return reshard_loaded(pairs, watchdog=snap.watchdog, what=what)


def _import_routes(
    snap: Snapshot, entries: Sequence[StateEntry], shards: dict[StateKey, torch.Tensor]
) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[int]], _Targets]:
    """What this rank sends to each owner, receives from each holder, and where it lands."""
    dedup = snap.replica_dedup
    sends: dict[int, list[torch.Tensor]] = {}
    recv: dict[int, list[int]] = {}
    places: _Targets = {}
    for entry, layout, item in _walk(snap, entries):
        if snap.rank not in item.unit:
            continue
        computing = snap.computing(item)
        frag = _fragment(layout, entry, _coord(layout, item, snap.rank), dedup)
        piece = _piece(layout, entry, item, frag)
        if piece is not None:
            local = shards[(entry.param, entry.key)]
            data = local if item.lead is None else local[frag.position(item.lead)]
            for c in computing:
                sends.setdefault(c, []).append(data)
        if snap.rank in computing:
            for t in item.unit:
                tfrag = _fragment(layout, entry, _coord(layout, item, t), dedup)
                tpiece = _piece(layout, entry, item, tfrag)
                if tpiece is not None:
                    recv.setdefault(t, []).append(tpiece.numel)
                    places.setdefault(t, []).append((item, entry, tpiece))
    return sends, recv, places


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """Where owner-held state lived, without the process group (kept by optimizer copies).

    A copy plans again at its first step; its plan can differ from the one its copied
    states live under (a re-pricing, parameters added since), so the state moves from
    the recorded owners as after any re-plan.
    """

    items: tuple[Item, ...]
    routes: dict[str, Route]
    topology: Topology
    rank: int
    world: int
    replica_dedup: bool
    positions: tuple[int | None, ...] | None = None  # see Snapshot.positions

    def snapshot(
        self, process_group: dist.ProcessGroup | None, rank: int, world: int, watchdog: Watchdog
    ) -> Snapshot | None:
        """The record as a snapshot in this job; None when it belongs to another rank set."""
        if (rank, world) != (self.rank, self.world):
            return None
        return Snapshot(
            self.items,
            self.routes,
            self.topology,
            process_group,
            rank,
            world,
            self.replica_dedup,
            watchdog,
            positions=self.positions,
        )


def record(runtime: MatrixRuntime, params: Sequence[torch.Tensor]) -> PlanRecord | None:
    """Where ``runtime``'s owner-held state lives (None before any plan and copy).

    ``params``: the optimizer's parameters now (the copy's will be in this order), whose
    positions in the plan it records (param groups may have been edited since it was made).
    """
    if runtime.topology is None:  # a copy that has not planned yet: still where it was
        return runtime.inherited
    snap = runtime.state_home()
    assert snap is not None
    ids = map(id, params)
    positions = snap.positions if snap.param_ids is None else positions_in(snap.param_ids, ids)
    return PlanRecord(
        snap.items,
        snap.routes,
        snap.topology,
        snap.rank,
        snap.world,
        snap.replica_dedup,
        positions,
    )


def snapshot(runtime: MatrixRuntime) -> Snapshot:
    """What state movement needs from ``runtime`` (valid until its next re-plan)."""
    if runtime.topology is None:
        raise RuntimeError("the runtime has no plan yet")
    process_group, rank, world, watchdog = runtime.planned_on
    return Snapshot(
        items=tuple(runtime.items),
        routes=dict(runtime.routes),
        topology=runtime.topology,
        process_group=process_group,
        rank=rank,
        world=world,
        replica_dedup=runtime.plan_config.replica_dedup,
        watchdog=watchdog,
        param_ids=runtime.planned_ids,
    )
