"""Every runtime dependency declared in pyproject.toml is imported by the package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0] for dep in project["dependencies"]]


def test_every_declared_dependency_is_imported() -> None:
    """Catches a dependency declared but unused (e.g. numpy put back into ``dependencies``)."""
    sources = "\n".join(p.read_text() for p in (ROOT / "src" / "canzona").rglob("*.py"))
    declared = _declared()
    for name in declared:
        assert re.search(rf"^\s*(import|from) {name}\b", sources, re.M), name
