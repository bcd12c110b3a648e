"""What the planner knows about one matrix: name, shape, payload size and eligible ranks."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

__all__ = ["MatrixSpec", "Ranks", "check_specs"]


#: The largest payload of one spec: torch sizes tensors in int64.
MAX_BYTES = 2**63 - 1


class Ranks(tuple[int, ...]):
    """A tuple of ranks that computes its hash, and a set for membership, once.

    A job's rank sets (a mesh copy, the ranks that update a matrix) hold up to thousands of
    ranks; while a plan is built and routed they key dictionaries and are asked whether they
    hold a rank once per matrix, where a plain tuple hashes every element on every lookup
    and scans up to its end for the last ranks. Equal to, and hashing like, the plain tuple.
    """

    def __hash__(self) -> int:
        cached: int | None = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached

    def __contains__(self, rank: object) -> bool:
        members: frozenset[object] | None = self.__dict__.get("members")
        if members is None:
            members = self.__dict__["members"] = frozenset(self)
        return rank in members

    def __reduce__(self) -> tuple[type[Ranks], tuple[tuple[int, ...]]]:
        """Pickled as its ranks alone (what it caches is rebuilt where it is used)."""
        return (Ranks, (tuple(self),))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rank_ints(values: Sequence[object]) -> bool:
    """Whether every value is an int >= 0 (no bool): C-level passes, for units of 1000s."""
    kinds = set(map(type, values))
    if not all(issubclass(k, int) and not issubclass(k, bool) for k in kinds):
        return False
    return min(cast("Sequence[int]", values), default=0) >= 0


def _increasing(values: Sequence[int]) -> bool:
    """Whether the values are sorted and unique."""
    return all(map(operator.lt, values, itertools.islice(values, 1, None)))


#: The rank tuple last found valid: specs built from one unit share the object (a tuple
#: never changes), so thousands of specs check hundreds of ranks once.
_valid: list[tuple[int, ...] | None] = [None]


@dataclass(frozen=True, slots=True)
class MatrixSpec:
    """One matrix (or a stack of matrices) updated as a whole by a single owner rank.

    A 2-D ``shape`` ``(m, n)`` is one matrix; a 3-D shape ``(batch, m, n)`` is a stack of
    ``batch`` matrices that are updated independently but always travel together (for example
    the experts of a fused MoE weight).

    Attributes:
        name: Unique name of the parameter inside a plan (for example its FQN).
        shape: ``(m, n)`` or ``(batch, m, n)``, every dimension positive.
        itemsize: Bytes per element of the payload that travels to the owner (4 for fp32).
        ranks: The ranks allowed to own the matrix, sorted and unique; ``None`` means every
            rank. Checked against the number of ranks when owners are assigned.
        cost_key: Which cost model of a :class:`~canzona.plan.GroupedCost` prices this
            matrix (e.g. its param group, whose hyper-parameters set the work); ``None``
            for a single cost model.
        holders: Ranks that already hold the whole matrix (sorted, unique; a subset of the
            eligible ranks), e.g. the rank holding an expert under expert parallelism.
            Owning it there moves no bytes, so ``canzona`` and ``numel`` start it on one of
            them (``canzona``'s refinement moves it when that strictly lowers the
            makespan, the move's transfer counted on the owner and each holder where the
            cost model measured a rate). ``None``: no rank holds it whole.
        pinned: Never move it off its holders (a matrix of a stack sharded over its
            leading dimension: expert parallelism places experts by design).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int = 4
    ranks: tuple[int, ...] | None = None
    cost_key: str | None = None
    holders: tuple[int, ...] | None = None
    pinned: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"MatrixSpec name must be a non-empty string, got {self.name!r}")
        shape = self.shape
        if not isinstance(shape, Sequence) or isinstance(shape, str):
            raise ValueError(f"MatrixSpec {self.name!r}: shape must be a tuple, got {shape!r}")
        if len(shape) not in (2, 3):
            raise ValueError(f"MatrixSpec {self.name!r}: shape must be 2-D or 3-D, got {shape!r}")
        if not all(_is_int(d) and d > 0 for d in shape):
            raise ValueError(
                f"MatrixSpec {self.name!r}: dimensions must be positive integers, got {shape!r}"
            )
        object.__setattr__(self, "shape", tuple(shape))
        if not _is_int(self.itemsize) or self.itemsize < 1:
            raise ValueError(
                f"MatrixSpec {self.name!r}: itemsize must be an integer >= 1, got {self.itemsize!r}"
            )
        if math.prod(shape) * self.itemsize > MAX_BYTES:
            raise ValueError(
                f"MatrixSpec {self.name!r}: shape {tuple(shape)} of {self.itemsize}-byte items "
                f"exceeds {MAX_BYTES} bytes (a tensor's size is an int64)"
            )
        if self.ranks is not None and self.ranks is not _valid[0]:
            ranks = self.ranks
            if isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence):
                raise ValueError(f"MatrixSpec {self.name!r}: ranks must be a tuple, got {ranks!r}")
            if not ranks:
                raise ValueError(
                    f"MatrixSpec {self.name!r}: ranks must not be empty, got {ranks!r}"
                )
            if not _rank_ints(ranks):
                raise ValueError(
                    f"MatrixSpec {self.name!r}: ranks must be integers >= 0, got {ranks!r}"
                )
            if not _increasing(ranks):
                raise ValueError(
                    f"MatrixSpec {self.name!r}: ranks must be sorted and unique, got {ranks!r}"
                )
            object.__setattr__(self, "ranks", ranks if type(ranks) is Ranks else Ranks(ranks))
            _valid[0] = self.ranks
        if self.holders is not None:
            holders = tuple(self.holders)
            if not _rank_ints(holders):
                raise ValueError(
                    f"MatrixSpec {self.name!r}: holders must be integers >= 0, got {holders!r}"
                )
            if not holders or not _increasing(holders):
                raise ValueError(
                    f"MatrixSpec {self.name!r}: holders must be sorted, unique and not empty, "
                    f"got {self.holders!r}"
                )
            if self.ranks is not None and not set(holders) <= set(self.ranks):
                raise ValueError(
                    f"MatrixSpec {self.name!r}: holders must be eligible ranks, got {holders!r}"
                )
            object.__setattr__(self, "holders", holders)
        if not isinstance(self.pinned, bool):  # a digest writes it: True, never 1
            raise ValueError(
                f"MatrixSpec {self.name!r}: pinned must be a bool, got {self.pinned!r}"
            )
        if self.pinned and self.holders is None:
            raise ValueError(f"MatrixSpec {self.name!r}: pinned needs holders, got None")
        if self.cost_key is not None and not isinstance(self.cost_key, str):
            raise ValueError(
                f"MatrixSpec {self.name!r}: cost_key must be a string or None, "
                f"got {self.cost_key!r}"
            )

    @property
    def batch(self) -> int:
        """Number of stacked matrices (1 for a 2-D shape)."""
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def m(self) -> int:
        """Rows of each matrix."""
        return self.shape[-2]

    @property
    def n(self) -> int:
        """Columns of each matrix."""
        return self.shape[-1]

    @property
    def numel(self) -> int:
        """Number of elements over the whole stack."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Payload size in bytes: ``numel * itemsize``."""
        return self.numel * self.itemsize

    def eligible(self, num_ranks: int) -> tuple[int, ...]:
        """The ranks allowed to own this matrix among ``range(num_ranks)``."""
        return tuple(range(num_ranks)) if self.ranks is None else self.ranks

    def comm_bytes_on(self, rank: int, full: int) -> int:
        """Bytes that travel to ``rank`` if it owns the matrix: none for a holder."""
        return 0 if self.holders is not None and rank in self.holders else full


def check_specs(specs: Sequence[MatrixSpec], num_ranks: int) -> None:
    """Validate a list of specs against a number of ranks.

    Args:
        specs: The matrices of one plan.
        num_ranks: Number of ranks the plan spreads them over.

    Raises:
        ValueError: On a non-integer or non-positive ``num_ranks``, an entry that is not a
            :class:`MatrixSpec`, a duplicate name, or an eligible rank outside the world.
    """
    if not _is_int(num_ranks) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, MatrixSpec):
            raise ValueError(f"expected MatrixSpec entries, got {spec!r}")
        if spec.name in seen:
            raise ValueError(f"duplicate matrix name in one plan, got {spec.name!r}")
        seen.add(spec.name)
        if spec.holders is not None and spec.holders[-1] >= num_ranks:
            raise ValueError(
                f"MatrixSpec {spec.name!r}: holders must be < num_ranks={num_ranks}, "
                f"got {spec.holders!r}"
            )
        if spec.ranks is not None and spec.ranks[-1] >= num_ranks:
            raise ValueError(
                f"MatrixSpec {spec.name!r}: eligible ranks must be < num_ranks={num_ranks}, "
                f"got {spec.ranks!r}"
            )
