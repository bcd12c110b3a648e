"""The top-level ``canzona`` names: each resolves, and the version is the package's."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import canzona

ROOT = Path(__file__).resolve().parents[1]


def test_every_exported_name_resolves_to_its_layers_object() -> None:
    """Catches: a name dropped from the lazy table (``canzona.MatrixSpec`` raising
    AttributeError), a name resolved from another module, and ``dir()`` hiding the names."""
    exports = canzona._EXPORTS
    assert set(canzona.__all__) == {*exports, "__version__"}
    for name, module in exports.items():
        assert getattr(canzona, name) is getattr(importlib.import_module(module), name), name
    assert sorted(dir(canzona)) == sorted(canzona.__all__)
    with pytest.raises(AttributeError, match="module 'canzona' has no attribute 'Adam'"):
        canzona.Adam  # noqa: B018


def test_the_version_is_the_packages() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert canzona.__version__ == project["version"]


def test_the_top_level_names_resolve_in_a_fresh_process() -> None:
    """Each name by itself, as a user's first ``from canzona import X`` finds it."""
    names = ", ".join(sorted(n for n in canzona.__all__ if n != "__version__"))
    code = f"from canzona import {names}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
