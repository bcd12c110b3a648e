"""Parameter layouts across ranks: describe each parameter, agree on them, list the matrices."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from canzona.plan.spec import Ranks
from canzona.runtime.checks import AGREE, STAGES_HINT, first_difference, ranks_by_value
from canzona.runtime.config import PlanMismatchError
from canzona.runtime.layout import LayoutError, check_placements, fragment_for
from canzona.runtime.watchdog import Watchdog, gather_objects

MeshKey = tuple[tuple[int, ...], tuple[str, ...] | None]


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """How one parameter is stored: global shape, mesh and placements.

    ``mesh_ranks`` are ranks of the optimizer's process group, in the row-major
    order of the mesh (position i has coordinate ``unravel(i, mesh_shape)``). A
    plain tensor is a one-rank mesh holding the whole tensor.
    """

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[Placement, ...]
    mesh_ranks: tuple[int, ...]
    problem: str | None = None  # this rank's shard is not what the placements give

    @property
    def mesh_key(self) -> MeshKey:
        """Identifies 'the same mesh' across ranks, independently of which ranks it holds."""
        return (self.mesh_shape, self.mesh_dim_names)

    @property
    def is_local(self) -> bool:
        """True for a plain tensor or a DTensor on a one-rank mesh."""
        return len(self.mesh_ranks) == 1

    def structure(self) -> str:
        """Everything that must match on every rank (not the concrete mesh ranks)."""
        return repr(
            (
                self.index,
                self.name,
                self.shape,
                str(self.dtype),
                self.mesh_shape,
                self.mesh_dim_names,
                tuple(repr(p) for p in self.placements),
            )
        )

    def replicate_dims(self) -> tuple[int, ...]:
        """Mesh dimensions along which the tensor is replicated."""
        return tuple(i for i, p in enumerate(self.placements) if isinstance(p, Replicate))


def describe(
    index: int, name: str, tensor: torch.Tensor, process_group: dist.ProcessGroup | None, rank: int
) -> ParamLayout:
    """Read a parameter's storage layout.

    Args:
        index: Position of the parameter in the optimizer.
        name: Parameter name (used in error messages and plan specs).
        tensor: The parameter (plain tensor or DTensor).
        process_group: The optimizer's process group (None when not distributed).
        rank: This process's rank in ``process_group``.

    Raises:
        canzona.runtime.layout.LayoutError: for unsupported placements.
        ValueError: when the mesh holds ranks outside the optimizer's process group.

    A local shard of another shape than the placements give is rank-local: it is kept as
    the layout's ``problem`` (not part of :meth:`ParamLayout.structure`), which
    :func:`agree` and the step raise on every rank, not here on one.
    """
    if not isinstance(tensor, DTensor):
        return ParamLayout(index, name, tuple(tensor.shape), tensor.dtype, (), None, (), (rank,))
    mesh = tensor.device_mesh
    placements = tuple(tensor.placements)
    check_placements(name, placements, tensor.ndim)
    global_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if process_group is None or process_group is dist.group.WORLD or not dist.is_initialized():
        ranks = tuple(global_ranks)
    else:
        try:
            ranks = tuple(dist.get_group_rank(process_group, r) for r in global_ranks)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(
                f"parameter {name!r} lives on a mesh with ranks {global_ranks} that are not all "
                "in the optimizer's process group"
            ) from exc
    coordinate = mesh.get_coordinate()
    problem = None
    if coordinate is not None:
        held = fragment_for(tuple(tensor.shape), tuple(mesh.shape), placements, coordinate).shape
        if held != tuple(tensor._local_tensor.shape):
            problem = (
                f"parameter {name!r} {tuple(tensor.shape)} with placements {placements} holds "
                f"a local shard of shape {tuple(tensor._local_tensor.shape)} on rank {rank} "
                f"(mesh coordinate {tuple(coordinate)}), where these placements give {held}: "
                "a storage layout canzona cannot read"
            )
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    shape, mesh_shape = tuple(tensor.shape), tuple(mesh.shape)
    return ParamLayout(
        index, name, shape, tensor.dtype, mesh_shape, names, placements, ranks, problem
    )


def describe_all(
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    process_group: dist.ProcessGroup | None,
    rank: int,
) -> tuple[list[ParamLayout], tuple[int, LayoutError] | None]:
    """:func:`describe` of every parameter, in optimizer order, and :func:`first_problem`."""
    pairs = enumerate(zip(names, tensors, strict=True))
    layouts = [describe(i, n, t, process_group, rank) for i, (n, t) in pairs]
    return layouts, first_problem(layouts)


def positions_in(before: Sequence[int], now: Iterable[int]) -> tuple[int | None, ...]:
    """For each id of ``now``, its position in ``before`` (None: not there)."""
    at = {pid: i for i, pid in enumerate(before)}
    return tuple(at.get(pid) for pid in now)


def first_problem(layouts: Sequence[ParamLayout]) -> tuple[int, LayoutError] | None:
    """The first layout this rank cannot read (see :func:`describe`): index and error."""
    for layout in layouts:
        if layout.problem is not None:
            return layout.index, LayoutError(layout.problem)
    return None


def structure_digest(layouts: Sequence[ParamLayout], extra: str = "") -> str:
    """sha256 over every layout's structure (and ``extra``, e.g. the algorithm config)."""
    h = hashlib.sha256(extra.encode())
    for layout in layouts:
        h.update(layout.structure().encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Topology:
    """What every rank agreed on: the layouts and, per mesh, its disjoint copies."""

    layouts: tuple[ParamLayout, ...]
    copies: dict[MeshKey, tuple[tuple[int, ...], ...]]
    rank: int
    world: int
    #: the optimizer's name for its markers in the job's store: the largest of the ranks'
    #: (:func:`~canzona.runtime.watchdog.marker_name`: equal unless some process built
    #: more optimizers over the same parameters than another)
    namespace: str = ""

    def param_copies(self, index: int) -> tuple[tuple[int, ...], ...]:
        """Every copy (rank tuple, row-major) of the mesh parameter ``index`` lives on."""
        layout = self.layouts[index]
        if layout.is_local and layout.mesh_key not in self.copies:
            return tuple((r,) for r in range(self.world))
        return self.copies[layout.mesh_key]


def agree(
    layouts: Sequence[ParamLayout],
    *,
    watchdog: Watchdog,
    rank: int,
    world: int,
    extra: str = "",
    name: str = "",
) -> Topology:
    """Check that all ranks hold the same parameters and learn every mesh's copies.

    ``name`` is this rank's name of the optimizer in the job's store; the result's
    ``namespace`` is the largest over the ranks.

    One gather of a digest, the local meshes and this rank's first unreadable layout
    (:func:`~canzona.runtime.watchdog.gather_objects`: its waits have the watchdog's
    deadline); on a mismatch a second one gathers the full descriptions so that every
    rank raises the same :class:`PlanMismatchError` naming the ranks that disagree and
    the first difference.

    Raises:
        canzona.runtime.layout.LayoutError: on every rank, when some rank holds a local
            shard its placements do not give (naming the parameter, shapes and ranks).
    """
    meshes: dict[MeshKey, tuple[int, ...]] = {}
    for layout in layouts:
        if layout.is_local:
            continue
        known = meshes.setdefault(layout.mesh_key, layout.mesh_ranks)
        if known != layout.mesh_ranks:
            raise ValueError(
                f"parameter {layout.name!r} is on a mesh of shape {layout.mesh_shape} and dims "
                f"{layout.mesh_dim_names} with ranks {layout.mesh_ranks}, while another "
                f"parameter uses a different mesh of the same shape and names ({known}); "
                "give distinct meshes distinct mesh_dim_names"
            )
    digest = structure_digest(layouts, extra)
    bad = first_problem(layouts)
    mine = None if bad is None else str(bad[1])
    if world == 1:
        if bad is not None:
            raise bad[1]
        alone: dict[MeshKey, tuple[tuple[int, ...], ...]] = {k: (v,) for k, v in meshes.items()}
        return Topology(tuple(layouts), alone, rank, world, name)
    gathered: list[tuple[str, dict[MeshKey, tuple[int, ...]], str | None, str] | None]
    gathered = gather_objects(
        (digest, meshes, mine, name),
        watchdog=watchdog,
        phase=AGREE,
        what="the layout agreement",
    )
    problems = [(r, g[2]) for r, g in enumerate(gathered) if g is not None and g[2] is not None]
    if problems:
        raise LayoutError(
            f"unreadable local shards on ranks {[r for r, _ in problems]}: {problems[0][1]}"
        )
    digests = [g[0] for g in gathered if g is not None]
    if len(set(digests)) != 1:
        parts = [ranks for _, ranks in ranks_by_value(digests)]
        full: list[list[str]] = gather_objects(
            [*(lo.structure() for lo in layouts), extra],  # parameters first
            watchdog=watchdog,
            phase=AGREE,
            what="the layout agreement's descriptions",
        )
        lists = [f or [] for f in full]
        detail = first_difference(lists, parts[0][0], parts[1][0])
        raise PlanMismatchError(
            "ranks disagree on the optimizer's parameters or configuration: "
            + " vs ".join(f"ranks {p}" for p in parts)
            + f"; first difference: {detail}{STAGES_HINT}"
        )
    copies: dict[MeshKey, set[tuple[int, ...]]] = {}
    for entry in gathered:
        assert entry is not None
        for key, ranks in entry[1].items():
            copies.setdefault(key, set()).add(tuple(ranks))
    result: dict[MeshKey, tuple[tuple[int, ...], ...]] = {}
    for key, found in copies.items():
        ordered = tuple(Ranks(r) for r in sorted(found))
        seen: set[int] = set()
        for ranks in ordered:
            if seen & set(ranks):
                raise PlanMismatchError(
                    f"meshes of shape {key[0]} and dims {key[1]} overlap across ranks: "
                    f"{list(ordered)}; each rank must belong to exactly one copy of a mesh"
                )
            seen |= set(ranks)
        result[key] = ordered
    namespace = max(g[3] for g in gathered if g is not None)
    return Topology(tuple(layouts), result, rank, world, namespace)
