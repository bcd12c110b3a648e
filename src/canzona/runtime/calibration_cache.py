"""Calibration timings on disk, reused by later jobs on the same device, torch and settings."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Layout version of the cache file (a file of another version is ignored, then replaced).
#: 2: entries hold a third timing (twice the batch: pieces).
FORMAT = 2

#: One shape's agreed timings: seconds per matrix at the expected batch, at the second
#: batch size and at twice the batch (-1 where that was not timed).
Entry = tuple[float, float, float]


def _entry(value: Any) -> Entry | None:
    """A stored entry, or None when it is not three finite numbers with a non-negative first."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        return None
    try:
        seconds, second, third = (float(v) for v in value)
    except OverflowError:  # an int past a float's range
        return None
    if not all(math.isfinite(v) for v in (seconds, second, third)) or seconds < 0:
        return None
    return seconds, (second if second >= 0 else -1.0), (third if third >= 0 else -1.0)


def _file_mode(path: Path) -> int:
    """The permissions of the file at ``path``, or of a new file under the umask."""
    try:
        return path.stat().st_mode & 0o777
    except (OSError, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return 0o666 & ~umask


@dataclass(frozen=True, slots=True)
class DiskCache:
    """A calibration's agreed timings in one JSON file per device and torch build.

    Entries are keyed by a digest of everything that prices a shape (device, torch version,
    the optimizer's configuration and the param group's settings, the phases timed, the
    shape, the batch and the payload dtype: ``calibrate.entry_key``). Reading never fails a
    step: a missing file is empty, and an unreadable or malformed one is empty with a
    warning. Writing merges into the file and replaces it atomically, so concurrent jobs
    never read a partial file (the last writer's entries win); a failed write only warns.

    Attributes:
        directory: Where the file lives (created on the first write).
        device: The device's name (``calibrate.device_name``), part of the file name.
    """

    directory: Path
    device: str

    @property
    def path(self) -> Path:
        """The cache file of this device and torch build."""
        tag = hashlib.sha256(f"{self.device}|{torch.__version__}".encode()).hexdigest()[:16]
        return self.directory / f"calibration-{tag}.json"

    def load(self, *, warn: bool = True) -> dict[str, Entry]:
        """The stored entries (empty when the file is missing or unusable)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8, a NUL in the path
            if warn:
                warnings.warn(
                    f"canzona: calibration cache {str(self.path)!r} is not readable ({exc}); "
                    "timing instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                found = data.get("format") if isinstance(data, dict) else type(data).__name__
                raise ValueError(f"format {found!r}, expected {FORMAT}")
            raw = data["entries"]
            if not isinstance(raw, dict):
                raise ValueError(f"entries must be an object, got {type(raw).__name__}")
        except (ValueError, KeyError, RecursionError) as exc:  # RecursionError: deep nesting
            if warn:
                warnings.warn(
                    f"canzona: calibration cache {str(self.path)!r} is not a cache file of "
                    f"format {FORMAT} ({type(exc).__name__}: {exc}); timing instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return {}
        out: dict[str, Entry] = {}
        for key, value in raw.items():
            entry = _entry(value)
            if entry is not None:
                out[str(key)] = entry
        return out

    def store(self, entries: Mapping[str, Entry]) -> None:
        """Merge ``entries`` into the file (atomic replace; an error only warns)."""
        merged = self.load(warn=False)  # its reader has warned already
        merged.update((k, e) for k, v in entries.items() if (e := _entry(v)) is not None)
        data = {
            "format": FORMAT,
            "device": self.device,
            "torch": torch.__version__,
            "entries": {k: list(v) for k, v in sorted(merged.items())},
        }
        tmp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".calibration-", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                if hasattr(os, "fchmod"):  # mkstemp's 0600 would lock out a shared cache
                    os.fchmod(f.fileno(), _file_mode(self.path))
                json.dump(data, f, indent=1, allow_nan=False)
            os.replace(tmp, self.path)
            tmp = None
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"canzona: could not write the calibration cache {str(self.path)!r} ({exc})",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
