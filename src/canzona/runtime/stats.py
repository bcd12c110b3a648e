"""What one step did on this rank: sizes, counts and times of its matrix phase."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """What one rank did in one step (exposed as ``optimizer.last_step_stats``).

    ``compute_s`` is the wall time of the owner-side math and ``compute_cpu_s`` its CPU
    time on this thread (they differ when processes share cores); ``wait_s`` is time
    blocked on collectives; ``apply_s`` the time writing directions into the parameters
    after the step's success vote; ``total_s`` is the whole matrix phase of the step.
    ``backup_bytes`` is what the optimizer copied to undo a failed step
    (``PipelineConfig(atomic=True)``): the extra memory a step holds for atomicity.
    ``header_rode``: the step's cross-rank check travelled in its first gather (a steady
    step) instead of a collective of its own. ``assembled``: parameters whose directions
    arrived in many small pieces and were applied whole, read from the scatter by one
    index (:mod:`canzona.runtime.assembled`).
    """

    rank: int = 0
    micro_groups: int = 0
    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    matrices_computed: int = 0
    batches: int = 0
    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0
    total_s: float = 0.0
    backup_bytes: int = 0
    skipped: bool = False
    header_rode: bool = False
    assembled: int = 0
    group_compute_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict view (JSON-friendly)."""
        return {
            "rank": self.rank,
            "micro_groups": self.micro_groups,
            "collectives": self.collectives,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "matrices_computed": self.matrices_computed,
            "batches": self.batches,
            "compute_s": self.compute_s,
            "compute_cpu_s": self.compute_cpu_s,
            "wait_s": self.wait_s,
            "apply_s": self.apply_s,
            "total_s": self.total_s,
            "backup_bytes": self.backup_bytes,
            "skipped": self.skipped,
            "header_rode": self.header_rode,
            "assembled": self.assembled,
        }
