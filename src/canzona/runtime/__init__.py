"""The distributed runtime: storage layouts, cross-rank checks, gather -> compute -> scatter."""

from canzona.runtime.config import (
    CollectiveTimeoutError,
    GradientMismatchError,
    PipelineConfig,
    PlanMismatchError,
    UpdateFailedError,
)
from canzona.runtime.engine import (
    MatrixRuntime,
    all_finite,
    as_storage_layout,
    check_all_ok,
    fingerprint,
    local_grad,
    local_tensor,
    needs_communication,
    param_mesh,
    snapshot,
    validate_param,
)
from canzona.runtime.layout import Fragment, LayoutError, fragment_for
from canzona.runtime.pipeline import StepStats
from canzona.runtime.routing import Item
from canzona.runtime.statecomm import StateEntry, export_state, import_state

__all__ = [
    "CollectiveTimeoutError",
    "Fragment",
    "GradientMismatchError",
    "Item",
    "LayoutError",
    "MatrixRuntime",
    "PipelineConfig",
    "PlanMismatchError",
    "StateEntry",
    "StepStats",
    "UpdateFailedError",
    "all_finite",
    "as_storage_layout",
    "check_all_ok",
    "export_state",
    "fingerprint",
    "fragment_for",
    "import_state",
    "local_grad",
    "local_tensor",
    "needs_communication",
    "param_mesh",
    "snapshot",
    "validate_param",
]
