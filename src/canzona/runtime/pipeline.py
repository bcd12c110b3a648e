"""Runs a step's schedule: gather -> compute -> scatter over micro-groups, then vote and apply."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from canzona.runtime.alltoall import all_to_all
from canzona.runtime.apply import apply_runs
from canzona.runtime.assembled import Assembled
from canzona.runtime.checks import RIDE_READY, reports_of, ride_agrees, timed_vote
from canzona.runtime.config import PipelineConfig, UpdateFailedError, partial_update
from canzona.runtime.exchanges import (
    Exchange,
    Pending,
    Wire,
    assemble,
    concat,
    fused_send,
    labels,
    pack,
    piece_of,
    release,
    row_major,
)
from canzona.runtime.scatter_index import scatter_parts
from canzona.runtime.schedule_parts import Delivery, GroupSchedule, OwnerBatch, Piece, Schedule
from canzona.runtime.stats import StepStats
from canzona.runtime.table import ApplyFn, ComputeBatch, ComputeFn, StepTable
from canzona.runtime.watchdog import Watchdog

if TYPE_CHECKING:
    from canzona.runtime.repricing import Observation

_T = TypeVar("_T")
#: How much earlier than its deadline a peer's wait in the vote counts as possibly given up:
#: the ranks leave the collective the vote's times count from a moment apart, and the flags
#: take a while to arrive.
VOTE_MARGIN_S = 0.25


def receive_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An all-to-all's receive buffer (its contents are undefined)."""
    return torch.empty(numel, dtype=dtype, device=device)


def kept_copies(
    outs: list[torch.Tensor], kept: Sequence[tuple[Piece, Delivery]]
) -> list[tuple[torch.Tensor, Delivery]]:
    """Copies of this rank's own fragments of a replicated group's results."""
    return [(piece_of(outs, pc).clone(), d) for pc, d in kept]


class StepDeclined(Exception):
    """The headers that rode the step's first gather say it cannot go on as planned.

    Raised on every rank alike (all read the same headers) once every collective the step
    issued has completed; the optimizer undoes the step and runs it again with the check
    as a collective of its own, which then re-plans or raises the usual error.
    """


@dataclass
class Failure:
    """The first thing that raised on this rank during a step.

    Attributes:
        where: What was running (e.g. ``"computing micro-group 2"``).
        error: The exception.
        params: Parameter indices concerned (empty when unknown).
    """

    where: str
    error: BaseException
    params: tuple[int, ...] = ()

    def describe(self, names: Sequence[str]) -> str:
        """One line naming what failed and the parameters concerned."""
        named = [names[p] for p in self.params[:3]]
        more = f" and {len(self.params) - 3} more" if len(self.params) > 3 else ""
        what = f" (parameters {named}{more})" if named else ""
        return f"{self.where}{what} raised {type(self.error).__name__}: {self.error}"


class Pipeline:
    """Runs one optimizer step's matrix updates for one rank.

    Args:
        schedule: The step's precomputed work.
        process_group: Process group of the collectives (None: single process).
        rank: This rank in ``process_group``.
        world: Size of ``process_group``.
        config: Pipeline configuration.
        watchdog: Deadline and progress markers of the collectives.
        device: Device of the communication buffers (the parameters' device).
    """

    def __init__(
        self,
        *,
        schedule: Schedule,
        process_group: dist.ProcessGroup | None,
        rank: int,
        world: int,
        config: PipelineConfig,
        watchdog: Watchdog,
        device: torch.device,
    ) -> None:
        self.schedule = schedule
        self.process_group = process_group
        self.rank = rank
        self.world = world
        self.config = config
        self.watchdog = watchdog
        self.device = device
        #: A step left collectives in flight (it raised while waiting): the step buffers
        #: may still be read or written by them, so they are never freed or reused; the
        #: runtime builds a new pipeline for the next step.
        self.retired = False
        #: Records the owner calls of the step about to run (see :mod:`.repricing`).
        self.observe: Observation | None = None

    # ------------------------------------------------------------------ step
    def run(
        self,
        *,
        table: StepTable,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        compute: ComputeFn,
        apply: ApplyFn,
        failure: Failure | None = None,
        ride: list[int] | None = None,
    ) -> StepStats:
        """Compute every active matrix's direction, agree that every rank succeeded, apply.

        The schedule's buffers must hold the prepared payloads (see
        :meth:`MatrixRuntime.begin_step`). Nothing is applied before every rank has voted
        success, so a failure anywhere leaves every parameter untouched.

        Args:
            table: This step's table.
            tensors: The optimizer's parameters (targets of the apply).
            names: Their names (error messages).
            compute: Owner-side math of one batch.
            apply: Storage-side update of one batch.
            failure: What already failed on this rank in this step (e.g. the prepare).
            ride: The header (:func:`~canzona.runtime.checks.ride_header`) that travels in
                the first gather's slot; its ready flag unset, this rank prepared nothing
                and computes nothing.

        Raises:
            UpdateFailedError: on every rank, naming the failing ranks and what failed
                there, when anything failed on any rank; nothing was applied anywhere.
            StepDeclined: on every rank, when the headers that rode the first gather
                disagree or some rank was not ready; nothing was applied anywhere.
            PartialUpdateError: on this rank alone, when the apply raised here after the
                decision (the other ranks applied the step; a distributed job only).
        """
        run = _Run(self, table, compute, failure)
        if ride is not None:
            slot = self.schedule.micro_groups[0].header
            assert slot is not None and self.process_group is not None
            words = torch.tensor(ride, dtype=torch.int64)
            if self.device.type != "cpu":  # from pinned memory the copy does not block the host
                words = words.pin_memory().to(self.device, non_blocking=True)
            slot.view(torch.int64).copy_(words)
            run.riding, run.hold = True, ride[RIDE_READY] == 0
        t0 = time.perf_counter()
        try:
            if run.failure is None and not run.hold:
                try:  # the payloads travel in their payload dtype
                    for prepared, payload in self.schedule.casts:
                        payload.tensor.copy_(prepared.tensor)
                except Exception as exc:
                    run.fail("casting the payloads", exc)
            if ride is not None and slot is not None and self.schedule.held:
                copies = list(self.schedule.micro_groups[0].header_slots)  # after the cast;
                if copies:  # one call for all (with one owner per peer, a copy per peer)
                    torch._foreach_copy_(copies, [slot] * len(copies))
            kept = run.local_batches()
            if self.schedule.micro_groups and self.process_group is not None:
                run.micro_groups()
            waited = self._vote(run.failure, run.failed_ranks, names)
            start = time.perf_counter()
            elapsed = start - t0  # an owner late in the last group: its own pipeline's time
            deadline = self.watchdog.timeout_s
            late = elapsed > deadline
            if waited is not None:  # the vote decided: a peer had waited in it that long
                # (however late this rank was: in its closure, its prepare, before step())
                late = late or waited + VOTE_MARGIN_S > deadline
                elapsed = max(elapsed, waited)
            if late and self.process_group is not None:
                self.watchdog.check_no_peer_gave_up(elapsed)  # before applying anything
            try:
                apply_runs(kept + run.received, table, tensors, apply)
            except Exception as exc:
                if self.process_group is None:
                    raise  # one process: as torch.optim
                raise partial_update(self.rank, "the matrix directions", exc) from exc
            run.stats.apply_s = time.perf_counter() - start
        finally:
            if run.wires:  # a collective may still use the buffers: never free them
                self.retired = True
            else:
                self.schedule.release()
            # the error's traceback holds the frames that hold ``run``: no cycle through it
            run.failure = None
        run.stats.total_s = time.perf_counter() - t0
        return run.stats

    def _vote(
        self, failure: Failure | None, failed: list[int] | None, names: Sequence[str]
    ) -> float | None:
        """Raise the same error on every rank when any rank failed.

        ``failed`` holds the failing ranks when the last scatter carried every rank's
        status; otherwise one small gather decides, and how long the first rank in had
        waited in it (:func:`~canzona.runtime.checks.timed_vote`) is returned.
        """
        mine = None if failure is None else failure.describe(names)
        waited = None
        if self.process_group is None:
            reports = [] if mine is None else [(self.rank, mine)]
        elif failed is None:
            reports, waited = timed_vote(mine, watchdog=self.watchdog)
        else:
            reports = reports_of(failed, mine, watchdog=self.watchdog)
        if reports:
            text = "; ".join(f"rank {r}: {line}" for r, line in reports)
            raise UpdateFailedError(
                f"the step failed on ranks {[r for r, _ in reports]} ({text}); "
                "nothing was updated on any rank"
            ) from (failure.error if failure is not None else None)
        return waited


class _Run:
    """One step of a :class:`Pipeline`: its buffers in flight, results and first failure."""

    def __init__(
        self,
        pipeline: Pipeline,
        table: StepTable,
        compute: ComputeFn,
        failure: Failure | None,
    ) -> None:
        self.p = pipeline
        self.table = table
        self.compute = compute
        self.failure = failure
        self.stats = StepStats(rank=pipeline.rank)
        self.received: list[tuple[torch.Tensor, Delivery | Assembled]] = []
        self.failed_ranks: list[int] | None = None  # from the last scatter's status
        self.wires: list[Wire] = []  # all-to-alls issued and not yet waited for
        self.riding = False  # the header rides the first gather
        self.hold = False  # ... and says this rank is not ready: compute nothing

    def fail(self, where: str, exc: BaseException, params: Sequence[int] = ()) -> None:
        if self.failure is None:
            self.failure = Failure(where, exc, tuple(params))

    def buffer(self, make: Callable[[], _T], what: str, of: str = "") -> _T:
        """``make()``: a buffer this rank needs to enter a collective.

        ``what`` and ``of`` are the failure's text, joined only on a failure (a healthy step
        formats nothing). When ``make()`` raises (out of memory) the step has failed here,
        but the rank must still enter the collective, so that every rank raises the
        failure: it waits for its all-to-alls in flight, frees the step's buffers and what it
        has received (nothing will be applied) and makes the buffer again. Only a second
        failure is raised, on this rank alone: the ranks waiting for it learn it from what it
        files on leaving the step (:meth:`~canzona.runtime.watchdog.Watchdog.left`).
        """
        try:
            return make()
        except Exception as exc:
            self.fail(f"{what} {of}" if of else what, exc)
        for wire in self.wires:  # their send buffers may be the step buffers
            self.p.watchdog.wait(wire.work, wire.label)
        self.received.clear()
        self.p.schedule.free()
        return make()

    # ------------------------------------------------------------------ compute
    def _compute(self, batch: OwnerBatch, full: torch.Tensor | None, where: str) -> torch.Tensor:
        """The batch's directions; after a failure, zeros of the scatter's dtype."""
        if self.failure is None and not self.hold and full is not None:
            try:
                cb = ComputeBatch(batch.items, batch.key, self.table.hparams[batch.key])
                observe = self.p.observe
                mark = observe.start() if observe is not None else None
                start, cpu = time.perf_counter(), time.thread_time()
                out = self.compute(cb, full)
                self.stats.compute_s += time.perf_counter() - start
                self.stats.compute_cpu_s += time.thread_time() - cpu
                if observe is not None:
                    observe.stop(mark, batch.key, batch.m, batch.n, full.shape[0])
                out = row_major(out)
                self.stats.matrices_computed += len(batch.items)
                self.stats.batches += 1
                return out
            except Exception as exc:  # every rank must still enter the collectives
                self.fail(where, exc, [it.param for it in batch.items])
        shape = (len(batch.items), batch.m, batch.n)
        dtype = self.table.row(batch.items[0].param).direction_dtype
        return self.buffer(partial(torch.zeros, shape, dtype=dtype, device=self.p.device), where)

    def local_batches(self) -> list[tuple[torch.Tensor, Delivery]]:
        """Matrices this rank holds whole: stack, compute, keep."""
        outs = []
        for batch in self.p.schedule.local:
            full = None
            try:
                if self.failure is None and not self.hold:
                    full = torch.stack(batch.inputs)
            except Exception as exc:
                self.fail("stacking local matrices", exc, [it.param for it in batch.items])
            outs.append(self._compute(batch, full, "computing a local matrix"))
        return [(piece_of(outs, piece), d) for piece, d in self.p.schedule.local_kept]

    # ------------------------------------------------------------------ groups
    def micro_groups(self) -> None:
        """Gather -> compute -> scatter over the micro-groups, ``depth`` groups in flight.

        Exchanges issued at the same point travel in one all-to-all when their micro-groups
        are small (:attr:`PipelineConfig.fuse_bytes`): the step's first gathers, and a
        group's scatter with the gather issued right after it. The decision depends only on
        the agreed plan and configuration, so every rank issues the same collectives.
        """
        groups = self.p.schedule.micro_groups
        count = len(groups)
        self.stats.micro_groups = count
        lookahead = self.p.config.depth if self.p.config.overlap else 0
        limit = self.p.config.fuse_bytes
        small = [0 < g.nbytes <= limit for g in groups]
        gathers: dict[int, Pending] = {}
        first = range(min(lookahead + 1, count))
        issued = 0
        if len(first) > 1 and all(small[j] for j in first):
            parts = self._fused([self._gather_exchange(groups[j]) for j in first])
            gathers.update(zip(first, parts, strict=True))
            issued = len(first)
        in_flight: list[tuple[Pending, GroupSchedule]] = []
        for k, g in enumerate(groups):
            while issued <= min(k + lookahead, count - 1):
                gathers[issued] = self._single(self._gather_exchange(groups[issued]))
                issued += 1
            pending = gathers.pop(k)
            self._wait(pending)
            if k == 0 and self.riding:
                self._read_header(g, pending.out, gathers.values())
            outs = self._compute_group(g, pending.out)
            del pending
            if self.p.schedule.replicated:  # every rank keeps its own fragment: no scatter
                if self.failure is None:
                    try:
                        self.received += kept_copies(outs, g.kept)
                    except Exception as exc:  # the vote after the groups reports it
                        self.fail(f"keeping the directions of micro-group {g.index}", exc)
                continue
            later = k + 1 + lookahead
            scatter = self._scatter_exchange(g, outs)
            if later == issued < count and small[k] and small[later] and not g.status:
                sent, gathers[later] = self._fused([scatter, self._gather_exchange(groups[later])])
                issued += 1
            else:
                sent = self._single(scatter)
            in_flight.append((sent, g))
            while len(in_flight) > lookahead:
                self._receive(*in_flight.pop(0))
        while in_flight:
            self._receive(*in_flight.pop(0))

    def _read_header(self, g: GroupSchedule, recv: torch.Tensor, issued: Iterable[Pending]) -> None:
        """Go on only if every rank's header in the first gather agrees (one host read)."""
        assert g.header_index is not None
        words = recv.index_select(0, g.header_index).view(torch.int64)
        if ride_agrees(words.view(self.p.world, -1).tolist()):
            self.stats.header_rode = True
            return
        for pending in list(issued):  # the buffers must outlive every collective issued
            self._wait(pending)
        raise StepDeclined("the header that rode the first gather declined the step")

    def _single(self, ex: Exchange) -> Pending:
        """Issue one exchange as its own all-to-all."""
        label = labels([ex])
        where = "allocating the receive buffer of"
        out = self.buffer(
            partial(receive_buffer, sum(ex.out_splits), ex.inp.dtype, self.p.device), where, label
        )
        inp = ex.inp
        if ex.what == "gather" and not self.p.schedule.held:  # a view of freed buffers?
            inp = self.buffer(partial(torch.zeros_like, inp), where, label)  # (a header: declined)
        elif ex.status and self.failure is not None:  # its flags may say "not failed"
            inp = self.buffer(partial(torch.ones_like, inp), where, label)  # every one: failed
        wire = self._issue(out, inp, ex.out_splits, ex.in_splits, ex.phase, label)
        self._count(ex)
        part = Pending(wire, out, ex.what, ex.micro_group)
        wire.parts.append(part)
        return part

    def _fused(self, exchanges: Sequence[Exchange]) -> list[Pending]:
        """Issue several exchanges as one all-to-all (see :func:`fused_send`)."""
        label = labels(exchanges)
        try:
            inp, in_splits, out_splits, layout = fused_send(exchanges, self.p.world)
        except Exception as exc:  # every rank must still enter the collective
            self.fail("packing " + label, exc)
            zeros = partial(fused_send, exchanges, self.p.world, zeros=True)
            inp, in_splits, out_splits, layout = self.buffer(zeros, "packing " + label)
        out = self.buffer(
            partial(receive_buffer, sum(out_splits), inp.dtype, self.p.device),
            "allocating the receive buffer of",
            label,
        )
        wire = self._issue(out, inp, out_splits, in_splits, exchanges[0].phase, label)
        wire.layout = layout
        for ex in exchanges:
            self._count(ex)
            empty = torch.empty(0, dtype=ex.inp.dtype)  # its dtype, until the wait fills it
            wire.parts.append(Pending(wire, empty, ex.what, ex.micro_group))
        return list(wire.parts)

    def _issue(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        phase: int,
        label: str,
    ) -> Wire:
        self.p.watchdog.mark(phase, label)
        work = all_to_all(out, inp, out_splits, in_splits, self.p.process_group)
        wire = Wire(work, out, inp, label)
        self.wires.append(wire)
        self.stats.collectives += 1
        return wire

    def _count(self, ex: Exchange) -> None:
        """Add an exchange's payload bytes (status flags are not payload) to the stats."""
        size = ex.inp.element_size()
        peers = (self.p.world - 1) * (int(ex.status) + ex.header)
        self.stats.bytes_sent += (sum(ex.in_splits) - ex.in_splits[self.p.rank] - peers) * size
        self.stats.bytes_received += (
            sum(ex.out_splits) - ex.out_splits[self.p.rank] - peers
        ) * size

    def _wait(self, pending: Pending) -> None:
        wire = pending.wire
        if wire.work is None:  # a fused all-to-all already waited for
            return
        start = time.perf_counter()
        self.p.watchdog.wait(wire.work, wire.label)
        wire.work = None  # drop the handle as soon as it completed
        self.wires.remove(wire)
        self.buffer(partial(release, wire), "copying out", wire.label)  # a fused one's copies
        self.stats.wait_s += time.perf_counter() - start

    def _gather_exchange(self, g: GroupSchedule) -> Exchange:
        try:
            if not self.p.schedule.held:  # its buffers are gone: send zeros (no header)
                raise RuntimeError("the step's buffers are not allocated")
            inp = pack(g.send, g.gather_dtype, self.p.device)
            if self.failure is not None:  # the payloads may be half written: zeros go
                inp = _zeros_but_header(inp, g)
        except Exception as exc:
            where = f"packing the gather of micro-group {g.index}"
            self.fail(where, exc)
            size = sum(g.gather_in)
            zeros = partial(torch.zeros, size, dtype=g.gather_dtype, device=self.p.device)
            inp = self.buffer(zeros, where)
        head = 0 if g.header is None else g.header.numel()
        return Exchange(
            inp, g.gather_out, g.gather_in, "gather", g.index, 10 + 2 * g.index, header=head
        )

    def _compute_group(self, g: GroupSchedule, recv: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        outs: list[torch.Tensor | None] = [None] * len(g.batches)
        for b in g.compute_order or range(len(g.batches)):
            batch = g.batches[b]
            full = None
            if self.failure is None:
                try:
                    full = assemble(batch, recv, self.p.device)
                except Exception as exc:
                    self.fail(f"assembling micro-group {g.index}", exc)
            outs[b] = self._compute(batch, full, f"computing micro-group {g.index}")
        self.stats.group_compute_s.append(time.perf_counter() - start)
        return outs  # type: ignore[return-value]

    def _scatter_exchange(self, g: GroupSchedule, outs: list[torch.Tensor]) -> Exchange:
        try:
            flag = None
            if g.status:  # every segment starts with "has the sender failed so far"
                flag = torch.full(
                    (1,),
                    float(self.failure is not None),
                    dtype=g.scatter_dtype,
                    device=self.p.device,
                )
            assert g.scatter_send is not None
            parts = scatter_parts(g.scatter_send, outs, flag)
            inp = concat(parts, g.scatter_dtype, self.p.device)
        except Exception as exc:
            where = f"packing the scatter of micro-group {g.index}"
            self.fail(where, exc)
            size = (sum(g.scatter_in),)  # every status element says "failed"
            ones = partial(torch.full, size, 1.0, dtype=g.scatter_dtype, device=self.p.device)
            inp = self.buffer(ones, where)
        phase = 11 + 2 * g.index
        return Exchange(inp, g.scatter_out, g.scatter_in, "scatter", g.index, phase, g.status)

    def _receive(self, pending: Pending, g: GroupSchedule) -> None:
        self._wait(pending)
        out = pending.out
        if g.status_index is not None:  # one host read per step: which ranks failed
            flags = out.index_select(0, g.status_index).tolist()
            self.failed_ranks = [r for r, f in enumerate(flags) if f != 0]
        if self.failure is not None:
            return  # nothing will be applied: keep no memory for it
        if g.assembled is not None:
            self.received.append((out.index_select(0, g.assembled.index), g.assembled))
            self.stats.assembled += len(g.assembled.params)
        for d in g.deliveries:
            numel = d.count * d.shape[0] * d.shape[1]
            self.received.append((out.narrow(0, d.offset, numel).view(d.count, *d.shape), d))


def _zeros_but_header(inp: torch.Tensor, g: GroupSchedule) -> torch.Tensor:
    """A gather's send with zeros in place of every payload; each segment's header kept."""
    out = torch.zeros_like(inp)
    head = 0 if g.header is None else g.header.numel()
    if head:
        start = 0
        for size in g.gather_in:
            end = start + min(head, size)
            out[start:end] = inp[start:end]
            start += size
    return out
