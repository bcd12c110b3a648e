"""A ``canzona.Muon`` state dict from the state dicts of other Muon and AdamW optimizers."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from canzona.optim.checkpoint import ADAMW
from canzona.optim.group_values import plain_value, saved_groups
from canzona.optim.muon import Muon
from canzona.optim.normuon import NorMuon

__all__ = ["from_torch_state"]

#: A source: a state dict whose param groups name their parameters, or one with the names.
Source = Mapping[str, Any] | tuple[Mapping[str, Any], Sequence[str]]

_MUON_KEYS = frozenset({"momentum_buffer"})
_ADAMW_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})
#: Param-group values a restored LR scheduler drives: taken from the sources.
_SCHEDULED = ("lr", "initial_lr")
#: A source group's values and the optimizer group's entries that take their place, by
#: algorithm: where they differ the optimizer continues with its own (a warning says so).
_CONTINUED = {
    "muon": {k: k for k in ("momentum", "nesterov", "weight_decay", "eps")},
    ADAMW: {"betas": "adamw_betas", "eps": "adamw_eps", "weight_decay": "weight_decay"},
}


@dataclass(frozen=True, slots=True)
class _Saved:
    """One parameter of a source: where it came from, its group and its state (if any)."""

    source: int
    kind: str  # "muon" or "adamw"
    group: Mapping[str, Any]
    entry: Mapping[str, Any] | None


def from_torch_state(optimizer: Muon, *sources: Source) -> dict[str, Any]:
    """Convert ``torch.optim.Muon`` and ``torch.optim.AdamW`` state dicts for ``optimizer``.

    A job that trained with ``torch.optim.Muon`` on its matrices and ``torch.optim.AdamW``
    on the rest continues with ``canzona.Muon`` (on one device or any mesh) from their
    state: ``optimizer.load_state_dict(from_torch_state(optimizer, muon_sd, adamw_sd))``.
    Parameters are matched by name: ``optimizer`` must be built from named parameters
    (:func:`canzona.param_groups` or ``model.named_parameters()``), and each source either
    names its parameters in its param groups (``torch.optim`` saves ``param_names`` when
    built from ``named_parameters()``) or comes as a pair ``(state_dict, names)``, the names
    in the order the source's groups hold the parameters. DCP's state dicts
    (``get_optimizer_state_dict``, of one optimizer or several) name them by themselves,
    nested or flattened (``state.{name}.{key}``, as TorchTitan's container saves them).
    Every parameter of ``optimizer`` must be in exactly one source, and every source
    parameter in ``optimizer``.

    The state is carried over as it is: Muon's momentum buffers to the Muon groups, AdamW's
    step and moments to the ``algorithm="adamw"`` groups (the tensors in whatever layout
    they were saved: full tensors are sliced for sharded parameters when loaded). A
    parameter the source never stepped gets no state and starts afresh. ``torch.optim.Muon``
    keeps no step count: a Muon parameter's ``step`` starts at 0 (no formula of Muon reads
    it). Hyper-parameters are the optimizer's own, except ``lr`` (and ``initial_lr``, when
    the sources have it), taken from the parameters' source groups, so that a restored LR
    scheduler continues where it stopped. Collective-free: ``load_state_dict`` is the
    collective, and every rank passes it the same sources.

    Args:
        optimizer: A :class:`canzona.Muon` (not a subclass with other state, such as
            :class:`canzona.NorMuon`).
        sources: ``torch.optim.Muon`` and ``torch.optim.AdamW`` (or ``Adam`` without L2
            weight decay) state dicts, TorchTitan ``DistMuon``'s, or the ``muon`` package's
            ``MuonWithAuxAdam``'s (both algorithms in one), each alone or as
            ``(state_dict, names)``.

    Returns:
        A state dict for ``optimizer.load_state_dict``.

    Raises:
        TypeError: for an optimizer other than :class:`canzona.Muon`.
        ValueError: naming the offending source, group, parameter or key: a source of
            another optimizer (AMSGrad, ``maximize``, L2 weight decay included), missing
            names, a parameter in no source or in two, a source parameter the optimizer
            lacks, Muon state for an AdamW-routed parameter (or the reverse), or sources
            that disagree on the ``lr`` of one of the optimizer's groups.
    """
    if not isinstance(optimizer, Muon) or isinstance(optimizer, NorMuon):
        raise TypeError(
            f"from_torch_state converts for canzona.Muon, got {type(optimizer).__name__}"
        )
    saved = _read_sources(sources)
    groups: list[dict[str, Any]] = []
    state: dict[int, dict[str, Any]] = {}
    used: set[str] = set()
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        if not names:
            raise ValueError(
                f"param group {g} of the optimizer has no parameter names: build it from "
                "named parameters (canzona.param_groups(model) or model.named_parameters())"
            )
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(index, index + len(names)))
        kind = ADAMW if group.get("algorithm") == ADAMW else "muon"
        found: list[_Saved] = []
        for pid, name in zip(packed["params"], names, strict=True):
            entry = saved.get(name)
            if entry is None:
                raise ValueError(f"parameter {name!r} (param group {g}) is in no source")
            if entry.kind != kind:
                raise ValueError(
                    f"parameter {name!r} is in a {kind!r} param group of the optimizer, but "
                    f"source {entry.source} holds {entry.kind!r} state for it"
                )
            used.add(name)
            found.append(entry)
            if entry.entry is not None:
                state[pid] = _converted(entry, name)
        packed.update(_scheduled(found, g))
        _warn_of_own_values(found, group, g, kind)
        groups.append(packed)
        index += len(names)
    extra = [name for name in saved if name not in used]
    if extra:
        raise ValueError(
            f"source {saved[extra[0]].source} holds parameter {extra[0]!r}, which the "
            f"optimizer lacks ({len(extra)} such parameter(s))"
        )
    return {"state": state, "param_groups": saved_groups(groups)}


def _read_sources(sources: Sequence[Source]) -> dict[str, _Saved]:
    """Every source parameter by name, with its group's values and its state entry."""
    saved: dict[str, _Saved] = {}
    for k, source in enumerate(sources):
        sd, names = source if isinstance(source, tuple) else (source, None)
        for name, where, group, entry in _parameters(sd, names, k):
            if name in saved:
                raise ValueError(
                    f"parameter {name!r} is in source {saved[name].source} and in source {k}"
                )
            saved[name] = _Saved(k, _kind(group, f"source {k}, {where}"), group, entry)
    return saved


def _parameters(
    sd: Any, names: Sequence[str] | None, k: int
) -> list[tuple[str, str, Mapping[str, Any], Mapping[str, Any] | None]]:
    """A source's parameters: name, where they are (for messages), group values, state.

    Three layouts: ``torch.optim``'s (``params`` as indices, named by ``param_names`` or
    ``names``), DCP's ``get_optimizer_state_dict`` (``params`` as names) and its flattened
    form (``state.{name}.{key}``, ``param_groups.{name}.{key}``: TorchTitan's container).
    """
    if isinstance(sd, Mapping) and {"state", "param_groups"} <= set(sd):
        order = [(pid, j, g) for j, g in enumerate(sd["param_groups"]) for pid in g["params"]]
        if names is None and order and all(isinstance(pid, str) for pid, _, _ in order):
            names = [pid for pid, _, _ in order]
        elif names is None:
            if not all(g.get("param_names") for g in sd["param_groups"]):
                raise ValueError(
                    f"source {k} does not name its parameters: pass (state_dict, names), or "
                    "build its optimizer from model.named_parameters()"
                )
            names = [n for g in sd["param_groups"] for n in g["param_names"]]
        names = list(names)
        if len(names) != len(order):
            raise ValueError(f"source {k} holds {len(order)} parameters, given {len(names)} names")
        return [
            (name, f"param group {j}", g, sd["state"].get(pid))
            for name, (pid, j, g) in zip(names, order, strict=True)
        ]
    if (
        not isinstance(sd, Mapping)
        or not sd
        or not all(
            isinstance(key, str)
            and key.startswith(("state.", "param_groups."))
            and "." in key.split(".", 1)[1]
            for key in sd
        )
    ):
        raise ValueError(
            f"source {k} is not a state dict: neither 'state' and 'param_groups' nor the "
            "flattened 'state.{name}.{key}' and 'param_groups.{name}.{key}' entries"
        )
    if names is not None:
        raise ValueError(f"source {k} is flattened: its keys name its parameters, give no names")
    groups: dict[str, dict[str, Any]] = {}
    states: dict[str, dict[str, Any]] = {}
    for key, value in sd.items():
        prefix, rest = key.split(".", 1)
        name, leaf = rest.rsplit(".", 1)
        (states if prefix == "state" else groups).setdefault(name, {})[leaf] = value
    for name in states:
        if name not in groups:
            raise ValueError(f"source {k} holds state for {name!r} but no param-group values")
    return [(name, f"parameter {name!r}", g, states.get(name)) for name, g in groups.items()]


def _kind(group: Mapping[str, Any], where: str) -> str:
    """``"muon"`` or ``"adamw"``: which algorithm a source group's state belongs to.

    ``torch.optim.Muon`` (and TorchTitan's DistMuon) groups, ``torch.optim.AdamW`` (or
    L2-free ``Adam``) groups, and the groups of the ``muon`` package's
    ``MuonWithAuxAdam`` (a ``use_muon`` flag); refused where canzona's AdamW cannot continue.
    """
    if "use_muon" in group:
        return "muon" if group["use_muon"] else ADAMW
    if "nesterov" in group and "ns_coefficients" in group:
        return "muon"
    if "betas" not in group:
        raise ValueError(
            f"{where} is neither torch.optim.Muon's nor AdamW's (keys {sorted(group)})"
        )
    for flag in ("amsgrad", "maximize"):
        if group.get(flag):
            raise ValueError(f"{where}: {flag}=True has no counterpart in canzona's AdamW")
    if not group.get("decoupled_weight_decay", True) and group.get("weight_decay", 0):
        raise ValueError(
            f"{where}: Adam's L2 weight decay (weight_decay={group['weight_decay']!r}) is not "
            "AdamW's decoupled decay"
        )
    return ADAMW


def _converted(saved: _Saved, name: str) -> dict[str, Any]:
    """One parameter's state in canzona's keys."""
    assert saved.entry is not None
    keys = set(saved.entry)
    expected = _MUON_KEYS if saved.kind == "muon" else _ADAMW_KEYS
    if keys != expected:
        odd = sorted(keys ^ expected)
        raise ValueError(
            f"state of parameter {name!r} in source {saved.source} has keys {sorted(keys)}, "
            f"expected {sorted(expected)} (differs in {odd[0]!r})"
        )
    if saved.kind == "muon":
        return {"step": torch.tensor(0.0), "momentum_buffer": saved.entry["momentum_buffer"]}
    return {key: saved.entry[key] for key in sorted(_ADAMW_KEYS)}  # an int step loads too


def _warn_of_own_values(
    found: Sequence[_Saved], group: Mapping[str, Any], g: int, kind: str
) -> None:
    """Warn where the optimizer's group continues with other values than its sources had."""
    differ: dict[str, str] = {}
    for entry in found:
        for theirs, ours in _CONTINUED[kind].items():
            if theirs in entry.group and ours in group and theirs not in differ:
                was, now = entry.group[theirs], group[ours]
                if plain_value(_tupled(was)) != plain_value(_tupled(now)):
                    differ[theirs] = f"{theirs} {was!r} -> {now!r}"
    if differ:
        warnings.warn(
            f"from_torch_state: param group {g} continues with its own values where its "
            f"source's differ ({', '.join(differ.values())}); set them in the optimizer's "
            "param group to continue as the source did (lr is taken from the source)",
            UserWarning,
            stacklevel=3,
        )


def _tupled(value: Any) -> Any:
    """A list as a tuple (torch saves ``betas`` as either), anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


def _scheduled(found: Sequence[_Saved], group: int) -> dict[str, Any]:
    """The ``lr`` (and ``initial_lr``) of one of the optimizer's groups, from its sources."""
    out: dict[str, Any] = {}
    for key in _SCHEDULED:
        values = [s.group[key] for s in found if key in s.group]
        if not values or len(values) < len(found):
            continue
        if any(plain_value(v) != plain_value(values[0]) for v in values[1:]):
            raise ValueError(
                f"param group {group} of the optimizer takes parameters from source groups "
                f"with different {key!r} values ({values[0]!r}, ...): give it parameters of "
                "one source group, or set the values after loading"
            )
        out[key] = values[0]
    return out
