"""The pure parts of the cross-rank checks: who is named first, what a riding header says."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from canzona.runtime.checks import (
    RIDE_READY,
    RIDE_WORDS,
    describe_groups,
    differing_params,
    digest_chunks,
    first_difference,
    header_values,
    ranks_by_value,
    ride_agrees,
    ride_header,
)


def test_the_majority_is_named_first_and_ties_by_lowest_rank() -> None:
    """Catches: an odd rank 0 named as if it were the majority (errors would blame the
    three ranks that agree)."""
    assert ranks_by_value(["b", "a", "a", "a"]) == [("a", [1, 2, 3]), ("b", [0])]
    assert ranks_by_value(["y", "x", "x", "y"]) == [("y", [0, 3]), ("x", [1, 2])]


def test_digests_travel_as_three_exact_40_bit_words() -> None:
    words = digest_chunks("f" * 64)
    assert words == [(1 << 40) - 1] * 3 and all(w < 2**63 for w in words)
    assert digest_chunks("") == [0, 0, 0]


def test_a_riding_header_goes_on_only_when_equal_and_ready() -> None:
    header = header_values(
        num_params=3,
        structure="ab" * 32,
        plan="cd" * 32,
        hparams="ef" * 32,
        has_grad=[True, True, False],
        failed=False,
        nonfinite=False,
        needs_setup=False,
    )
    ready, not_ready = ride_header(header, True), ride_header(header, False)
    assert len(ready) == RIDE_WORDS and ready[RIDE_READY] == 1 and not_ready[RIDE_READY] == 0
    assert ride_agrees([ready, ready])
    assert not ride_agrees([not_ready, not_ready])  # equal, but nobody prepared by the plan
    assert not ride_agrees([ready, not_ready])  # one rank computed nothing: not the others
    assert not ride_agrees([not_ready, ready])
    assert not ride_agrees([ready, ride_header([4, *header[1:]], True)])


class _Hook:
    """A param-group value the hyper-parameter check compares by its type alone."""


def test_the_difference_named_is_the_value_not_an_objects_address() -> None:
    """Catches: ``repr``s with memory addresses in the description, so that two ranks'
    copies of an object sorted before ``lr`` were named as the difference instead of ``lr``."""
    ranks = [describe_groups([{"hook": _Hook(), "lr": lr, "params": []}]) for lr in (0.1, 0.2)]
    assert ranks[0][0] == ranks[1][0] and " at 0x" not in ranks[0][0]
    assert first_difference(ranks, 0, 1) == (
        "entry 1: rank 0 has param group 0 lr=0.1, rank 1 has param group 0 lr=0.2"
    )


def _differing(monkeypatch: pytest.MonkeyPatch, per_rank: list[list[str]]) -> str | None:
    """:func:`differing_params` on rank 0 of ranks holding ``per_rank``, collectives faked."""
    from canzona.runtime import checks

    def rows(values: list[int], **_: object) -> list[list[int]]:
        return [
            [len(v), *digest_chunks(hashlib.sha256(repr(v).encode()).hexdigest())] for v in per_rank
        ]

    monkeypatch.setattr(checks, "gather_ints", rows)
    monkeypatch.setattr(checks, "gather_objects", lambda obj, **_: per_rank)
    runtime = SimpleNamespace(process_group=object(), watchdog=None)
    names = [f"w{i}" for i in range(len(per_rank[0]))]
    return differing_params(per_rank[0], names, runtime, what="a test")  # type: ignore[arg-type]


def test_differing_params_names_each_rank_value_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: a load that goes on when the ranks' texts differ, a description that names
    a parameter every rank agrees on, or one that drops the ranks' values; and an empty
    description where the ranks only hold different numbers of parameters."""
    same = [["step 2.0", "no state"]] * 3
    assert _differing(monkeypatch, same) is None
    one = [["step 2.0", "step 2.0"], ["step 2.0", "no state"], ["step 2.0", "step 2.0"]]
    assert _differing(monkeypatch, one) == "'w1': step 2.0 on ranks [0, 2], no state on ranks [1]"
    many = [["a"] * 5, ["b"] * 5]
    got = _differing(monkeypatch, many)
    assert got is not None and got.count("'w") == 3 and got.endswith(" and 2 more"), got
    assert _differing(monkeypatch, [["a"], ["a", "b"]]) == "[1, 2] parameters on the ranks"
