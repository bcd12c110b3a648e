"""Cross-rank checks that run before a step's first pipeline collective, with a watchdog."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.config import (
    CollectiveTimeoutError,
    GradientMismatchError,
    PlanMismatchError,
)

HEADER_FIELDS = ("parameters", "structure", "plan", "hyper-parameters", "setup")
_CHUNKS = 3  # 40-bit chunks per digest: exact in int64


def digest_chunks(hexdigest: str) -> list[int]:
    """Three 40-bit integers from a hex digest (an empty digest gives zeros)."""
    if not hexdigest:
        return [0] * _CHUNKS
    return [int(hexdigest[i : i + 10], 16) for i in range(0, 10 * _CHUNKS, 10)]


def wait(work: Any, *, timeout_s: float, what: str, rank: int) -> None:
    """Wait for an async collective, turning a stuck wait into :class:`CollectiveTimeoutError`."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CollectiveTimeoutError(
            f"rank {rank}: {what} did not complete within {timeout_s:g}s; a peer rank is stuck, "
            f"crashed or did not call optimizer.step() ({exc})"
        ) from exc


def check_header(
    *,
    num_params: int,
    structure: str,
    plan: str,
    hparams: str,
    needs_setup: bool,
    group: dist.ProcessGroup,
    world: int,
    rank: int,
    timeout_s: float,
) -> bool:
    """All-gather a small fixed-size header and compare it across ranks.

    Returns:
        True when any rank needs to (re)build its plan; every rank then rebuilds.

    Raises:
        PlanMismatchError: on every rank, naming the ranks that disagree and on what.
    """
    values = [
        num_params,
        *digest_chunks(structure),
        *digest_chunks(plan),
        *digest_chunks(hparams),
    ]
    header = torch.tensor([*values, int(needs_setup)], dtype=torch.int64)
    size = header.numel()
    gathered = torch.empty(world * size, dtype=torch.int64)
    work = dist.all_gather_single(gathered, header, group=group, async_op=True)
    wait(work, timeout_s=timeout_s, what="the step's cross-rank check", rank=rank)
    rows = [tuple(r) for r in gathered.view(world, size).tolist()]
    setups = [r[-1] for r in rows]
    compared = [r[:-1] for r in rows]
    # a rank that is about to re-plan has no valid plan digest yet: compare it only
    # when nobody re-plans
    if any(setups):
        plan_slice = slice(1 + _CHUNKS, 1 + 2 * _CHUNKS)
        compared = [r[: plan_slice.start] + r[plan_slice.stop :] for r in compared]
    if len(set(compared)) != 1:
        _raise_mismatch(rows, any(setups))
    return any(setups)


def _raise_mismatch(rows: list[tuple[int, ...]], replanning: bool) -> None:
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(row[:-1], []).append(rank)
    parts = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    (a, ranks_a), (b, ranks_b) = parts[0], parts[1]
    spans = {
        "the number of parameters": slice(0, 1),
        "the parameter list (names, order, shapes, dtypes or layouts)": slice(1, 1 + _CHUNKS),
        "the plan digest": slice(1 + _CHUNKS, 1 + 2 * _CHUNKS),
        "the param groups' hyper-parameters": slice(1 + 2 * _CHUNKS, 1 + 3 * _CHUNKS),
    }
    what = [
        name for name, sl in spans.items() if a[sl] != b[sl] and not (replanning and "plan" in name)
    ]
    detail = f" ({a[0]} vs {b[0]})" if a[0] != b[0] else ""
    raise PlanMismatchError(
        f"ranks {ranks_a} and ranks {ranks_b} disagree on {' and '.join(what)}{detail}; every "
        "rank must call step() with the same parameters, param groups and configuration"
    )


def check_plan_digest(
    digest: str, *, group: dist.ProcessGroup, world: int, rank: int, timeout_s: float
) -> None:
    """Compare ``Plan.digest()`` across ranks right after (re)planning.

    Raises:
        PlanMismatchError: on every rank, naming the ranks that disagree.
    """
    mine = torch.tensor(digest_chunks(digest), dtype=torch.int64)
    gathered = torch.empty(world * _CHUNKS, dtype=torch.int64)
    work = dist.all_gather_single(gathered, mine, group=group, async_op=True)
    wait(work, timeout_s=timeout_s, what="the plan digest check", rank=rank)
    rows = [tuple(r) for r in gathered.view(world, _CHUNKS).tolist()]
    if len(set(rows)) != 1:
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(row, []).append(r)
        parts = " vs ".join(f"ranks {g}" for g in groups.values())
        raise PlanMismatchError(f"plan digests differ across ranks: {parts}")


def check_gradients(
    names: Sequence[str],
    has_grad: Sequence[bool],
    *,
    group: dist.ProcessGroup,
    world: int,
    rank: int,
    timeout_s: float,
) -> set[int]:
    """One all-reduce of gradient presence; returns the parameters active on every rank.

    A parameter without a gradient on any rank is skipped consistently.

    Raises:
        GradientMismatchError: on every rank, naming parameters whose gradient exists on
            some ranks only, and the ranks that miss it.
    """
    mine = torch.tensor([1 if g else 0 for g in has_grad], dtype=torch.int32)
    counts = mine.clone()
    work = dist.all_reduce(counts, group=group, async_op=True)
    wait(work, timeout_s=timeout_s, what="the gradient-presence check", rank=rank)
    totals = counts.tolist()
    partial = [i for i, c in enumerate(totals) if 0 < c < world]
    if partial:
        every = torch.empty(world * len(has_grad), dtype=torch.int32)
        work = dist.all_gather_single(every, mine, group=group, async_op=True)
        wait(work, timeout_s=timeout_s, what="the gradient-presence report", rank=rank)
        table = every.view(world, len(has_grad)).tolist()
        lines = [
            f"{names[i]!r} has a gradient on {totals[i]} of {world} ranks (missing on ranks "
            f"{[r for r in range(world) if not table[r][i]]})"
            for i in partial[:5]
        ]
        more = f" and {len(partial) - 5} more" if len(partial) > 5 else ""
        raise GradientMismatchError(
            "gradients differ across ranks: "
            + "; ".join(lines)
            + more
            + ". Every rank must produce a gradient for the same parameters (or none)."
        )
    return {i for i, c in enumerate(totals) if c == world}


def failing_ranks(
    ok: bool, *, group: dist.ProcessGroup, world: int, rank: int, timeout_s: float
) -> list[int]:
    """All-gather a success flag; returns the ranks where it was False."""
    mine = torch.tensor([0 if ok else 1], dtype=torch.int32)
    every = torch.empty(world, dtype=torch.int32)
    work = dist.all_gather_single(every, mine, group=group, async_op=True)
    wait(work, timeout_s=timeout_s, what="the cross-rank success check", rank=rank)
    return [r for r, bad in enumerate(every.tolist()) if bad]
