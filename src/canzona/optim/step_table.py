"""The step's table: what a step reads of the param groups, built and checked once a change."""

from __future__ import annotations

import operator
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from canzona.optim.adamw_route import adamw_betas
from canzona.optim.group_values import plain_value
from canzona.optim.owner_state import OwnerState
from canzona.optim.validation import (
    ADAMW,
    check_algorithms,
    check_hparams,
    check_moves,
    check_state_shapes,
    regrouped,
)
from canzona.optim.value_types import check_types
from canzona.plan import GroupedCost, cost_model
from canzona.runtime import Failure, ParamRow, StepTable, fingerprint, shapes

_DTYPE = operator.attrgetter("dtype")
_GRAD_DTYPE = operator.attrgetter("grad_dtype")
#: Group entries that are not hyper-parameters of the step (``initial_lr``: a scheduler's
#: record of the starting rate, which the step never reads).
_NOT_HYPER = frozenset({"params", "param_names", "initial_lr"})


class StepTableMixin:
    """The table of a :class:`~canzona.optim.base.MatrixOptimizer`'s step and its checks.

    The rows (per matrix parameter: dtypes, param group, split) and the cost models are
    rebuilt only when groups, parameters or dtypes change; the hyper-parameters are read
    every step and checked again when their fingerprint changes.
    """

    # provided by MatrixOptimizer
    cost_model: ClassVar[str]
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    state: Any
    _table: StepTable | None
    _table_key: tuple[object, ...]
    _table_version: int
    _owner: OwnerState
    _kinds: dict[int, Hashable]
    _moved: ValueError | None
    _checked_hparams: str
    _state_shapes: dict[int, tuple[tuple[str, Any], ...]]
    _algorithms: dict[int, str]
    _group_ids: tuple[int, ...]

    if TYPE_CHECKING:  # MatrixOptimizer's

        def _flat(self) -> tuple[list[Tensor], list[str], list[int]]: ...

        def _check_common(self, *values: Any) -> None: ...

        def _validate_group(self, group: dict[str, Any]) -> None: ...

        def _row_signature(self, group: dict[str, Any]) -> tuple[object, ...]: ...

        def _cost_params(self, group: dict[str, Any]) -> dict[str, Any]: ...

        def _payload_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype: ...

        def _prepared_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype: ...

        def _direction_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype: ...

        def _calibration_phases(self, group: dict[str, Any]) -> tuple[tuple[str, float], ...]: ...

        def _config_repr(self) -> str: ...

        def _state_shape(self, group: dict[str, Any]) -> tuple[tuple[str, Any], ...]: ...

    def _hyper_fingerprint(self, groups: list[dict[str, Any]]) -> str:
        rows = tuple(
            tuple(
                (key, plain_value(value))
                for key, value in sorted(group.items())
                if key not in _NOT_HYPER
            )
            for group in groups
        )
        return fingerprint(rows)

    def _check_values(self, group: dict[str, Any]) -> None:
        """Raise for a value of ``group`` the step cannot use: its type, then its range."""
        check_types(group, type(self))
        adamw = group["algorithm"] == ADAMW
        betas = adamw_betas(group, self.defaults) if adamw else group["adamw_betas"]
        self._check_common(group["lr"], group["weight_decay"], betas, group["adamw_eps"])
        if not adamw:
            self._validate_group(group)

    def _cost(self) -> GroupedCost | None:
        """One cost model per matrix param group, from the group's hyper-parameters."""
        models = {
            str(gid): cost_model(self.cost_model, **self._cost_params(g))
            for gid, g in enumerate(self.param_groups)
            if g["algorithm"] != ADAMW
        }
        return GroupedCost(models, name=self.cost_model) if models else None

    def _step_table(
        self, params: list[Tensor], gids: list[int], sizes: tuple[torch.Size, ...] | None = None
    ) -> StepTable:
        """The table of this step (rebuilt only when groups, params, dtypes or shapes change).

        ``sizes``: the parameters' shapes, when the step has read them already.
        """
        groups = self.param_groups
        key = (
            tuple(
                (
                    len(g["params"]),
                    g["algorithm"],
                    g.get("split"),
                    bool(g.get("flatten")),
                    self._row_signature(g),
                    tuple(sorted(self._cost_params(g).items())) if g["algorithm"] != ADAMW else (),
                )
                for g in groups
            ),
            tuple(map(id, params)),
            tuple(map(_DTYPE, params)),
            tuple(map(_GRAD_DTYPE, params)),  # the payloads' dtypes follow them
            shapes(params) if sizes is None else sizes,  # ``p.data`` of another shape
        )
        if self._table is None or key != self._table_key:
            # first what may raise (a split that does not tile its matrix): the key is kept
            # only with a table built, so the check runs again at every step until resolved
            names = self._flat()[1]
            kinds = [
                self._owner.kind(p, groups[g], name=f"parameter {n!r}")
                for p, g, n in zip(params, gids, names, strict=True)
            ]
            matrix = [
                i
                for i, (p, gid) in enumerate(zip(params, gids, strict=True))
                if groups[gid]["algorithm"] != ADAMW and p.numel() > 0
            ]
            rows = [
                ParamRow(
                    self._payload_dtype(params[i], groups[gids[i]]),
                    self._direction_dtype(params[i], groups[gids[i]]),
                    gids[i],
                    groups[gids[i]].get("split"),
                    bool(groups[gids[i]].get("flatten")) and params[i].ndim > 2,
                    self._prepared_dtype(params[i], groups[gids[i]]),
                )
                for i in matrix
            ]
            self._table_version += 1
            cost = self._cost()
            self._table = StepTable(
                matrix=tuple(matrix),
                rows=tuple(rows),
                hparams=(),
                fingerprint="",
                config=repr(
                    (
                        self._config_repr(),
                        cost,
                        [(g.get("split"), bool(g.get("flatten"))) for g in groups],
                        # what travels prices the plan's bytes and its timings
                        sorted({(r.batch_key, str(r.payload_dtype)) for r in rows}),
                    )
                ),
                version=self._table_version,
                cost=cost,
                calibration=tuple(self._calibration_phases(g) for g in groups),
            )
            self._table_key = key
            self._moved = check_moves(params, names, kinds, self.state, self._kinds)
            if self._moved is not None:
                self._table_key = ()  # checked again at every step until resolved
        hparams = step_hparams(groups)
        return self._table.with_hparams(hparams, self._hyper_fingerprint(hparams))

    def _table_or_failure(
        self, params: list[Tensor], gids: list[int], sizes: tuple[torch.Size, ...]
    ) -> tuple[StepTable, Failure | None]:
        """This step's table, or the last one and a failure naming a value that breaks it."""
        try:
            return self._step_table(params, gids, sizes), None
        except Exception as exc:  # any value the table cannot read: a failure, not a hang
            error = check_hparams(self.param_groups, self._check_values) or exc
            last = self._table or StepTable((), (), (), "", "", version=-1)
            failure = Failure("checking the param groups' hyper-parameters", error)
            return last.with_hparams(self.param_groups, ""), failure

    def _algorithm_changed(
        self, params: list[Tensor], names: list[str], gids: list[int]
    ) -> ValueError | None:
        """A group whose algorithm changed after its state was created, as the error naming it.

        The per-group records first follow param groups added, removed or reordered.
        Returned, never raised: the step fails on every rank with it (a change made on
        some ranks only would otherwise leave the others waiting in the step).
        """
        if (groups := tuple(map(id, self.param_groups))) != self._group_ids:
            records = regrouped(self._group_ids, groups, self._algorithms, self._state_shapes)
            (self._algorithms, self._state_shapes), self._group_ids = records, groups
        if not self._algorithms:
            return None
        try:
            check_algorithms(self.param_groups, self._algorithms, self.state, params, names, gids)
        except ValueError as exc:
            return exc
        return None

    def _state_misfit(
        self, params: list[Tensor], names: list[str], gids: list[int]
    ) -> Exception | None:
        """What a step would refuse because the state no longer fits the param groups.

        ``state_dict()`` votes on it first: it would export (and, after a re-plan, move)
        the owner-held state by the changed values, dropping what they no longer give.
        """
        error = self._algorithm_changed(params, names, gids)
        if error is not None:
            return error
        try:
            self._step_table(params, gids)
        except Exception as exc:  # a value the table cannot read
            return check_hparams(self.param_groups, self._check_values) or exc
        shapes = check_state_shapes(
            self.param_groups, self.state, self._state_shape, self._state_shapes, type(self)
        )
        return shapes or self._moved

    def _check_hparams(self, table: StepTable) -> Failure | None:
        """The groups' hyper-parameters checked again when they changed since the last step.

        A scheduler or the job may set any group entry between steps; a value the step
        could not use would otherwise raise in the apply, after the vote, leaving part of
        the step applied (and on a rank without local data, nothing raised at all). As a
        failure of this rank it fails the step on every rank before anything changes.
        The values checked are the step's (``table.hparams``: a tensor learning rate as
        the step copied it to the host).
        """
        fingerprint = table.fingerprint
        if fingerprint == self._checked_hparams:
            return None
        error = check_hparams([dict(g) for g in table.hparams], self._check_values)
        if error is None:
            error = check_state_shapes(
                self.param_groups, self.state, self._state_shape, self._state_shapes, type(self)
            )
        if error is not None:
            return Failure("checking the param groups' hyper-parameters", error)
        self._checked_hparams = fingerprint
        return None


def step_hparams(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups as a step reads them: each one-element tensor copied to the host.

    A learning rate given as a tensor: every later use in the step (the fingerprint, the
    check, each apply call, the AdamW route) reads the copy, so on a GPU one device read
    per group and step, however many calls. A larger tensor a job keeps in a group is no
    hyper-parameter (the fingerprint reads only its dtype and shape) and stays where it is.
    """
    return [
        {k: _on_host(v) if k not in _NOT_HYPER else v for k, v in g.items()}
        if any(map(_scalar_tensor, g.values()))
        else g
        for g in groups
    ]


def _scalar_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.numel() == 1


def _on_host(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if _scalar_tensor(value) else value


def grad_dtype(p: Tensor) -> torch.dtype:
    """The dtype of ``p``'s gradients: ``p.grad_dtype``, or ``p``'s own where any is admitted."""
    dtype: torch.dtype | None = p.grad_dtype
    return p.dtype if dtype is None else dtype
