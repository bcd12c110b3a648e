"""Watchdog for the optimizer's collectives: timeouts that name the ranks left behind."""

from __future__ import annotations

import hashlib
import math
import pickle
import re
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.alltoall import all_to_all
from canzona.runtime.config import CollectiveTimeoutError

_PREFIX = "canzona/progress"

#: How long a rank whose step ran past the deadline looks for peers that gave up waiting
#: for it (they file that with one write of the store, the moment they give up).
GAVE_UP_LOOK_S = 0.25

#: Work handles of the most recent collectives a watchdog keeps after waiting on them.
RETAINED_WORKS = 2

#: How :meth:`Watchdog.behind` describes a rank without a marker in the store.
NOT_WAITING = "not waiting in any collective"

#: What gloo raises when a peer's connection drops (the peer exited or crashed).
_CLOSED = re.compile(r"connection (?:closed|reset)|broken pipe|ECONNRESET|EPIPE", re.IGNORECASE)


def default_store() -> Any:
    """The default process group's key-value store, or None where it is not reachable."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


@dataclass
class Calls:
    """The collective calls an optimizer began on this rank (the same count on every rank).

    ``step()``, ``state_dict()`` and ``load_state_dict()``: every rank of a job makes them in
    the same order.
    """

    begun: int = 0


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
        process_group: Process group of the collectives.
        rank: This rank in ``group``.
        world: Size of ``group``.
        timeout_s: Deadline of every wait.
        tag: Namespace shared by the ranks of one optimizer (its :attr:`name` and
            a prefix of its parameter-structure digest).
        markers: Publish progress markers on slow waits.
        grace_s: How long a wait runs before this rank publishes its position.
        step: Steps begun so far (markers and messages name it).
        device: Device of the small check tensors (the parameters' device; None: CPU).
        name: The optimizer's name in the job's store (:func:`marker_name`, then what the
            ranks agree on when planning), which the marker of a rank that left a call
            (:meth:`left`) is filed under.
        calls: The optimizer's collective calls begun (shared by its watchdogs).
        settled: When (``time.monotonic()``) this rank's last :func:`gather_ints` returned:
            a moment every rank of ``process_group`` shares, give or take the collective's
            spread, since the ranks leave a collective together (the last rank in releases
            every rank) and make the same collectives in the same order. None before the
            first one.
        global_ranks: The default group's rank of each rank of ``process_group``, in order
            (empty without a process group). Its digest is part of every key in the store:
            optimizers on disjoint groups (pipeline stages) never read each other's markers,
            even where they optimize parameters of the same names and shapes.

    The default store is looked up only when a marker is published or read, never kept,
    so an optimizer does not keep it alive past ``destroy_process_group()``.
    """

    process_group: dist.ProcessGroup | None
    rank: int
    world: int
    timeout_s: float
    tag: str = ""
    markers: bool = True
    step: int = 0
    device: Any = None
    grace_s: float = 1.0
    name: str = ""
    calls: Calls = field(default_factory=Calls)
    global_ranks: tuple[int, ...] = field(init=False, default=())
    _space: str = field(init=False, default="")
    _label: str = ""
    _position: tuple[int, int] = (0, 0)
    _recent: deque[Any] = field(default_factory=lambda: deque(maxlen=RETAINED_WORKS), repr=False)
    settled: float | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.markers = (
            self.markers and self.process_group is not None and default_store() is not None
        )
        if self.process_group is not None:
            self.global_ranks = tuple(dist.get_process_group_ranks(self.process_group))
            ranks = ",".join(map(str, self.global_ranks))
            self._space = hashlib.sha1(ranks.encode()).hexdigest()[:8]

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/{self._space}/{self.tag}/{rank}"

    def mark(self, phase: int, label: str) -> None:
        """Record that this rank is about to enter collective ``phase`` of the step."""
        self._position = (self.step, phase)
        self._label = label

    def _publish(self) -> None:
        step, phase = self._position
        self._set(self._key(self.rank), f"{step}|{phase}|{self._label}")

    def _set(self, key: str, value: str) -> None:
        """Write ``key`` to the default store (nothing without markers)."""
        store = default_store() if self.markers else None
        if store is None:
            return
        try:
            store.set(key, value)
        except RuntimeError:
            self.markers = False  # the store went away: keep running without markers

    def _left_key(self, rank: int) -> str:
        return f"{_PREFIX}/{self._space}/{self.name}/left/{rank}"

    def rank_note(self) -> str:
        """What the rank numbers of this optimizer's messages are, where not global ranks.

        Empty where the process group's ranks are the default group's (rank ``r`` is global
        rank ``r``); else a sentence that maps them, e.g. for a pipeline stage's group.
        """
        ranks = self.global_ranks
        if ranks == tuple(range(len(ranks))):
            return ""
        shown = ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
        own = "0 and 1" if len(ranks) == 2 else f"0 to {len(ranks) - 1}"
        return (
            f"(rank numbers here are ranks of the optimizer's process group, whose ranks {own} "
            f"are global ranks {shown})"
        )

    def left(self, exc: BaseException) -> None:
        """This rank leaves the current call with ``exc``: tell peers that may wait for it.

        Filed under the call's number, so that a peer waiting in a collective of the same
        call gives up at its next look (see :meth:`wait`) instead of at the deadline. Where
        every rank raised together (the usual case), no rank is left waiting in that call,
        and a marker of an earlier call is never read.
        """
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]
        self._set(self._left_key(self.rank), f"{self.calls.begun}|{text}")

    def _left_peers(self) -> list[tuple[int, str]]:
        """Peers that left the call this rank is in, with what they raised."""
        out: list[tuple[int, str]] = []
        for r, value in self._peer_values(self._left_key):
            call, _, text = (value or "").partition("|")
            if r != self.rank and call.isdigit() and int(call) == self.calls.begun:
                out.append((r, text))
        return out

    def _peer_values(self, key_of: Callable[[int], str]) -> list[tuple[int, str | None]]:
        """Each rank's value under ``key_of(rank)`` in the store (None: not there).

        Ranks whose value cannot be read (the store went away) are left out.
        """
        store = default_store() if self.markers else None
        if store is None:
            return []
        out: list[tuple[int, str | None]] = []
        for r in range(self.world):
            key = key_of(r)
            try:
                out.append((r, store.get(key).decode() if store.check([key]) else None))
            except RuntimeError:
                continue
        return out

    def behind(self) -> list[tuple[int, str]]:
        """Ranks whose last marker is before this rank's, with what they last entered."""
        out: list[tuple[int, str]] = []
        for r, value in self._peer_values(self._key):
            if value is None:
                out.append((r, NOT_WAITING))
                continue
            try:
                step, phase, label = value.split("|", 2)
                position = (int(step), int(phase))
            except ValueError:
                continue
            if position < self._position:
                out.append((r, f"step {step}: {label}"))
        return out

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work``; on a timeout or a dropped peer raise :class:`CollectiveTimeoutError`.

        On CPU process groups ``work`` stays referenced until :data:`RETAINED_WORKS` later
        waits. gloo's worker thread drops its own reference to a finished collective a
        moment after this thread wakes up; had this thread already dropped the last Python
        reference, the worker would destroy the work and its tensors, which takes the GIL.
        When that falls after the interpreter began shutting down (a job that exits right
        after its last ``step()``), the worker thread is ended inside a C++ destructor and
        the process aborts with ``terminate called without an active exception``. Keeping
        the latest handles leaves their release to this thread, later.

        Raises:
            CollectiveTimeoutError: naming the collective and what ended the wait: a peer
                that closed its connection (gloo fails the wait at once when a peer exits
                or crashes), the process group failing it before the deadline, or the
                deadline; the last two name the ranks that have not reached it (where the
                default store is reachable).
        """
        if self.device is not None and torch.device(self.device).type != "cpu":
            # accelerator process groups (NCCL) enqueue the wait on the stream; a timed
            # wait that expires would abort the communicator, so their own watchdog
            # (the process group's timeout) bounds the collective instead
            work.wait()
            return
        self._recent.append(work)
        start = time.monotonic()
        grace = min(self.grace_s, self.timeout_s / 2) if self.markers else 0.0
        if grace > 0:
            try:
                work.wait(timeout=_limit(grace))
                return
            except RuntimeError as exc:
                if _CLOSED.search(str(exc)):
                    self._gave_up(what)
                    raise self._error(what, exc, time.monotonic() - start) from exc
                self._publish()  # slow: let peers see where this rank waits
        deadline = start + self.timeout_s
        while True:  # with markers: look every ``grace`` whether a peer left the call
            begun = time.monotonic()
            chunk = deadline - begun if grace <= 0 else min(grace, deadline - begun)
            try:
                work.wait(timeout=_limit(chunk))
                return
            except RuntimeError as exc:
                now = time.monotonic()
                if now >= deadline or now - begun < 0.99 * chunk or _CLOSED.search(str(exc)):
                    self._gave_up(what)
                    raise self._error(what, exc, now - start) from exc
                left = self._left_peers()  # the chunk timed out; the deadline is ahead
                if left:
                    self._gave_up(what)
                    raise self._left_error(what, left, now - start) from exc

    def _gave_up(self, what: str) -> None:
        """File at once that this rank gives up waiting in ``what`` (see :meth:`left`).

        Before the error is built (naming the ranks behind reads every rank's marker) and
        before the step unwinds (its rollback may take a while): a peer whose collectives all
        completed, because this rank had posted its part of them before giving up, looks for
        it before applying (:meth:`check_no_peer_gave_up`). Leaving the call files the whole
        error over it.
        """
        text = f"{CollectiveTimeoutError.__name__}: rank {self.rank} gave up waiting in {what}"
        self._set(self._left_key(self.rank), f"{self.calls.begun}|{text} (step {self.step})")

    def check_no_peer_gave_up(self, elapsed: float) -> None:
        """Raise where a peer gave up waiting for this rank in this call (before applying).

        For a rank whose step ran ``elapsed`` seconds, past the deadline (or whose peer
        entered the step's vote that long before it decided): every collective of its step
        may have completed (each peer posted its part before it gave up) and the vote been
        unanimous, while a peer raised :class:`CollectiveTimeoutError` and applied nothing;
        applying here would leave the ranks' shards a step apart. Such a peer files that it
        gave up at once (:meth:`_gave_up`); this rank looks for it during up to
        :data:`GAVE_UP_LOOK_S`. Without markers nothing can be known.
        """
        if not self.markers:
            return
        end = time.monotonic() + min(GAVE_UP_LOOK_S, self.timeout_s)
        prefix = f"{CollectiveTimeoutError.__name__}:"
        while not (gave_up := [p for p in self._left_peers() if p[1].startswith(prefix)]):
            if time.monotonic() >= end:
                return
            time.sleep(0.05)
        raise CollectiveTimeoutError(
            f"rank {self.rank}: the step's collectives completed here {elapsed:.1f}s after the "
            "step began (on this rank, or on a peer that waited in the vote), but "
            f"peers gave up waiting for this rank past the {self.timeout_s:g}s deadline "
            f"({_raised(gave_up)}); nothing was applied here either, so every rank's "
            "parameters stay as they were. The process group may be left with a collective in "
            "flight: restart the job (e.g. from the last checkpoint)"
        )

    def collective(self, phase: int, what: str, issue: Callable[[], Any]) -> None:
        """Mark ``(phase, what)``, issue a collective (``issue()`` returns its work), wait."""
        self.mark(phase, what)
        self.wait(issue(), what)

    def _left_error(
        self, what: str, left: list[tuple[int, str]], elapsed: float
    ) -> CollectiveTimeoutError:
        """The error of a wait for peers that left the call with an exception of their own."""
        return CollectiveTimeoutError(
            f"rank {self.rank}: {what} (step {self.step}) cannot complete: {_raised(left)}, "
            "outside the failure handling every rank shares, and will not enter it (gave up after "
            f"{elapsed:.1f}s of the {self.timeout_s:g}s deadline). The process group is left "
            "with a collective in flight: restart the job (e.g. from the last checkpoint)"
        )

    def _error(self, what: str, exc: RuntimeError, elapsed: float) -> CollectiveTimeoutError:
        """The error of a failed wait: a peer that left, an early failure, or a late peer."""
        where = f"rank {self.rank}: {what} (step {self.step})"
        early = elapsed < 0.99 * self.timeout_s
        if early and _CLOSED.search(str(exc)):
            return CollectiveTimeoutError(
                f"{where} failed after {elapsed:.1f}s of the {self.timeout_s:g}s deadline: a "
                "peer rank closed its connection (it exited, crashed or destroyed the process "
                f"group; see its log) ({exc})"
            )
        late = self.behind()
        who = (
            "ranks that have not reached it: "
            + ", ".join(f"{r} (last: {label})" for r, label in late)
            if late
            else "a peer rank is stuck, crashed or did not call the same method"
        )
        if self.step <= 1 and any(label == NOT_WAITING for _, label in late):
            who += (
                "; at a first step this is also how ranks that never built this optimizer "
                "look: one that only some ranks use needs PipelineConfig(process_group=...) "
                "of those ranks"
            )
        if early:  # e.g. the process group's own timeout, shorter than timeout_s
            return CollectiveTimeoutError(
                f"{where} failed after {elapsed:.1f}s, before the {self.timeout_s:g}s "
                f"deadline, in the process group; {who} ({exc})"
            )
        return CollectiveTimeoutError(
            f"{where} did not complete within {self.timeout_s:g}s; {who} ({exc})"
        )


def _raised(peers: list[tuple[int, str]]) -> str:
    """``rank r raised <what>`` for each peer that left a call, joined."""
    return "; ".join(f"rank {r} raised {text}" for r, text in peers)


def _limit(seconds: float) -> timedelta:
    """A wait's timeout in whole milliseconds, rounded up, at least one.

    gloo takes a timeout in whole milliseconds, rounded down, and waits without a limit for
    0 ms: a wait woken a fraction of a millisecond before the deadline would otherwise wait
    again for as long as the peers take, past the deadline.
    """
    return timedelta(milliseconds=max(1, math.ceil(seconds * 1000)))


#: Optimizers built in this process, per description digest (see :func:`marker_name`).
_NAMES: Counter[str] = Counter()


def marker_name(description: str) -> str:
    """The name an optimizer files its markers under: what it optimizes, and how many.

    A digest of ``description`` (its class and its parameters' names and shapes) and how
    many optimizers of that description this process built before: the same on every rank
    that builds it, whatever other optimizers each process built first.
    """
    digest = hashlib.sha1(description.encode()).hexdigest()[:12]
    _NAMES[digest] += 1
    return f"{digest}.{_NAMES[digest]}"


def _on_device(host: torch.Tensor, watchdog: Watchdog) -> torch.Tensor:
    """A small host tensor on the watchdog's device (from pinned memory: no host block)."""
    if watchdog.device is None or torch.device(watchdog.device).type == "cpu":
        return host
    return host.pin_memory().to(torch.device(watchdog.device), non_blocking=True)


def gather_ints(values: list[int], *, watchdog: Watchdog, phase: int, what: str) -> list[list[int]]:
    """All-gather a short int64 vector (same length on every rank); rows in rank order.

    Runs as an all-to-all of the vector to every rank: for a few numbers it is the fastest
    collective of CPU process groups (gloo's all-gather and all-reduce take two to three
    times as long on loopback).
    """
    n, world = len(values), watchdog.world
    mine = _on_device(torch.tensor(values * world, dtype=torch.int64), watchdog)
    out = torch.empty(world * n, dtype=torch.int64, device=mine.device)
    watchdog.collective(phase, what, lambda: all_to_all(out, mine, (), (), watchdog.process_group))
    rows: list[list[int]] = out.view(world, n).tolist()
    watchdog.settled = time.monotonic()  # after the host has the rows, on any device
    return rows


def gather_objects(obj: Any, *, watchdog: Watchdog, phase: int, what: str) -> list[Any]:
    """All-gather a picklable object; every rank's, in rank order.

    ``dist.all_gather_object`` waits without a deadline; here both collectives (the sizes,
    then the padded bytes, each an all-to-all) wait as every other one of the optimizer:
    until ``timeout_s``, and no longer than it takes to see that a peer left the call.
    """
    data = pickle.dumps(obj)
    sizes = [size for (size,) in gather_ints([len(data)], watchdog=watchdog, phase=phase,
                                             what=f"{what} (sizes)")]  # fmt: skip
    width, world = max(sizes), watchdog.world
    mine = torch.zeros((world, width), dtype=torch.uint8)
    mine[:, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = _on_device(mine, watchdog)
    out = torch.empty((world, width), dtype=torch.uint8, device=mine.device)
    watchdog.collective(
        phase, what, lambda: all_to_all(out.view(-1), mine.view(-1), (), (), watchdog.process_group)
    )
    rows = out.cpu()
    return [pickle.loads(bytes(rows[r, :size].tolist())) for r, size in enumerate(sizes)]
