"""The CUDA-graph replay of the per-matrix Newton–Schulz loop: CPU-side behaviour and wiring."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from canzona.updates import cuda_graphs, newton_schulz

ns_module = importlib.import_module("canzona.updates.newton_schulz")
SCHEDULE = ns_module.resolve_ns_coefficients(ns_module.DEFAULT_NS_COEFFICIENTS, 2)
EPS = ns_module.DEFAULT_NS_EPS


def test_cpu_tensors_run_eagerly() -> None:
    calls: list[Tensor] = []

    def fn(x: Tensor, branches: Sequence[torch.cuda.Stream]) -> Tensor:
        calls.append(x)
        return x

    assert cuda_graphs.replay_exact(fn, torch.zeros(2, 3, 3), "k") is None
    assert cuda_graphs.replay_in_pieces(fn, torch.zeros(2, 3, 3), "k") is None
    assert calls == [] and cuda_graphs._GRAPHS == {}


@pytest.mark.parametrize(
    ("count", "elements", "sizes"),
    [
        (13, 1 << 19, [8, 4, 1]),  # pieces of at most 16 items of 2^19 elements
        (40, 1 << 19, [16, 16, 8]),
        (3, 655360, [2, 1]),  # 128x5120 head blocks: 12 fit, pieces of 8
        (20, 655360, [8, 8, 4]),
        (1000, 64, [512, 256, 128, 64, 32, 8]),  # binary digits: few sizes, few graphs
        (1, 1 << 23, [1]),
        (5, (1 << 23) + 1, []),  # an item above the limit: eager
        (0, 64, []),
        (4, 0, []),
    ],
)
def test_pieces_are_powers_of_two_within_the_limit(
    count: int, elements: int, sizes: list[int]
) -> None:
    got = cuda_graphs.piece_sizes(count, elements)
    assert got == sizes
    assert sum(got) == (count if got else 0)
    assert all(s * elements <= cuda_graphs.MAX_ELEMENTS for s in got)


def test_the_environment_variable_turns_graphs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda_graphs.ENV_VAR, raising=False)
    assert cuda_graphs.graphs_enabled()
    monkeypatch.setenv(cuda_graphs.ENV_VAR, "0")
    assert not cuda_graphs.graphs_enabled()
    monkeypatch.setenv(cuda_graphs.ENV_VAR, "1")
    assert cuda_graphs.graphs_enabled()


def test_the_per_matrix_loop_goes_through_the_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack that runs matrix by matrix asks for a replay of the eager loop, keyed by every
    setting of the loop and checked per matrix shape, and returns the replay's result; the
    batched kernels never ask."""
    seen: list[tuple[tuple[int, ...], Any, Any]] = []
    sentinel = torch.full((3, 5, 9), 7.0)

    def fake(fn: Any, x: Tensor, key: Any, check_key: Any) -> Tensor | None:
        seen.append((tuple(x.shape), key, check_key))
        eager = ns_module._ns_loop(x, SCHEDULE, EPS, torch.float32, 1.0)
        assert torch.equal(fn(x, ()), eager)  # fn is the eager loop with these settings
        return sentinel

    monkeypatch.setattr(ns_module, "replay_in_pieces", fake)
    assert newton_schulz(torch.randn(3, 5, 9), dtype=torch.float32, steps=2) is sentinel
    key = ("newton_schulz", torch.float32, SCHEDULE, EPS, 1.0)
    assert seen == [((3, 5, 9), key, (5, 9, key))]  # one check per matrix shape, any count
    newton_schulz(torch.randn(4, 40, 48), dtype=torch.float32, steps=2, batched=True)
    assert len(seen) == 1


def test_a_declined_replay_runs_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ns_module, "replay_in_pieces", lambda fn, x, key, check: None)
    x = torch.randn(3, 5, 9)
    got = newton_schulz(x, dtype=torch.float32, steps=2)
    assert torch.equal(got, ns_module._ns_loop(x, SCHEDULE, EPS, torch.float32, 1.0))


def test_graphs_are_admitted_within_the_count_and_memory_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new graph is captured only while the kept graphs stay under both limits."""
    held: dict[Any, Any] = {}
    monkeypatch.setattr(cuda_graphs, "_GRAPHS", held)
    limit = cuda_graphs.MAX_HELD_ELEMENTS
    assert cuda_graphs._admits(limit) and not cuda_graphs._admits(limit + 1)

    class Kept:
        def __init__(self, numel: int) -> None:
            self.static_in = torch.empty(1).expand(numel)

    held["a"] = Kept(limit - 10)
    held["failed"] = None  # a key that runs eagerly holds nothing
    assert cuda_graphs._admits(10) and not cuda_graphs._admits(11)
    held.clear()
    held.update({i: None for i in range(cuda_graphs.MAX_GRAPHS)})
    assert not cuda_graphs._admits(1)
