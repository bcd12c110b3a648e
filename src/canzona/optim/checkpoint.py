"""state_dict / load_state_dict: owner-held state in a layout DCP can save and reshard."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import zip_longest
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from canzona.optim.calls import collective_call
from canzona.optim.group_values import loaded_groups, saved_groups
from canzona.optim.owner_state import OwnerState, is_stack, matrix_shape
from canzona.plan import Split
from canzona.runtime import (
    Snapshot,
    StateEntry,
    agree_entries,
    check_all_ok,
    check_loadable,
    differing_params,
    first_problem,
    param_mesh,
    snapshot,
    to_storage_layouts,
)

ADAMW = "adamw"
ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")


@contextmanager
def held_hooks(optimizer: Any, *names: str) -> Iterator[list[list[Any]]]:
    """Hide the optimizer's hook dicts ``names`` from torch's own code; yields their hooks.

    torch runs state-dict hooks inside ``Optimizer.state_dict``/``load_state_dict``, before
    (save) or after (load) the parts that only exist here: the caller runs them itself.
    """
    saved = [getattr(optimizer, name) for name in names]
    for name in names:
        setattr(optimizer, name, OrderedDict())
    try:
        yield [list(hooks.values()) for hooks in saved]
    finally:
        for name, hooks in zip(names, saved, strict=True):
            setattr(optimizer, name, hooks)


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, Tensor) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _step_tensor(value: Any) -> Tensor:
    """A step counter as torch.optim keeps it: a float32 scalar tensor (numbers converted)."""
    return torch.tensor(float(value)) if _is_number(value) else value


class CheckpointMixin:
    """Checkpointing for optimizers whose matrix state lives on owner ranks.

    ``state_dict()`` returns, for every parameter, the same keys on every rank:
    element-wise state in the parameter's own layout, and owner-held state (e.g.
    Shampoo's factors) as DTensors sharded by rows over the parameter's mesh (plain
    tensors for plain parameters), so ``torch.distributed.checkpoint`` can save it
    and reload it on another mesh. Both calls are collective on a distributed mesh.
    The owner-held values themselves live in the optimizer's :class:`OwnerState`.
    """

    # provided by MatrixOptimizer
    state: Any
    param_groups: list[dict[str, Any]]
    storage_keys: ClassVar[tuple[str, ...]] = ()
    _owner: OwnerState
    _runtime: Any
    _state_generation: int
    _state_shapes: dict[int, tuple[tuple[str, Any], ...]]
    _algorithms: dict[int, str]
    _group_ids: tuple[int, ...]
    _kinds: dict[int, Any]
    _table_key: tuple[object, ...]

    if TYPE_CHECKING:  # MatrixOptimizer's

        def _flat(self) -> tuple[list[Tensor], list[str], list[int]]: ...

        def _step_table(self, params: list[Tensor], gids: list[int]) -> Any: ...

        def _state_misfit(
            self, params: list[Tensor], names: list[str], gids: list[int]
        ) -> Exception | None: ...

        def _directions(self, batch: Any, full: Tensor) -> Tensor: ...

        def _state_shape(self, group: dict[str, Any]) -> tuple[tuple[str, Any], ...]: ...

    def _storage_dtype(self, p: Tensor, key: str, saved: Tensor) -> torch.dtype | None:
        """The dtype element-wise state ``key`` of ``p`` (saved as ``saved``) keeps when loaded.

        ``None``: the parameter's (floating point), as torch.optim's load casts it.
        """
        return None

    def _stepped_entries(
        self, params: list[Tensor], names: list[str], gids: list[int], what: str
    ) -> list[StateEntry]:
        """The owner-held state tensors of the parameters that have stepped.

        In a job the ranks agree on them first (collective; ``what`` names the call that
        moves them): each rank reads its own ``optimizer.state``.
        """
        stepped = {i for i, p in enumerate(params) if "step" in self.state.get(p, {})}
        entries = self._owner.entries(params, [self.param_groups[g] for g in gids], stepped)
        if self._runtime.distributed:
            agree_entries(entries, names, watchdog=self._runtime.watchdog, what=what)
        return entries

    def _raise_together(
        self, error: Exception | None, elsewhere: Callable[[list[int]], Exception]
    ) -> None:
        """Vote on ``error`` (collective), then raise on every rank if any failed.

        ``error`` where it was raised, ``elsewhere(ranks)`` on the other ranks.
        """
        failed = check_all_ok(error is None, self._runtime)
        if error is not None:
            raise error
        if failed:
            raise elsewhere(failed)

    def _sync_plan(self, move: bool = True) -> Snapshot | None:
        """Agree on the plan with every rank (collective); re-plans if needed.

        After a re-plan the owner-held state moves to the new owners, unless not ``move``
        (the state is about to be replaced): then where it lives is returned.
        """
        params, names, gids = self._flat()
        previous: Snapshot | None = self._runtime.sync_plan(
            names, params, self._step_table(params, gids), compute=self._directions
        )
        if previous is not None and move:
            self._migrate_owner_state(previous, params, names, gids)
            return None
        return previous

    def _migrate_owner_state(
        self, previous: Snapshot, params: list[Tensor], names: list[str], gids: list[int]
    ) -> None:
        """After a re-plan, move owner-held state from the old owners to the new ones.

        A move that raises leaves the state where ``previous`` holds it, and the next step
        (or ``state_dict()``) plans again and moves it.
        """
        what = "moving the owner-held state to its owners"
        try:
            entries = self._stepped_entries(params, names, gids, what)
            self._owner.migrate(previous, snapshot(self._runtime), params, entries)
        except BaseException:
            self._runtime.move_failed(previous)
            raise

    # ------------------------------------------------------------------ save
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state (collective on a distributed mesh); see the class doc.

        State-dict pre-hooks (``register_state_dict_pre_hook``) run first; one that raises
        on some ranks raises there, and ``RuntimeError`` naming those ranks on the others.
        Post-hooks (``register_state_dict_post_hook``) see the whole state dict, owner-held
        state and saved param groups included, and may replace it.
        """
        hooks = ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")
        with collective_call(self._runtime):
            with held_hooks(self, *hooks) as (pre, post):
                error: Exception | None = None
                try:
                    for hook in pre:
                        hook(self)
                except Exception as exc:  # raised below, once every rank knows a rank failed
                    error = exc
                unsaveable = self._unsaveable()  # on every rank: it resolves the group
                error = error or unsaveable
                self._raise_together(
                    error,
                    lambda failed: RuntimeError(
                        f"state_dict failed on ranks {failed} (a state-dict pre-hook raised "
                        "there, or its param groups no longer fit the optimizer state); "
                        "nothing was saved"
                    ),
                )
                sd: dict[str, Any] = super().state_dict()  # type: ignore[misc]
            sd = self._complete_state_dict(sd)
        for hook in post:
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _unsaveable(self) -> Exception | None:
        """What keeps this rank from saving (the error), or None.

        A local shard its placements do not give, or param groups the state no longer
        fits (what the step refuses, as a changed ``max_precond_dim``: the export would
        drop the state the old value gave).

        Reading the layouts first also resolves the process group, so that the vote is
        collective on a copied or never-stepped optimizer too.
        """
        params, names, gids = self._flat()
        return self._unreadable(params, names) or self._state_misfit(params, names, gids)

    def _unreadable(self, params: list[Tensor], names: list[str]) -> Exception | None:
        """A local shard of another shape than its placements give, as its error, or None.

        Reading the layouts also resolves the process group (the votes' collectives).
        """
        problem = first_problem(self._runtime.layouts(names, params))
        return None if problem is None else problem[1]

    def _complete_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The state dict of torch.optim with saved param-group values and owner-held state."""
        sd["param_groups"] = saved_groups(sd["param_groups"])
        params, names, gids = self._flat()
        entries = self._stepped_entries(params, names, gids, "exporting the owner-held state")
        if not entries:
            return sd
        self._sync_plan()
        values = self._owner.export(
            snapshot(self._runtime),
            entries,
            meshes={e.param: param_mesh(params[e.param]) for e in entries},
        )
        packed = {k: dict(v) for k, v in sd["state"].items()}
        for (i, key), value in values.items():
            packed[i][key] = value
        sd["state"] = packed
        return sd

    # ------------------------------------------------------------------ load
    def _expected_keys(self, p: Tensor, group: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        if group.get("algorithm") == ADAMW:
            return {"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
        keys: dict[str, tuple[int, ...]] = {"step": ()}
        if p.numel() == 0:  # nothing to update: only the step counter
            return keys
        for key in self.storage_keys:
            keys[key] = tuple(p.shape)
        lead = (p.shape[0],) if is_stack(p, group) else ()
        for key, (shape, _, _) in self._owner.specs(p, group).items():
            keys[key] = (*lead, *shape)
        return keys

    def _validate(self, state_dict: Any) -> None:
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups' entries")
        saved_groups = state_dict["param_groups"]
        flat = self._validate_groups(saved_groups)
        ids = {pid for group in saved_groups for pid in group["params"]}
        for pid in state_dict["state"]:
            if pid not in ids:
                raise ValueError(f"state dict holds state for unknown parameter id {pid!r}")
        order = [pid for group in saved_groups for pid in group["params"]]
        for pos, pid in enumerate(order):
            entry = state_dict["state"].get(pid)
            if entry is not None:
                self._validate_entry(entry, *flat[pos])

    def _validate_groups(self, saved_groups: Any) -> list[tuple[Tensor, dict[str, Any], str]]:
        """Check the saved param groups against this optimizer's.

        Returns:
            Per parameter, in order: the parameter, its group merged with the saved
            hyper-parameters, and its label for messages.
        """
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, the optimizer has "
                f"{len(self.param_groups)} (a state dict of another model?)"
            )
        flat: list[tuple[Tensor, dict[str, Any], str]] = []
        for g, (mine, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if "algorithm" not in saved and set(saved) <= {"params", "param_names"}:
                raise ValueError(
                    f"param group {g} of the state dict holds parameters but no hyper-parameters: "
                    "DCP's set_optimizer_state_dict gives a group only its parameters when the "
                    "checkpoint's param groups hold them otherwise (a parameter moved to "
                    "another group?); build the optimizer with the checkpoint's param groups"
                )
            if "algorithm" not in saved:
                way = (
                    "; torch.optim.Muon's and AdamW's convert with canzona.from_torch_state"
                    if type(self).__name__ == "Muon"
                    else ""
                )
                raise ValueError(
                    f"param group {g} of the state dict has no 'algorithm' entry: it was not "
                    f"saved by a canzona optimizer ({type(self).__name__} expected{way})"
                )
            if saved["algorithm"] != mine["algorithm"]:
                raise ValueError(
                    f"param group {g}: state dict algorithm {saved['algorithm']!r} does not match "
                    f"{mine['algorithm']!r} (a state dict of another optimizer type?)"
                )
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"param group {g}: state dict has {len(saved['params'])} parameters, the "
                    f"optimizer has {len(mine['params'])} (a state dict of another model?)"
                )
            for key in ("split", "flatten"):  # the matrices the state belongs to
                ours, theirs = mine.get(key) or None, saved.get(key) or None
                if ours != theirs and not (key == "split" and _same_blocks(ours, theirs, mine)):
                    raise ValueError(
                        f"param group {g}: state dict {key} {saved.get(key)!r} does not match "
                        f"the optimizer's {mine.get(key)!r} (its state is per block or per "
                        "matrix: build the optimizer with the same param groups)"
                    )
            names = mine.get("param_names")
            saved_names = saved.get("param_names")
            if names and saved_names and list(names) != list(saved_names):
                pairs = enumerate(zip_longest(names, saved_names))
                at, (ours, theirs) = next((i, ab) for i, ab in pairs if ab[0] != ab[1])
                raise ValueError(
                    f"param group {g}: parameter names differ at position {at}: {ours!r} "
                    f"here, {theirs!r} in the state dict ({len(names)} names here, "
                    f"{len(saved_names)} there)"
                )
            for j, p in enumerate(mine["params"]):
                label = names[j] if names else f"param{len(flat)}"
                flat.append(
                    (p, {**mine, **{k: v for k, v in saved.items() if k != "params"}}, label)
                )
        return flat

    def _validate_entry(
        self, entry: dict[str, Any], p: Tensor, group: dict[str, Any], label: str
    ) -> None:
        """Check one parameter's saved state: its keys, and each tensor's shape."""
        expected = self._expected_keys(p, group)
        missing = sorted(set(expected) - set(entry))
        extra = sorted(set(entry) - set(expected))
        if missing:
            raise ValueError(f"state of parameter {label!r} is missing key {missing[0]!r}")
        if extra:
            raise ValueError(f"state of parameter {label!r} has unexpected key {extra[0]!r}")
        for key, shape in expected.items():
            if key == "step" and _is_number(entry[key]):
                continue  # a plain number (older checkpoints) loads as a tensor
            got = _shape(entry[key])
            if got is None:
                raise ValueError(f"state {key!r} of parameter {label!r} is not a tensor")
            if key == "step":
                if entry[key].numel() != 1:
                    raise ValueError(f"state 'step' of parameter {label!r} must hold one value")
            elif got != shape:
                raise ValueError(
                    f"state {key!r} of parameter {label!r} has shape {got}, expected {shape}"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; on any error nothing changes (collective on a distributed mesh).

        Load pre-hooks (``register_load_state_dict_pre_hook``) run first and may change or
        replace the state dict before anything reads it; post-hooks run once every state,
        owner-held included, is loaded.

        Raises:
            ValueError: naming the offending group, parameter or key; every rank raises
                (a pre-hook's own exception on the rank where it raised).
            UpdateFailedError: a rank could not allocate what placing the owner-held
                state needs (every rank raises; nothing was loaded).
        """
        hooks = ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
        with collective_call(self._runtime), held_hooks(self, *hooks) as (pre, post):
            self._load_state_dict(state_dict, pre)
        for hook in post:
            hook(self)

    def _load_state_dict(self, state_dict: dict[str, Any], pre_hooks: list[Any]) -> None:
        """:meth:`load_state_dict` between its hooks (``pre_hooks`` run here, on a copy)."""
        params, names, _ = self._flat()
        error: Exception | None = None
        loaded: list[str] = []  # per parameter, "no state" or its step
        state_dict = dict(state_dict)  # shallow, as torch's: a hook may edit it
        try:
            for hook in pre_hooks:
                result = hook(self, state_dict)
                if result is not None:
                    state_dict = result
        except Exception as exc:  # raised below, once every rank knows a rank failed
            error = exc
        if error is None:
            try:
                # dtypes and splits as state_dict() writes them (DCP holds no such objects)
                groups = loaded_groups(state_dict["param_groups"])
                state_dict = {**state_dict, "param_groups": groups}
                self._validate(state_dict)
                _check_meshes(state_dict, params, names)
                loaded = _loaded_steps(state_dict)
            except ValueError as exc:
                error = exc
            except (KeyError, TypeError, AttributeError, IndexError) as exc:
                error = ValueError(f"malformed state dict: {type(exc).__name__}: {exc}")
        unreadable = self._unreadable(params, names)  # on every rank: it resolves the group
        error = error or unreadable
        self._raise_together(
            error,
            lambda failed: ValueError(
                f"load_state_dict failed on ranks {failed}; nothing was loaded"
            ),
        )
        # first: the conversions below move DTensors in other placements (collectives)
        differ = differing_params(
            loaded, names, self._runtime, what="load_state_dict's check of the loaded steps"
        )
        if differ is not None:
            raise ValueError(
                f"load_state_dict: the ranks loaded different state ({differ}), as from a state "
                "dict edited or saved on some ranks only; load the same checkpoint on every "
                "rank. Nothing was loaded"
            )
        order = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        saved_groups = [
            {**mine, **{k: v for k, v in saved.items() if k != "params"}}
            for mine, saved in zip(self.param_groups, state_dict["param_groups"], strict=True)
        ]
        owner_keys: dict[int, set[str]] = {}
        group_of: list[dict[str, Any]] = []
        for g, mine in enumerate(self.param_groups):
            group_of += [saved_groups[g]] * len(mine["params"])
        for pos, p in enumerate(params):
            if group_of[pos]["algorithm"] != ADAMW:
                owner_keys[pos] = set(self._owner.specs(p, group_of[pos]))
        storage: dict[Any, dict[str, Any]] = {}
        owner_values: dict[tuple[int, str], Tensor] = {}
        stepped: set[int] = set()
        element_wise: list[tuple[Any, str, Tensor, Tensor]] = []  # (pid, key, value, param)
        for pos, pid in enumerate(order):
            entry = state_dict["state"].get(pid)
            if entry is None:
                continue
            stepped.add(pos)
            keys = owner_keys.get(pos, set())
            storage[pid] = {k: v for k, v in entry.items() if k not in keys}
            for k, v in storage[pid].items():
                if k == "step":
                    storage[pid][k] = _step_tensor(v)
                else:  # converted below, with the others
                    element_wise.append((pid, k, v, params[pos]))
            owner_values.update({(pos, k): v for k, v in entry.items() if k in keys})
        # collective where loaded DTensors lie in other placements (every rank loads alike);
        # first: a failure there, on any rank, leaves everything as it was
        converted = to_storage_layouts(
            [(v, p) for _, _, v, p in element_wise],
            watchdog=self._runtime.watchdog,
            what="load_state_dict's move of the loaded state into its parameters' layouts",
        )
        for (pid, k, _, _), value in zip(element_wise, converted, strict=True):
            storage[pid][k] = value
        entries = self._owner.entries(params, group_of, stepped)
        if entries:
            # collective: every rank has validated by now. The state it replaces is not
            # moved to a new plan's owners first (a move that cannot succeed, as after a
            # failed one, would keep every checkpoint from loading)
            home = self._sync_plan(move=False)
            try:
                # first: a move that fails (on any rank: all raise) leaves everything as it was
                self._owner.load(snapshot(self._runtime), entries, owner_values)
            except BaseException:
                if home is not None:  # the state stays where it was: the next step moves it
                    self._runtime.move_failed(home)
                raise
        else:
            self._owner.clear()
        super().load_state_dict({**state_dict, "state": storage})  # type: ignore[misc]
        for pos, pid in enumerate(order):  # state kept in another dtype than its parameter's
            for k, v in storage.get(pid, {}).items():
                now = self.state[params[pos]].get(k)
                if not isinstance(v, Tensor) or not isinstance(now, Tensor):
                    continue
                want = self._storage_dtype(params[pos], k, v)
                if want is not None and now.dtype != want:
                    self.state[params[pos]][k] = v.to(device=now.device, dtype=want)
        self._state_generation += 1  # every state tensor was replaced
        # the loaded groups' values shaped the loaded state
        self._state_shapes = {g: self._state_shape(grp) for g, grp in enumerate(self.param_groups)}
        for pos in sorted(stepped & set(owner_keys)):
            p = params[pos]
            if p.numel():
                self._owner.add_placeholders(p, self.state[p], group_of[pos])
        self._algorithms = {  # the loaded states are of these (validated) algorithms
            g: group["algorithm"] for g, group in enumerate(self.param_groups)
        }
        self._group_ids = ()  # the records are by the loaded groups' positions
        self._kinds, self._table_key = {}, ()  # the loaded state fits the groups: recorded anew
        self.__dict__.pop("_partial", None)  # a step applied in part is behind the checkpoint


def _loaded_steps(state_dict: dict[str, Any]) -> list[str]:
    """Per parameter of a validated state dict, in order: ``"no state"`` or its step.

    The ranks compare them after the vote, before anything changes: each rank validates
    its own state dict, and one edited, cut or saved on some ranks only would leave the
    ranks stepping from different states (shards updated with different bias corrections)
    or, where owner-held state must move, entering different exchanges.
    """
    out = []
    for group in state_dict["param_groups"]:
        for pid in group["params"]:
            entry = state_dict["state"].get(pid)
            step = None if entry is None else float(_step_tensor(entry["step"]))
            out.append("no state" if step is None else f"step {step!r}")
    return out


def _same_blocks(ours: Any, theirs: Any, group: dict[str, Any]) -> bool:
    """Whether two splits cut every matrix of ``group`` into the same blocks.

    ``Split(0, sizes=(8, 8, 8))`` and ``Split(0, size=8)`` do, on 24 rows.
    """
    if not (isinstance(ours, Split) and isinstance(theirs, Split)):
        return False
    for p in group["params"]:
        m, n = matrix_shape(p, group)
        try:
            if ours.shapes(m, n) != theirs.shapes(m, n):
                return False
        except ValueError:  # blocks that do not tile the matrix
            return False
    return True


def _check_meshes(state_dict: dict[str, Any], params: list[Tensor], names: list[str]) -> None:
    """Every loaded state tensor on its parameter's mesh (checked before the ranks vote).

    Raises:
        ValueError: naming the parameter and the key of one that is not.
    """
    order = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    for pos, pid in enumerate(order):
        for key, value in (state_dict["state"].get(pid) or {}).items():
            if isinstance(value, Tensor):
                try:
                    check_loadable(value, params[pos])
                except ValueError as exc:
                    raise ValueError(f"state {key!r} of parameter {names[pos]!r}: {exc}") from None
