"""Cross-rank checks that run before a step's first pipeline collective, with a watchdog."""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from canzona.runtime.config import GradientMismatchError, PlanMismatchError, UpdateFailedError
from canzona.runtime.tensors import REDISTRIBUTED
from canzona.runtime.watchdog import Watchdog, gather_ints, gather_objects

if TYPE_CHECKING:
    from canzona.runtime.engine import MatrixRuntime
    from canzona.runtime.pipeline import Failure

_CHUNKS = 3  # 40-bit chunks per digest: exact in int64
#: What a mismatch of the parameters themselves adds: where ranks optimize different ones.
STAGES_HINT = (
    ". Ranks that optimize different parameters (pipeline stages) need an optimizer each on "
    "its own process group: PipelineConfig(process_group=...)"
)
VOTE = 1_000_000  # progress-marker phase of the success vote: after every micro-group
AGREE = -1  # progress-marker phase of the layout agreement: before the step's own check
_FIXED = 1 + 3 * _CHUNKS  # header words before the gradients' digest
_FRESH = _FIXED + _CHUNKS  # where the word of the state entries begun afresh sits
#: int64 words of the header that rides a step's first gather: the header, the ready flag
#: and padding to 16 bytes (the slot is reinterpreted in the gather's dtype)
RIDE_WORDS = 18
RIDE_READY = _FRESH + 4  # where the ready flag sits in it


def ranks_by_value(values: Sequence[Hashable]) -> list[tuple[Hashable, list[int]]]:
    """(value, ranks holding it), the most common value first (ties by lowest rank)."""
    groups: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))


def first_difference(lists: Sequence[Sequence[str]], a: int, b: int) -> str:
    """The first entry where rank ``a``'s and rank ``b``'s descriptions differ, both shown."""
    for i, (x, y) in enumerate(itertools.zip_longest(lists[a], lists[b])):
        if x != y:
            return f"entry {i}: rank {a} has {x}, rank {b} has {y}"
    return "no difference found in the parameter layouts (configuration differs)"


#: A memory address in a ``repr`` (``<object at 0x7f...>``): different in every process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe_groups(groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each param group's hyper-parameters, one entry per value (a mismatch's description).

    Memory addresses are left out of the ``repr``s: the hyper-parameter check compares an
    object it cannot read by its type, so two ranks' copies of it must not be named as the
    difference.
    """
    out = []
    for gid, group in enumerate(groups):
        for key, value in sorted(group.items()):
            if key not in ("params", "param_names"):
                shown = (
                    f"tensor({value.item()!r}, dtype={value.dtype})"
                    if isinstance(value, torch.Tensor) and value.numel() == 1
                    else _ADDRESS.sub("", repr(value))
                )
                out.append(f"param group {gid} {key}={shown}")
    return out


def digest_chunks(hexdigest: str) -> list[int]:
    """Three 40-bit integers from a hex digest (an empty digest gives zeros)."""
    if not hexdigest:
        return [0] * _CHUNKS
    return [int(hexdigest[i : i + 10], 16) for i in range(0, 10 * _CHUNKS, 10)]


def grads_digest(has_grad: Sequence[int]) -> str:
    """sha256 of the gradients' codes (:func:`~canzona.runtime.tensors.grad_codes`)."""
    return hashlib.sha256(bytes(has_grad)).hexdigest()


def fresh_word(fresh: Sequence[int]) -> int:
    """40 bits of sha256 of the parameters (indices) whose state begins afresh; 0 for none."""
    if not fresh:
        return 0
    return digest_chunks(hashlib.sha256(repr(list(fresh)).encode()).hexdigest())[0]


def header_values(
    *,
    num_params: int,
    structure: str,
    plan: str,
    hparams: str,
    has_grad: Sequence[int],
    failed: bool,
    nonfinite: bool,
    needs_setup: bool,
    fresh: Sequence[int] = (),
) -> list[int]:
    """A rank's header: counts and digests that must agree, then its three flags.

    ``fresh``: the parameters with a gradient whose ``optimizer.state`` entry has no step
    yet (all of them at the first step; those the user cleared since).
    """
    return [
        num_params,
        *digest_chunks(structure),
        *digest_chunks(plan),
        *digest_chunks(hparams),
        *digest_chunks(grads_digest(has_grad)),
        fresh_word(fresh),
        int(failed),
        int(nonfinite),
        int(needs_setup),
    ]


def ride_header(header: list[int], ready: bool) -> list[int]:
    """The header that rides a step's first gather: ``header``, ``ready``, padding.

    ``ready`` says that this rank's step matches the last agreed one (same plan, same
    parameters with gradients, nothing failed), so it prepared its payloads by that plan.
    """
    words = [*header, int(ready)]
    return words + [0] * (RIDE_WORDS - len(words))


def ride_agrees(rows: Sequence[Sequence[int]]) -> bool:
    """Whether a step whose header rode its first gather goes on.

    Only when every rank was ready and every header is equal; anything else runs the step
    again with :func:`check_header`.
    """
    return all(row == rows[0] for row in rows) and rows[0][RIDE_READY] == 1


def check_header(
    *,
    num_params: int,
    structure: str,
    plan: str,
    hparams: str,
    needs_setup: bool,
    watchdog: Watchdog,
    names: Sequence[str] = (),
    has_grad: Sequence[int] = (),
    nonfinite: bool = False,
    failed: bool = False,
    describe: Callable[[], Sequence[str]] | None = None,
    groups: Sequence[Mapping[str, Any]] = (),
    fresh: Sequence[int] = (),
) -> tuple[bool, bool, bool]:
    """Gather one small fixed-size header from every rank and compare.

    The header holds the parameter count and digests of the parameter list, the plan,
    the hyper-parameters and the gradient-presence bitmap, a digest of the parameters whose
    state begins afresh (``fresh``: an ``optimizer.state`` entry cleared on some ranks only
    would restart part of a matrix's state, or one replica's), plus three flags (something
    already failed on this rank, non-finite gradient, re-plan needed). It is the only
    collective of a step's checks when everything agrees.

    ``describe`` gives this rank's configuration and parameter layouts as strings (what the
    structure digest covers), ``groups`` the param groups' values: when the parameter
    lists or the hyper-parameters differ, one more all-gather of both names the first
    difference.

    Returns:
        (any rank needs to (re)build its plan, any rank saw a non-finite gradient, any
        rank reported a failure).

    Raises:
        PlanMismatchError: on every rank, naming the ranks that disagree and on what.
        GradientMismatchError: on every rank, when gradient presence differs (after one
            more all-gather that finds which parameters and ranks).
        UpdateFailedError: on every rank, when only the state entries begun afresh differ
            (after one more all-gather that finds which parameters and ranks).
    """
    header = header_values(
        num_params=num_params,
        structure=structure,
        plan=plan,
        hparams=hparams,
        has_grad=has_grad,
        failed=failed,
        nonfinite=nonfinite,
        needs_setup=needs_setup,
        fresh=fresh,
    )
    values = header[:_FIXED]
    gathered = gather_ints(header, watchdog=watchdog, phase=0, what="the step's cross-rank check")
    flagged = any(r[-2] for r in gathered)
    if any(r[-3] for r in gathered):
        return False, flagged, True
    rows = [(*r[: len(values)], r[-1]) for r in gathered]
    setup = any(r[-1] for r in rows)
    compared = [r[:-1] for r in rows]
    # a rank that is about to re-plan has no valid plan digest yet: compare it only
    # when nobody re-plans
    if setup:
        plan_slice = slice(1 + _CHUNKS, 1 + 2 * _CHUNKS)
        compared = [r[: plan_slice.start] + r[plan_slice.stop :] for r in compared]
    if len(set(compared)) != 1:
        described = None if describe is None else (lambda: [*describe(), *describe_groups(groups)])
        _raise_mismatch(rows, setup, described, watchdog)
    if len({tuple(r[len(values) : len(values) + _CHUNKS]) for r in gathered}) != 1:
        _raise_partial_gradients(names, has_grad, watchdog=watchdog)
    # last: a gradient on some ranks only begins its state there only
    if len({r[_FRESH] for r in gathered}) != 1:
        _raise_cleared_state(names, fresh, watchdog=watchdog)
    return setup, flagged, False


def _raise_mismatch(
    rows: list[tuple[int, ...]],
    replanning: bool,
    describe: Callable[[], Sequence[str]] | None,
    watchdog: Watchdog,
) -> None:
    parts = ranks_by_value([row[:-1] for row in rows])
    (a, ranks_a), (b, ranks_b) = parts[0], parts[1]
    assert isinstance(a, tuple) and isinstance(b, tuple)
    layouts = slice(1, 1 + _CHUNKS)
    spans = {
        "the number of parameters": slice(0, 1),
        "the parameter list (names, order, shapes, dtypes or layouts)": layouts,
        "the plan digest": slice(1 + _CHUNKS, 1 + 2 * _CHUNKS),
        "the param groups' hyper-parameters": slice(1 + 2 * _CHUNKS, 1 + 3 * _CHUNKS),
    }
    what = [
        name for name, sl in spans.items() if a[sl] != b[sl] and not (replanning and "plan" in name)
    ]
    if a[0] != b[0]:
        what[0] += f" ({a[0]} vs {b[0]})"
    detail = ""
    hparams = spans["the param groups' hyper-parameters"]
    if describe is not None and (a[layouts] != b[layouts] or a[hparams] != b[hparams]):
        # every rank saw the same rows, so every rank gathers here (an error path only)
        full: list[list[str]] = gather_objects(
            list(describe()), watchdog=watchdog, phase=0, what="the check's descriptions"
        )
        lists = [f or [] for f in full]
        detail = f" (first difference: {first_difference(lists, ranks_a[0], ranks_b[0])})"
    stages = STAGES_HINT if a[: layouts.stop] != b[: layouts.stop] else ""
    raise PlanMismatchError(
        f"ranks {ranks_a} and ranks {ranks_b} disagree on {' and '.join(what)}{detail}; "
        f"every rank must call step() with the same parameters, param groups and "
        f"configuration{stages}"
    )


def check_plan_digest(digest: str, *, watchdog: Watchdog) -> None:
    """Compare ``Plan.digest()`` across ranks right after (re)planning.

    Raises:
        PlanMismatchError: on every rank, naming the ranks that disagree.
    """
    gathered = gather_ints(
        digest_chunks(digest), watchdog=watchdog, phase=1, what="the plan digest check"
    )
    rows = [tuple(r) for r in gathered]
    if len(set(rows)) != 1:
        parts = " vs ".join(f"ranks {ranks}" for _, ranks in ranks_by_value(rows))
        raise PlanMismatchError(f"plan digests differ across ranks: {parts}")


def _report(
    values: Sequence[int], watchdog: Watchdog, what: str
) -> tuple[list[list[int]], list[int], str]:
    """Every rank's ``values`` (one per parameter) and the parameters where they differ.

    An error path's second all-gather; also what naming the first five leaves out.
    """
    table = gather_ints(list(values), watchdog=watchdog, phase=3, what=what)
    differ = [i for i in range(len(values)) if len({row[i] for row in table}) > 1]
    return table, differ, f" and {len(differ) - 5} more" if len(differ) > 5 else ""


def _raise_partial_gradients(
    names: Sequence[str], has_grad: Sequence[int], *, watchdog: Watchdog
) -> None:
    """Gather every rank's gradient codes and name what differs (error path).

    Raises:
        GradientMismatchError: on every rank, naming parameters whose gradient exists on
            some ranks only and the ranks that miss it, or is in other placements than its
            parameter's on some ranks only.
    """
    world = watchdog.world
    table, differ, more = _report(has_grad, watchdog, "the gradient report")
    lines = []
    for i in differ[:5]:
        missing = [r for r in range(world) if not table[r][i]]
        if missing:
            lines.append(
                f"{names[i]!r} has a gradient on {world - len(missing)} of {world} ranks "
                f"(missing on ranks {missing})"
            )
        else:
            moved = [r for r in range(world) if table[r][i] == REDISTRIBUTED]
            lines.append(
                f"{names[i]!r} has a gradient in other placements than the parameter's on "
                f"ranks {moved} only (its redistribution is a collective of every rank)"
            )
    raise GradientMismatchError(
        "gradients differ across ranks: "
        + "; ".join(lines)
        + more
        + ". Every rank must produce a gradient for the same parameters (or none), "
        "in the same placements."
    )


def _raise_cleared_state(
    names: Sequence[str], fresh: Sequence[int], *, watchdog: Watchdog
) -> NoReturn:
    """Gather which parameters' state begins afresh on every rank and name them (error path).

    Raises:
        UpdateFailedError: on every rank, naming the parameters whose ``optimizer.state``
            entry was cleared on some ranks only, and those ranks.
    """
    mine = set(fresh)
    bits = [int(i in mine) for i in range(len(names))]
    table, differ, more = _report(bits, watchdog, "the state report")
    lines = [
        f"{names[i]!r} on ranks {[r for r, row in enumerate(table) if row[i]]}" for i in differ[:5]
    ]
    raise UpdateFailedError(
        "optimizer.state entries were cleared on some ranks only: "
        + "; ".join(lines)
        + more
        + ". A parameter's state is held in pieces on every rank (or in one copy per "
        "replica), so it can only start afresh everywhere: clear the entry on every rank "
        "(or load a checkpoint); nothing changed"
    )


def failing_ranks(
    ok: bool, *, watchdog: Watchdog, what: str = "the cross-rank success check"
) -> list[int]:
    """All-gather a success flag; returns the ranks where it was False."""
    rows = gather_ints([0 if ok else 1], watchdog=watchdog, phase=4, what=what)
    return [r for r, (bad,) in enumerate(rows) if bad]


def raise_failures(
    failure: Failure | None, names: Sequence[str], watchdog: Watchdog, distributed: bool
) -> NoReturn:
    """Raise the same :class:`UpdateFailedError` on every rank, with every failing rank's report.

    Collective when ``distributed``: every rank calls it.
    """
    mine = None if failure is None else failure.describe(names)
    reports = vote(mine, watchdog=watchdog) if distributed else []
    if not distributed and mine is not None:
        reports = [(watchdog.rank, mine)]
    text = "; ".join(f"rank {r}: {line}" for r, line in reports)
    raise UpdateFailedError(
        f"the step failed on ranks {[r for r, _ in reports]} ({text}); "
        "nothing was updated on any rank"
    ) from (failure.error if failure is not None else None)


def vote(
    report: str | None, *, watchdog: Watchdog, what: str = "the step's success vote"
) -> list[tuple[int, str]]:
    """Agree on whether every rank succeeded; ``report`` is None on success.

    One small gather of success flags (``what`` names it in a timeout); only when some rank
    failed, a gather of objects brings every failing rank's report to every rank.

    Returns:
        ``(rank, report)`` of every failing rank, in rank order (empty on success).
    """
    return timed_vote(report, watchdog=watchdog, what=what)[0]


def timed_vote(
    report: str | None, *, watchdog: Watchdog, what: str = "the step's success vote"
) -> tuple[list[tuple[int, str]], float | None]:
    """:func:`vote`, and how long the first rank in had been in it when it decided (seconds).

    Each rank sends with its flag how long after the previous small gather it entered the
    vote (whole milliseconds, its own monotonic clock: ranks leave a collective together,
    so that moment is shared, and no two hosts' wall clocks are compared). A rank that
    reached the vote more than the deadline after a peer did finds its vote complete all
    the same (the peer had posted its part before it gave up); the earliest entry tells it
    to look whether that peer left. None before any small gather (no shared moment).
    """
    settled = watchdog.settled
    entered = -1 if settled is None else int((time.monotonic() - settled) * 1000)
    rows = gather_ints([int(report is not None), entered], watchdog=watchdog, phase=VOTE, what=what)
    decided = time.monotonic()
    failed = [r for r, (bad, _) in enumerate(rows) if bad]
    first = min(t for _, t in rows)
    waited = None if settled is None or first < 0 else decided - settled - first / 1000
    return reports_of(failed, report, watchdog=watchdog), waited


def reports_of(
    failed: Sequence[int], report: str | None, *, watchdog: Watchdog
) -> list[tuple[int, str]]:
    """``(rank, report)`` of the failing ranks (a collective when any failed, else none)."""
    if not failed:
        return []
    reports: list[str | None] = gather_objects(
        report, watchdog=watchdog, phase=VOTE, what="the failing ranks' reports"
    )
    return [(r, reports[r] or "failed") for r in failed]


def same_everywhere(text: str, count: int, watchdog: Watchdog, what: str) -> bool:
    """Whether every rank holds the same ``text`` of ``count`` entries (collective).

    One small all-to-all of the count and the text's digest; ``what`` names it in a timeout.
    """
    digest = digest_chunks(hashlib.sha256(text.encode()).hexdigest())
    rows = gather_ints([count, *digest], watchdog=watchdog, phase=VOTE, what=what)
    return all(row == rows[0] for row in rows)


def differing_params(
    values: Sequence[str], names: Sequence[str], runtime: MatrixRuntime, *, what: str
) -> str | None:
    """Compare one text per parameter across ranks; None where every rank has the same.

    Collective on a distributed runtime: one small gather of a digest, and only when the
    digests differ a gather of the texts, which names up to three parameters that differ
    and each rank's text there (the same description on every rank).
    """
    if runtime.process_group is None:
        return None
    if same_everywhere(repr(list(values)), len(values), runtime.watchdog, f"{what} (digest)"):
        return None
    every: list[list[str]] = gather_objects(
        list(values), watchdog=runtime.watchdog, phase=VOTE, what=f"{what} (values)"
    )
    differ = [
        i for i in range(len(names)) if any(len(row) <= i or row[i] != every[0][i] for row in every)
    ]
    if not differ:  # as many parameters on this rank, more on another
        return f"{[len(row) for row in every]} parameters on the ranks"
    detail = "; ".join(
        f"{names[i]!r}: "
        + ", ".join(
            f"{text} on ranks {ranks}"
            for text, ranks in ranks_by_value([row[i] if i < len(row) else "-" for row in every])
        )
        for i in differ[:3]
    )
    return detail + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")


def check_all_ok(ok: bool, runtime: MatrixRuntime) -> list[int]:
    """Ranks of the runtime's process group where ``ok`` is False (no collective when local)."""
    if runtime.process_group is None:
        return [] if ok else [runtime.rank]
    return failing_ranks(ok, watchdog=runtime.watchdog)
