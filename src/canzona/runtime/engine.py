"""The runtime facade used by the optimizers: agree, plan, check, schedule, run."""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import compress

import torch
import torch.distributed as dist

from canzona.plan import CostModel, GroupedCost, MatrixSpec, Plan, PlanConfig, build_plan
from canzona.runtime.calibrate import measures
from canzona.runtime.checks import (
    check_header,
    check_plan_digest,
    header_values,
    raise_failures,
    ride_header,
)
from canzona.runtime.config import PartialUpdateError, PipelineConfig
from canzona.runtime.pipeline import Failure, Pipeline
from canzona.runtime.pipelines import build_pipeline
from canzona.runtime.plan_inputs import calibrated, items_and_specs
from canzona.runtime.repricing import Observation, repriced
from canzona.runtime.routing import Item, Route, route_all
from canzona.runtime.statecomm import PlanRecord, Snapshot, snapshot
from canzona.runtime.stats import StepStats
from canzona.runtime.step_start import StepStart
from canzona.runtime.table import ApplyFn, ComputeFn, StepTable
from canzona.runtime.tensors import REDISTRIBUTED, process_group_of, shapes, tensor_device
from canzona.runtime.topology import (
    ParamLayout,
    Topology,
    agree,
    describe_all,
    positions_in,
    structure_digest,
)
from canzona.runtime.watchdog import Watchdog, marker_name

_SCHEDULES = 4  # schedules kept per plan (one per set of parameters with gradients)


class MatrixRuntime:
    """Everything distributed about one optimizer: layouts, plan, routes, schedules.

    Args:
        plan_config: Owner assignment and micro-group configuration.
        pipeline_config: Pipeline configuration.
        cost: Cost model name or object for the planner.
    """

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
        self.process_group: dist.ProcessGroup | None = None
        self.rank = 0
        self.world = 1
        self.digest = ""
        self._structure = ""
        self._layout_key: tuple[tuple[int, ...], tuple[str, ...], tuple[object, ...]] = ((),) * 3
        self._layouts: list[ParamLayout] = []
        self._unreadable: Failure | None = None
        self._layout_version = 0
        self._structure_key: tuple[object, ...] = ()
        self._structure_now = ""
        self._config_now = ""
        self._planned = False
        self._plan_version = 0
        self._pipelines: dict[tuple[object, ...], Pipeline] = {}
        self._current: Pipeline | None = None
        # the header rides the first gather while steps repeat the last agreed one:
        # (plan digest, gradient presence) of this step, of the last successful step,
        # and (pipeline, gradient presence, table version) to ride with
        self._begun: tuple[str, tuple[int, ...]] | None = None
        self._last_ok: tuple[str, tuple[int, ...]] | None = None
        self._ride: tuple[Pipeline, tuple[int, ...], int] | None = None
        self._header: list[int] | None = None
        self.watchdog = Watchdog(None, 0, 1, pipeline_config.timeout_s)
        # (process group, rank, world, watchdog) the current plan was made for: parameters added
        # later can make the job distributed before the old plan's state is moved
        self.planned_on: tuple[dist.ProcessGroup | None, int, int, Watchdog]
        self.planned_on = (None, 0, 1, self.watchdog)
        self.device = torch.device("cpu")
        self.planned_ids: tuple[int, ...] = ()  # the parameters (ids) of the current plan
        self.calibration_s = 0.0  # time the last calibration took
        self.calibrations = 0  # calibrations so far
        self.reprice_s = 0.0  # time the last re-pricing by observed calls took (with its plan)
        self.repricings = 0  # plans re-priced by observed calls so far
        self._specs: list[MatrixSpec] = []
        self._observation: Observation | None = None
        # a copied optimizer's owner-held state: where it lived (moves at the first plan)
        self.inherited: PlanRecord | None = None
        # where the owner-held state lives after a re-plan, until a step hands it over to
        # be moved (a step that raises after its re-plan leaves it for the next one)
        self._unmoved: Snapshot | None = None

    def identify(self, description: str) -> None:
        """Name the markers by what the optimizer optimizes (the ranks agree when planning)."""
        self.watchdog.name = marker_name(description)

    @property
    def distributed(self) -> bool:
        """True when the optimizer's collectives run on a process group."""
        return self.process_group is not None

    def invalidate(self) -> None:
        """Forget the plan (e.g. after ``add_param_group``); the next step re-plans."""
        self._planned = False
        self._pipelines.clear()
        self._forget_ride()

    def _forget_ride(self) -> None:
        """The next step runs its cross-rank check on its own (and the one after too)."""
        self._ride = self._last_ok = self._begun = None
        self._header = None

    def _resolve_group(self, tensors: Sequence[torch.Tensor]) -> None:
        group = process_group_of(self.config.process_group)
        if group is not None:
            self.process_group = group
            self.rank = dist.get_rank(self.process_group)
            self.world = dist.get_world_size(self.process_group)
        else:
            self.process_group, self.rank, self.world = None, 0, 1
        self.device = tensor_device(tensors)
        self.watchdog = Watchdog(
            self.process_group,
            self.rank,
            self.world,
            self.config.timeout_s,
            markers=self.config.progress_markers,
            step=self.watchdog.step,
            device=self.device,
            name=self.watchdog.name,
            calls=self.watchdog.calls,
        )

    def layouts(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        sizes: tuple[torch.Size, ...] | None = None,
    ) -> list[ParamLayout]:
        """Storage layouts of the parameters (cached while the parameters and ``sizes`` stay)."""
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} parameters")
        key = (tuple(map(id, tensors)), tuple(names), shapes(tensors) if sizes is None else sizes)
        if key != self._layout_key:
            self._resolve_group(tensors)
            self._layout_version += 1
            self._layouts, bad = describe_all(names, tensors, self.process_group, self.rank)
            self._unreadable = bad and Failure("reading the layout", bad[1], (bad[0],))
            self._layout_key = key
        return self._layouts

    # ------------------------------------------------------------------ step
    def begin_step(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        table: StepTable,
        *,
        has_grad: Sequence[int],
        nonfinite: bool = False,
        failure: Failure | None = None,
        compute: ComputeFn | None = None,
        fresh: Sequence[int] = (),
        shapes: tuple[torch.Size, ...] | None = None,
    ) -> StepStart:
        """Check the step across ranks, (re)plan if needed, and allocate the step's buffers.

        Every collective here is small and entered by every rank in the same order,
        before the pipeline's first all-to-all.

        Args:
            names: Parameter names, in optimizer order.
            tensors: The parameters.
            table: The optimizer's table (matrix parameters, dtypes, hyper-parameters).
            has_grad: Each parameter's gradient on this rank (:func:`.tensors.grad_codes`).
            nonfinite: This rank saw a non-finite gradient (with ``skip_nonfinite``).
            failure: Something already failed on this rank (every rank then raises).
            compute: The owner math, timed when a plan with measured costs is built.
            fresh: The parameters with a gradient whose ``optimizer.state`` entry has no
                step yet (new, or cleared by the user): every rank must begin the same.
            shapes: The parameters' shapes, when the caller has read them this step.

        In a steady step (the last two succeeded with the same plan and parameters with
        gradients, the step is atomic and the per-step check is on) nothing is exchanged
        here: the header rides the first gather (see :meth:`run`) and the step reuses the
        last one's schedule.

        Raises:
            UpdateFailedError: on every rank, when ``failure`` was given on some rank.
        """
        self.watchdog.step += 1
        self._header = None
        if self._observation is not None and self._observation.due:
            self._forget_ride()  # the re-pricing is a collective of its own: no header rides
        try:
            self.layouts(names, tensors, shapes)
            failure = failure or self._unreadable  # raised on every rank, like any failure
            if self._rides():
                return self._begin_riding(
                    names, tensors, table, has_grad, nonfinite, failure, fresh
                )
            previous, flagged, failed = self._sync(
                names,
                tensors,
                table,
                has_grad=has_grad,
                nonfinite=nonfinite,
                failed=failure is not None,
                compute=compute,
                fresh=fresh,
            )
            if failed or (failure is not None and self.process_group is None):
                raise_failures(failure, names, self.watchdog, self.process_group is not None)
            active = frozenset(compress(range(len(has_grad)), has_grad))
            if flagged:
                self._forget_ride()
                return StepStart(active, True, {}, self._hand_over(previous))
            pipeline = self._pipeline(table, active, tensors)
            unheld = self._hold(pipeline)
            self._begun = (self.digest, tuple(has_grad))
            payload = pipeline.schedule.payload
            previous = self._hand_over(previous)
            return StepStart(active, False, payload, previous, failure=unheld)
        except BaseException:
            self._forget_ride()
            raise

    def _rides(self) -> bool:
        """Whether this step's header rides its first gather (the same on every rank)."""
        c = self.config
        return (
            self._ride is not None
            and self.process_group is not None
            and c.atomic  # a declined step is undone exactly, like a failed one
            and c.check_every_step
        )

    def _begin_riding(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        table: StepTable,
        has_grad: Sequence[int],
        nonfinite: bool,
        failure: Failure | None,
        fresh: Sequence[int],
    ) -> StepStart:
        assert self._ride is not None
        pipeline, grads, version = self._ride
        unheld = self._hold(pipeline)  # a rank without its buffers says it is not ready
        failure = failure or unheld
        structure = self._structure_of(self._layouts, table)  # begin_step read them
        needs_setup = self._stale(structure)
        ready = (
            not needs_setup
            and failure is None
            and not nonfinite
            and version == table.version
            and tuple(has_grad) == grads
            and not fresh  # a state begun afresh is compared with the check on its own
        )
        header = header_values(
            num_params=len(tensors),
            structure=structure,
            plan=self.digest,
            hparams=table.fingerprint,
            has_grad=has_grad,
            failed=failure is not None,
            nonfinite=nonfinite,
            needs_setup=needs_setup,
            fresh=fresh,
        )
        self._header = ride_header(header, ready)
        self._begun = (self.digest, grads)
        self.watchdog.tag = f"{self.watchdog.name}-{structure[:16]}"
        active = frozenset(compress(range(len(grads)), grads))
        payload = pipeline.schedule.payload
        return StepStart(active, False, payload, None, declined=not ready, failure=unheld)

    def _hold(self, pipeline: Pipeline) -> Failure | None:
        """Make ``pipeline`` the step's and allocate its buffers.

        In a distributed job a failed allocation (out of memory) is returned, not raised:
        the rank must still enter the step's collectives, so that every rank raises it
        (see :meth:`~canzona.runtime.schedule_parts.Schedule.acquire`); in one process
        it is raised, as in ``torch.optim``.
        """
        for other in self._pipelines.values():
            # kept buffers: one schedule's at a time (another set of parameters with
            # gradients has its own schedule); a retired one may still be in use
            if other is not pipeline and not other.retired:
                other.schedule.free()
        self._current = pipeline
        try:
            pipeline.schedule.acquire()
        except Exception as exc:
            if any(buf.broken for buf in pipeline.schedule.buffers):  # built again next step
                self._pipelines = {k: v for k, v in self._pipelines.items() if v is not pipeline}
            if self.process_group is None:
                self._current = None
                raise
            return Failure("allocating the step's buffers", exc)
        return None

    def run(
        self,
        table: StepTable,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        compute: ComputeFn,
        apply: ApplyFn,
        failure: Failure | None = None,
    ) -> StepStats:
        """Run the step begun by :meth:`begin_step` (see :meth:`Pipeline.run`)."""
        pipeline = self._current
        if pipeline is None:
            raise RuntimeError("MatrixRuntime.begin_step() must run before run()")
        self._current = None
        begun, ride, self._header = self._begun, self._header, None
        observation = self._observation
        pipeline.observe = observation if observation and observation.recording else None
        partial: PartialUpdateError | None = None
        try:
            stats = pipeline.run(
                table=table,
                tensors=tensors,
                names=names,
                compute=compute,
                apply=apply,
                failure=failure,
                ride=ride,
            )
        except PartialUpdateError as exc:  # the others applied it: take their path next
            partial = exc
        except BaseException:
            self._forget_ride()
            raise
        finally:
            pipeline.observe = None
        if observation is not None:
            observation.runs += 1  # a step that raised raised on every rank: not counted
        # agreed facts only (the plan digest, the gradients the header compared): every rank
        # makes the same choice; no ride where gradients are redistributed (read before it)
        heads = pipeline.schedule.micro_groups
        rides = begun is not None and begun == self._last_ok and REDISTRIBUTED not in begun[1]
        if rides and begun is not None and heads and heads[0].header is not None:
            self._ride = (pipeline, begun[1], table.version)
        else:
            self._ride = None
        self._last_ok = begun
        if partial is not None:
            raise partial
        return stats

    def abandon(self) -> None:
        """Release a begun step's buffers without running it."""
        if self._current is not None:
            self._current.schedule.release()
            self._current = None

    def sync_plan(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        table: StepTable,
        compute: ComputeFn | None = None,
    ) -> Snapshot | None:
        """Agree on the plan with every rank (collective); re-plan when needed.

        Returns the old plan's snapshot after a re-plan (the state moves from it), else None.
        """
        previous, _, _ = self._sync(names, tensors, table, compute=compute)
        return self._hand_over(previous)

    def _hand_over(self, previous: Snapshot | None) -> Snapshot | None:
        """``previous`` for the caller to move the state from: no longer kept here."""
        self._unmoved = None
        return previous

    def move_failed(self, previous: Snapshot) -> None:
        """The state did not leave ``previous`` (its move raised): the next step moves it."""
        self._unmoved = previous
        self.invalidate()

    def _sync(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        table: StepTable,
        *,
        has_grad: Sequence[int] = (),
        nonfinite: bool = False,
        failed: bool = False,
        compute: ComputeFn | None = None,
        fresh: Sequence[int] = (),
    ) -> tuple[Snapshot | None, bool, bool]:
        layouts = self.layouts(names, tensors)
        structure = self._structure_of(layouts, table)
        config = self._config_now
        needs_setup = self._stale(structure)
        self.watchdog.tag = f"{self.watchdog.name}-{structure[:16]}"
        flagged = nonfinite
        if self.process_group is not None and (
            # the first step of a plan checks either way: the settings that skip the
            # check are among those compared (ranks that differ raise, never hang)
            self.config.check_every_step or self.config.skip_nonfinite or not self._planned
        ):
            needs_setup, flagged, failed = check_header(
                num_params=len(tensors),
                structure=structure,
                plan=self.digest,
                hparams=table.fingerprint,
                needs_setup=needs_setup,
                watchdog=self.watchdog,
                names=names,
                has_grad=has_grad,
                nonfinite=nonfinite,
                failed=failed,
                describe=lambda: [*(lo.structure() for lo in layouts), self._config_now],
                groups=table.hparams,
                fresh=fresh,
            )
            if failed:
                return None, flagged, True
        else:  # no header: a failure stays this rank's until the vote (see begin_step)
            failed = False
        if needs_setup:
            self._keep_home()
            try:
                self._setup(layouts, structure, config, table, compute)
            except BaseException:
                self._planned = False  # the next step plans again, from the kept home
                raise
            self.inherited = None
        elif self._observation is not None and self._observation.due:
            self._keep_home()
            try:
                self._reprice()
            except BaseException:
                self._planned = False
                raise
        return self._unmoved, flagged, failed

    def _keep_home(self) -> None:
        """Before a re-plan: remember where the owner-held state lives, unless known.

        Known already when an earlier re-plan's step raised before handing it over: the
        state never left it, whatever plans were made since.
        """
        if self._unmoved is None:
            self._unmoved = self.state_home()

    def state_home(self) -> Snapshot | None:
        """Where the owner-held state lives now (None before any plan and copy)."""
        if self._unmoved is not None:  # a re-plan whose step raised before the move
            return self._unmoved
        if self.topology is not None:
            return snapshot(self)
        if self.inherited is not None:  # a copy's first plan: the copied state moves
            return self.inherited.snapshot(self.process_group, self.rank, self.world, self.watchdog)
        return None

    def _reprice(self) -> None:
        """Re-price the calibrated table by the owner calls the steps made, and re-plan.

        A collective. The first round re-prices the plan's own (calibrated) table; a later
        one re-prices that same table (``observation.base``) by every round's calls.
        """
        observation, self._observation = self._observation, None
        assert observation is not None and self.plan is not None
        cost = observation.base or self.plan.optimizer
        assert isinstance(cost, GroupedCost)
        start = time.perf_counter()
        agreed = observation.agree(self.watchdog)
        self._build(repriced(cost, agreed), self._structure)
        self.reprice_s = time.perf_counter() - start
        self.repricings += 1
        self._observation = observation.next_round(cost, agreed)

    def _stale(self, structure: str) -> bool:
        """Whether the plan must be (re)built: none yet, other layouts or other parameters.

        The same layouts in another order re-plan too: the state moves to the new positions.
        """
        moved = self._layout_key[0] is not self.planned_ids
        return not self._planned or structure != self._structure or moved

    def _structure_of(self, layouts: Sequence[ParamLayout], table: StepTable) -> str:
        """The structure digest of the parameters and configuration (cached per key)."""
        # frozen configs and the table's version: the key costs nothing per matrix
        agreed = (table.config, self.plan_config, *self.config.collective_settings)
        key = (self._layout_version, table.version, *agreed)
        if self._structure_key != key:
            self._structure_key = key
            self._config_now = repr((*agreed, table.matrix))
            self._structure_now = structure_digest(layouts, self._config_now)
        return self._structure_now

    def _setup(
        self,
        layouts: Sequence[ParamLayout],
        structure: str,
        config: str,
        table: StepTable,
        compute: ComputeFn | None,
    ) -> None:
        self._forget_ride()
        # the ranks agree on where each parameter was too (equal layouts reordered on some
        # ranks only would pair one matrix's rows with another's)
        moved = positions_in(self.planned_ids, self._layout_key[0]) if self.planned_ids else ()
        self.planned_ids = self._layout_key[0]
        self.topology = agree(
            layouts,
            watchdog=self.watchdog,
            rank=self.rank,
            world=self.world,
            extra=f"{config}; from positions {moved}",
            name=self.watchdog.name,
        )
        self.watchdog.name = self.topology.namespace
        self.items, specs = items_and_specs(
            self.topology, table, replica_dedup=self.plan_config.replica_dedup
        )
        cost = table.cost if table.cost is not None else self.cost
        self._specs = specs
        self._observation = None
        if specs and measures(self.plan_config, table, compute, self.process_group is not None):
            assert compute is not None
            start = time.perf_counter()
            cost = calibrated(
                self.items,
                table,
                compute,
                world=self.world,
                config=self.config,
                watchdog=self.watchdog,
                device=self.device,
            )
            self.calibration_s = time.perf_counter() - start
            self.calibrations += 1
            if self.config.reprice_steps:
                self._observation = Observation(specs, self.config.reprice_steps, self.device)
        self._build(cost, structure)

    def _build(self, cost: str | CostModel, structure: str) -> None:
        """Plan the items' specs on ``cost``, route them, and agree on the plan's digest.

        A new plan's first step checks on its own: the header that rides a gather belongs
        to a pipeline of the plan before it (a re-pricing through :meth:`sync_plan`, as
        ``state_dict()`` makes when one is due, must not leave the next step riding it).
        """
        self._forget_ride()
        specs = self._specs
        assert self.topology is not None
        self.plan = (
            build_plan(specs, self.world, self.plan_config, optimizer=cost) if specs else None
        )
        self.routes = route_all(self.items, self.topology, self.plan, self.rank)
        self.planned_on = (self.process_group, self.rank, self.world, self.watchdog)
        self.digest = self.plan.digest() if self.plan else structure
        self._structure = structure
        self._planned = True
        self._plan_version += 1
        self._pipelines.clear()
        if self.process_group is not None:
            check_plan_digest(self.digest, watchdog=self.watchdog)

    def _pipeline(
        self, table: StepTable, active: frozenset[int], tensors: Sequence[torch.Tensor]
    ) -> Pipeline:
        """The pipeline of the current plan for this table and set of active parameters."""
        matrix_active = tuple(filter(active.__contains__, table.matrix))
        key = (self._plan_version, table.version, matrix_active)
        pipeline = self._pipelines.get(key)
        if pipeline is not None and not pipeline.retired:
            return pipeline
        pipeline = build_pipeline(self, table, matrix_active, tensors)
        if key not in self._pipelines and len(self._pipelines) >= _SCHEDULES:
            self._pipelines.pop(next(iter(self._pipelines)))
        self._pipelines[key] = pipeline
        return pipeline
