"""Pipeline configuration and the runtime's error types."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


class PlanMismatchError(RuntimeError):
    """Ranks disagree on the parameters, their layouts, the plan or the hyper-parameters."""


class GradientMismatchError(RuntimeError):
    """A parameter has a gradient on some ranks and not on others."""


class UpdateFailedError(RuntimeError):
    """Computing some matrix's update raised on some rank; every rank raises this."""


class PartialUpdateError(RuntimeError):
    """The apply raised on this rank after every rank had decided to apply the step.

    The other ranks applied it; this rank's parameters are updated in part. Every later
    step raises :class:`UpdateFailedError` on every rank, naming this rank, until a
    checkpoint is loaded (``load_state_dict`` on every rank, with the model's weights).
    """


def partial_update(rank: int, what: str, exc: BaseException) -> PartialUpdateError:
    """The error of an apply that raised after every rank decided to apply the step."""
    return PartialUpdateError(
        f"rank {rank}: applying {what} raised {type(exc).__name__}: {exc}, after every rank "
        "had decided to apply the step: the other ranks applied it and this rank's "
        "parameters are updated in part; every later step raises on every rank until a "
        "checkpoint is loaded (load_state_dict on every rank, with the model's weights)"
    )


class CollectiveTimeoutError(RuntimeError):
    """A collective owned by the optimizer did not complete.

    Its deadline passed, a peer rank closed its connection, or the process group failed it
    first; the message says which.
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """How the gather -> compute -> scatter pipeline runs.

    Attributes:
        overlap: Keep the next micro-group's gather and the previous one's scatter in
            flight while a micro-group computes. Results are bit-identical either way.
        depth: With ``overlap``, how many micro-groups ahead gathers are issued and how
            many scatters stay in flight before being applied (1: the next group's gather
            and the previous group's scatter). More depth lets ranks drift further apart
            within a step (absorbing per-group imbalance) at the cost of that many more
            groups' buffers in memory.
        timeout_s: Deadline of every wait on a collective the optimizer issues during
            a step or a state-dict conversion; a wait that exceeds it raises
            :class:`CollectiveTimeoutError` naming the collective and the ranks left
            behind (the first step's layout agreement included).
        check_every_step: Run the small per-step cross-rank check (parameter set,
            plan digest, hyper-parameters, gradient presence) before any owner computes.
            In a steady step (with ``atomic``) it rides the first micro-group's gather
            and costs no collective; otherwise it is one small collective of its own.
            Disabling it saves that collective in the steps that are not steady but
            turns mismatches into hangs, aborts (gloo ends a process whose collective
            sizes differ from its peers', e.g. a gradient missing on one rank only) or
            wrong results (with ``skip_nonfinite`` the
            header gather still runs, since it carries the non-finite flag). The first
            step after a (re-)plan runs the check either way, so ranks built with
            different settings raise instead of pairing different collectives.
        process_group: Process group the optimizer's collectives run on (default: the
            default group). Every rank of it must hold the same parameter list.
        progress_markers: Record, before each collective, which one this rank is about
            to enter, and publish it in the default store when a wait lasts longer than a
            short grace (1 s; healthy steps never touch the store), so that a timeout can
            name the ranks that never arrived.
        skip_nonfinite: Skip the whole step on every rank when any rank's gradient holds
            NaN or Inf (counted in ``optimizer.skipped_steps``), as a gradient scaler
            does. Off by default: non-finite values then propagate exactly as on one
            device. Costs one device-to-host read per step.
        atomic: A step that fails on any rank changes nothing on any rank. Parameters are
            written only after every rank has voted success, in every mode; with
            ``atomic`` the optimizer state that changes before the vote (momentum, Adam
            moments, owner-held state) is copied first and restored on failure, which
            costs one copy of that state per step in time and in memory (during the step,
            and between steps where ``keep_buffers`` keeps the copies). Without it a failed
            step leaves that state advanced.
        keep_buffers: Keep the step's flat buffers (the payloads and, with ``atomic``, the
            copies of the state) allocated between steps instead of freeing them after
            each step. ``None`` (default) decides by device: kept on the CPU, where a freed
            large block goes back to the operating system and the next step faults every
            page in again (docs/design.md gives the measured cost), freed on accelerators,
            whose caching allocator lends the memory to forward and backward and hands it
            back at no cost. Kept buffers hold their bytes between steps (those of the last step's
            schedule only: a step with another set of parameters with gradients frees
            the others); results are bit-identical either way.
        fuse_bytes: Exchanges that the pipeline issues at the same point travel in one
            all-to-all when each of their micro-groups moves at most this many payload
            bytes per rank (its whole matrices' bytes over the number of ranks; all of them
            under the ``replicated`` strategy, where every rank receives them): the step's
            first gathers (with ``overlap``), and a micro-group's scatter with the gather
            issued right after it. A fusion saves one collective's fixed cost (issuing and
            waiting for it) and pays for copying both exchanges into one buffer and out of
            another; on gloo the saving wins below a few tens of KiB per rank (measured in
            docs/benchmarks.md, *Fused exchanges*), hence the default of 32 KiB: steps
            made of many tiny micro-groups. ``0`` turns it off. Results are bit-identical
            either way.
        calibration_cache: A directory where the calibration of measured costs keeps its
            agreed timings for later jobs (one JSON file per device and torch build, keyed
            by the optimizer's settings and each shape; rank 0 of the process group writes
            it). A job whose ranks all find every shape there times nothing. ``None``
            (default): timings are kept in this process only.
        pause_gc: Hold Python's cyclic garbage collector off while ``step()`` runs (after
            the closure) and turn it back on afterwards, when it was on. A step over many
            matrices creates and drops thousands of short-lived tensor objects in bursts;
            with the collector on, those bursts set off collections inside the step, now
            and then a full one that walks every object of the process (docs/design.md
            gives the measured cost). Objects are still freed by reference counting when
            the step drops them; only reference cycles wait for the next collection.
            Results are bit-identical either way.
        reprice_steps: A plan balanced in measured seconds (``PlanConfig(cost="measured")``)
            is re-priced by its own steps, in two rounds: after the first step, this many
            steps record the seconds of every owner call (by param group, shape and batch
            size), the ranks agree on the median of each call in one all-gather, the table
            takes those prices (a line through a shape's batch sizes where it ran at
            several), and the next step re-plans on it; then the new plan's steps do the
            same once more, its calls added to the first round's (the re-plan stacks some
            shapes in batch sizes the first plan never ran). A calibration times each
            shape in isolation; in a step the same call runs after the others of its
            micro-group, with other data in cache, and a single matrix in its own kernels:
            measured here, calls priced 5-25% off (docs/design.md). ``0`` keeps the
            calibrated table. Owners change, never the math: results are bit-identical
            either way.
    """

    overlap: bool = True
    depth: int = 1
    timeout_s: float = 600.0
    check_every_step: bool = True
    process_group: dist.ProcessGroup | None = None
    progress_markers: bool = True
    skip_nonfinite: bool = False
    atomic: bool = True
    keep_buffers: bool | None = None
    fuse_bytes: int = 32 << 10
    calibration_cache: str | os.PathLike[str] | None = None
    pause_gc: bool = True
    reprice_steps: int = 3

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {self.depth!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
        if not isinstance(self.atomic, bool):
            raise ValueError(f"atomic must be a bool, got {self.atomic!r}")
        if not isinstance(self.pause_gc, bool):
            raise ValueError(f"pause_gc must be a bool, got {self.pause_gc!r}")
        if self.keep_buffers is not None and not isinstance(self.keep_buffers, bool):
            raise ValueError(f"keep_buffers must be a bool or None, got {self.keep_buffers!r}")
        fuse = self.fuse_bytes
        if isinstance(fuse, bool) or not isinstance(fuse, int) or fuse < 0:
            raise ValueError(f"fuse_bytes must be an int >= 0, got {fuse!r}")
        reprice = self.reprice_steps
        if isinstance(reprice, bool) or not isinstance(reprice, int) or reprice < 0:
            raise ValueError(f"reprice_steps must be an int >= 0, got {reprice!r}")
        cache = self.calibration_cache
        if cache is not None and (
            not isinstance(cache, str | os.PathLike) or not str(cache) or "\0" in str(cache)
        ):
            raise ValueError(f"calibration_cache must be a directory path or None, got {cache!r}")
        group = self.process_group
        if group is not None and not isinstance(group, getattr(dist, "ProcessGroup", ())):
            raise ValueError(f"process_group must be a ProcessGroup or None, got {group!r}")

    @property
    def collective_settings(self) -> tuple[bool, int, int, int, bool, bool, bool]:
        """The settings that decide which collectives a step makes, so ranks must agree.

        ``(overlap, depth, fuse_bytes, reprice_steps, atomic, check_every_step,
        skip_nonfinite)``: they enter the structure digest that every rank compares before
        the first collective (``atomic``, ``check_every_step`` and ``skip_nonfinite``
        decide whether a step's header rides its first gather, travels on its own or
        stays home).
        """
        return (
            self.overlap,
            self.depth,
            self.fuse_bytes,
            self.reprice_steps,
            self.atomic,
            self.check_every_step,
            self.skip_nonfinite,
        )

    def keeps_buffers(self, device_type: str) -> bool:
        """Whether step buffers on a ``device_type`` device stay allocated between steps."""
        return device_type == "cpu" if self.keep_buffers is None else self.keep_buffers
