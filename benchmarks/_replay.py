"""A ``canzona`` step's collectives replayed without canzona: what they cost in the step's cadence.

:func:`replay` records, on every rank, when each all-to-all of a few steps was issued and
waited for (through the runtime's two entry points, ``canzona.runtime.pipeline.all_to_all`` and
``Watchdog.wait``, wrapped while it records). Each rank then replays its median step: it
busy-waits through the host time it spent between those calls (the gaps) and makes the same
calls on buffers of the same sizes, with no canzona code in between. The replay and the real
step take turns. When the replay takes as long as the step, the step's time is its host work
(the gaps) plus what the collectives cost when they are entered at these moments, which can
be more than what one collective costs when every rank enters it right after a barrier.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import canzona.runtime.pipeline as pipeline
import canzona.runtime.watchdog as watchdog
from canzona.runtime.alltoall import all_to_all

#: One recorded call: ("issue", start, end, out_splits, in_splits, dtype, key) or
#: ("wait", start, end, key); times in seconds from the step's start.
Event = tuple[Any, ...]


def _spin(until: float) -> None:
    """Busy-wait (host work holds the core, as a busy-wait does) until ``until``."""
    while time.perf_counter() < until:
        pass


def _record(
    opt: Any, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], steps: int
) -> tuple[list[tuple[list[Event], float]], Any]:
    """This rank's all-to-all calls in ``steps`` steps of ``opt``, and each step's length."""
    issue, wait = pipeline.all_to_all, watchdog.Watchdog.wait
    events: list[Event] = []
    keys: dict[int, int] = {}
    group: list[Any] = []  # the process group of the calls (one for all)

    def issuing(out: Any, inp: Any, out_splits: Any, in_splits: Any, pg: Any) -> Any:
        start = time.perf_counter()
        work = issue(out, inp, out_splits, in_splits, pg)
        keys[id(work)] = len(keys)
        if not group:
            group.append(pg)
        splits = (tuple(out_splits), tuple(in_splits))
        events.append(("issue", start, time.perf_counter(), *splits, inp.dtype, keys[id(work)]))
        return work

    def waiting(self: Any, work: Any, what: str) -> None:
        start = time.perf_counter()
        wait(self, work, what)
        events.append(("wait", start, time.perf_counter(), keys.get(id(work), -1)))

    steps_seen: list[tuple[list[Event], float]] = []
    pipeline.all_to_all, watchdog.Watchdog.wait = issuing, waiting  # type: ignore[assignment]
    try:
        for _ in range(steps):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            dist.barrier()
            events.clear()
            keys.clear()
            start = time.perf_counter()
            opt.step()
            length = time.perf_counter() - start
            shifted = [(e[0], e[1] - start, e[2] - start, *e[3:]) for e in events]
            steps_seen.append((shifted, length))
    finally:
        pipeline.all_to_all, watchdog.Watchdog.wait = issue, wait  # type: ignore[assignment]
    return steps_seen, (group[0] if group else None)


def _steady(steps_seen: list[tuple[list[Event], float]]) -> list[tuple[list[Event], float]]:
    """The steps that make the calls most of them make (their kinds, sizes and order).

    Empty unless more than half of the steps make them: a stray step (one that checks its
    header on its own, say) drops out; steps with no common sequence have no timeline.
    """
    shapes = [tuple((e[0], *e[3:]) for e in events) for events, _ in steps_seen]
    common = Counter(shapes).most_common(1)
    if not common or 2 * common[0][1] <= len(steps_seen):
        return []
    return [seen for seen, shape in zip(steps_seen, shapes, strict=True) if shape == common[0][0]]


def _timeline(steps_seen: list[tuple[list[Event], float]]) -> list[tuple[float, Event]] | None:
    """The median gap before each call (and the last one to the step's end), or None.

    Over the steps that make the calls most steps make (:func:`_steady`); None when there
    are none, or a wait is not for an all-to-all the step issued (another collective, such
    as the vote of a step without a scatter): such steps have no timeline to replay.
    """
    steps_seen = _steady(steps_seen)
    first = steps_seen[0][0] if steps_seen else []
    if not first or any(e[0] == "wait" and e[3] < 0 for e in first):
        return None
    plan: list[tuple[float, Event]] = []
    for i, event in enumerate(first):
        gaps = [ev[i][1] - (ev[i - 1][2] if i else 0.0) for ev, _ in steps_seen]
        plan.append((statistics.median(gaps), event))
    tail = statistics.median(length - ev[-1][2] for ev, length in steps_seen)
    plan.append((tail, ("end",)))
    return plan


def _replay_step(plan: list[tuple[float, Event]], group: Any, buffers: dict[int, Any]) -> float:
    """One replayed step (the caller passes a barrier first); returns the seconds in the calls."""
    works: dict[int, Any] = {}
    inside = 0.0
    clock = time.perf_counter()
    for gap, event in plan:
        _spin(clock + gap)
        begun = time.perf_counter()
        if event[0] == "issue":
            out, inp = buffers[event[6]]
            works[event[6]] = all_to_all(out, inp, event[3], event[4], group)
        elif event[0] == "wait":
            works.pop(event[3]).wait()
        clock = time.perf_counter()
        inside += clock - begun
    return inside


def replay(
    opt: Any,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    steps: int,
    gather: Any,
) -> dict[str, float]:
    """The step and its replay, ``steps`` times each in turn; medians in seconds (empty if none).

    ``gather(start, end)`` returns every rank's starts and ends (a step's time is the slowest
    rank's). Keys: ``replay_s`` and ``paired_step_s`` (the replay and the step, taken in
    turn), ``host_gaps_s`` (this rank's gaps summed), ``step_calls_s`` and ``replay_calls_s``
    (this rank's time inside the calls, issuing and waiting, in the step and in the replay).
    """
    seen, group = _record(opt, params, grads, steps)
    plan = _timeline(seen)
    # every rank must take the same branch: replay only where every rank has a timeline
    flag = torch.tensor([0.0 if plan is None else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if plan is None or flag.item() == 0.0:
        return {}
    buffers = {
        e[6]: (torch.empty(sum(e[3]), dtype=e[5]), torch.zeros(sum(e[4]), dtype=e[5]))
        for _, e in plan
        if e[0] == "issue"
    }
    times: dict[str, list[float]] = {"replay_s": [], "paired_step_s": [], "replay_calls_s": []}
    for _ in range(steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        starts, ends = gather(start, time.perf_counter())
        times["paired_step_s"].append(max(e - s for s, e in zip(starts, ends, strict=True)))
        dist.barrier()
        start = time.perf_counter()
        inside = _replay_step(plan, group, buffers)
        starts, ends = gather(start, time.perf_counter())
        times["replay_s"].append(max(e - s for s, e in zip(starts, ends, strict=True)))
        times["replay_calls_s"].append(inside)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["host_gaps_s"] = sum(gap for gap, _ in plan)
    out["step_calls_s"] = statistics.median(
        sum(e[2] - e[1] for e in events) for events, _ in _steady(seen)
    )
    return out
