"""Launch a benchmark's ranks: ``world`` processes forked from this one, joined in a gloo group.

Forking from a parent that already imported torch starts 4 ranks in ~0.1 s (spawn: 5-12 s).
Two conditions make it safe (see ``tests/_dist.py`` for the long story): one OpenMP thread in
the parent before torch is imported (a child forked after the parent's OpenMP pool ran hangs
in its first parallel kernel), and no process group in the parent. The parent also runs one
DTensor op and one FSDP2 step on a ``fake`` group first, so that the ranks inherit torch's
lazily imported modules instead of each importing them on the clock.

    results = launch(my_body, 4, config)   # my_body(rank, world, config) on every rank
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import multiprocessing as mp
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PG_TIMEOUT = timedelta(seconds=120)
_warmed_up = False


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time; the message has every rank's account."""


def prepare_parent() -> None:
    """Make this process safe to fork ranks from (once per process)."""
    global _warmed_up
    if dist.is_initialized():
        raise RuntimeError("launch() needs a parent process without a process group")
    torch.set_num_threads(1)
    if _warmed_up:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.randn(4, 4, requires_grad=True), mesh, [Shard(0)])
        (x @ x.T).full_tensor().sum().backward()
        model = torch.nn.Linear(4, 4)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 4)).sum().backward()
    finally:
        dist.destroy_process_group()
    _warmed_up = True


def _child(
    fn: Callable[..., Any], rank: int, world: int, store: str, conn: Any, args: tuple[Any, ...]
) -> None:
    status: str
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            store=dist.FileStore(store, world),
            timeout=PG_TIMEOUT,
        )
        value = fn(rank, world, *args)
        status, body = "ok", pickle.dumps(value)
    except BaseException:
        status, body = "error", pickle.dumps(traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps((status, body)))
    finally:
        conn.close()
        os._exit(0)  # skip atexit and gloo teardown: the parent collects what matters


def launch(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; results in rank order.

    ``fn`` must return picklable values. Raises :class:`RankFailure` with each failing rank's
    traceback when a rank raises or dies, or when ``timeout`` seconds pass first.
    """
    prepare_parent()
    ctx = mp.get_context("fork")
    tmp = Path(tempfile.mkdtemp(prefix=f"canzona-bench{world}-"))
    procs, conns = [], {}
    try:
        for rank in range(world):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(fn, rank, world, str(tmp / "store"), child_end, args),
                daemon=True,
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns[parent_end] = rank
        results: dict[int, Any] = {}
        failed: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(conns)
        while pending and (left := deadline - time.monotonic()) > 0:
            for conn in wait(list(pending), timeout=left):
                rank = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    status, body = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    failed[rank] = f"died (exit code {procs[rank].exitcode}) without answering"
                    continue
                if status == "ok":
                    results[rank] = pickle.loads(body)
                else:
                    failed[rank] = pickle.loads(body)
            if failed:  # the others are probably blocked in a collective
                deadline = min(deadline, time.monotonic() + 10.0)
        for rank in pending.values():
            failed.setdefault(rank, f"no answer within {timeout:.0f} s")
        if failed:
            text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failed.items()))
            raise RankFailure(f"{getattr(fn, '__name__', fn)} failed on {world} ranks:\n{text}")
        return [results[r] for r in range(world)]
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5.0)
        for conn in conns:
            conn.close()
        shutil.rmtree(tmp, ignore_errors=True)
