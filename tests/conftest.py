"""Suite set-up: one OpenMP thread before torch loads, a timeout backstop, the ``dist`` fixture."""

from __future__ import annotations

import os

# First, before anything imports torch (pytest imports this file before any test module): a child
# forked from a process whose OpenMP pool has run hangs in its first parallel kernel, and ranks
# sharing two cores are faster single-threaded anyway.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _dist import DistPool

# Test modules import the harness as ``from _dist import DistPool, mesh``: this directory is on
# sys.path under every pytest import mode, with no __init__.py needed anywhere in tests/.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

if "torch" in sys.modules:  # imported before this file, so the environment came too late
    sys.modules["torch"].set_num_threads(1)

DEFAULT_TIMEOUT = 600.0  # seconds; pytest-timeout's backstop behind DistPool's own deadlines

_POOLS: list[DistPool] = []


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Runs before pytest-timeout reads its settings; --timeout, PYTEST_TIMEOUT or an ini value win.
    if not config.pluginmanager.hasplugin("timeout"):
        return
    if (
        config.getoption("timeout", None) is None
        and not os.environ.get("PYTEST_TIMEOUT")
        and not config.getini("timeout")
    ):
        config.option.timeout = DEFAULT_TIMEOUT


@pytest.fixture(scope="session")
def dist() -> Iterator[Callable[[int], DistPool]]:
    """``dist(world_size)``: the session's pool of that many gloo ranks, started on first use."""
    from _dist import DistPool  # torch loads only for suites that use ranks

    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size)
            _POOLS.append(pools[world_size])
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _POOLS:
        return
    import _dist

    parts = [f"warm-up {_dist.warm_up_seconds or 0.0:.2f} s"]
    for pool in sorted(_POOLS, key=lambda p: p.world_size):
        starts = pool.startup_seconds
        parts.append(
            f"{pool.world_size} ranks: {pool.runs} runs, {len(starts)} start(s)"
            f" of {sum(starts) / max(1, len(starts)):.2f} s"
        )
    terminalreporter.write_line("dist pools: " + "; ".join(parts))
