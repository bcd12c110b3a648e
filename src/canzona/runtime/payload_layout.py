"""Where a step's payloads lie in its flat buffers, and the send parts cut from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from canzona.runtime.buffers import Selector, expand, strided_pattern
from canzona.runtime.schedule_parts import Indexed

Dtypes = tuple[torch.dtype, torch.dtype]  # (prepared, payload): a buffer class
SendPart = tuple[int, int, int] | torch.Tensor | tuple[torch.Tensor, Selector] | list[int]


#: Send parts of fewer elements than this, consecutive and of one payload buffer, are read
#: by one index (:class:`~canzona.runtime.schedule_parts.Indexed`): below it a part costs more
#: host time as an operand of its own (a view, its flattening, an entry of the ``cat``, about
#: 2 us) than its elements cost through an index (about 1 ns each on this CPU, and 8 bytes
#: of index), which is built in Python when the schedule is.
INDEXED_NUMEL = 1024


def add_part(
    parts: list[SendPart], part: SendPart, classes: list[int | None], cls: int | None
) -> None:
    """Append a send part (a buffer range extends the last one where it follows it).

    ``classes`` keeps each part's buffer class (``cls``; None: read from no payload buffer).
    """
    last = parts[-1] if parts else None
    if isinstance(part, tuple) and len(part) == 3:
        cls, off, numel = part
        if isinstance(last, list) and last[0] == cls and last[1] + last[2] == off:
            last[2] += numel
            return
        part = [cls, off, numel]
    parts.append(part)
    classes.append(cls if isinstance(part, list | torch.Tensor) else None)


def indexed(
    parts: list[SendPart], classes: list[int | None], buffers: list[torch.Tensor]
) -> list[SendPart | Indexed]:
    """``parts`` with every run of two or more small parts of one buffer read by one index.

    A part is a range ``[class, offset, numel]`` or a strided view of the class's buffer
    ``buffers[class]`` (a 1-D tensor from element 0); small: under :data:`INDEXED_NUMEL`.
    """
    out: list[SendPart | Indexed] = []
    run: list[SendPart] = []
    run_cls = -1

    def close() -> None:
        if len(run) > 1:
            out.append(Indexed(buffers[run_cls], _index(run).to(buffers[run_cls].device)))
        else:
            out.extend(run)
        run.clear()

    for part, cls in zip(parts, classes, strict=True):
        numel = part[2] if isinstance(part, list) else part.numel()  # type: ignore[union-attr]
        if cls is None or numel >= INDEXED_NUMEL:
            close()
            out.append(part)
            continue
        if cls != run_cls:
            close()
            run_cls = cls
        run.append(part)
    close()
    return out


Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, strides)


def _index(parts: list[SendPart]) -> torch.Tensor:
    """Where the parts' elements lie in their buffer, one part after the other (row-major).

    Consecutive parts of one shape and strides share a pattern (offsets from their first
    element), so a run of them costs a few tensor operations, not one per part.
    """
    segments: list[torch.Tensor] = []
    patterns: dict[Layout, torch.Tensor] = {}
    starts: list[int] = []
    key: Layout | None = None

    def flush() -> None:
        if starts:
            assert key is not None
            pattern = patterns.get(key)
            if pattern is None:
                pattern = patterns[key] = strided_pattern(*key)
            segments.append(expand(starts, pattern))
            starts.clear()

    for part in parts:
        layout: Layout
        if isinstance(part, list):
            layout, start = ((part[2],), (1,)), part[1]
        else:
            assert isinstance(part, torch.Tensor)
            layout, start = (tuple(part.shape), tuple(part.stride())), int(part.storage_offset())
        if layout != key:
            flush()
            key = layout
        starts.append(start)
    flush()
    return torch.cat(segments)


@dataclass(slots=True)
class PayloadLayout:
    """Where each active matrix parameter's payload lives in the flat buffers."""

    views: dict[int, tuple[int, int]] = field(default_factory=dict)  # param -> (class, offset)
    sizes: list[int] = field(default_factory=list)
    classes: dict[Dtypes, int] = field(default_factory=dict)

    def place(self, param: int, numel: int, dtypes: Dtypes) -> None:
        """Give ``param`` its ``numel`` elements in the class of ``dtypes`` (once)."""
        if param not in self.views:
            self.views[param] = self.reserve(numel, dtypes)

    def reserve(self, numel: int, dtypes: Dtypes) -> tuple[int, int]:
        """``numel`` elements at the end of the class of ``dtypes``: (class, offset)."""
        cls = self.classes.setdefault(dtypes, len(self.classes))
        if cls == len(self.sizes):
            self.sizes.append(0)
        self.sizes[cls] += numel
        return cls, self.sizes[cls] - numel
