"""The distributed runtime: storage layouts, cross-rank checks, gather -> compute -> scatter."""

from canzona.runtime.buffers import FlatBuffer
from canzona.runtime.checks import check_all_ok, differing_params
from canzona.runtime.config import (
    CollectiveTimeoutError,
    GradientMismatchError,
    PartialUpdateError,
    PipelineConfig,
    PlanMismatchError,
    UpdateFailedError,
    partial_update,
)
from canzona.runtime.engine import MatrixRuntime
from canzona.runtime.layout import Fragment, LayoutError, fragment_for
from canzona.runtime.pipeline import Failure, StepDeclined
from canzona.runtime.reshard import to_storage_layouts
from canzona.runtime.routing import Item
from canzona.runtime.statecomm import (
    Snapshot,
    StateEntry,
    agree_entries,
    export_state,
    import_state,
    snapshot,
)
from canzona.runtime.stats import StepStats
from canzona.runtime.step_start import StepStart
from canzona.runtime.table import ApplyBatch, ComputeBatch, ParamRow, StepTable
from canzona.runtime.tensors import (
    all_finite,
    as_storage_layout,
    check_loadable,
    fingerprint,
    grad_codes,
    local_grad,
    local_grads,
    local_tensor,
    param_mesh,
    process_group_of,
    read_gradients,
    shapes,
    validate_param,
)
from canzona.runtime.topology import first_problem, positions_in

__all__ = [
    "ApplyBatch",
    "CollectiveTimeoutError",
    "ComputeBatch",
    "Failure",
    "FlatBuffer",
    "Fragment",
    "GradientMismatchError",
    "Item",
    "LayoutError",
    "MatrixRuntime",
    "ParamRow",
    "PartialUpdateError",
    "PipelineConfig",
    "PlanMismatchError",
    "Snapshot",
    "StateEntry",
    "StepDeclined",
    "StepStart",
    "StepStats",
    "StepTable",
    "UpdateFailedError",
    "agree_entries",
    "all_finite",
    "as_storage_layout",
    "check_all_ok",
    "check_loadable",
    "differing_params",
    "export_state",
    "fingerprint",
    "first_problem",
    "fragment_for",
    "grad_codes",
    "import_state",
    "local_grad",
    "local_grads",
    "local_tensor",
    "param_mesh",
    "partial_update",
    "positions_in",
    "process_group_of",
    "read_gradients",
    "shapes",
    "snapshot",
    "to_storage_layouts",
    "validate_param",
]
