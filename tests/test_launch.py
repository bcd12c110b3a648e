"""canzona.launch: results in rank order, progress, and every way a rank can fail, reported."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from canzona.launch import RankFailure, run_ranks


def _ok(progress: Any) -> int:
    progress({"rank": dist.get_rank()})
    return dist.get_rank() * 10


def test_results_come_back_in_rank_order_with_progress() -> None:
    seen: list[dict[str, Any]] = []
    assert run_ranks(2, _ok, seen.append) == [0, 10]
    assert sorted(p["rank"] for p in seen) == [0, 1]


def _fail_on_rank_1(progress: Any) -> int:
    if dist.get_rank() == 1:
        raise RuntimeError("rank one breaks")
    time.sleep(60)  # busy elsewhere: it never reports on its own
    return dist.get_rank()


def test_a_failing_rank_is_named_with_its_traceback_and_the_others_stopped() -> None:
    """Catches: a failure reported without the rank's traceback, or a launcher that waits
    for a rank that will not finish once another one failed (rank 0 would then end its
    sleep and fail at the closing barrier with an error of its own)."""
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _fail_on_rank_1)
    text = str(info.value)
    assert text.startswith("rank 1 failed:\nTraceback")
    assert "RuntimeError: rank one breaks" in text
    assert text.endswith("\nrank 0 stopped after another rank failed")


def _dies_on_rank_0(progress: Any) -> int:
    if dist.get_rank() == 0:
        os._exit(3)
    return 1


def test_a_rank_that_dies_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RankFailure, match=r"rank 0 failed:\ndied \(exit code 3\)"):
        run_ranks(2, _dies_on_rank_0)


def _sleeps(progress: Any) -> int:
    time.sleep(60)
    return 0


def test_a_deadline_stops_every_rank() -> None:
    with pytest.raises(RankFailure, match="rank 0 did not finish in time\nrank 1 did not finish"):
        run_ranks(2, _sleeps, timeout_s=1.0)


@pytest.mark.parametrize("world", [0, -2, 1.5, True])
def test_a_world_that_is_not_a_positive_int_is_refused(world: Any) -> None:
    """Catches: ``run_ranks(0, job)`` returning ``[]`` as if the job had run."""
    with pytest.raises(ValueError, match=f"world must be a positive int, got {world!r}"):
        run_ranks(world, _ok)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_run_leaves_no_file_descriptor_open() -> None:
    """Catches: the parent's pipe ends left open (one descriptor lost per rank per run)."""
    run_ranks(2, _ok)  # the first run may open what torch keeps for good
    before = _open_fds()
    for _ in range(2):
        run_ranks(2, _ok)
    assert _open_fds() == before


def _sleeps_and_reports(progress: Any) -> int:
    progress({"pid": os.getpid()})
    time.sleep(60)
    return 0


def test_ranks_are_gone_once_a_failure_is_reported() -> None:
    """Catches: a rank left running after the deadline's failure is reported."""
    pids: list[int] = []
    with pytest.raises(RankFailure, match="did not finish in time"):
        run_ranks(2, _sleeps_and_reports, lambda p: pids.append(p["pid"]), timeout_s=3.0)
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ranks_are_not_forked_from_a_process_in_a_process_group() -> None:
    from canzona.launch import prepare_parent

    dist.init_process_group("fake", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="without a default process group"):
            prepare_parent()
    finally:
        dist.destroy_process_group()


def _dies_leaving_a_child(progress: Any) -> int:
    if dist.get_rank() == 0:
        child = os.fork()
        if child == 0:  # holds rank 0's ends of its pipes open
            time.sleep(60)
            os._exit(0)
        progress({"child": child})
        os._exit(3)
    time.sleep(60)
    return 1


def test_a_rank_that_dies_leaving_a_forked_child_is_reported_at_once() -> None:
    """Catches: the death seen only through the pipe's end, which the child holds open (the
    launcher would wait for the deadline and call the rank late, not dead)."""
    children: list[int] = []
    try:
        with pytest.raises(RankFailure) as info:
            run_ranks(
                2, _dies_leaving_a_child, lambda p: children.append(p["child"]), timeout_s=30.0
            )
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    assert str(info.value).startswith("rank 0 failed:\ndied (exit code 3) without a result")


def _backward_in_a_rank(progress: Any) -> float:
    """A backward pass through an FSDP2 module on the job's mesh: the gradient's sum."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model(torch.randn(2, 4)).sum().backward()
    return float(model.weight.grad.full_tensor().sum())  # type: ignore[union-attr]


_WARM_UP_PROBE = """
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import canzona.launch as launch


class DTensorOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


backwards = []
real_backward = torch.autograd.backward
torch.autograd.backward = lambda *a, **k: (backwards.append(1), real_backward(*a, **k))[1]
with DTensorOps() as seen:
    launch.prepare_parent()
print(seen.ops, len(backwards))
"""


def _last_line(script: str) -> tuple[str, str]:
    """The last line ``script`` prints in a fresh process, and everything it wrote."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    )
    return out.stdout.strip().splitlines()[-1], out.stdout + out.stderr


def test_the_parent_warm_up_dispatches_no_dtensor_op_and_runs_no_backward() -> None:
    """Catches: a warm-up that runs a DTensor op or a backward pass in the parent. With
    torch's CUDA builds (2.13 to 2.15, no GPU) a process that dispatched a DTensor op and
    then ran any backward pass forks ranks whose first ``backward()`` raises "Unable to
    handle autograd's threading in combination with fork-based multiprocessing" (``canzona
    demo`` failed so)."""
    last, output = _last_line(_WARM_UP_PROBE)
    assert last == "[] 0", output


def test_ranks_run_backward_after_the_parent_warmed_up_and_ran_one() -> None:
    """Catches (on torch's CUDA builds, 2.13 to 2.15, where the bug shows): ranks forked
    from a parent whose warm-up dispatched DTensor ops and which then ran a backward pass of
    its own cannot run ``backward()``. On the CPU build of torch 2.13.0 (CI's) this passes
    either way; the test above catches the cause there."""
    from canzona.launch import prepare_parent

    prepare_parent()
    x = torch.ones(3, requires_grad=True)
    (2 * x).sum().backward()  # the parent trains a little before it forks ranks
    sums = run_ranks(2, _backward_in_a_rank)
    assert sums[0] == sums[1] != 0.0


_POISONED_PARENT = """
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from canzona.launch import RankFailure, _FORK_HINT, run_ranks

with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.ones(4, 4, requires_grad=True), mesh, [Shard(0)])
    (2 * w).sum().backward()  # the parent trains a little, on DTensors, before it forks
    dist.destroy_process_group()

pid = os.fork()  # does this torch refuse backward() in a child of such a process?
if pid == 0:
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        os._exit(3)
    os._exit(0)
if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 3:
    print("backward runs in forked children")
    sys.exit(0)


def job(progress):
    x = torch.ones(3, requires_grad=True)
    (2 * x).sum().backward()


try:
    run_ranks(2, job)
except RankFailure as failure:
    print(str(failure).count(_FORK_HINT))
"""


def test_ranks_that_cannot_run_backward_after_the_parent_trained_say_what_to_do() -> None:
    """Catches: a rank's report without the hint when torch refuses its ``backward()``
    because the parent ran a backward pass after a DTensor op (torch's CUDA builds, 2.13 to
    2.15; skipped where torch runs it, as the CPU build of 2.13.0, CI's, does)."""
    last, output = _last_line(_POISONED_PARENT)
    if last == "backward runs in forked children":
        pytest.skip(f"torch {torch.__version__} runs backward() in such a parent's forked ranks")
    assert last == "2", output  # both ranks' reports carry it


class _Sent:
    """A rank's end of the pipe as the launcher sees it: the result arrives between the
    launcher's look at the pipe and its look at the exit code."""

    def __init__(self, fd: int) -> None:
        self.fd, self.polls = fd, 0

    def fileno(self) -> int:
        return self.fd

    def poll(self) -> bool:
        self.polls += 1
        return self.polls > 1

    def recv_bytes(self) -> bytes:
        import pickle

        return pickle.dumps(("done", 42))


class _Ended:
    exitcode = 0

    def __init__(self, fd: int) -> None:
        self.sentinel = fd


def test_a_result_sent_just_before_the_rank_ended_is_read() -> None:
    """Catches: a rank that sent its result and exited between the launcher's look at its
    pipe (nothing yet) and at its exit code (0) reported as "died (exit code 0) without a
    result": ``RankFailure`` for a job that succeeded."""
    import canzona.launch as launch

    fds = [os.pipe(), os.pipe()]
    for _, w in fds:
        os.write(w, b"x")  # readable: the wait returns at once
    try:
        got = launch._collect(
            [_Ended(fds[0][0])],  # type: ignore[list-item]
            [_Sent(fds[1][0])],  # type: ignore[list-item]
            lambda _: None,
            time.monotonic() + 5.0,
        )
    finally:
        for pair in fds:
            for fd in pair:
                os.close(fd)
    assert got == [42]
