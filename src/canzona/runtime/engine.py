"""The runtime facade used by the optimizers: agree, plan, check, run."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from canzona.plan import CostModel, Plan, PlanConfig, build_plan
from canzona.runtime.checks import (
    check_header,
    check_plan_digest,
    failing_ranks,
)
from canzona.runtime.config import PipelineConfig
from canzona.runtime.layout import check_placements, fragment_for
from canzona.runtime.pipeline import Pipeline
from canzona.runtime.routing import Item, Route, build_items, plan_specs, route_all
from canzona.runtime.statecomm import Snapshot
from canzona.runtime.topology import ParamLayout, Topology, agree, describe, structure_digest
from canzona.runtime.watchdog import Watchdog


def fingerprint(value: object) -> str:
    """sha256 of a value's repr (used for hyper-parameters)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()


def tensor_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where the parameters live (the device of communication buffers and checks)."""
    for t in tensors:
        if isinstance(t, DTensor):
            return t._local_tensor.device
    return tensors[0].device if tensors else torch.device("cpu")


def needs_communication(tensors: Sequence[torch.Tensor]) -> bool:
    """True when some parameter is a DTensor on a mesh of more than one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return any(isinstance(t, DTensor) and t.device_mesh.size() > 1 for t in tensors)


class MatrixRuntime:
    """Everything distributed about one optimizer: layouts, plan, routes, pipeline.

    Attributes:
        _instances: Runtimes created in this process (names progress markers).

    Args:
        plan_config: Owner assignment and micro-group configuration.
        pipeline_config: Pipeline configuration.
        cost: Cost model name or object for the planner.
    """

    _instances = 0

    def __init__(
        self, *, plan_config: PlanConfig, pipeline_config: PipelineConfig, cost: str | CostModel
    ) -> None:
        self.plan_config = plan_config
        self.config = pipeline_config
        self.cost = cost
        self.plan: Plan | None = None
        self.items: list[Item] = []
        self.routes: dict[str, Route] = {}
        self.topology: Topology | None = None
        self.pipeline: Pipeline | None = None
        self.group: dist.ProcessGroup | None = None
        self.rank = 0
        self.world = 1
        self.digest = ""
        self._structure = ""
        self._layout_key: tuple[object, ...] = ()
        self._layouts: list[ParamLayout] = []
        self._layout_version = 0
        self._structure_key: tuple[int, str] = (0, "")
        self._structure_now = ""
        self.previous: Snapshot | None = None
        self.watchdog = Watchdog(None, 0, 1, pipeline_config.timeout_s)
        # (group, rank, world, watchdog) the current plan was made for: parameters added
        # later can make the job distributed before the old plan's state is moved
        self.planned_on: tuple[dist.ProcessGroup | None, int, int, Watchdog] = (
            None,
            0,
            1,
            self.watchdog,
        )
        self.device = torch.device("cpu")
        # ranks build their optimizers in the same order: the n-th one shares a namespace
        MatrixRuntime._instances += 1
        self._instance = MatrixRuntime._instances

    @property
    def distributed(self) -> bool:
        """True when the optimizer's collectives run on a process group."""
        return self.group is not None

    def invalidate(self) -> None:
        """Forget the plan (e.g. after ``add_param_group``); the next step re-plans."""
        self.pipeline = None

    def _resolve_group(self, tensors: Sequence[torch.Tensor]) -> None:
        if needs_communication(tensors):
            self.group = self.config.process_group or dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.world = dist.get_world_size(self.group)
        else:
            self.group, self.rank, self.world = None, 0, 1
        self.device = tensor_device(tensors)
        self.watchdog = Watchdog(
            self.group,
            self.rank,
            self.world,
            self.config.timeout_s,
            markers=self.config.progress_markers,
            step=self.watchdog.step,
            device=self.device,
        )

    def layouts(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[ParamLayout]:
        """Storage layouts of the parameters (cached while the parameter list is unchanged)."""
        key = tuple((id(t), n) for n, t in zip(names, tensors, strict=True))
        if key != self._layout_key:
            self._resolve_group(tensors)
            self._layout_version += 1
            self._layouts = [
                describe(i, n, t, self.group, self.rank)
                for i, (n, t) in enumerate(zip(names, tensors, strict=True))
            ]
            self._layout_key = key
        return self._layouts

    def begin_step(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        matrix_params: Sequence[int],
        *,
        itemsize: Callable[[int], int],
        extra: str,
        has_grad: Sequence[bool],
        hparams: str,
        nonfinite: bool = False,
    ) -> tuple[set[int], bool]:
        """Check the step across ranks, (re)plan if needed, return the active parameters.

        Every collective here is small and entered by every rank in the same order,
        before the pipeline's first all-to-all. After a re-plan, ``previous`` holds the
        old plan's snapshot so that owner-held state can be moved to the new owners.

        Args:
            names: Parameter names, in optimizer order.
            tensors: The parameters.
            matrix_params: Indices of parameters updated by the matrix algorithm.
            itemsize: Bytes per element of a parameter's payload.
            extra: Algorithm configuration every rank must share.
            has_grad: Whether each parameter has a gradient on this rank.
            hparams: Fingerprint of the param groups' hyper-parameters.
            nonfinite: This rank saw a non-finite gradient (with ``skip_nonfinite``).

        Returns:
            The parameters with a gradient on every rank, and whether any rank saw a
            non-finite gradient (then every rank skips the step).
        """
        self.watchdog.step += 1
        _, flagged = self.sync_plan(
            names,
            tensors,
            matrix_params,
            itemsize=itemsize,
            extra=extra,
            hparams=hparams,
            has_grad=has_grad,
            nonfinite=nonfinite,
        )
        return {i for i, g in enumerate(has_grad) if g}, flagged

    def sync_plan(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        matrix_params: Sequence[int],
        *,
        itemsize: Callable[[int], int],
        extra: str,
        hparams: str,
        has_grad: Sequence[bool] = (),
        nonfinite: bool = False,
    ) -> tuple[bool, bool]:
        """Run the cross-rank header check and (re)plan when needed.

        Returns:
            (whether it re-planned, whether any rank saw a non-finite gradient).
        """
        layouts = self.layouts(names, tensors)
        config = repr(
            (extra, self.plan_config, self.config.overlap, self.config.depth, tuple(matrix_params))
        )
        if self._structure_key != (self._layout_version, config):  # hashing is O(params)
            self._structure_key = (self._layout_version, config)
            self._structure_now = structure_digest(layouts, config)
        structure = self._structure_now
        needs_setup = self.pipeline is None or structure != self._structure
        self.watchdog.tag = f"{self._instance}-{structure[:16]}"
        flagged = nonfinite
        if self.group is not None and (self.config.check_every_step or self.config.skip_nonfinite):
            needs_setup, flagged = check_header(
                num_params=len(tensors),
                structure=structure,
                plan=self.digest,
                hparams=hparams,
                needs_setup=needs_setup,
                watchdog=self.watchdog,
                names=names,
                has_grad=has_grad,
                nonfinite=nonfinite,
            )
        self.previous = None
        if needs_setup:
            if self.topology is not None:
                self.previous = snapshot(self)
            self._setup(layouts, structure, config, matrix_params, itemsize)
        return needs_setup, flagged

    def _setup(
        self,
        layouts: Sequence[ParamLayout],
        structure: str,
        config: str,
        matrix_params: Sequence[int],
        itemsize: Callable[[int], int],
    ) -> None:
        self.topology = agree(
            layouts, group=self.group, rank=self.rank, world=self.world, extra=config
        )
        self.items = build_items(
            self.topology, matrix_params, replica_dedup=self.plan_config.replica_dedup
        )
        specs = plan_specs(self.items, itemsize)
        self.plan = (
            build_plan(specs, self.world, self.plan_config, optimizer=self.cost) if specs else None
        )
        self.routes = route_all(self.items, self.topology, self.plan, self.rank)
        by_name = {it.name: it for it in self.items}
        groups = [[by_name[n] for n in g.names] for g in self.plan.groups] if self.plan else []
        local = [it for it in self.items if it.is_local and it.unit == (self.rank,)]
        self.pipeline = Pipeline(
            routes=self.routes,
            groups=groups,
            local_items=local,
            group=self.group,
            rank=self.rank,
            world=self.world,
            config=self.config,
            replicated=bool(self.plan and self.plan.assignment.replicated),
            watchdog=self.watchdog,
            device=self.device,
        )
        self.planned_on = (self.group, self.rank, self.world, self.watchdog)
        self.digest = self.plan.digest() if self.plan else structure
        self._structure = structure
        if self.group is not None:
            check_plan_digest(self.digest, watchdog=self.watchdog)

    @property
    def step_pipeline(self) -> Pipeline:
        """The pipeline of the current plan (``begin_step`` builds it)."""
        if self.pipeline is None:
            raise RuntimeError("MatrixRuntime.begin_step() must run before the pipeline")
        return self.pipeline


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing storage), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def snapshot(runtime: MatrixRuntime) -> Snapshot:
    """What state movement needs from ``runtime`` (valid until its next re-plan)."""
    if runtime.topology is None:
        raise RuntimeError("the runtime has no plan yet")
    group, rank, world, watchdog = runtime.planned_on
    return Snapshot(
        items=tuple(runtime.items),
        routes=dict(runtime.routes),
        topology=runtime.topology,
        group=group,
        rank=rank,
        world=world,
        replica_dedup=runtime.plan_config.replica_dedup,
        watchdog=watchdog,
    )


def check_all_ok(ok: bool, runtime: MatrixRuntime) -> list[int]:
    """Ranks of the runtime's group where ``ok`` is False (no collective when local)."""
    if runtime.group is None:
        return [] if ok else [runtime.rank]
    return failing_ranks(ok, watchdog=runtime.watchdog)


def validate_param(name: str, p: torch.Tensor) -> None:
    """Reject storage layouts the runtime cannot reconstruct (e.g. ``Partial``), by name.

    Raises:
        canzona.runtime.layout.LayoutError: a ``ValueError`` naming the parameter.
    """
    if isinstance(p, DTensor):
        check_placements(name, tuple(p.placements), p.ndim)


def all_finite(grads: Sequence[torch.Tensor]) -> bool:
    """True when every local gradient shard is free of NaN and Inf (one host read)."""
    flags = [torch.isfinite(local_tensor(g)).all() for g in grads if local_tensor(g).numel()]
    return bool(torch.stack(flags).all()) if flags else True


def as_storage_layout(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Element-wise state in ``p``'s storage layout, from a loaded value.

    A plain tensor of the parameter's global shape (a consolidated checkpoint) becomes a
    DTensor holding this rank's slice; a DTensor in other placements on the same mesh is
    redistributed (collective: every rank loads the same structure); a DTensor loaded
    for a plain parameter is gathered.

    Raises:
        ValueError: for a DTensor on another mesh than the parameter's.
    """
    if not isinstance(p, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    mesh, placements = p.device_mesh, tuple(p.placements)
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:
            raise ValueError(
                f"state on mesh {value.device_mesh} cannot be loaded for a parameter on {mesh}"
            )
        if tuple(value.placements) == placements:
            return value
        return value.redistribute(mesh, placements)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank holds the parameter, so it is in its mesh"
    frag = fragment_for(tuple(p.shape), tuple(mesh.shape), placements, coordinate)
    local = frag.read(value.to(p._local_tensor.device)).contiguous()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def param_mesh(p: torch.Tensor) -> object | None:
    """The DeviceMesh of a DTensor parameter (None for a plain tensor)."""
    return p.device_mesh if isinstance(p, DTensor) else None


def local_grad(name: str, p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``p.grad`` in ``p``'s storage layout.

    Raises:
        RuntimeError: for sparse gradients.
        TypeError: for a plain gradient on a DTensor parameter.
    """
    grad = p.grad
    if grad is None:
        raise RuntimeError(f"parameter {name!r} has no gradient")
    if grad.is_sparse:
        raise RuntimeError(f"parameter {name!r}: sparse gradients are not supported")
    if isinstance(p, DTensor):
        if not isinstance(grad, DTensor):
            raise TypeError(
                f"parameter {name!r} is a DTensor but its gradient is a plain tensor; "
                "set .grad to a DTensor with the parameter's placements"
            )
        if tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)
    return local_tensor(grad)
