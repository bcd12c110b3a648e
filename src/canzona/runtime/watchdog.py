"""Watchdog for the optimizer's collectives: timeouts that name the ranks left behind."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.config import CollectiveTimeoutError

_PREFIX = "canzona/progress"


def default_store() -> Any:
    """The default process group's key-value store, or None where it is not reachable."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


@dataclass
class Watchdog:
    """Waits on async collectives with a deadline and names the ranks left behind.

    Before every collective it issues, a rank records ``(step, phase, label)``. A wait
    that takes longer than a short grace publishes that position under the rank's key
    in the default store (healthy steps never touch the store); when the deadline
    passes, the rank reads every peer's key and names the ranks that have not reached
    the collective it is stuck in: those whose published position is behind, and those
    that never published one (they are not waiting in a collective at all).

    Attributes:
        group: Process group of the collectives.
        rank: This rank in ``group``.
        world: Size of ``group``.
        timeout_s: Deadline of every wait.
        tag: Namespace shared by the ranks of one optimizer (its construction index and
            a prefix of its parameter-structure digest).
        markers: Publish progress markers on slow waits.
        grace_s: How long a wait runs before this rank publishes its position.
        step: Steps begun so far (markers and messages name it).
        device: Device of the small check tensors (the parameters' device; None: CPU).
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    timeout_s: float
    tag: str = ""
    markers: bool = True
    step: int = 0
    device: Any = None
    grace_s: float = 1.0
    _label: str = ""
    _store: Any = field(default=None, repr=False)
    _position: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.markers and self.group is not None:
            self._store = default_store()

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/{self.tag}/{rank}"

    def mark(self, phase: int, label: str) -> None:
        """Record that this rank is about to enter collective ``phase`` of the step."""
        self._position = (self.step, phase)
        self._label = label

    def _publish(self) -> None:
        if self._store is None:
            return
        step, phase = self._position
        try:
            self._store.set(self._key(self.rank), f"{step}|{phase}|{self._label}")
        except RuntimeError:
            self._store = None  # the store went away: keep running without markers

    def behind(self) -> list[tuple[int, str]]:
        """Ranks whose last marker is before this rank's, with what they last entered."""
        if self._store is None:
            return []
        out: list[tuple[int, str]] = []
        for r in range(self.world):
            key = self._key(r)
            try:
                if not self._store.check([key]):
                    out.append((r, "not waiting in any collective"))
                    continue
                step, phase, label = self._store.get(key).decode().split("|", 2)
            except (RuntimeError, ValueError):
                continue
            if (int(step), int(phase)) < self._position:
                out.append((r, f"step {step}: {label}"))
        return out

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work``; on timeout raise :class:`CollectiveTimeoutError`.

        Raises:
            CollectiveTimeoutError: naming the collective and, where the default store
                is reachable, the ranks that have not reached it.
        """
        if self.device is not None and torch.device(self.device).type != "cpu":
            # accelerator process groups (NCCL) enqueue the wait on the stream; a timed
            # wait that expires would abort the communicator, so their own watchdog
            # (the process group's timeout) bounds the collective instead
            work.wait()
            return
        grace = min(self.grace_s, self.timeout_s / 2) if self._store is not None else 0.0
        if grace > 0:
            try:
                work.wait(timeout=timedelta(seconds=grace))
                return
            except RuntimeError:
                self._publish()  # slow: let peers see where this rank waits
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s - grace))
        except RuntimeError as exc:
            late = self.behind()
            who = (
                "ranks that have not reached it: "
                + ", ".join(f"{r} (last: {label})" for r, label in late)
                if late
                else "a peer rank is stuck, crashed or did not call the same method"
            )
            raise CollectiveTimeoutError(
                f"rank {self.rank}: {what} (step {self.step}) did not complete within "
                f"{self.timeout_s:g}s; {who} ({exc})"
            ) from exc


def gather_ints(values: list[int], *, watchdog: Watchdog, phase: int, what: str) -> list[list[int]]:
    """All-gather a short int64 vector (same length on every rank); rows in rank order."""
    mine = torch.tensor(values, dtype=torch.int64, device=watchdog.device)
    out = torch.empty(watchdog.world * len(values), dtype=torch.int64, device=watchdog.device)
    watchdog.mark(phase, what)
    work = dist.all_gather_single(out, mine, group=watchdog.group, async_op=True)
    watchdog.wait(work, what)
    rows: list[list[int]] = out.view(watchdog.world, len(values)).tolist()
    return rows


def reduce_max_ints(values: list[int], *, watchdog: Watchdog, phase: int, what: str) -> list[int]:
    """All-reduce a short int64 vector with MAX (same length on every rank)."""
    t = torch.tensor(values, dtype=torch.int64, device=watchdog.device)
    watchdog.mark(phase, what)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=watchdog.group, async_op=True)
    watchdog.wait(work, what)
    out: list[int] = t.tolist()
    return out
