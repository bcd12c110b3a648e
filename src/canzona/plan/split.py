"""A parameter that is several matrices along one dimension: fused QKV, gate/up, heads."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, SupportsIndex

__all__ = ["Split"]


def _as_int(value: object) -> int | None:
    """``value`` as a plain ``int`` when it is an integer (``numpy.int64`` too), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


@dataclass(frozen=True, slots=True)
class Split:
    """Declares that a matrix is several matrices along one of its two dimensions.

    Each block is its own matrix for the algorithm (own momentum direction, own
    preconditioners, own learning-rate adjustment by its shape) and its own item for the
    planner (own owner, cost and bytes). ``dim`` counts the matrix's dimensions: 0 splits
    the rows (a fused ``qkv_proj`` or ``gate_up_proj``, the heads of ``q_proj``), 1 the
    columns (the heads of ``o_proj``); for a 3-D stack ``(E, m, n)`` it applies to every
    matrix of the stack.

    Give either ``sizes`` (the blocks in order, e.g. ``(q, k, v)`` for grouped-query
    attention) or ``size`` (equal blocks, e.g. the head dimension).

    Attributes:
        dim: 0 (rows) or 1 (columns).
        sizes: The block sizes, in order.
        size: The size of every block.
    """

    dim: int
    sizes: tuple[int, ...] | None = None
    size: int | None = None

    if TYPE_CHECKING:  # what the constructor takes; the fields hold plain ints after it

        def __init__(
            self,
            dim: SupportsIndex,
            sizes: Sequence[SupportsIndex] | None = None,
            size: SupportsIndex | None = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        dim = _as_int(self.dim)
        if dim not in (0, 1):
            raise ValueError(f"Split.dim must be 0 (rows) or 1 (columns), got {self.dim!r}")
        object.__setattr__(self, "dim", dim)
        if (self.sizes is None) == (self.size is None):
            raise ValueError(
                f"Split takes exactly one of sizes= and size=, got sizes={self.sizes!r}, "
                f"size={self.size!r}"
            )
        if self.sizes is not None:
            sizes = self.sizes
            if not isinstance(sizes, Sequence) and callable(getattr(sizes, "tolist", None)):
                sizes = sizes.tolist()  # a 1-D numpy array or tensor of sizes
            if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence) or not sizes:
                raise ValueError(f"Split.sizes must be a non-empty tuple, got {self.sizes!r}")
            ints = [_as_int(s) for s in sizes]
            if not all(i is not None and i > 0 for i in ints):
                raise ValueError(f"Split.sizes must be positive integers, got {self.sizes!r}")
            # plain ints: the blocks' description is compared across ranks by its repr
            object.__setattr__(self, "sizes", tuple(ints))
        else:
            size = _as_int(self.size)
            if size is None or size <= 0:
                raise ValueError(f"Split.size must be a positive integer, got {self.size!r}")
            object.__setattr__(self, "size", size)

    def spans(self, extent: int, *, name: str = "the parameter") -> tuple[tuple[int, int], ...]:
        """The blocks' ``(start, stop)`` along a dimension of ``extent`` elements.

        Raises:
            ValueError: naming ``name`` when the blocks do not tile the dimension.
        """
        if self.sizes is not None:
            sizes = self.sizes
            if sum(sizes) != extent:
                raise ValueError(
                    f"{name}: Split sizes {sizes} sum to {sum(sizes)}, but dimension "
                    f"{self.dim} of the matrix has {extent}"
                )
        else:
            assert self.size is not None
            if extent % self.size:
                raise ValueError(
                    f"{name}: dimension {self.dim} of the matrix has {extent} elements, not a "
                    f"multiple of Split size {self.size}"
                )
            sizes = (self.size,) * (extent // self.size)
        bounds = (0, *itertools.accumulate(sizes))
        return tuple(itertools.pairwise(bounds))

    def shapes(self, m: int, n: int, *, name: str = "the parameter") -> tuple[tuple[int, int], ...]:
        """The ``(rows, cols)`` of every block of an ``m x n`` matrix."""
        if self.dim == 0:
            return tuple((b - a, n) for a, b in self.spans(m, name=name))
        return tuple((m, b - a) for a, b in self.spans(n, name=name))

    def describe(self) -> tuple[object, ...]:
        """A plain, process-independent value (compared across ranks)."""
        return ("Split", self.dim, self.sizes, self.size)
