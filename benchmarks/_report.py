"""Shared helpers for the benchmark scripts: machine info, JSON results, Markdown sections."""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
QUICK = RESULTS / "quick"
QUICK_DOC = QUICK / "benchmarks_quick.md"


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


def git_commit() -> str:
    """The commit the benchmark runs on: ``git rev-parse --short HEAD``.

    With ``-dirty`` when ``src/`` differs from that commit (modified, staged or untracked
    files), and ``-installed`` when the ``canzona`` this process imports is a copy whose files
    differ from ``src/`` (a stale non-editable install), so that a number is never attributed
    to code it was not measured on; ``"unknown"`` outside a git checkout (unless
    ``CANZONA_BENCH_COMMIT`` names the commit a copy of the tree was taken from). Read-only:
    no index refresh is written.
    """
    named = os.environ.get("CANZONA_BENCH_COMMIT")  # a copy of the tree without .git
    if named:
        return named + ("" if imported_is_src() else "-installed")
    git = ["git", "--no-optional-locks"]
    try:
        sha = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            [*git, "diff", "--quiet", "HEAD", "--", "src"], cwd=ROOT
        ).returncode
        untracked = subprocess.run(
            [*git, "ls-files", "--others", "--exclude-standard", "--", "src"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return (
        sha
        + ("-dirty" if changed or untracked else "")
        + ("" if imported_is_src() else "-installed")
    )


def imported_is_src() -> bool:
    """Whether ``import canzona`` here runs the files of this checkout's ``src/canzona``.

    True when it resolves into ``src/`` (``PYTHONPATH=src``, an editable install) or into a
    copy whose Python files are the same, byte for byte (a fresh non-editable install).
    """
    spec = importlib.util.find_spec("canzona")
    if spec is None or spec.origin is None:
        return False
    here, mine = Path(spec.origin).resolve().parent, SRC / "canzona"
    if here == mine.resolve():
        return True

    def files(top: Path) -> dict[str, bytes]:
        return {str(f.relative_to(top)): f.read_bytes() for f in sorted(top.rglob("*.py"))}

    return files(here) == files(mine)


#: The commit when this process started, before it imported and ran the code it measures:
#: a commit or an edit of ``src/`` during a long run does not relabel its numbers.
STARTED_ON = git_commit()


def commit_of(payload: dict[str, Any]) -> str:
    """The commit a results payload names (set by :func:`write_json`), else :data:`STARTED_ON`."""
    return str(payload.get("commit") or STARTED_ON)


def write_json(name: str, payload: dict[str, Any], *, out_dir: Path | None = None) -> Path:
    """Write ``payload`` to ``benchmarks/results/<name>.json`` (or ``out_dir``).

    The file also records the machine and the commit (:data:`STARTED_ON`; the payload's own
    ``"commit"`` when it has one), and ``payload["commit"]`` is set to it, so that the
    Markdown rendered from the same payload names the same commit.
    """
    directory = out_dir or RESULTS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    payload["commit"] = commit_of(payload)
    rest = {k: v for k, v in payload.items() if k != "commit"}
    body = {"machine": machine_info(), "commit": payload["commit"], **rest}
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


def publish(
    name: str,
    payload: dict[str, Any],
    render: Callable[[dict[str, Any]], str],
    *,
    mode: str,
    out: Path | None = None,
    doc: Path | None = None,
) -> Path:
    """Write a script's JSON and its Markdown section, print the section; the JSON's path.

    Full mode writes under ``benchmarks/results/`` and into docs/benchmarks.md, other modes
    under ``benchmarks/results/quick/``; ``out`` and ``doc`` override either.
    """
    path = write_json(name, payload, out_dir=out or (RESULTS if mode == "full" else QUICK))
    markdown = render(payload)
    update_section(name, markdown, doc=doc or (DOC if mode == "full" else QUICK_DOC))
    print(markdown)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
