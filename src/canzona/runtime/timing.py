"""Timing the owner math: each shape's calls warmed up once, then timed in interleaved rounds."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median

import torch

from canzona.runtime.table import ComputeBatch, ComputeFn

#: Timed calls per shape and phase (their median counts).
REPEATS = 5
#: Timed calls of a long computation (see :data:`SHORT_CALL_S`): its noise is relatively
#: small, and the budget they leave times more shapes instead of fitting them.
LONG_REPEATS = 3
#: Calls shorter than this are timed with cold caches (for longer ones a cache refill is a
#: negligible part of the time) and five times instead of three.
SHORT_CALL_S = 0.02
#: Bytes a CPU calibration touches before each short timed call (more than the caches hold).
EVICT_BYTES = 32 << 20
#: A shape's timed calls stop once they have taken this many seconds.
SHAPE_CAP_S = 0.25

#: Bytes of the block :func:`settle_heap` allocates and frees: just below the 32 MiB ceiling
#: of glibc's dynamic mmap threshold (a block above it would not raise the threshold).
SETTLE_BYTES = 31 << 20

_EVICT: torch.Tensor | None = None


def clock() -> Callable[[], float]:
    """The calibration's clock.

    This thread's CPU time with one intra-op thread (robust to other processes sharing the
    cores); wall time when torch's kernels run on several threads.
    """
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def evict_caches() -> None:
    """Touch :data:`EVICT_BYTES` so that a timed call starts with cold caches, as in a step.

    Between two owner calls of a step run gathers, scatters and element-wise phases; a call
    repeated back to back finds its operands in cache and runs ~10-20% faster on this CPU.
    """
    global _EVICT
    if _EVICT is None:
        _EVICT = torch.zeros(EVICT_BYTES // 4, dtype=torch.float32)
    _EVICT.add_(1.0)


def settle_heap() -> None:
    """Free one large block first, so that the timed calls reuse memory as a step's calls do.

    glibc's malloc maps blocks above a threshold afresh and hands the top of its heap back
    to the system whenever more than twice that threshold lies free there; freeing a mapped
    block raises the threshold to that block's size (up to 32 MiB). In a running job the
    step's all-to-all buffers have raised it; a calibration at the first step comes before
    them, and the products of its timed calls came from fresh pages: measured on the
    Qwen3-like model's largest shapes, 500 to 3,800 page faults per timed call, which the
    steps did not have, up to 20% of the call's time in this virtual machine. Nothing is
    written to the block; with another allocator it is an allocation and a free.
    """
    torch.empty(SETTLE_BYTES, dtype=torch.uint8)


def repeats(call_s: float) -> int:
    """Timed calls of a computation whose one call takes ``call_s``."""
    return REPEATS if call_s < SHORT_CALL_S else LONG_REPEATS


@dataclass(slots=True)
class Call:
    """One phase of one shape's owner math, ready to run again and again."""

    run: ComputeFn
    batch: ComputeBatch
    full: torch.Tensor
    #: Matrices in the call (its seconds are divided by it).
    k: int
    #: Seconds of the call timed right after the warm-up (what decides short or long, and
    #: prices the shape until the rounds have timed it).
    first: float = 0.0
    times: list[float] = field(default_factory=list)
    #: The math raised in a timed call (the shape is then predicted, not timed).
    failed: bool = False

    def once(self) -> float:
        """Seconds of one call (CUDA events on a GPU, :func:`clock` elsewhere)."""
        if self.full.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            self.run(self.batch, self.full)
            stop.record()
            stop.synchronize()
            return float(start.elapsed_time(stop)) / 1e3
        tick = clock()
        t0 = tick()
        self.run(self.batch, self.full)
        return tick() - t0

    @property
    def short(self) -> bool:
        """Whether the call is short (:data:`SHORT_CALL_S`): cold caches, more repeats."""
        return self.first < SHORT_CALL_S

    def wanted(self) -> int:
        """Timed calls still to take (none once they have taken :data:`SHAPE_CAP_S`)."""
        if self.failed or (self.times and sum(self.times) > SHAPE_CAP_S):
            return 0
        return repeats(self.first) - 1 - len(self.times)

    def seconds(self) -> float:
        """The median of the timed calls, the one right after the warm-up included."""
        return median([self.first, *self.times])


def warm_up(calls: Sequence[Call]) -> float:
    """Run each call once (and prime owner-side state), then time it once; their seconds.

    The warm-up call of a new shape pays one-off costs (fresh pages, kernel selection):
    the call timed right after it prices the shape for the calibration's budget.
    """
    total = 0.0
    for call in calls:
        call.run(call.batch, call.full)
        if call.full.device.type == "cuda":
            torch.cuda.synchronize(call.full.device)
        call.first = call.once()
        total += call.first
    return total


def time_rounds(calls: Sequence[Call]) -> None:
    """Time every call its :func:`repeats` but one, round by round over the calls.

    In a step each batch's call follows other shapes' calls, never itself; a call repeated
    back to back runs 3-15% faster on the Xeon with AMX (its kernels' state is warm), so a
    call is timed between the others, as the pipeline runs it. Each round runs the calls
    lightest first (by the seconds of their first timing), as the pipeline computes a
    micro-group's batches (``light_first``): a call right after a heavier one runs slower
    on that CPU (a 1152 x 384 bf16 Newton-Schulz 20-60% after a 2304 x 768 one, still
    20 ms later), and rounds in the order the shapes were started (the most owner work
    first) priced the Qwen3-like heterogeneous model's smaller shapes 10-25% below the
    steps' calls. A short call starts with cold caches (:func:`evict_caches`; not on a GPU).
    """
    while True:
        due = sorted((c for c in calls if c.wanted() > 0), key=lambda c: c.first)
        if not due:
            return
        for call in due:
            if call.short and call.full.device.type != "cuda":
                evict_caches()
            try:
                call.times.append(call.once())
            except Exception:  # as in a warm-up: predicted instead; ranks stay in step
                call.failed = True
