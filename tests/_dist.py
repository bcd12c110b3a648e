"""Tests' ranks: a persistent pool of forked gloo processes, warmed up by ``canzona.launch``.

A :class:`DistPool` forks ``world_size`` workers from the pytest process once; each joins a real
gloo default process group and then serves scenarios until the pool is closed. A scenario is a
module-level function of a test module; ``pool.run(fn, *args)`` calls it on every rank and returns
the results in rank order::

    import torch
    import torch.distributed as dist

    def _sum_of_ranks() -> float:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce(dist):  # the session fixture from conftest.py shadows the module here
        assert dist(4).run(_sum_of_ranks) == [6.0] * 4

Rules for scenarios:

* ``fn`` travels by reference and its arguments by value (pickle), so ``fn`` must be a
  module-level function (no lambda, no closure). ``timeout`` is a keyword of :meth:`DistPool.run`
  and never reaches ``fn``.
* Return plain values or plain tensors: tensors come back detached, on CPU and compact. A DTensor
  cannot leave its rank: return ``.full_tensor()`` or ``.to_local()``.
* Every rank starts each scenario from ``torch.manual_seed(0)`` (and ``random``/numpy seeds 0),
  grad mode on, float32 default dtype and one intra-op thread, whatever ran before.
* Build meshes with :func:`mesh`: one cached ``DeviceMesh`` per shape and names per worker, since
  creating sub-groups again and again leaks gloo connections. Like any collective, all ranks must
  call it alike.
* What a rank prints comes back as ``[rank r] ...`` lines on the test's stdout; its warnings are
  issued again in the pytest process.

Failures: a rank that raises or dies gives :class:`RankError` with every failing rank's traceback;
ranks that do not answer by the deadline give :class:`RankTimeout` with their Python stacks (and a
rank still busy ``straggler_grace`` seconds after another one failed is reported the same way,
inside the ``RankError``). After any failure the workers are killed and the next run forks new
ones: a rank that raised may have left its peers mid-collective, and forking again costs well
under a second, so a pool is never reused after a failure.

The pytest process must never hold a process group when a pool starts, and must run one OpenMP
thread (``conftest.py`` sets ``OMP_NUM_THREADS=1`` before torch is imported): a child forked from
a process whose OpenMP pool has run hangs in its first parallel kernel.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import _dist_worker
from _dist_worker import _PARENT_ENDS, OUTPUT_LIMIT, _worker_main
from canzona.launch import prepare_parent

__all__ = ["DistPool", "PoolFailure", "RankError", "RankTimeout", "mesh"]

MAX_WORLD_SIZE = 8
STARTUP_TIMEOUT = 60.0  # seconds for the ranks of a new pool to join their process group
STACK_WAIT = 2.0  # seconds to wait for a stuck rank to write its stack

_CTX = mp.get_context("fork")
_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...] | None], DeviceMesh] = {}
_meshes_pid: int | None = None
_warmed_up_pid: int | None = None
warm_up_seconds: float | None = None  # what preparing the pytest process cost, once


class PoolFailure(Exception):
    """A scenario failed on a pool's ranks; the message has every rank's account."""

    def __init__(
        self,
        message: str,
        *,
        scenario: str,
        succeeded: list[int],
        failed: dict[int, str],
        stuck: dict[int, str],
        exceptions: dict[int, BaseException],
    ) -> None:
        super().__init__(message)
        self.scenario = scenario
        self.succeeded = succeeded
        self.failed = failed  # rank -> traceback text, or how its process died
        self.stuck = stuck  # rank -> its Python stack when it was given up on
        self.exceptions = exceptions  # rank -> the exception raised there, when it pickles


class RankError(PoolFailure):
    """At least one rank raised, or its process died, while running a scenario."""


class RankTimeout(PoolFailure):
    """The deadline passed before every rank answered, and none of them had failed."""


def mesh(
    shape: int | tuple[int, ...] | None = None, names: tuple[str, ...] | None = None
) -> DeviceMesh:
    """The CPU device mesh of ``shape`` (default: all ranks in 1-D), created once per worker.

    Only for scenarios running on a :class:`DistPool`; every rank must call it alike.
    """
    global _meshes_pid
    if not dist.is_initialized():
        raise RuntimeError("mesh() is for scenario functions running on DistPool ranks")
    if os.getpid() != _meshes_pid:  # a new worker starts without meshes
        _MESHES.clear()
        _meshes_pid = os.getpid()
    if shape is None:
        shape = (dist.get_world_size(),)
    elif isinstance(shape, int):
        shape = (shape,)
    key = (tuple(shape), None if names is None else tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _MESHES[key]


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection
    log_path: Path
    stack_path: Path


@dataclass
class _Outcome:
    """What the ranks answered for one scenario."""

    values: dict[int, Any] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    exceptions: dict[int, BaseException] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)
    warnings: list[tuple[str, type[Warning], str, int]] = field(default_factory=list)
    unhealthy: bool = False  # a rank lost its process group


class DistPool:
    """``world_size`` forked ranks in one gloo process group, reused for many scenarios.

    Args:
        world_size: number of ranks, 1 to 8.
        default_timeout: seconds a scenario may run when :meth:`run` gets no ``timeout``.
        straggler_grace: once a rank has failed, seconds the others get to answer before they
            are taken to be blocked in a collective.
    """

    def __init__(
        self, world_size: int, *, default_timeout: float = 120.0, straggler_grace: float = 5.0
    ) -> None:
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size!r}")
        if default_timeout <= 0 or straggler_grace <= 0:
            raise ValueError(
                f"timeouts must be positive, got {default_timeout!r} and {straggler_grace!r}"
            )
        self.world_size = world_size
        self.default_timeout = default_timeout
        self.straggler_grace = straggler_grace
        self.runs = 0
        self.startup_seconds: list[float] = []  # one entry per fork of the ranks
        self._workers: list[_Worker] = []
        self._tmp: Path | None = None
        self._closed = False
        self._start()

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DistPool(world_size={self.world_size}, pids={self.pids})"

    @property
    def pids(self) -> list[int]:
        """The worker process ids in rank order; empty while the pool is down."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; the return values in rank order.

        Raises:
            RankError: a rank raised or died; the message has each failing rank's traceback.
            RankTimeout: ``timeout`` (default ``default_timeout``) seconds passed first.
        """
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        scenario = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        limit = self.default_timeout if timeout is None else timeout
        if limit <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"scenario {scenario} or its arguments cannot be pickled ({exc}); a scenario"
                " must be a module-level function of an importable module"
            ) from exc
        if not self._workers or not all(w.process.is_alive() for w in self._workers):
            self._shutdown()
            self._start()
        self.runs += 1
        pending = {w.rank: w for w in self._workers}
        outcome = _Outcome()
        try:
            for w in self._workers:
                w.conn.send_bytes(payload)
            stuck = self._collect(pending, outcome, time.monotonic() + limit)
        except BaseException:  # Ctrl-C or pytest-timeout: the ranks are mid-scenario
            for rank, text in sorted(self._dump_stacks(list(pending.values())).items()):
                sys.stderr.write(f"rank {rank} of {scenario}, when interrupted:\n{text}\n")
            self._shutdown()
            raise
        _forward_output(outcome, self._workers, stuck)
        _reissue_warnings(outcome.warnings)
        if outcome.failed or stuck or outcome.unhealthy:
            self._shutdown()  # started again by the next run
        if outcome.failed or stuck:
            raise _failure(scenario, self.world_size, outcome, stuck, limit, self.straggler_grace)
        return [outcome.values[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the workers; the pool runs nothing afterwards."""
        self._closed = True
        self._shutdown(graceful=True)

    def _start(self) -> None:
        _prepare_parent()
        began = time.perf_counter()
        self._tmp = Path(tempfile.mkdtemp(prefix=f"canzona-dist{self.world_size}-"))
        for rank in range(self.world_size):
            parent_end, child_end = _CTX.Pipe(duplex=True)
            _PARENT_ENDS.add(parent_end)
            log_path = self._tmp / f"rank{rank}.log"
            process = _CTX.Process(
                target=_worker_main,
                args=(rank, self.world_size, str(self._tmp / "store"), child_end, log_path),
                name=f"dist{self.world_size}-rank{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._workers.append(
                _Worker(rank, process, parent_end, log_path, log_path.with_suffix(".stack"))
            )
        outcome = _Outcome()
        stuck = self._collect({w.rank: w for w in self._workers}, outcome, began + STARTUP_TIMEOUT)
        if outcome.failed or stuck:
            _forward_output(outcome, self._workers, stuck)
            self._shutdown()
            raise _failure("<start-up>", self.world_size, outcome, stuck, STARTUP_TIMEOUT, None)
        self.startup_seconds.append(time.perf_counter() - began)

    def _shutdown(self, *, graceful: bool = False) -> None:
        if graceful:
            for w in self._workers:
                with contextlib.suppress(OSError):
                    w.conn.send_bytes(b"stop")
            for w in self._workers:
                w.process.join(timeout=2.0)
        for w in self._workers:
            if w.process.is_alive() and w.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, signal.SIGKILL)
            w.process.join(timeout=5.0)
            w.conn.close()
            _PARENT_ENDS.discard(w.conn)
        self._workers = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _collect(
        self, pending: dict[int, _Worker], outcome: _Outcome, deadline: float
    ) -> dict[int, str]:
        """Read answers until all ranks answered or the deadline passed; stacks of the rest."""
        while pending and (remaining := deadline - time.monotonic()) > 0:
            waitables: list[Any] = [w.conn for w in pending.values()]
            waitables += [w.process.sentinel for w in pending.values()]
            ready = set(wait(waitables, timeout=remaining))
            for rank, w in list(pending.items()):
                if w.conn in ready or w.process.sentinel in ready:
                    _receive(w, outcome)
                    del pending[rank]
                    if rank in outcome.failed:  # the others now get only a short grace
                        deadline = min(deadline, time.monotonic() + self.straggler_grace)
        return self._dump_stacks(list(pending.values()))

    def _dump_stacks(self, workers: list[_Worker]) -> dict[int, str]:
        """Each worker's Python stack, written by faulthandler on SIGUSR1."""
        for w in workers:
            with contextlib.suppress(OSError):
                w.stack_path.write_bytes(b"")
                if w.process.pid is not None and w.process.is_alive():
                    os.kill(w.process.pid, signal.SIGUSR1)
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + STACK_WAIT
        for w in workers:
            text = ""
            while time.monotonic() < deadline and not text.endswith("\n"):
                time.sleep(0.02)
                text = _read_text(w.stack_path)
            time.sleep(0.02)  # the last lines of a long stack
            text = _read_text(w.stack_path)
            stacks[w.rank] = _trim_stack(text) or "(the process wrote no stack)"
        return stacks


# -- the pytest process --------------------------------------------------------------------------


def _prepare_parent() -> None:
    """Check that the pytest process is safe to fork from; warm torch up in it once."""
    global _warmed_up_pid, warm_up_seconds
    if dist.is_initialized():
        raise RuntimeError(
            "the pytest process holds a default process group (a test did not call"
            " destroy_process_group()); DistPool forks its ranks from a process without one"
        )
    if os.getpid() != _warmed_up_pid:
        began = time.perf_counter()
        prepare_parent()  # the launcher's checks and warm-up, once per process
        warm_up_seconds = time.perf_counter() - began
        _warmed_up_pid = os.getpid()
    threads = _thread_count()
    if threads > 1:
        warnings.warn(
            f"forking DistPool ranks from a process with {threads} threads (an OpenMP pool?"
            " OMP_NUM_THREADS must be 1 before torch is imported); the ranks may hang",
            RuntimeWarning,
            stacklevel=4,
        )


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: nothing to check
        return 1


def _receive(w: _Worker, outcome: _Outcome) -> None:
    """Record one worker's answer, or how its process ended."""
    message = None
    with contextlib.suppress(EOFError, OSError):
        if w.conn.poll():
            message = pickle.loads(w.conn.recv_bytes())
    if message is None:  # nothing to read: the process ended
        w.process.join(timeout=1.0)
        code = w.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit {code}"
        outcome.failed[w.rank] = f"the process died ({how}) without answering"
        outcome.outputs[w.rank] = _read_text(w.log_path)[-OUTPUT_LIMIT:]
        return
    status, body, output, caught, healthy = message
    outcome.outputs[w.rank] = output
    outcome.unhealthy |= not healthy
    with contextlib.suppress(Exception):  # a warning category this process cannot import
        outcome.warnings.extend(pickle.loads(caught))
    if status == "ok":
        try:
            outcome.values[w.rank] = pickle.loads(body)
        except Exception:
            outcome.failed[w.rank] = "its result could not be unpickled:\n" + traceback.format_exc()
        return
    text, exc_bytes = body
    outcome.failed[w.rank] = text
    if exc_bytes is not None:
        with contextlib.suppress(Exception):
            outcome.exceptions[w.rank] = pickle.loads(exc_bytes)


def _forward_output(outcome: _Outcome, workers: list[_Worker], stuck: dict[int, str]) -> None:
    for w in workers:
        text = outcome.outputs.get(w.rank)
        if text is None and w.rank in stuck:
            text = _read_text(w.log_path)[-OUTPUT_LIMIT:]
        if text:
            sys.stdout.write("".join(f"[rank {w.rank}] {line}\n" for line in text.splitlines()))


def _reissue_warnings(caught: list[tuple[str, type[Warning], str, int]]) -> None:
    for message, category, filename, lineno in dict.fromkeys(caught):
        warnings.warn_explicit(message, category, filename, lineno)


def _failure(
    scenario: str,
    world_size: int,
    outcome: _Outcome,
    stuck: dict[int, str],
    limit: float,
    grace: float | None,
) -> PoolFailure:
    succeeded = sorted(outcome.values)
    failed = dict(sorted(outcome.failed.items()))
    if failed:
        head = f"scenario {scenario} failed on rank(s) {sorted(failed)} of {world_size}"
        if stuck:
            head += (
                f"; rank(s) {sorted(stuck)} still busy {grace} s after the first failure"
                " (blocked in a collective?)"
            )
    else:
        head = (
            f"scenario {scenario} timed out after {limit:.1f} s on {world_size} ranks:"
            f" no answer from rank(s) {sorted(stuck)}"
        )
    head += f"; succeeded: {succeeded or 'none'}. The ranks were stopped; the next run forks anew."
    sections = [head]
    sections += _sections(failed, "traceback")
    sections += _sections(stuck, "Python stack when given up on")
    return (RankError if failed else RankTimeout)(
        "\n".join(sections),
        scenario=scenario,
        succeeded=succeeded,
        failed=failed,
        stuck=stuck,
        exceptions=outcome.exceptions,
    )


def _sections(texts: dict[int, str], what: str) -> list[str]:
    """One section per distinct text, naming every rank that produced it."""
    ranks_of: dict[str, list[int]] = {}
    for rank, text in sorted(texts.items()):
        ranks_of.setdefault(text.rstrip(), []).append(rank)
    rule = "=" * 16
    return [
        f"{rule} rank {', '.join(map(str, ranks))}: {what} {rule}\n{text}"
        for text, ranks in ranks_of.items()
    ]


def _trim_stack(text: str) -> str:
    """A faulthandler dump without the frames below the scenario (the worker loop, the fork)."""
    lines = text.rstrip().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(" in _serve") and _dist_worker.__file__ in line:
            return "\n".join(lines[: i + 1])
    return "\n".join(lines)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="backslashreplace")
    except OSError:
        return ""
