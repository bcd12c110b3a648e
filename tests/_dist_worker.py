"""The worker side of the test harness (``_dist.py``): a forked rank serving scenarios."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import io
import os
import pickle
import random
import signal
import sys
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PG_TIMEOUT = timedelta(seconds=60)  # gloo's own limit on one collective
OUTPUT_LIMIT = 64_000  # bytes of a rank's output kept per scenario

_PARENT_ENDS: set[Connection] = set()  # the pytest side of every live worker's pipe
_KEEP_OPEN: list[Any] = []  # in a worker: the file faulthandler writes stacks to


def _worker_main(
    rank: int, world_size: int, store_path: str, conn: Connection, log_path: Path
) -> None:
    """Join the process group, then serve scenarios until told to stop or the parent is gone."""
    try:
        _isolate(log_path)
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, store=store, timeout=PG_TIMEOUT
        )
        conn.send_bytes(pickle.dumps(("ok", pickle.dumps(os.getpid()), "", pickle.dumps([]), True)))
    except BaseException:
        failed = ("error", (traceback.format_exc(), None), "", pickle.dumps([]), False)
        with contextlib.suppress(Exception):
            conn.send_bytes(pickle.dumps(failed))
        os._exit(1)
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        if payload == b"stop":
            os._exit(0)
        conn.send_bytes(_serve(payload))


def _isolate(log_path: Path) -> None:
    """Own this worker's signals, output and crash reports; die with the pytest process."""
    for end in list(_PARENT_ENDS):  # inherited ends of the other workers' pipes
        end.close()
    _PARENT_ENDS.clear()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the pytest process to handle
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    fd = os.open(log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash dumps into the log
    stack_file = open(log_path.with_suffix(".stack"), "a")  # noqa: SIM115  (appends after truncation)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    _KEEP_OPEN.append(stack_file)


def _serve(payload: bytes) -> bytes:
    """Run one scenario; the pickled answer for the pytest process."""
    _reset_rank_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            status, body = "ok", _dumps_result(value)
        except BaseException as exc:
            status, body = "error", (traceback.format_exc(), _dumps_exception(exc))
    seen = dict.fromkeys((str(w.message), w.category, w.filename, w.lineno) for w in caught)
    try:
        caught_bytes = pickle.dumps(list(seen))
    except Exception:  # an exotic warning category; the answer matters more
        caught_bytes = pickle.dumps([])
    return pickle.dumps((status, body, _take_output(), caught_bytes, dist.is_initialized()))


def _reset_rank_state() -> None:
    torch.manual_seed(0)
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)


class _ResultPickler(pickle.Pickler):
    """Pickles a scenario's result: tensors detached, on CPU and compact; DTensors refused."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            raise TypeError("a DTensor cannot leave its rank: return .full_tensor() or .to_local()")
        wasteful = (
            obj.layout == torch.strided
            and obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()
        )
        if obj.requires_grad or obj.device.type != "cpu" or wasteful:
            return _identity, (obj.detach().cpu().clone(),)
        return NotImplemented


def _identity(x: Any) -> Any:
    return x


def _dumps_result(value: Any) -> bytes:
    buffer = io.BytesIO()
    _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _dumps_exception(exc: BaseException) -> bytes | None:
    try:
        return pickle.dumps(exc.with_traceback(None))
    except Exception:
        return None


def _take_output() -> str:
    """What this rank printed since the last call; the log starts empty again afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    size = os.fstat(1).st_size
    start = max(0, size - OUTPUT_LIMIT)
    data = os.pread(1, size - start, start) if size else b""
    os.ftruncate(1, 0)
    return data.decode(errors="backslashreplace")
