"""Every python example of docs/usage.md (on 2 and 4 gloo ranks) and docs/checkpointing.md
(on 4) runs."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _blocks(name: str) -> list[str]:
    return BLOCK.findall((DOCS / name).read_text())


def _run_block(code: str, tmp: str) -> str:
    """Run one example on this rank, in a scratch working directory shared by the ranks."""
    here = os.getcwd()
    os.chdir(tmp)
    try:
        exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(here)
    return "ok"


CASES = [("usage.md", i, w) for i in range(len(_blocks("usage.md"))) for w in (4, 2)]
CASES += [("checkpointing.md", i, 4) for i in range(len(_blocks("checkpointing.md")))]


@pytest.mark.parametrize(("doc", "index", "world"), CASES)
def test_doc_example_runs(dist: Any, tmp_path: Path, doc: str, index: int, world: int) -> None:
    """Catches: an example that no longer runs, or one that holds only at 4 ranks (the
    examples take their world size from the launcher)."""
    code = _blocks(doc)[index]
    assert dist(world).run(_run_block, code, str(tmp_path), timeout=180) == ["ok"] * world


def test_docs_have_examples() -> None:
    assert len(_blocks("usage.md")) >= 4
