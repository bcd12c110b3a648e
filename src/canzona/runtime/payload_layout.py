"""Where a step's payloads lie in its flat buffers, and the send parts cut from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from canzona.runtime.buffers import Selector

Dtypes = tuple[torch.dtype, torch.dtype]  # (prepared, payload): a buffer class
SendPart = tuple[int, int, int] | torch.Tensor | tuple[torch.Tensor, Selector] | list[int]


def add_part(parts: list[SendPart], part: SendPart) -> None:
    """Append a send part (a buffer range extends the last one where it follows it)."""
    last = parts[-1] if parts else None
    if isinstance(part, tuple) and len(part) == 3:
        cls, off, numel = part
        if isinstance(last, list) and last[0] == cls and last[1] + last[2] == off:
            last[2] += numel
        else:
            parts.append([cls, off, numel])
    else:
        parts.append(part)


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
