"""TorchTitan route: an ``OptimizersContainer`` whose param groups can name canzona's optimizers.

TorchTitan (0.3) builds the trainer's optimizer with ``config.optimizer.build(model_parts=...)``;
``config.optimizer`` is an ``OptimizersContainer.Config`` whose ``param_groups`` map FQN regexes
to an ``optimizer_name`` and its kwargs, and groups naming the same optimizer share one
instance. :class:`CanzonaOptimizersContainer` is that container with three more names,
``"canzona.Muon"``, ``"canzona.Shampoo"`` and ``"canzona.SOAP"`` (torchtitan's own names keep
working). Instance-wide structure (``plan``, ``pipeline``) travels the way torchtitan passes it
to ``DistMuon``: in ``optimizer_factory_kwargs_by_name``. A job's config function writes::

    from canzona.integrations.torchtitan import canzona_optimizers

    config.optimizer = canzona_optimizers("muon", lr=0.02, adamw_lr=8e-4)

This module imports without torchtitan; the container class and :func:`canzona_optimizers`
import it on first use (``ImportError`` naming the missing package otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import canzona
from canzona.optim import MatrixOptimizer
from canzona.plan import PlanConfig
from canzona.runtime import PipelineConfig

__all__ = [
    "ADAMW_PATTERN",
    "OPTIMIZER_NAMES",
    "CanzonaOptimizersContainer",
    "build_optimizer",
    "canzona_optimizers",
]

#: ``optimizer_name`` values this route adds, and the canzona class each one builds.
OPTIMIZER_NAMES: dict[str, str] = {
    "canzona.Muon": "Muon",
    "canzona.Shampoo": "Shampoo",
    "canzona.SOAP": "SOAP",
}
_SHORT = {"muon": "canzona.Muon", "shampoo": "canzona.Shampoo", "soap": "canzona.SOAP"}

#: Parameters that :func:`canzona_optimizers` sends to AdamW, by torchtitan's FQNs: token
#: embeddings, the output head (``output`` in Llama, ``lm_head`` in Qwen3), every norm weight
#: and every bias. Everything else must be a 2-D matrix or a 3-D stack of them.
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
        name: One of :data:`OPTIMIZER_NAMES`.
        param_groups: Groups as torchtitan makes them: ``params``, ``param_names`` (FQNs,
            which name the matrices in canzona's plan) and the group's optimizer kwargs
            (``algorithm="adamw"`` routes a group to canzona's AdamW). ``fused`` and
            ``foreach`` are dropped.
        plan: Owner assignment and micro-group configuration.
        pipeline: Gather/compute/scatter pipeline configuration.
        **defaults: Constructor defaults for keys a group leaves out.

    Raises:
        ValueError: For an unknown ``name``, or a group that breaks the optimizer's rules
            (e.g. a 1-D parameter in a matrix group).
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(
            f"unknown canzona optimizer {name!r}; choose one of {list(OPTIMIZER_NAMES)}"
        )
    cls = getattr(canzona, OPTIMIZER_NAMES[name])
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
            """``OptimizersContainer.Config`` whose ``build()`` makes this container."""

        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Callable[..., Any]:
            if name in OPTIMIZER_NAMES:
                return functools.partial(build_optimizer, name)
            factory: Callable[..., Any] = OptimizersContainer._resolve_optimizer_factory(name)
            return factory

    CanzonaOptimizersContainer.__module__ = __name__
    CanzonaOptimizersContainer.__qualname__ = "CanzonaOptimizersContainer"
    CanzonaOptimizersContainer.Config.__module__ = __name__
    CanzonaOptimizersContainer.Config.__qualname__ = "CanzonaOptimizersContainer.Config"
    return CanzonaOptimizersContainer


def canzona_optimizers(
    optimizer: str = "muon",
    *,
    lr: float,
    adamw_lr: float,
    weight_decay: float = 0.1,
    adamw_weight_decay: float = 0.0,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_pattern: str = ADAMW_PATTERN,
    plan: PlanConfig | None = None,
    pipeline: PipelineConfig | None = None,
    **kwargs: Any,
) -> Any:
    """A ``CanzonaOptimizersContainer.Config``: one canzona optimizer for the whole model.

    Parameters matching ``adamw_pattern`` form a group with ``algorithm="adamw"``; every
    other parameter forms the matrix group. Both live in one canzona optimizer, so its
    plan covers every matrix and the AdamW part runs element-wise on the shards.

    Args:
        optimizer: ``"muon"``, ``"shampoo"`` or ``"soap"``.
        lr: Learning rate of the matrix group.
        adamw_lr: Learning rate of the AdamW group.
        weight_decay: Weight decay of the matrix group.
        adamw_weight_decay: Weight decay of the AdamW group.
        adamw_betas: AdamW betas.
        adamw_eps: AdamW epsilon.
        adamw_pattern: FQN regex of the AdamW group (``re.search``).
        plan: canzona's plan configuration (default: ``PlanConfig()``).
        pipeline: canzona's pipeline configuration (default: ``PipelineConfig()``).
        **kwargs: More hyper-parameters of the matrix group (e.g. ``momentum=0.9``).

    Raises:
        ValueError: For an unknown ``optimizer``.
        ImportError: If torchtitan is not installed.
    """
    if optimizer not in _SHORT:
        raise ValueError(f"optimizer must be one of {list(_SHORT)}, got {optimizer!r}")
    container = _container_class()  # a clear ImportError when torchtitan is missing
    from torchtitan.components.optimizer import ParamGroupConfig

    name = _SHORT[optimizer]
    adamw = {
        "algorithm": "adamw",
        "lr": adamw_lr,
        "weight_decay": adamw_weight_decay,
        "adamw_betas": tuple(adamw_betas),
        "adamw_eps": adamw_eps,
    }
    matrix = {"lr": lr, "weight_decay": weight_decay, **kwargs}
    return container.Config(
        param_groups=[
            ParamGroupConfig(pattern=adamw_pattern, optimizer_name=name, optimizer_kwargs=adamw),
            ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=matrix),
        ],
        optimizer_factory_kwargs_by_name={
            name: {"plan": plan or PlanConfig(), "pipeline": pipeline or PipelineConfig()}
        },
    )


def __getattr__(name: str) -> Any:
    if name == "CanzonaOptimizersContainer":
        return _container_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
