"""Every python example of docs/usage.md and docs/checkpointing.md runs on 4 gloo ranks."""

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


CASES = [("usage.md", i) for i in range(len(_blocks("usage.md")))]
CASES += [("checkpointing.md", i) for i in range(len(_blocks("checkpointing.md")))]


@pytest.mark.parametrize(("doc", "index"), CASES)
def test_doc_example_runs(dist: Any, tmp_path: Path, doc: str, index: int) -> None:
    code = _blocks(doc)[index]
    assert dist(4).run(_run_block, code, str(tmp_path), timeout=180) == ["ok"] * 4


def test_docs_have_examples() -> None:
    assert len(_blocks("usage.md")) >= 4
