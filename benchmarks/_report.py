"""Shared helpers for the benchmark scripts: machine info, JSON results, Markdown sections."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def machine_info() -> dict[str, Any]:
    """Describe the machine, torch build and thread settings for a results file."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # the plan benchmark runs without torch
        info["torch"] = None
    return info


def write_json(name: str, payload: dict[str, Any], *, out_dir: Path | None = None) -> Path:
    """Write ``payload`` (plus machine info) to ``benchmarks/results/<name>.json``."""
    directory = out_dir or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    body = {"machine": machine_info(), **payload}
    path.write_text(json.dumps(body, indent=2, sort_keys=False) + "\n")
    return path


def update_section(name: str, markdown: str, *, doc: Path | None = None) -> Path:
    """Replace the section ``name`` of docs/benchmarks.md (delimited by HTML comments).

    Each benchmark owns one section, so scripts can be re-run independently.
    A missing section is appended at the end of the document.
    """
    path = doc or DOC
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """Render a simple GitHub Markdown table."""

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
