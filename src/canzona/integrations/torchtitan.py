"""TorchTitan route: an ``OptimizersContainer`` whose param groups can name canzona's optimizers.

TorchTitan (0.3) builds the trainer's optimizer with ``config.optimizer.build(model_parts=...)``;
``config.optimizer`` is an ``OptimizersContainer.Config`` whose ``param_groups`` map FQN regexes
to an ``optimizer_name`` and its kwargs, and groups naming the same optimizer share one
instance. :class:`CanzonaOptimizersContainer` is that container with four more names,
``"canzona.Muon"``, ``"canzona.NorMuon"``, ``"canzona.Shampoo"`` and ``"canzona.SOAP"``
(torchtitan's own names keep working; an unknown name raises an error listing them all).
Instance-wide structure (``plan``, ``pipeline``) travels the way torchtitan passes it to
``DistMuon``: in ``optimizer_factory_kwargs_by_name``. A job's config function writes::

    from canzona.integrations.torchtitan import canzona_optimizers

    config.optimizer = canzona_optimizers("muon", lr=0.02, adamw_lr=8e-4)

This module imports without torchtitan; the container class and :func:`canzona_optimizers`
import it on first use (``ImportError`` naming the missing package otherwise).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import canzona
from canzona.defaults import ADAMW_DEFAULTS, MUON_DEFAULTS
from canzona.optim import MatrixOptimizer
from canzona.optim.param_groups import split_params
from canzona.plan import PlanConfig, Split
from canzona.runtime import PipelineConfig

__all__ = [
    "ADAMW_PATTERN",
    "OPTIMIZER_NAMES",
    "CanzonaOptimizersContainer",
    "build_optimizer",
    "canzona_optimizers",
    "resolve_name",
]

#: ``optimizer_name`` values this route adds, and the canzona class each one builds.
OPTIMIZER_NAMES: dict[str, str] = {
    "canzona.Muon": "Muon",
    "canzona.NorMuon": "NorMuon",
    "canzona.Shampoo": "Shampoo",
    "canzona.SOAP": "SOAP",
}

#: The param-group key of a :class:`canzona.Split`.
SPLIT = "split"

#: TorchTitan 0.3.0's own ``optimizer_name`` values (named in errors).
TORCHTITAN_NAMES = ("Adam", "AdamW", "DistMuon")


def resolve_name(name: str) -> str:
    """The container name of a canzona optimizer: ``"muon"``, ``"Muon"`` -> ``"canzona.Muon"``.

    Raises:
        ValueError: For any other name, listing the valid ones.
    """
    key = name.removeprefix("canzona.").lower() if isinstance(name, str) else None
    for full, cls in OPTIMIZER_NAMES.items():
        if key == cls.lower():
            return full
    short = [n.lower() for n in OPTIMIZER_NAMES.values()]
    raise ValueError(
        f"unknown canzona optimizer {name!r}; {_choices(name, [*short, *OPTIMIZER_NAMES])}"
    )


def _choices(name: object, valid: Sequence[str]) -> str:
    """'choose one of ...', after the closest valid name when one is close."""
    close = difflib.get_close_matches(str(name), valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}choose one of {', '.join(repr(n) for n in valid)}"


#: FQNs that :func:`canzona_optimizers` sends to AdamW besides its routing by shape:
#: token embeddings, the output head (``output`` in Llama, ``lm_head`` in Qwen3), every norm
#: weight and every bias, by torchtitan's names.
ADAMW_PATTERN = r"(?:^|\.)(?:tok_embeddings|output|lm_head)\.|norm\.weight$|\.bias$"

#: The container class; defined (importing torchtitan) on first access.
CanzonaOptimizersContainer: Any

#: Keys torchtitan adds to every group for its own optimizers (``implementation``).
_IMPLEMENTATION_KEYS = ("fused", "foreach")


def build_optimizer(
    name: str,
    param_groups: Iterable[Mapping[str, Any]],
    *,
    plan: PlanConfig | None = None,
    pipeline: PipelineConfig | None = None,
    **defaults: Any,
) -> MatrixOptimizer:
    """Build canzona optimizer ``name`` from torchtitan-style param groups.

    Args:
        name: One of :data:`OPTIMIZER_NAMES` (or a short name, see :func:`resolve_name`).
        param_groups: Groups as torchtitan makes them: ``params``, ``param_names`` (FQNs,
            which name the matrices in canzona's plan) and the group's optimizer kwargs
            (``algorithm="adamw"`` routes a group to canzona's AdamW). ``fused`` and
            ``foreach`` are dropped.
        plan: Owner assignment and micro-group configuration.
        pipeline: Gather/compute/scatter pipeline configuration.
        **defaults: Constructor defaults for keys a group leaves out.

    Raises:
        ValueError: For an unknown ``name`` (listing the valid ones), or a group that breaks
            the optimizer's rules (e.g. a 1-D parameter in a matrix group).
    """
    cls = getattr(canzona, OPTIMIZER_NAMES[resolve_name(name)])
    groups = [
        {key: value for key, value in group.items() if key not in _IMPLEMENTATION_KEYS}
        for group in param_groups
    ]
    optimizer: MatrixOptimizer = cls(groups, plan=plan, pipeline=pipeline, **defaults)
    return optimizer


@functools.cache
def _container_class() -> Any:
    try:
        from torchtitan.components.optimizer import OptimizersContainer
    except ImportError as exc:
        raise ImportError(
            f"canzona.integrations.torchtitan needs torchtitan (pip install torchtitan): {exc}"
        ) from exc

    class CanzonaOptimizersContainer(OptimizersContainer):  # type: ignore[misc]
        """torchtitan's ``OptimizersContainer`` that also builds canzona's optimizers.

        Checkpoints go through torchtitan's own flat, FQN-keyed state dicts: canzona lists
        its owner-held keys (Shampoo and SOAP factors) in ``optimizer.state`` and
        materialises their values, as DTensors, in ``state_dict()``.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):  # type: ignore[misc]
            """``OptimizersContainer.Config`` whose ``build()`` makes this container.

            Attributes:
                route_by_shape: Before the optimizers are built, move every parameter that
                    :func:`canzona.param_groups` sends to AdamW (not 2-D or 3-D, an
                    embedding, the output head, a weight tied to an embedding) from a
                    canzona matrix group to the first ``algorithm="adamw"`` group of the
                    same optimizer. :func:`canzona_optimizers` turns it on.
            """

            route_by_shape: bool = False

        def __init__(self, config: Any, *, model_parts: list[Any]) -> None:
            self._route_by_shape = bool(getattr(config, "route_by_shape", False))
            self._found: set[int] = set()  # canzona groups that took parameters in some part
            super().__init__(config, model_parts=model_parts)
            if self._route_by_shape:
                _check_found(config.param_groups, self._found)

        def _build_param_groups(
            self, model: Any, param_group_configs: list[Any], impl_kwargs: dict[str, Any]
        ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[str]]]:
            if self._route_by_shape:
                return _shape_routed_groups(model, param_group_configs, impl_kwargs, self._found)
            groups: tuple[dict[str, list[dict[str, Any]]], dict[str, list[str]]]
            groups = OptimizersContainer._build_param_groups(
                model, param_group_configs, impl_kwargs
            )
            return groups

        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Callable[..., Any]:
            if name in OPTIMIZER_NAMES:
                return functools.partial(build_optimizer, name)
            try:
                factory: Callable[..., Any] = OptimizersContainer._resolve_optimizer_factory(name)
            except NotImplementedError as exc:
                raise NotImplementedError(
                    f"Optimizer {name!r} not added; "
                    + _choices(name, [*OPTIMIZER_NAMES, *TORCHTITAN_NAMES])
                ) from exc
            return factory

    CanzonaOptimizersContainer.__module__ = __name__
    CanzonaOptimizersContainer.__qualname__ = "CanzonaOptimizersContainer"
    CanzonaOptimizersContainer.Config.__module__ = __name__
    CanzonaOptimizersContainer.Config.__qualname__ = "CanzonaOptimizersContainer.Config"
    return CanzonaOptimizersContainer


def _check_found(configs: Sequence[Any], found: set[int]) -> None:
    """Every canzona group took parameters in some model part (see :func:`_shape_routed_groups`).

    An ``algorithm="adamw"`` group may take none: it is where routing sends parameters.

    Raises:
        ValueError: naming the first pattern that took none in any part (a split pattern:
            that it matched no matrix parameter), as TorchTitan raises for its own groups.
    """
    for i, config in enumerate(configs):
        sink = config.optimizer_kwargs.get("algorithm") == "adamw"  # routing may fill it
        if config.optimizer_name not in OPTIMIZER_NAMES or i in found or sink:
            continue
        if SPLIT in config.optimizer_kwargs:
            raise ValueError(
                f"{config.optimizer_name}: the split pattern '{config.pattern}' matched no "
                "matrix parameter"
            )
        raise ValueError(f"Optimizer param_groups pattern '{config.pattern}' matched no parameters")


def _shape_routed_groups(
    model: Any, configs: list[Any], impl_kwargs: dict[str, Any], found: set[int]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[str]]]:
    """TorchTitan's first-match grouping, then routing by shape for canzona's groups.

    Every trainable parameter goes to the first ``ParamGroupConfig`` whose pattern matches
    its FQN, as in TorchTitan. Then the parameters that :func:`canzona.param_groups` sends to
    AdamW leave canzona's matrix groups for the first ``algorithm="adamw"`` group of the same
    optimizer, and canzona's groups left empty are dropped.

    A canzona group that takes parameters here joins ``found`` (for a split group: matrix
    parameters; for another: any parameter its pattern matches, routed or not); the
    container checks once every model part is built that each one took some
    (:func:`_check_found`), so a pipeline stage without, e.g., attention builds.

    Raises:
        ValueError: When such a parameter has no AdamW group to go to, or a pattern of
            another optimizer matches no parameter (as TorchTitan raises).
    """
    from torchtitan.components.checkpointer.utils import canonical_fqn

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    position = {id(p): k for k, (_, p) in enumerate(named)}
    to_adamw = {id(p) for _, p in split_params(model)[1]}
    members: list[list[tuple[str, Any]]] = [[] for _ in configs]
    claimed: set[str] = set()
    for members_i, config in zip(members, configs, strict=True):
        pattern = re.compile(config.pattern)
        for n, p in named:
            if n not in claimed and pattern.search(n):
                members_i.append((n, p))
                claimed.add(n)

    def is_adamw(config: Any) -> bool:
        return bool(config.optimizer_kwargs.get("algorithm") == "adamw")

    found.update(i for i, m in enumerate(members) if m and SPLIT not in configs[i].optimizer_kwargs)
    for i, config in enumerate(configs):
        moved = [(n, p) for n, p in members[i] if id(p) in to_adamw]
        if config.optimizer_name not in OPTIMIZER_NAMES or is_adamw(config) or not moved:
            continue
        target = next(
            (
                k
                for k, c in enumerate(configs)
                if c.optimizer_name == config.optimizer_name and is_adamw(c)
            ),
            None,
        )
        if target is None:
            raise ValueError(
                f"{config.optimizer_name}: parameters {[n for n, _ in moved][:5]} are not "
                "matrices (or are embeddings or the output head) and need a param group with "
                'optimizer_kwargs={"algorithm": "adamw", ...} for the same optimizer'
            )
        members[i] = [(n, p) for n, p in members[i] if id(p) not in to_adamw]
        members[target] = sorted(members[target] + moved, key=lambda np: position[id(np[1])])
    groups: dict[str, list[dict[str, Any]]] = {}
    patterns: dict[str, list[str]] = {}
    for i, (members_i, config) in enumerate(zip(members, configs, strict=True)):
        if not members_i:
            if config.optimizer_name in OPTIMIZER_NAMES:
                continue  # took nothing in this part: checked over every part
            raise ValueError(
                f"Optimizer param_groups pattern '{config.pattern}' matched no parameters"
            )
        found.add(i)
        groups.setdefault(config.optimizer_name, []).append(
            {
                "params": [p for _, p in members_i],
                "param_names": [canonical_fqn(n) for n, _ in members_i],
                **impl_kwargs,
                **config.optimizer_kwargs,
            }
        )
        patterns.setdefault(config.optimizer_name, []).append(config.pattern)
    return groups, patterns


def canzona_optimizers(
    optimizer: str = "muon",
    *,
    lr: float,
    adamw_lr: float,
    weight_decay: float = MUON_DEFAULTS.weight_decay,
    adamw_weight_decay: float = 0.0,
    adamw_betas: tuple[float, float] = ADAMW_DEFAULTS.betas,
    adamw_eps: float = ADAMW_DEFAULTS.eps,
    adamw_pattern: str = ADAMW_PATTERN,
    plan: PlanConfig | None = None,
    pipeline: PipelineConfig | None = None,
    split: Mapping[str, Split] | None = None,
    **kwargs: Any,
) -> Any:
    """A ``CanzonaOptimizersContainer.Config``: one canzona optimizer for the whole model.

    Parameters are routed as :func:`canzona.param_groups` routes them: those that are not
    2-D or 3-D, embeddings, the output head (modules named ``output`` or ``lm_head``) and
    weights tied to an embedding form a group with ``algorithm="adamw"``, as do those whose
    FQN matches ``adamw_pattern``; every other parameter forms the matrix group. Both live
    in one canzona optimizer, so its plan covers every matrix and the AdamW part runs
    element-wise on the shards.

    Args:
        optimizer: ``"muon"``, ``"normuon"``, ``"shampoo"`` or ``"soap"``, or the
            container's name (``"canzona.Muon"``, ...).
        lr: Learning rate of the matrix group.
        adamw_lr: Learning rate of the AdamW group.
        weight_decay: Weight decay of the matrix group (Muon's default, whichever optimizer).
        adamw_weight_decay: Weight decay of the AdamW group.
        adamw_betas: AdamW betas.
        adamw_eps: AdamW epsilon.
        adamw_pattern: FQN regex of the AdamW group (``re.search``).
        plan: canzona's plan configuration (default: ``PlanConfig()``).
        pipeline: canzona's pipeline configuration (default: ``PipelineConfig()``).
        split: FQN regex (``re.search``, like the container's patterns) -> how the matching
            matrices split into blocks (:class:`canzona.Split`; e.g. one block per head of
            a fused ``wqkv``). Each pattern is a matrix group of its own, placed before the
            catch-all one (TorchTitan gives a parameter the first group that matches).
        **kwargs: More hyper-parameters of the matrix group (e.g. ``momentum=0.9``); a
            keyword the optimizer's constructor does not take raises ``TypeError``.

    Raises:
        ValueError: For an unknown ``optimizer``, listing the valid names; at ``build``,
            for a ``split`` pattern that matches no matrix parameter.
        ImportError: If torchtitan is not installed.
    """
    name = resolve_name(optimizer)
    _check_hyper_parameters(name, kwargs)
    container = _container_class()  # a clear ImportError when torchtitan is missing
    from torchtitan.components.optimizer import ParamGroupConfig

    adamw = {
        "algorithm": "adamw",
        "lr": adamw_lr,
        "weight_decay": adamw_weight_decay,
        "adamw_betas": tuple(adamw_betas),
        "adamw_eps": adamw_eps,
    }
    matrix = {"lr": lr, "weight_decay": weight_decay, **kwargs}
    blocks = [
        ParamGroupConfig(
            pattern=pattern, optimizer_name=name, optimizer_kwargs={**matrix, SPLIT: how}
        )
        for pattern, how in (split or {}).items()
    ]
    return container.Config(
        param_groups=[
            ParamGroupConfig(pattern=adamw_pattern, optimizer_name=name, optimizer_kwargs=adamw),
            *blocks,
            ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=matrix),
        ],
        optimizer_factory_kwargs_by_name={
            name: {"plan": plan or PlanConfig(), "pipeline": pipeline or PipelineConfig()}
        },
        route_by_shape=True,
    )


def _check_hyper_parameters(name: str, given: Mapping[str, Any]) -> None:
    """Refuse keywords the optimizer's constructor does not take (it would raise too).

    Raises:
        TypeError: naming the keyword and the closest hyper-parameter.
    """
    cls = getattr(canzona, OPTIMIZER_NAMES[name])
    known = [k for k in inspect.signature(cls.__init__).parameters if k not in _NOT_GROUP_KEYS]
    for key in given:
        if key not in known:
            raise TypeError(
                f"canzona_optimizers({name!r}) got an unexpected keyword {key!r}: it is not a "
                f"hyper-parameter of {name}; {_choices(key, known)}"
            )


#: Constructor arguments that are not hyper-parameters of a param group.
_NOT_GROUP_KEYS = ("self", "params", "plan", "pipeline")


def __getattr__(name: str) -> Any:
    if name == "CanzonaOptimizersContainer":
        return _container_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
