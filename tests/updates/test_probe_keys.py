"""The bitwise probes of the batched kernels judge again for each intra-op thread count."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from canzona.updates import batch_kernels_exact, normuon_batch_exact


@pytest.mark.parametrize(
    ("module", "probe"),
    [
        ("canzona.updates.newton_schulz", batch_kernels_exact),
        ("canzona.updates.normuon", normuon_batch_exact),
    ],
    ids=["newton_schulz", "normuon"],
)
def test_the_probe_runs_again_for_another_thread_count(
    monkeypatch: pytest.MonkeyPatch, module: str, probe: Callable[..., bool]
) -> None:
    """Catches: a verdict reused across intra-op thread counts (reductions and BLAS split
    their work by threads)."""
    mod = importlib.import_module(module)  # canzona.updates re-exports a function of that name
    monkeypatch.setattr(mod, "_BATCH_EXACT", {})
    threads = torch.get_num_threads()
    assert probe(4, 48, 32, dtype=torch.float32)
    torch.set_num_threads(threads + 1)
    try:
        assert probe(4, 48, 32, dtype=torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert len(mod._BATCH_EXACT) == 2
