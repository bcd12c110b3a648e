"""The multi-process harness itself: results, DTensor and FSDP2 on gloo, failures and hangs."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from _dist import DistPool, RankError, RankTimeout, mesh

# -- scenarios: module-level functions, run on every rank -------------------------------------


def _all_reduce_ranks() -> tuple[int, int, torch.Tensor]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t


def _tensors() -> dict[str, torch.Tensor]:
    big = torch.arange(1000.0)
    weight = torch.nn.Parameter(torch.ones(2, 3))
    return {
        "randn": torch.randn(3, 4),
        "bf16": torch.full((2,), 1.5, dtype=torch.bfloat16),
        "view": big[10:12],
        "grad": weight * 2,
        "rank": torch.tensor(dist.get_rank()),
    }


def _shard_2d() -> tuple[tuple[int, ...], bool]:
    original = torch.arange(32.0).reshape(8, 4)
    sharded = distribute_tensor(original, mesh((2, 2), ("dp", "tp")), (Shard(0), Shard(1)))
    return tuple(sharded.to_local().shape), torch.equal(sharded.full_tensor(), original)


def _mesh_identity() -> tuple[int, int, bool]:
    m = mesh((2, 2), ("dp", "tp"))
    return os.getpid(), id(m), m is mesh((2, 2), ("dp", "tp"))


def _two_linears() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))


def _fsdp_step() -> tuple[bool, tuple[object, ...], tuple[int, ...], torch.Tensor]:
    model = _two_linears()
    fully_shard(model, mesh=mesh())
    model(torch.randn(5, 8)).sum().backward()
    grad = model[0].weight.grad
    return (
        isinstance(grad, DTensor),
        grad.placements,
        tuple(grad.to_local().shape),
        grad.full_tensor(),
    )


def _raise_on_rank(bad: int) -> str:
    if dist.get_rank() == bad:
        raise ValueError(f"boom on rank {bad}")
    return "fine"


def _raise_while_peer_waits() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))


def _hang_in_all_reduce() -> int:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return dist.get_rank()


def _exit_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _return_dtensor() -> DTensor:
    return distribute_tensor(torch.ones(4, 2), mesh(), [Shard(0)])


def _print_and_warn() -> None:
    print(f"hello from rank {dist.get_rank()}")
    warnings.warn("careful with rank state", UserWarning, stacklevel=1)


def _noop() -> None:
    return None


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_all_reduce_results_in_rank_order(dist, world_size):
    results = dist(world_size).run(_all_reduce_ranks)
    total = world_size * (world_size + 1) / 2
    assert [(r, w) for r, w, _ in results] == [(r, world_size) for r in range(world_size)]
    for _, _, t in results:
        assert torch.equal(t, torch.tensor([total]))


def test_tensors_round_trip_detached_and_seeded(dist):
    first, second = dist(2).run(_tensors)
    expected = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for rank, got in enumerate((first, second)):
        assert torch.equal(got["randn"], expected)  # every run starts from seed 0
        assert got["bf16"].dtype == torch.bfloat16 and got["bf16"].tolist() == [1.5, 1.5]
        assert torch.equal(got["view"], torch.tensor([10.0, 11.0]))
        assert got["view"].untyped_storage().nbytes() == 8  # not the whole 1000-element base
        assert not got["grad"].requires_grad and torch.equal(got["grad"], torch.full((2, 3), 2.0))
        assert got["rank"].item() == rank


def test_dtensor_2d_shard_and_full_tensor(dist):
    assert dist(4).run(_shard_2d) == [((4, 2), True)] * 4


def test_mesh_is_cached_per_worker_and_reset_with_the_pool(dist):
    pool = dist(4)
    before = pool.run(_mesh_identity)
    again = pool.run(_mesh_identity)
    assert before == again and all(same for _, _, same in before)
    assert [pid for pid, _, _ in before] == pool.pids
    with pytest.raises(RankError):
        pool.run(_raise_on_rank, 0)
    after = pool.run(_mesh_identity)
    assert not {pid for pid, _, _ in after} & {pid for pid, _, _ in before}


def test_mesh_refuses_the_pytest_process():
    with pytest.raises(RuntimeError, match="DistPool ranks"):
        mesh((2,))


def test_fsdp2_gradients_are_shard0_dtensors_matching_one_process(dist):
    results = dist(2).run(_fsdp_step)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # what each rank did: build the model, then draw the batch
        model = _two_linears()
        model(torch.randn(5, 8)).sum().backward()
    for is_dtensor, placements, local_shape, full_grad in results:
        assert is_dtensor and placements == (Shard(0),) and local_shape == (3, 8)
        torch.testing.assert_close(full_grad, model[0].weight.grad)


def test_rank_error_has_the_traceback_and_the_pool_recovers(dist):
    pool = dist(2)
    pids = pool.pids
    with pytest.raises(RankError) as info:
        pool.run(_raise_on_rank, 1)
    message = str(info.value)
    assert "_raise_on_rank" in message and "succeeded: [0]" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: boom on rank 1" in message
    assert isinstance(info.value.exceptions[1], ValueError)
    assert pool.run(_raise_on_rank, -1) == ["fine", "fine"]
    assert not set(pool.pids) & set(pids)


def test_a_peer_blocked_in_a_collective_is_caught_within_the_grace():
    with DistPool(2, straggler_grace=1.0) as pool:
        # without the grace, rank 0 would stay blocked until the run's deadline: a RankTimeout
        with pytest.raises(RankError) as info:
            pool.run(_raise_while_peer_waits)
        assert set(info.value.failed) == {1} and set(info.value.stuck) == {0}
        assert "RuntimeError: rank 1 gives up" in str(info.value)
        assert "_raise_while_peer_waits" in info.value.stuck[0]  # rank 0's stack, in all_reduce
        assert [r for r, _, _ in pool.run(_all_reduce_ranks)] == [0, 1]


def test_a_hang_times_out_with_the_scenario_and_the_stuck_rank(dist):
    pool = dist(2)
    pids = pool.pids
    with pytest.raises(RankTimeout) as info:
        pool.run(_hang_in_all_reduce, timeout=3.0)
    message = str(info.value)
    assert "_hang_in_all_reduce" in message and "no answer from rank(s) [0]" in message
    assert "succeeded: [1]" in message
    assert "_hang_in_all_reduce" in info.value.stuck[0]  # the stack shows where rank 0 waits
    assert [t.item() for _, _, t in pool.run(_all_reduce_ranks)] == [3.0, 3.0]
    assert not set(pool.pids) & set(pids)


def test_a_dead_rank_is_reported(dist):
    pool = dist(2)
    with pytest.raises(RankError, match=r"(?s)rank\(s\) \[1\].*died \(exit 3\)"):
        pool.run(_exit_on_rank_1)
    assert pool.run(_raise_on_rank, -1) == ["fine", "fine"]


def test_a_dtensor_result_is_refused_with_a_hint(dist):
    with pytest.raises(RankError, match=r"full_tensor\(\)"):
        dist(2).run(_return_dtensor)


def test_unpicklable_scenario_fails_in_the_parent_without_a_restart(dist):
    pool = dist(2)
    pids = pool.pids
    with pytest.raises(TypeError, match="module-level"):
        pool.run(lambda: None)
    assert pool.pids == pids


def test_output_and_warnings_come_back(dist, capsys):
    with pytest.warns(UserWarning, match="careful with rank state"):
        dist(2).run(_print_and_warn)
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out


def test_report_startup_and_reuse_cost(dist, capsys):
    pool = dist(4)
    pool.run(_noop)
    began = time.perf_counter()
    for _ in range(20):
        pool.run(_noop)
    per_run = (time.perf_counter() - began) / 20
    with DistPool(8) as fresh:
        startup8 = fresh.startup_seconds[0]
    with capsys.disabled():
        print(
            f"\ndist pool: start 4 ranks {pool.startup_seconds[0]:.2f} s, 8 ranks {startup8:.2f} s;"
            f" reuse {per_run * 1e3:.1f} ms per run (4 ranks)"
        )
