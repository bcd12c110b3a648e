"""Shared machinery of canzona's optimizers: param groups, the step, the AdamW route."""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import compress
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from canzona.optim.adamw_route import AdamWRouteMixin
from canzona.optim.calls import collective_call
from canzona.optim.checkpoint import CheckpointMixin
from canzona.optim.copies import CopyMixin
from canzona.optim.owner_state import OwnerState
from canzona.optim.prepare import GroupWork, SeenState, StepWork, build_work
from canzona.optim.step_hooks import hooked_step
from canzona.optim.step_table import StepTableMixin, grad_dtype
from canzona.optim.transaction import Backup, StepTransaction
from canzona.optim.validation import (
    check_adamw_names,
    check_common,
    check_group,
    watch_gradients,
)
from canzona.optim.value_types import typed_defaults
from canzona.plan import PlanConfig
from canzona.runtime import (
    ApplyBatch,
    ComputeBatch,
    Failure,
    Item,
    MatrixRuntime,
    PartialUpdateError,
    PipelineConfig,
    StepDeclined,
    StepStart,
    StepStats,
    StepTable,
    all_finite,
    grad_codes,
    local_grads,
    partial_update,
    process_group_of,
    read_gradients,
    shapes,
)

ADAMW = "adamw"


_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(fn: _F) -> _F:
    """``fn`` excluded from ``torch.compile``: a compiled caller runs it eagerly."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


class MatrixOptimizer(StepTableMixin, AdamWRouteMixin, CopyMixin, CheckpointMixin, Optimizer):
    """Base of :class:`Muon`, :class:`Shampoo` and :class:`SOAP`.

    A step runs in three phases per matrix: *prepare* (element-wise, on each rank's
    shard), *direction* (on the owner rank, on the full matrix) and *apply*
    (element-wise, on each shard), each phase batched: one call per param group, or per
    param group and shape. Parameters in groups with ``algorithm="adamw"`` are updated
    element-wise by AdamW on their shards. Nothing is written into a parameter before
    every rank has voted that the step succeeded. Subclasses provide the phases.
    """

    algorithm: ClassVar[str] = ""
    _closure_failure: Failure | None = None  # this step's closure raised (distributed)
    _hook_failure: Failure | None = None  # a step pre-hook raised before this step (distributed)
    _partial: Failure | None = None  # a step applied in part here: every later step fails
    cost_model: ClassVar[str] = "muon"
    storage_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        plan: PlanConfig | None,
        pipeline: PipelineConfig | None,
    ) -> None:
        if plan is not None and not isinstance(plan, PlanConfig):
            raise TypeError(f"plan must be a canzona.PlanConfig, got {type(plan).__name__}")
        if pipeline is not None and not isinstance(pipeline, PipelineConfig):
            raise TypeError(
                f"pipeline must be a canzona.PipelineConfig, got {type(pipeline).__name__}"
            )
        self.plan_config = plan or PlanConfig()
        self.pipeline_config = pipeline or PipelineConfig()
        self.skipped_steps = 0
        self._reset(OwnerState(self._fresh_item_state, self._owner_specs))
        defaults = typed_defaults({"algorithm": self.algorithm, **defaults}, type(self))
        self._check_values(defaults)
        super().__init__(params, defaults)
        self._identify()

    def _reset(self, owner: OwnerState) -> None:
        """A fresh runtime and empty step caches around ``owner`` (construction, copies)."""
        self._runtime = self._new_runtime()
        self._owner = owner
        self._table: StepTable | None = None
        self._table_key: tuple[object, ...] = ()
        self._kinds: dict[int, Hashable] = {}  # per parameter (id): what state its group gives
        self._moved: ValueError | None = None  # a parameter moved where its state cannot go
        self._table_version = 0
        self._step_params: list[Tensor] = []
        self._work: tuple[tuple[object, ...], dict[int, Tensor], StepWork] | None = None
        self._state_generation = 0
        self._steps_without_grads = 0
        self._algorithms: dict[int, str] = {}  # per param group, the algorithm of its state
        self._group_ids: tuple[int, ...] = ()  # the groups those records are by (see regrouped)
        self._checked_hparams = ""  # the hyper-parameters' fingerprint last found valid
        # per param group: the values that shaped its owner-held state (``_state_shape``)
        self._state_shapes: dict[int, tuple[tuple[str, Any], ...]] = {}
        self.last_step_stats: StepStats | None = None

    def _identify(self) -> None:
        """Name the runtime's markers by this optimizer's class and parameters."""
        params, names, _ = self._flat()
        shapes = [(n, tuple(p.shape)) for n, p in zip(names, params, strict=True)]
        self._runtime.identify(f"{type(self).__name__} {shapes}")

    def _new_runtime(self) -> MatrixRuntime:
        return MatrixRuntime(
            plan_config=self.plan_config,
            pipeline_config=self.pipeline_config,
            cost=self.cost_model,
        )

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; matrix groups accept only 2-D parameters and 3-D stacks."""
        if param_group.get("algorithm") == ADAMW:
            check_adamw_names(param_group, self.defaults)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        algorithm = group.get("algorithm")
        if algorithm not in (self.algorithm, ADAMW):
            self.param_groups.pop()
            raise ValueError(
                f"param group algorithm must be {self.algorithm!r} or {ADAMW!r}, got {algorithm!r}"
            )
        try:
            self._check_values(group)
        except (ValueError, TypeError, KeyError) as exc:
            self.param_groups.pop()
            raise ValueError(f"param group {len(self.param_groups)}: {exc}") from exc
        try:
            offset = sum(len(g["params"]) for g in self.param_groups[:-1])
            check_group(group, type(self).__name__, set(self._flat()[1][:offset]), offset)
        except ValueError:
            self.param_groups.pop()
            raise
        runtime = getattr(self, "_runtime", None)
        if runtime is not None:
            runtime.invalidate()

    def _flat(self) -> tuple[list[Tensor], list[str], list[int]]:
        """Every parameter, its name and the index of its param group, in optimizer order."""
        params: list[Tensor] = []
        names: list[str] = []
        gids: list[int] = []
        for gid, group in enumerate(self.param_groups):
            ps, pnames = group["params"], group.get("param_names")
            if pnames:
                if len(pnames) != len(ps):
                    raise ValueError(
                        f"param group {gid} has {len(ps)} params but {len(pnames)} param_names"
                    )
                names += pnames
            else:
                names += [f"param{k}" for k in range(len(params), len(params) + len(ps))]
            params += ps
            gids += [gid] * len(ps)
        return params, names, gids

    # ------------------------------------------------------------------ phases
    def _validate_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for invalid hyper-parameters of a matrix group."""

    def _init_storage_state(
        self, p: Tensor, state: dict[str, Any], group: dict[str, Any], grad: Tensor | None
    ) -> None:
        """Create the element-wise state of a matrix parameter (storage layout).

        ``grad``: the parameter's gradient in this step (None without one).
        """

    def _prepare_group(
        self, group: dict[str, Any], work: GroupWork, grads: list[Tensor], txn: StepTransaction
    ) -> None:
        """Element-wise phase of one param group's matrices with local data.

        Writes each matrix's payload into ``work.payloads`` (views shaped like the local
        shards; ``grads`` are the matching gradients); state changed in place must be
        saved with ``txn.save`` first. ``work.cache`` keeps lists across steps.
        """
        raise NotImplementedError

    def _directions(self, batch: ComputeBatch, full: Tensor) -> Tensor:
        """Owner phase on the full matrices ``(k, m, n)`` of one batch."""
        raise NotImplementedError

    def _apply_batch(self, batch: ApplyBatch) -> None:
        """Element-wise phase: write a batch of direction fragments into the parameters."""
        raise NotImplementedError

    def _payload_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        """Dtype of what travels to the owner (the prepared payload is cast to it).

        The gradients' (``p.grad_dtype``: fp32 gradients of bf16 weights reach the fp32
        state whole, not rounded to the weight's dtype on the way).
        """
        return grad_dtype(p)

    def _prepared_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        """Dtype the payload is prepared in, before its cast to :meth:`_payload_dtype`.

        The gradients'; an optimizer whose prepare can write the payload's dtype directly,
        with the values of that cast, returns it (no staged copy, no cast).
        """
        return grad_dtype(p)

    def _direction_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        return torch.promote_types(p.dtype, torch.float32)

    def _row_signature(self, group: dict[str, Any]) -> tuple[object, ...]:
        """The group values the table rows depend on (besides the parameters' dtypes)."""
        return ()

    def _cost_params(self, group: dict[str, Any]) -> dict[str, Any]:
        """The parameters of this group's cost model (its own hyper-parameters)."""
        return {}

    def _calibration_phases(self, group: dict[str, Any]) -> tuple[tuple[str, float], ...]:
        """The phases of the owner math a calibration times, and their weights per step."""
        return (("step", 1.0),)

    def _config_repr(self) -> str:
        return type(self).__name__

    def _fresh_item_state(self, item: Item) -> dict[str, Tensor]:
        """A new owner-held state for one matrix (none for optimizers without any)."""
        return {}

    def _owner_specs(
        self, p: Tensor, group: dict[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Owner-held state of one matrix ``p`` (meta): key -> (shape, dtype). None here."""
        return {}

    def _group_of(self, param: int) -> dict[str, Any]:
        """The param group of parameter ``param`` (optimizer order)."""
        seen = 0
        for group in self.param_groups:
            seen += len(group["params"])
            if param < seen:
                return group
        raise IndexError(f"no parameter {param} in this optimizer")

    @staticmethod
    def _state_dtype(p: Tensor) -> torch.dtype:
        """Dtype of owner-held state: at least float32 (bf16 parameters keep fp32 state)."""
        return torch.promote_types(p.dtype, torch.float32)

    def _item_step(self, item: Item) -> int:
        """The step count of ``item``'s parameter during a step (already incremented)."""
        return int(self.state[self._step_params[item.param]]["step"])

    # ------------------------------------------------------------------ table
    # ------------------------------------------------------------------ step
    @hooked_step  # torch's hooks, with a pre-hook's failure shared by every rank
    @_eager  # a compiled training step runs the optimizer step eagerly
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss (run with grad enabled).

        Raises:
            UpdateFailedError: on every rank when anything failed on any rank (the closure
                included, in a distributed job); no parameter (and, with
                ``PipelineConfig(atomic=True)``, no optimizer state) changed anywhere.
        """
        loss = None
        # a step pre-hook that raised here (in a job) fails the step on every rank
        self._closure_failure, self._hook_failure = self._hook_failure, None
        with collective_call(self._runtime):
            if closure is not None:
                with torch.enable_grad():
                    try:
                        loss = closure()
                    except Exception as exc:
                        if process_group_of(self.pipeline_config.process_group) is None:
                            raise  # one process: as torch.optim
                        # the other ranks are in the step: they raise with this one
                        failure = Failure("running the closure", exc)
                        self._closure_failure = self._closure_failure or failure
            paused = self.pipeline_config.pause_gc and gc.isenabled()
            if paused:
                gc.disable()
            try:
                self._step()
            finally:
                if paused:
                    gc.enable()
        return loss

    def _step(self) -> None:
        """The step after the closure (see :meth:`step`)."""
        try:
            self._attempt()
        except StepDeclined:
            # the header that rode the first gather found this step unlike the last agreed
            # one on some rank; everything was undone: again, with the check on its own
            self._attempt()

    def _attempt(self) -> None:
        params, names, gids = self._flat()
        changed = self._algorithm_changed(params, names, gids)
        sizes = shapes(params)  # read once: the table's key and the layouts' compare them
        table, failure = self._table_or_failure(params, gids, sizes)
        raw = [p.grad for p in params]  # each gradient read once a step
        has_grad = grad_codes(params, raw)  # the ranks compare them before any read
        fresh, unchanged = self._fresh_entries(params, has_grad)  # and these
        failure = self._partial or self._closure_failure or failure or self._check_hparams(table)
        if failure is None and (refused := changed or self._moved) is not None:
            # every rank raises it, however many ranks changed the groups
            failure = Failure("checking the param groups", refused)
        nonfinite = False
        if self.pipeline_config.skip_nonfinite:
            try:
                nonfinite = not all_finite([g for g in raw if g is not None])
            except Exception as exc:
                failure = Failure("checking the gradients for NaN/Inf", exc)
        start = self._runtime.begin_step(
            names,
            params,
            table,
            has_grad=has_grad,
            nonfinite=nonfinite,
            failure=failure,
            compute=self._directions,
            fresh=fresh,
            shapes=sizes,
        )
        unchanged = unchanged and start.previous is None  # a move may edit the entries
        try:
            if start.previous is not None:
                self._migrate_owner_state(start.previous, params, names, gids)
            if not start.declined:
                self._steps_without_grads = watch_gradients(
                    type(self).__name__, self._steps_without_grads, start.active, table.matrix
                )
            if start.skip:
                self.skipped_steps += 1
                self.last_step_stats = StepStats(rank=self._runtime.rank, skipped=True)
                return
            self._step_params = params
            failure = failure or start.failure
            self.last_step_stats = self._run_step(
                start, table, params, raw, has_grad, names, gids, failure, unchanged
            )
        finally:
            self._runtime.abandon()
            self._step_params = []

    def _run_step(
        self,
        start: StepStart,
        table: StepTable,
        params: list[Tensor],
        raw: list[Tensor | None],
        codes: list[int],
        names: list[str],
        gids: list[int],
        failure: Failure | None,
        unchanged: bool = False,
    ) -> StepStats:
        self.__dict__.pop("_calibrating", None)  # owner-side states of a calibration
        txn = StepTransaction(atomic=self.pipeline_config.atomic)
        self._owner.begin(
            atomic=self.pipeline_config.atomic,
            keep=self.pipeline_config.keeps_buffers(self._runtime.device.type),
        )
        txn.on_rollback(self._owner.rollback)
        work: StepWork | None = None
        read = False
        if failure is None and not start.declined:
            try:
                work = self._step_work(start, table, params, names, gids, raw, txn, unchanged)
                read = True  # the prepare reads every gradient, whatever fails
                self._prepare(work, raw, codes, names, txn)
            except Exception as exc:
                failure = Failure("preparing the step", exc)
        if not read and not start.declined:  # a declined step redistributes nothing
            read_gradients(names, params, raw, codes)
        try:
            stats: StepStats = self._runtime.run(
                table,
                params,
                names,
                compute=self._directions,
                apply=self._apply_batch,
                failure=failure,
            )
        except PartialUpdateError as exc:  # after the decision: the other ranks committed
            txn.commit()
            self._owner.commit()
            self._poison(exc)
            raise
        except BaseException:
            txn.rollback()
            self._state_generation += 1  # states created in the step are gone
            raise
        stats.backup_bytes = txn.backup_bytes + self._owner.backup_bytes
        txn.commit()
        self._owner.commit()
        assert work is not None  # a failed prepare fails the vote; a declined step raised
        try:
            for group_work in work.groups:
                if group_work.adamw:
                    self._adamw_params(group_work, table.hparams[group_work.gid])
        except Exception as exc:
            if not self._runtime.distributed:
                raise  # one process: as torch.optim
            error = partial_update(self._runtime.rank, "AdamW's parameter updates", exc)
            self._poison(error)
            raise error from exc
        return stats

    def _poison(self, error: PartialUpdateError) -> None:
        """Fail every later step until a load: this rank's parameters are updated in part.

        The failure keeps a copy of ``error`` without its traceback and cause, which hold
        the failed step's frames (its gradients and received directions): the load that
        lifts the failure needs that memory back.
        """
        self._partial = Failure(
            "an earlier step's apply (parameters updated in part)", PartialUpdateError(str(error))
        )

    def _step_work(
        self,
        start: StepStart,
        table: StepTable,
        params: list[Tensor],
        names: list[str],
        gids: list[int],
        raw: list[Tensor | None],
        txn: StepTransaction,
        unchanged: bool = False,
    ) -> StepWork:
        """The step's lists: reused while the table, active set and states are unchanged.

        A state entry the user cleared starts afresh, owner-held state included; one whose
        tensors the user replaced is read again (see :class:`SeenState`). ``unchanged``:
        :meth:`_fresh_entries` found the cached lists' entries as they were.
        """
        key = (table.version, start.active, self._state_generation)
        cached = self._work
        if cached is not None and cached[0] == key and cached[1] is start.payload:
            seen = cached[2].seen
            if unchanged or seen is None or seen.unchanged(self.state):
                return cached[2]
            seen.check_edits(self.state, [names[i] for i in sorted(start.active)])
        active = sorted(start.active)
        matrix = set(table.matrix)
        fresh: set[int] = set()
        for i in active:
            p = params[i]
            state = self.state[p]
            if "step" not in state:
                txn.created(self.state, p)
                self._init_state(p, state, self.param_groups[gids[i]], i in matrix, raw[i])
                fresh.add(i)
                self._algorithms.setdefault(gids[i], self.param_groups[gids[i]]["algorithm"])
        if fresh:
            self._owner.forget(fresh)  # a cleared entry: its owner-held state too
            self._state_generation += 1
        work = build_work(
            active=active,
            params=params,
            gids=gids,
            groups=self.param_groups,
            matrix=matrix,
            payload=start.payload,
            state=self.state,
        )
        work.seen = SeenState([params[i] for i in active], self.state)
        key = (table.version, start.active, self._state_generation)
        self._work = (key, start.payload, work)  # the payload views are the schedule's
        return work

    def _fresh_entries(
        self, params: list[Tensor], has_grad: Sequence[int]
    ) -> tuple[list[int], bool]:
        """The parameters with a gradient whose ``optimizer.state`` entry has no step yet.

        All of them at the first step; later, those whose entry the user cleared (or that
        have a gradient for the first time). The ranks compare them before the step: an
        entry cleared on some ranks only would start afresh a piece of a matrix's state, or
        one replica's. Also returns whether the last step's lists still see every entry
        as it was (their check is the cost here, and :meth:`_step_work` reuses it).
        """
        key, _, work = self._work or ((), None, None)
        unchanged = work is not None and work.seen is not None and work.seen.unchanged(self.state)
        if unchanged and work is not None and has_grad == work.covered:
            return [], True  # the same gradients as a step whose entries all had a step
        active = frozenset(compress(range(len(has_grad)), has_grad))
        if unchanged and work is not None and active <= cast(frozenset[int], key[1]):
            work.covered = list(has_grad)
            return [], True
        state = self.state
        return [i for i in sorted(active) if "step" not in state.get(params[i], ())], unchanged

    def _prepare(
        self,
        work: StepWork,
        raw: list[Tensor | None],
        codes: list[int],
        names: list[str],
        txn: StepTransaction,
    ) -> None:
        """Counters, AdamW moments and matrix payloads (before the vote).

        ``raw`` holds every parameter's ``.grad`` as the step read it (optimizer order),
        ``codes`` how each is read (:func:`~canzona.runtime.grad_codes`).
        Every gradient is read before anything else, and all of them even when one fails:
        a gradient in other placements than its parameter's is redistributed as it is read
        (a collective of its mesh), and every rank must enter the same ones.
        """
        read: list[list[Tensor]] = []
        error: Exception | None = None
        for w in work.groups:
            try:
                read.append(local_grads(names, w.idxs, w.params, raw, codes))
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        txn.bump(work.steps)
        for w, grads in zip(work.groups, read, strict=True):
            group = self.param_groups[w.gid]
            if w.adamw:
                self._adamw_moments(w, grads, txn)
            elif w.prepared:
                if len(w.prepared) != len(grads):
                    grads = [grads[k] for k in w.prepared]
                self._prepare_group(group, w, grads, txn)

    def _state_shape(self, group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        """The group values that decide which owner-held state a matrix has, and its shapes."""
        return ()

    def _init_state(
        self,
        p: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        is_matrix: bool,
        grad: Tensor | None,
    ) -> None:
        state["step"] = torch.tensor(0.0)
        if group["algorithm"] == ADAMW:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif is_matrix:
            self._init_storage_state(p, state, group, grad)
            self._owner.add_placeholders(p, state, group)

    def _backup(self, tensors: list[Tensor]) -> Backup:
        """A :class:`Backup` of ``tensors``, kept between steps as the pipeline config says."""
        keep = bool(tensors) and self.pipeline_config.keeps_buffers(tensors[0].device.type)
        return Backup(tensors, keep=keep)

    # ------------------------------------------------------------------ helpers
    _check_common = staticmethod(check_common)
