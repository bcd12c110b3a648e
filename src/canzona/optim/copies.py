"""copy.deepcopy and pickling of canzona's optimizers: what a copy keeps and rebuilds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from canzona.optim.owner_state import OwnerState
from canzona.optim.validation import regrouped
from canzona.plan import PlanConfig
from canzona.runtime import Failure, MatrixRuntime, PipelineConfig
from canzona.runtime.statecomm import record


class CopyMixin:
    """``__getstate__``/``__setstate__`` for :class:`~canzona.optim.base.MatrixOptimizer`.

    ``torch.optim.Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and
    ``param_groups``; a canzona optimizer also needs its configurations, ``skipped_steps``,
    its owner-held states and the algorithm each param group's state belongs to, and
    rebuilds its runtime (process group, plan, schedules, buffers) at the copy's next step,
    collectively on a mesh.
    """

    # provided by MatrixOptimizer
    plan_config: PlanConfig
    pipeline_config: PipelineConfig
    skipped_steps: int
    defaults: dict[str, Any]
    _owner: OwnerState
    _algorithms: dict[int, str]
    _group_ids: tuple[int, ...]
    _runtime: MatrixRuntime
    _partial: Failure | None
    param_groups: list[dict[str, Any]]

    if TYPE_CHECKING:  # MatrixOptimizer's

        def _flat(self) -> tuple[list[Any], list[str], list[int]]: ...

        def _reset(self, owner: OwnerState) -> None: ...

        def _identify(self) -> None: ...

        def _fresh_item_state(self, item: Any) -> Any: ...

        def _owner_specs(self, p: Any, group: dict[str, Any]) -> Any: ...

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickling keep (see the class docstring).

        Raises:
            TypeError: when ``PipelineConfig(process_group=...)`` holds a process group,
                which cannot be copied or pickled.
        """
        if self.pipeline_config.process_group is not None:
            raise TypeError(
                f"cannot copy or pickle a {type(self).__name__} whose PipelineConfig holds a "
                "process group (a process group cannot be copied); build a new optimizer and "
                "load this one's state_dict() into it"
            )
        state: dict[str, Any] = super().__getstate__()  # type: ignore[assignment]
        state["plan_config"] = self.plan_config
        state["pipeline_config"] = self.pipeline_config
        state["skipped_steps"] = self.skipped_steps
        state["owner_states"] = self._owner.states
        # where they live (on every rank, those that hold none too: the move is collective);
        # the copy's own plan may put them elsewhere
        state["owner_plan"] = record(self._runtime, self._flat()[0])
        # by the groups now (they may have been edited since the last step)
        groups = tuple(map(id, self.param_groups))
        state["algorithms"] = regrouped(self._group_ids, groups, self._algorithms)[0]
        if self._partial is not None:  # a copy fails its steps as this one
            state["_partial"] = self._partial
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild a copied or unpickled optimizer around the kept state.

        The copy gets a fresh runtime (it plans at its next step and moves the kept
        owner-held states from the owners they were recorded with to its plan's), its own
        :class:`OwnerState` holding those states, and empty step caches.
        ``torch.optim.Optimizer.load_state_dict`` calls this too, with ``state`` and
        ``param_groups`` only: that update keeps the runtime and the owner-held states.
        """
        if "defaults" not in state:
            super().__setstate__(state)  # type: ignore[misc]
            return
        state = dict(state)
        owner_states = state.pop("owner_states", {})
        owner_plan = state.pop("owner_plan", None)
        algorithms = state.pop("algorithms", {})
        torch_default = "differentiable" not in state["defaults"]
        super().__setstate__(state)  # type: ignore[misc]
        if torch_default:  # torch.optim adds it; a later param group would then carry it
            self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("plan_config", PlanConfig())
        self.__dict__.setdefault("pipeline_config", PipelineConfig())
        self.__dict__.setdefault("skipped_steps", 0)
        owner = OwnerState(self._fresh_item_state, self._owner_specs)
        owner.states = owner_states
        self._reset(owner)
        self._identify()
        self._runtime.inherited = owner_plan
        self._algorithms = algorithms
