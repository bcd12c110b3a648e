"""canzona: exact, load-balanced matrix optimizers for DTensor-sharded models.

Names are resolved lazily so that ``import canzona`` and ``import canzona.plan``
do not import torch; the optimizer classes import it on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # plan layer (pure Python)
    "MatrixSpec": "canzona.plan",
    "PlanConfig": "canzona.plan",
    "Plan": "canzona.plan",
    "Assignment": "canzona.plan",
    "MicroGroup": "canzona.plan",
    "assign_owners": "canzona.plan",
    "micro_groups": "canzona.plan",
    "build_plan": "canzona.plan",
    "cost_model": "canzona.plan",
    "Split": "canzona.plan",
    # runtime layer
    "PipelineConfig": "canzona.runtime",
    "PlanMismatchError": "canzona.runtime",
    "GradientMismatchError": "canzona.runtime",
    "CollectiveTimeoutError": "canzona.runtime",
    "UpdateFailedError": "canzona.runtime",
    "PartialUpdateError": "canzona.runtime",
    # optimizer front classes
    "Muon": "canzona.optim",
    "NorMuon": "canzona.optim",
    "Shampoo": "canzona.optim",
    "SOAP": "canzona.optim",
    "param_groups": "canzona.optim",
    "from_torch_state": "canzona.optim",
}

__all__ = [
    "SOAP",
    "Assignment",
    "CollectiveTimeoutError",
    "GradientMismatchError",
    "MatrixSpec",
    "MicroGroup",
    "Muon",
    "NorMuon",
    "PartialUpdateError",
    "PipelineConfig",
    "Plan",
    "PlanConfig",
    "PlanMismatchError",
    "Shampoo",
    "Split",
    "UpdateFailedError",
    "__version__",
    "assign_owners",
    "build_plan",
    "cost_model",
    "from_torch_state",
    "micro_groups",
    "param_groups",
]

if TYPE_CHECKING:  # pragma: no cover - import-time only for type checkers
    from canzona.optim import SOAP, Muon, NorMuon, Shampoo, from_torch_state, param_groups
    from canzona.plan import (
        Assignment,
        MatrixSpec,
        MicroGroup,
        Plan,
        PlanConfig,
        Split,
        assign_owners,
        build_plan,
        cost_model,
        micro_groups,
    )
    from canzona.runtime import (
        CollectiveTimeoutError,
        GradientMismatchError,
        PartialUpdateError,
        PipelineConfig,
        PlanMismatchError,
        UpdateFailedError,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'canzona' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
