"""Run a job on forked CPU ranks joined in a gloo process group: the demo's, benchmarks', tests'.

Forking from a process that already imported torch starts a rank in well under a second
(spawning one costs several seconds of imports each). Two conditions keep forked ranks
healthy: the parent runs one OpenMP thread (``OMP_NUM_THREADS=1`` before torch is imported;
a child forked after a multi-threaded OpenMP pool has run can hang in its first parallel
kernel), and the parent holds no process group when it forks. :func:`prepare_parent` checks
the second and warms torch's lazy imports up once per process on a ``fake`` process group,
so the ranks inherit them and a fresh rank's first DTensor op, backward pass and FSDP2 step
do not pay those imports (the ops themselves are left to the ranks: see :func:`_warm_up`).

    results = run_ranks(4, job)  # job(progress) on every rank; results in rank order
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["RankFailure", "limit_threads", "prepare_parent", "run_ranks"]

Job = Callable[[Callable[[dict[str, Any]], None]], Any]
"""A rank's work: called with a progress callback, returns a picklable result."""

PG_TIMEOUT = timedelta(seconds=120)
#: Seconds the other ranks get to report their own failure once one rank failed.
FAILURE_GRACE_S = 2.0
#: Seconds between looks at the ranks' exit codes while none reports.
_POLL_S = 0.5

_warmed_up_pid: int | None = None


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish in time; the message names each and why."""


def limit_threads() -> None:
    """One intra-op thread per process; call it before torch is imported.

    The environment reaches OpenMP only if torch has not loaded yet; a parent that imported
    torch earlier should have set ``OMP_NUM_THREADS=1`` itself (the test suite does).
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def prepare_parent() -> None:
    """Make this process safe to fork ranks from; warm torch up in it once.

    Raises:
        RuntimeError: If this process holds a default process group.
    """
    global _warmed_up_pid
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("ranks are forked from a process without a default process group")
    torch.set_num_threads(1)
    if os.getpid() != _warmed_up_pid:
        _warm_up()
        _warmed_up_pid = os.getpid()


def _warm_up() -> None:
    """What the ranks import and a mesh on a ``fake`` process group, destroyed afterwards.

    No DTensor op runs here: with torch's CUDA builds (2.13 to 2.15, on a machine without a
    GPU too) a process that dispatched one and then ran a backward pass has set up
    autograd's device threads, and a rank forked from it raises "Unable to handle autograd's
    threading in combination with fork-based multiprocessing" at its first ``backward()``.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp  # what the ranks import for fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    finally:
        dist.destroy_process_group()


def _rank_main(
    rank: int, world: int, store_path: str, conn: Connection, job: Job
) -> None:  # pragma: no cover - runs in the forked rank
    """Join the process group, run ``job``, send ``("done", result)`` or ``("error", text)``."""
    with contextlib.suppress(OSError, AttributeError):  # die with the parent (Linux)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, store=store, timeout=PG_TIMEOUT
        )
        # every rank connected before any runs the job: a rank whose job raises at once
        # would otherwise exit while a peer still connects, and the peer would report
        # gloo's "Connection closed by peer" as a failure of its own
        dist.barrier()

        def progress(payload: dict[str, Any]) -> None:
            conn.send_bytes(pickle.dumps(("progress", payload)))

        result = job(progress)
        dist.barrier()
        dist.destroy_process_group()
        conn.send_bytes(pickle.dumps(("done", result)))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send_bytes(pickle.dumps(("error", _with_hint(traceback.format_exc()))))
        os._exit(1)
    os._exit(0)


#: What torch raises at a forked rank's first ``backward()`` when the parent had run a
#: backward pass after a DTensor op (torch's CUDA builds, 2.13 to 2.15, with or without a GPU).
_AUTOGRAD_FORK = "Unable to handle autograd's threading in combination with fork-based"

_FORK_HINT = (
    "canzona.launch: this rank was forked from a process that had run a backward pass "
    "after a DTensor op (or an FSDP2 forward), and torch cannot run backward() in a rank "
    "forked from such a process. Train in the ranks only, or fork them from a fresh process."
)


def _with_hint(report: str) -> str:
    """A failing rank's traceback, with what to do where the cause lies in the parent."""
    return f"{report.rstrip()}\n{_FORK_HINT}" if _AUTOGRAD_FORK in report else report


def _loopback() -> None:
    """Keep gloo on the loopback interface (Linux names it ``lo``)."""
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def run_ranks(
    world: int,
    job: Job,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    *,
    timeout_s: float | None = None,
) -> list[Any]:
    """Run ``job`` on ``world`` forked ranks; their results in rank order.

    Args:
        world: Number of ranks.
        job: What each rank runs, with a progress callback (it inherits everything by fork:
            no pickling of ``job``; ``torch.distributed.get_rank()`` tells a rank apart).
        on_progress: Called in this process with each progress payload a rank sends.
        timeout_s: Deadline for the whole job (None: none; a rank stuck in a collective
            still fails after the process group's timeout).

    Raises:
        RankFailure: If a rank raised, died, or the deadline passed, with every failing
            rank's account (the others get ``FAILURE_GRACE_S`` to report); every rank is
            stopped first. A rank that dies while a process it forked still runs (which
            holds the rank's pipe open) is seen by its exit code.
        ValueError: If ``world`` is not a positive int.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    prepare_parent()
    _loopback()
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="canzona-ranks-") as tmp:
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        try:
            for rank in range(world):
                parent_end, child_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(rank, world, os.path.join(tmp, "store"), child_end, job),
                    name=f"canzona-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                procs.append(proc)
                conns.append(parent_end)
            deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
            return _collect(procs, conns, on_progress or (lambda _: None), deadline)
        finally:
            for started in procs:
                if started.is_alive() and started.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(started.pid, signal.SIGKILL)
                started.join(timeout=5.0)
            for conn in conns:
                conn.close()


def _collect(
    procs: list[BaseProcess],
    conns: list[Connection],
    on_progress: Callable[[dict[str, Any]], None],
    deadline: float,
) -> list[Any]:
    results: dict[int, Any] = {}
    failed: dict[int, str] = {}
    pending = set(range(len(procs)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[Any] = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        # woken now and then too: a rank whose forked child holds its pipe and sentinel open
        # shows its death only through its exit code
        wait(waitables, timeout=min(remaining, _POLL_S))
        for rank in sorted(pending):
            if not conns[rank].poll():  # nothing to read: ended (exit code) or still running
                if procs[rank].exitcode is None:
                    continue
                if not conns[rank].poll():  # (what it sent just before it ended is read)
                    failed[rank] = f"died (exit code {procs[rank].exitcode}) without a result"
                    pending.discard(rank)
                    continue
            try:
                kind, body = pickle.loads(conns[rank].recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(timeout=1.0)
                failed[rank] = f"died (exit code {procs[rank].exitcode}) without a result"
                pending.discard(rank)
                continue
            if kind == "progress":
                on_progress(body)
            elif kind == "done":
                results[rank] = body
                pending.discard(rank)
            else:
                failed[rank] = body.rstrip()
                pending.discard(rank)
        if failed:  # the others are probably blocked in a collective
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    if failed or pending:
        lines = [f"rank {r} failed:\n{t}" for r, t in sorted(failed.items())]
        why = "stopped after another rank failed" if failed else "did not finish in time"
        lines += [f"rank {r} {why}" for r in sorted(pending)]
        raise RankFailure("\n".join(lines))
    return [results[r] for r in range(len(procs))]
