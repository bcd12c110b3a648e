"""Checks of what an optimizer is given: param groups (at add_param_group) and shared settings."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence, Set
from typing import Any

import torch

from canzona.optim.owner_state import matrix_shape
from canzona.plan import Split
from canzona.runtime import validate_param

ADAMW = "adamw"
#: Steps without any matrix gradient after which the optimizer warns that it updates nothing.
NO_GRAD_WARN_STEPS = 3


#: torch.optim.AdamW's names the AdamW route takes under its own name, or does not implement.
TORCH_ADAMW_NAMES = {
    "betas": "its betas as 'adamw_betas'",
    "eps": "its epsilon as 'adamw_eps'",
    "amsgrad": "no amsgrad (AdamW as torch.optim.AdamW(amsgrad=False) computes it)",
    "maximize": "no maximize (negate the loss instead)",
}


def check_adamw_names(group: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Refuse torch.optim.AdamW's names in an AdamW group: the route would not read them.

    A name holding the optimizer's own default is taken as filled in by it (every group
    it holds has them: a group copied from one of them is accepted).
    """
    given = sorted(
        k for k in TORCH_ADAMW_NAMES.keys() & group.keys() if not _default(group[k], defaults, k)
    )
    if given:
        # defaults fill betas/eps for the matrix algorithm and the AdamW route never
        # reads them: torch.optim.AdamW's names would be silently ignored
        raise ValueError(
            f"an algorithm={ADAMW!r} group takes "
            f"{'; '.join(TORCH_ADAMW_NAMES[k] for k in given)}, got "
            f"{', '.join(f'{k}={group[k]!r}' for k in given)}"
        )


def _default(value: Any, defaults: Mapping[str, Any], key: str) -> bool:
    """Whether ``value`` is the optimizer's default for ``key`` (of the same type)."""
    if key not in defaults or type(value) is not type(defaults[key]):
        return False
    try:
        return bool(value == defaults[key])
    except (RuntimeError, TypeError, ValueError):  # a tensor of several elements
        return False


def check_group(group: dict[str, Any], owner: str, taken: Set[str], offset: int) -> None:
    """Raise ``ValueError`` naming the parameter for anything the optimizer cannot update.

    Args:
        group: The new param group (``params``, optional ``param_names``, ``split``,
            ``flatten``, ``algorithm``).
        owner: The optimizer's class name (for messages).
        taken: Names of the parameters of the earlier groups.
        offset: Number of parameters in the earlier groups (default names ``param<i>``).
    """
    split = group.get("split")
    flatten = group.get("flatten", False)
    if not isinstance(flatten, bool):
        raise ValueError(f"a param group's flatten must be a bool, got {flatten!r}")
    names = group.get("param_names")
    labels = [names[i] if names else f"param{offset + i}" for i in range(len(group["params"]))]
    if split is not None and not isinstance(split, Split):
        raise ValueError(
            f"the split of the param group of {_shown(labels)} must be a canzona.Split, "
            f"got {split!r}"
        )
    if split is not None and group.get("algorithm") == ADAMW:
        raise ValueError(
            f"the param group of {_shown(labels)} has a split, which applies to matrix groups, not "
            f'algorithm="{ADAMW}": {split!r}'
        )
    repeated = sorted({n for n in labels if n in taken or labels.count(n) > 1})
    if repeated:
        raise ValueError(
            f"parameter names must be unique in one optimizer; repeated: {repeated[:5]} "
            "(prefix the names of parameters gathered from different modules)"
        )
    first: dict[int, str] = {}
    for label, p in zip(labels, group["params"], strict=True):
        if id(p) in first:
            raise ValueError(
                f"parameter {label!r} is the same tensor as {first[id(p)]!r} in one param "
                "group: each parameter may appear once"
            )
        first[id(p)] = label
        validate_param(label, p)
        if group.get("algorithm") == ADAMW:
            continue
        if not (flatten and p.ndim >= 2) and p.ndim not in (2, 3):
            raise ValueError(
                f"parameter {label!r} ({tuple(p.shape)}) is {p.ndim}-D; {owner} updates 2-D "
                "matrices and 3-D stacks of matrices only (N-D weights as matrices with "
                f'flatten=True). Put it in a group with algorithm="{ADAMW}" '
                "(canzona.param_groups does this for you)."
            )
        if torch.is_complex(p):
            raise ValueError(f"parameter {label!r}: complex dtype {p.dtype} is not supported")
        if split is not None:
            split.shapes(*matrix_shape(p, group), name=f"parameter {label!r}")


def _shown(labels: list[str]) -> str:
    """The first parameter names of a group, for a message."""
    return ", ".join(repr(n) for n in labels[:3]) + (", ..." if len(labels) > 3 else "")


def check_common(
    lr: float | torch.Tensor, weight_decay: float, adamw_betas: Sequence[float], adamw_eps: float
) -> None:
    """Raise ``ValueError`` naming the value for an invalid setting every optimizer shares."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not float(lr) >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if len(adamw_betas) != 2 or not all(0.0 <= b < 1.0 for b in adamw_betas):
        raise ValueError(f"Invalid adamw_betas: {adamw_betas}")
    if not adamw_eps >= 0.0 or math.isnan(adamw_eps):
        raise ValueError(f"Invalid adamw_eps: {adamw_eps}")


def watch_gradients(owner: str, steps_without: int, active: Set[int], matrix: Sequence[int]) -> int:
    """Warn (on every rank alike) when no matrix has had a gradient for a few steps.

    Args:
        owner: The optimizer's class name (for the message).
        steps_without: Steps so far without a matrix gradient (-1: one was seen, never warn).
        active: Parameters with a gradient in this step.
        matrix: The matrix parameters.

    Returns:
        The count after this step.
    """
    if steps_without < 0:
        return steps_without
    if any(i in active for i in matrix) or not matrix:
        return -1  # seen one: never warn
    steps_without += 1
    if steps_without == NO_GRAD_WARN_STEPS:
        warnings.warn(
            f"{owner}: none of its {len(matrix)} matrix parameters has "
            f"had a gradient in {NO_GRAD_WARN_STEPS} steps, so nothing was updated. The "
            "likely cause: the optimizer was built before fully_shard or "
            "parallelize_module replaced the model's parameters; build it afterwards "
            "(canzona.param_groups(model) on the sharded model).",
            RuntimeWarning,
            stacklevel=4,
        )
    return steps_without


def regrouped(
    before: tuple[int, ...], now: tuple[int, ...], *records: dict[int, Any]
) -> list[dict[int, Any]]:
    """Per-param-group ``records`` re-keyed from the groups ``before`` to those ``now``.

    ``before`` and ``now`` are the groups' ``id()`` in order: a group moved keeps its
    record, a removed one loses it. An empty ``before`` means the records are by the
    current positions already (a new, copied or loaded optimizer).
    """
    if not before:
        return list(records)
    at = {group: i for i, group in enumerate(now)}
    return [
        {at[before[g]]: v for g, v in record.items() if g < len(before) and before[g] in at}
        for record in records
    ]


def _kind_difference(before: Hashable, now: Hashable) -> str:
    """What differs between two kinds of state (``(algorithm, *sorted (key, spec))``), briefly."""
    if not (isinstance(before, tuple) and isinstance(now, tuple) and before and now):
        return f"{before!r}, now {now!r}"
    if before[0] != now[0]:
        return f"algorithm {before[0]!r}, now {now[0]!r}"
    old, new = dict(before[1:]), dict(now[1:])
    gone = [k for k in old if k not in new]
    added = [k for k in new if k not in old]
    changed = [k for k in old if k in new and old[k] != new[k]]
    parts = [f"{len(old)} owner-held state entries, now {len(new)}"]
    if gone:
        parts.append(f"no longer {gone[0]!r}" + (f" and {len(gone) - 1} more" if gone[1:] else ""))
    if added:
        parts.append(f"new {added[0]!r}" + (f" and {len(added) - 1} more" if added[1:] else ""))
    if changed:
        k = changed[0]
        parts.append(f"{k!r} was {old[k]!r}, now {new[k]!r}")
    return "; ".join(parts)


def check_moves(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    kinds: Sequence[Hashable],
    state: Mapping[Any, dict[str, Any]],
    seen: dict[int, Hashable],
) -> ValueError | None:
    """Refuse a parameter with state that param groups moved where its state does not fit.

    ``kinds[i]`` says what state parameter ``i``'s group gives it (its algorithm, and the
    keys and shapes of its owner-held state); ``seen`` keeps each parameter's kind (by
    ``id``) as of the last check, and takes the new kinds when nothing is refused. A
    parameter without state, or not seen before (a loaded or copied optimizer), is taken
    as it is.

    Raises:
        Nothing; returns the ``ValueError`` naming the parameter (every rank fails the step).
    """
    for p, name, kind in zip(params, names, kinds, strict=True):
        before = seen.get(id(p))
        if before is not None and before != kind and "step" in state.get(p, {}):
            return ValueError(
                f"parameter {name!r} has state of another param group than the one it is in "
                f"now ({_kind_difference(before, kind)}): its group's algorithm, split, "
                "flatten or max_precond_dim changed, or it moved to another group; clear "
                "optimizer.state for it (it starts afresh) or keep it in a group like the old"
            )
    seen.clear()
    seen.update((id(p), kind) for p, kind in zip(params, kinds, strict=True))
    return None


def check_algorithms(
    groups: Sequence[dict[str, Any]],
    algorithms: dict[int, str],
    state: Mapping[Any, dict[str, Any]],
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    gids: Sequence[int],
) -> None:
    """Refuse a step whose param group changed algorithm after its state was created.

    ``algorithms`` holds each group's algorithm when its state was created; a group whose
    states were all rolled back takes its new algorithm there.

    Raises:
        ValueError: naming the group, a parameter with state and both algorithms (every
            rank raises it, before any collective).
    """
    for gid, seen in list(algorithms.items()):
        now = groups[gid]["algorithm"]
        if now == seen:
            continue
        held = [
            n
            for p, n, g in zip(params, names, gids, strict=True)
            if g == gid and "step" in state.get(p, {})
        ]
        if not held:  # its states were rolled back: nothing to keep consistent
            algorithms[gid] = now
            continue
        raise ValueError(
            f"param group {gid} has {seen!r} state (parameter {held[0]!r}), but its "
            f"algorithm is now {now!r}: a param group keeps its algorithm once it has "
            "state (build a new optimizer to switch)"
        )


def check_hparams(
    groups: Sequence[dict[str, Any]], check: Callable[[dict[str, Any]], None]
) -> ValueError | None:
    """The first param group whose values the optimizer cannot use, as an error naming it.

    ``check`` raises for a group's value (its type, its range).
    """
    for gid, group in enumerate(groups):
        try:
            check(group)
        except (ValueError, TypeError, KeyError) as exc:
            return ValueError(f"param group {gid}: {exc}")
    return None


Shape = tuple[tuple[str, Any], ...]


def check_state_shapes(
    groups: Sequence[dict[str, Any]],
    state: Mapping[Any, dict[str, Any]],
    shape_of: Callable[[dict[str, Any]], Shape],
    recorded: dict[int, Shape],
    owner: type,
) -> ValueError | None:
    """A value that shapes the state, changed in a group whose state exists, is refused.

    ``shape_of(group)`` gives the group values that decide which owner-held state a matrix
    has and its shapes; ``recorded`` keeps them per group (updated here while a group has
    no state). The state keeps the shapes of the values it was created with: a step would
    mix them (a factor the new value drops, or one it adds missing its history).
    """
    for g, group in enumerate(groups):
        now = shape_of(group)
        before = recorded.setdefault(g, now)
        if now == before:
            continue
        if any("step" in state.get(p, {}) for p in group["params"]):
            changed = [(k, b, n) for (k, b), (_, n) in zip(before, now, strict=True) if b != n]
            what = ", ".join(f"{k} from {b!r} to {n!r}" for k, b, n in changed)
            return ValueError(
                f"param group {g}: changed {what} after its {owner.__name__} state was "
                "created (the owner-held state has the shapes the old values give); set "
                "it before the first step, or build a new optimizer"
            )
        recorded[g] = now
    return None
