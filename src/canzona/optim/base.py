"""Shared machinery of canzona's optimizers: param groups, the step, the AdamW route."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from canzona.optim.checkpoint import OwnerStateMixin
from canzona.plan import PlanConfig
from canzona.runtime import (
    Item,
    MatrixRuntime,
    PipelineConfig,
    StepStats,
    all_finite,
    export_state,
    fingerprint,
    import_state,
    local_grad,
    local_tensor,
    param_mesh,
    snapshot,
    validate_param,
)
from canzona.updates import adamw_

ADAMW = "adamw"
_NOT_HYPER = ("params", "param_names")


def scalar(value: float | Tensor) -> float:
    """A learning rate given as a float or a 1-element tensor, as a float."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"a tensor learning rate must have one element, got {value.shape}")
        return float(value.item())
    return float(value)


def _plain(value: Any) -> Any:
    """A process-independent view of a param-group value, for the cross-rank check.

    Numbers, strings, dtypes and containers of them compare by value; a tensor by its
    value when it has one element; any other object only by its type (its ``repr`` may
    hold a memory address that differs between processes).
    """
    if value is None or isinstance(value, bool | int | float | str | torch.dtype):
        return value
    if isinstance(value, Tensor):
        return scalar(value) if value.numel() == 1 else (str(value.dtype), tuple(value.shape))
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    return type(value).__qualname__


class MatrixOptimizer(OwnerStateMixin, Optimizer):
    """Base of :class:`Muon`, :class:`Shampoo` and :class:`SOAP`.

    A step runs in three phases per matrix: *prepare* (element-wise, on each rank's
    shard), *direction* (on the owner rank, on the full matrix) and *apply*
    (element-wise, on each shard). Parameters in groups with ``algorithm="adamw"``
    are updated element-wise by AdamW on their shards. Subclasses provide the phases.
    """

    algorithm: ClassVar[str] = ""
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
        self._runtime = MatrixRuntime(
            plan_config=self.plan_config,
            pipeline_config=self.pipeline_config,
            cost=self.cost_model,
        )
        self._owner_state: dict[tuple[int, int | None, int], dict[str, Tensor]] = {}
        self.last_step_stats: StepStats | None = None
        self.skipped_steps = 0
        defaults = {"algorithm": self.algorithm, **defaults}
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; matrix groups accept only 2-D parameters and 3-D stacks."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        algorithm = group.get("algorithm")
        if algorithm not in (self.algorithm, ADAMW):
            self.param_groups.pop()
            raise ValueError(
                f"param group algorithm must be {self.algorithm!r} or {ADAMW!r}, got {algorithm!r}"
            )
        try:
            self._check_common(
                group["lr"], group["weight_decay"], group["adamw_betas"], group["adamw_eps"]
            )
            if algorithm != ADAMW:
                self._validate_group(group)
        except (ValueError, TypeError, KeyError) as exc:
            self.param_groups.pop()
            raise ValueError(f"param group {len(self.param_groups)}: {exc}") from exc
        names = group.get("param_names")
        offset = sum(len(g["params"]) for g in self.param_groups[:-1])
        labels = [names[i] if names else f"param{offset + i}" for i in range(len(group["params"]))]
        taken = set(self._flat()[1][:offset])
        repeated = sorted({n for n in labels if n in taken or labels.count(n) > 1})
        if repeated:
            self.param_groups.pop()
            raise ValueError(
                f"parameter names must be unique in one optimizer; repeated: {repeated[:5]} "
                "(prefix the names of parameters gathered from different modules)"
            )
        try:
            for label, p in zip(labels, group["params"], strict=True):
                validate_param(label, p)
                if algorithm == ADAMW:
                    continue
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"parameter {label!r} ({tuple(p.shape)}) is {p.ndim}-D; "
                        f"{type(self).__name__} updates 2-D matrices and 3-D stacks of matrices "
                        f'only. Put it in a group with algorithm="{ADAMW}" '
                        "(canzona.param_groups does this for you)."
                    )
                if torch.is_complex(p):
                    raise ValueError(
                        f"parameter {label!r}: complex dtype {p.dtype} is not supported"
                    )
        except ValueError:
            self.param_groups.pop()
            raise
        runtime = getattr(self, "_runtime", None)
        if runtime is not None:
            runtime.invalidate()

    def _flat(self) -> tuple[list[Tensor], list[str], list[dict[str, Any]]]:
        params: list[Tensor] = []
        names: list[str] = []
        groups: list[dict[str, Any]] = []
        for group in self.param_groups:
            pnames = group.get("param_names")
            for j, p in enumerate(group["params"]):
                names.append(pnames[j] if pnames else f"param{len(params)}")
                params.append(p)
                groups.append(group)
        return params, names, groups

    def _hyper_fingerprint(self) -> str:
        rows = []
        for group in self.param_groups:
            row = [(key, _plain(group[key])) for key in sorted(group) if key not in _NOT_HYPER]
            rows.append(tuple(row))
        return fingerprint(tuple(rows))

    # ------------------------------------------------------------------ phases
    def _validate_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` for invalid hyper-parameters of a matrix group."""

    def _init_storage_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Create the element-wise state of a matrix parameter (storage layout)."""

    def _prepare(
        self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> Tensor:
        """Element-wise phase on this rank's shard; returns the payload's local tensor."""
        raise NotImplementedError

    def _directions(
        self, items: Sequence[Item], full: Tensor, group: dict[str, Any], steps: list[int]
    ) -> Tensor:
        """Owner phase on full matrices ``(k, m, n)`` sharing one param group.

        Args:
            items: The matrices.
            full: Their gathered payloads.
            group: Their param group.
            steps: Each matrix's step count (1-based, already incremented).
        """
        raise NotImplementedError

    def _apply(
        self, p: Tensor, direction: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Element-wise phase: write this rank's fragment of the direction into ``p``."""
        raise NotImplementedError

    def _payload_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        """Dtype of what travels to the owner (``_prepare``'s output is cast to it)."""
        return p.dtype

    def _direction_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        return torch.promote_types(p.dtype, torch.float32)

    def _config_repr(self) -> str:
        return type(self).__name__

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step.

        Args:
            closure: Re-evaluates the model and returns the loss (run with grad enabled).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, names, groups = self._flat()
        matrix = self._matrix_indices(params, groups)
        matrix_set = set(matrix)
        has_grad = [p.grad is not None for p in params]
        nonfinite = False
        if self.pipeline_config.skip_nonfinite:
            nonfinite = not all_finite([p.grad for p in params if p.grad is not None])
        active, skip = self._runtime.begin_step(
            names,
            params,
            matrix,
            has_grad=has_grad,
            nonfinite=nonfinite,
            **self._plan_inputs(params, groups),
        )
        self._migrate_owner_state(params, groups)
        if skip:
            self.skipped_steps += 1
            self.last_step_stats = StepStats(rank=self._runtime.rank, skipped=True)
            return loss
        for i in sorted(active):
            group = groups[i]
            if group["algorithm"] == ADAMW:
                self._adamw(params[i], names[i], group)
            elif i not in matrix_set:  # an empty matrix: nothing to update
                self._bump_step(self.state[params[i]])
        payloads: dict[int, Tensor] = {}
        shapes: dict[int, tuple[int, ...]] = {}
        for i in matrix:
            if i not in active:
                continue
            p, group = params[i], groups[i]
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                self._init_storage_state(p, state, group)
                self._add_owner_placeholders(p, state, group)
            self._bump_step(state)
            payload = self._prepare(p, local_grad(names[i], p), state, group)
            payloads[i] = payload.to(self._payload_dtype(p, group))
            shapes[i] = tuple(local_tensor(p).shape)
        matrix_active = active & matrix_set
        if not matrix_active:
            self.last_step_stats = StepStats(rank=self._runtime.rank)
            return loss

        def steps_of(items: Sequence[Item]) -> list[int]:
            return [int(self.state[params[it.param]]["step"]) for it in items]

        def compute(items: Sequence[Item], full: Tensor) -> Tensor:
            # the pipeline batches by param group: one set of hyper-parameters per call
            return self._directions(items, full, groups[items[0].param], steps_of(items))

        def apply(i: int, direction: Tensor) -> None:
            self._apply(params[i], direction, self.state[params[i]], groups[i])

        self.last_step_stats = self._runtime.step_pipeline.run(
            active=matrix_active,
            payloads=payloads,
            payload_dtype=lambda i: self._payload_dtype(params[i], groups[i]),
            direction_dtype=lambda i: self._direction_dtype(params[i], groups[i]),
            local_shapes=shapes,
            compute=compute,
            apply=apply,
            batch_key=lambda i: id(groups[i]),
        )
        return loss

    @staticmethod
    def _matrix_indices(params: list[Tensor], groups: list[dict[str, Any]]) -> list[int]:
        return [
            i for i, g in enumerate(groups) if g["algorithm"] != ADAMW and params[i].numel() > 0
        ]

    def _plan_inputs(self, params: list[Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
        """What the runtime plans from, besides the parameters (identical on every rank)."""
        return {
            "itemsize": lambda i: self._payload_dtype(params[i], groups[i]).itemsize,
            "extra": self._config_repr(),
            "hparams": self._hyper_fingerprint(),
        }

    def _sync_plan(self) -> None:
        """Agree on the plan with every rank (collective); re-plans when needed."""
        params, names, groups = self._flat()
        self._runtime.sync_plan(
            names, params, self._matrix_indices(params, groups), **self._plan_inputs(params, groups)
        )
        self._migrate_owner_state(params, groups)

    def _migrate_owner_state(self, params: list[Tensor], groups: list[dict[str, Any]]) -> None:
        """After a re-plan, move owner-held state from the old owners to the new ones."""
        previous = self._runtime.previous
        self._runtime.previous = None
        if previous is None:
            return
        stepped = {i for i, p in enumerate(params) if "step" in self.state.get(p, {})}
        entries = [
            e
            for e in self._entries(params, groups, stepped)
            if e.param < len(previous.topology.layouts)
        ]
        if not entries:
            return
        old = self._owner_state
        values = export_state(
            previous,
            entries,
            get=lambda item, key: self._owner_state_of(item, params[item.param], groups, old)[key],
            meshes={e.param: param_mesh(params[e.param]) for e in entries},
        )
        self._owner_state = {}

        def put(item: Item, key: str, value: Tensor) -> None:
            self._owner_state.setdefault(item.key, {})[key] = value

        import_state(snapshot(self._runtime), entries, values, put)

    @staticmethod
    def _bump_step(state: dict[str, Any]) -> int:
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        return int(state["step"])

    def _adamw(self, p: Tensor, name: str, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = self._bump_step(state)
        adamw_(
            local_tensor(p),
            local_grad(name, p),
            local_tensor(state["exp_avg"]),
            local_tensor(state["exp_avg_sq"]),
            step,
            lr=scalar(group["lr"]),
            betas=tuple(group["adamw_betas"]),
            eps=group["adamw_eps"],
            weight_decay=group["weight_decay"],
        )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _check_common(
        lr: float | Tensor, weight_decay: float, adamw_betas: Sequence[float], adamw_eps: float
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not scalar(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if len(adamw_betas) != 2 or not all(0.0 <= b < 1.0 for b in adamw_betas):
            raise ValueError(f"Invalid adamw_betas: {adamw_betas}")
        if not adamw_eps >= 0.0 or math.isnan(adamw_eps):
            raise ValueError(f"Invalid adamw_eps: {adamw_eps}")
