"""MatrixSpec validation and the closed forms of the cost models."""

from __future__ import annotations

import pytest

from canzona.plan import (
    COST_MODELS,
    AdamWCost,
    CostModel,
    GroupedCost,
    MatrixSpec,
    MuonCost,
    PlanConfig,
    ShampooCost,
    SoapCost,
    build_plan,
    cost_model,
    lower_bound,
)
from canzona.plan.cost import NORMUON_ELEMENTWISE


def test_spec_properties() -> None:
    s = MatrixSpec("w", (3, 4, 8), itemsize=2)
    assert (s.batch, s.m, s.n, s.numel, s.nbytes) == (3, 4, 8, 96, 192)
    t = MatrixSpec("v", (5, 7))
    assert (t.batch, t.m, t.n, t.numel, t.nbytes, t.ranks) == (1, 5, 7, 35, 140, None)
    assert MatrixSpec("r", (2, 2), ranks=(1, 3)).eligible(4) == (1, 3)
    assert t.eligible(3) == (0, 1, 2)


def test_spec_normalises_sequences() -> None:
    s = MatrixSpec("w", [2, 3], ranks=[0, 2])  # type: ignore[arg-type]
    assert s.shape == (2, 3) and s.ranks == (0, 2)
    assert hash(s) == hash(MatrixSpec("w", (2, 3), ranks=(0, 2)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "", "shape": (2, 2)}, "non-empty string"),
        ({"name": "w", "shape": (2,)}, "2-D or 3-D"),
        ({"name": "w", "shape": (1, 2, 3, 4)}, "2-D or 3-D"),
        ({"name": "w", "shape": (0, 2)}, "positive integers"),
        ({"name": "w", "shape": (2, -1)}, "positive integers"),
        ({"name": "w", "shape": (2.0, 2)}, "positive integers"),
        ({"name": "w", "shape": "ab"}, "must be a tuple"),
        ({"name": "w", "shape": (2, 2), "itemsize": 0}, "itemsize"),
        ({"name": "w", "shape": (2, 2), "ranks": ()}, "must not be empty"),
        ({"name": "w", "shape": (2, 2), "ranks": (2, 1)}, "sorted and unique"),
        ({"name": "w", "shape": (2, 2), "ranks": (1, 1)}, "sorted and unique"),
        ({"name": "w", "shape": (2, 2), "ranks": (-1, 1)}, ">= 0"),
        ({"name": "w", "shape": (2**31, 2**31), "itemsize": 2}, r"exceeds 9223372036854775807"),
        ({"name": "w", "shape": (2, 2), "itemsize": 10**400}, r"exceeds 9223372036854775807"),
        ({"name": "w", "shape": (2, 2), "holders": (0, "x")}, r"holders must be integers >= 0"),
        ({"name": "w", "shape": (2, 2), "holders": (0,), "pinned": 1}, "pinned must be a bool"),
        ({"name": "w", "shape": (2, 2), "holders": (0,), "pinned": "no"}, "pinned must be a bool"),
    ],
)
def test_spec_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MatrixSpec(**kwargs)  # type: ignore[arg-type]


def test_muon_closed_form() -> None:
    muon = MuonCost()
    # a=4, b=8: (4 a^2 b + 2 a^3) = 640 per iteration, 5 iterations, + 10 m n
    assert muon.flops(MatrixSpec("w", (4, 8))) == 5 * 640 + 10 * 32
    assert muon.flops(MatrixSpec("w", (8, 4))) == 5 * 640 + 10 * 32
    assert muon.flops(MatrixSpec("w", (3, 4, 8))) == 3 * (5 * 640 + 10 * 32)
    assert MuonCost(ns_steps=1).flops(MatrixSpec("w", (4, 8))) == 640 + 320


def test_muon_costs_a_schedule_by_its_length_and_normuon_by_its_extra_elementwise_work() -> None:
    # The planner costs the iterations a coefficient schedule runs (one triple each), so the
    # eight Polar Express polynomials cost 8 / 5 of the default's Newton-Schulz work; a
    # zero-length schedule leaves the element-wise work only.
    spec = MatrixSpec("w", (4, 8))
    assert MuonCost(ns_steps=8).flops(spec) == 8 * 640 + 10 * 32
    assert MuonCost(ns_steps=0).flops(spec) == 10 * 32
    normuon = cost_model("muon", ns_steps=5, extra_elementwise=NORMUON_ELEMENTWISE)
    assert normuon.flops(spec) == 5 * 640 + (10 + 6) * 32
    assert normuon.flops(MatrixSpec("w", (3, 4, 8))) == 3 * normuon.flops(spec)


def test_shampoo_closed_form() -> None:
    spec = MatrixSpec("w", (4, 8))
    # 2 m^2 n (stat) + 2 m^2 n (precond) + 2 m n^2 + 2 m n^2 + 10 (m^3 + n^3) / 20 + 12 m n
    assert ShampooCost().flops(spec) == pytest.approx(256 + 256 + 512 + 512 + 288 + 384)
    # the 8-wide side above max_precond_dim: no statistic, preconditioning or root for it
    assert ShampooCost(max_precond_dim=6).flops(spec) == pytest.approx(512 + 32 + 384)
    assert ShampooCost(max_precond_dim=2).flops(spec) == pytest.approx(384)


def test_soap_closed_form() -> None:
    spec = MatrixSpec("w", (4, 8))
    refresh = (2 + 8 / 3) * (64 + 512) / 10
    assert SoapCost().flops(spec) == pytest.approx(3 * 256 + 3 * 512 + refresh + 384)
    only_left = 3 * 256 + (2 + 8 / 3) * 64 / 10 + 384
    assert SoapCost(max_precond_dim=4).flops(spec) == pytest.approx(only_left)
    assert SoapCost().flops(MatrixSpec("w", (2, 4, 8))) == pytest.approx(2 * SoapCost().flops(spec))


def test_adamw_and_bytes() -> None:
    spec = MatrixSpec("w", (2, 3, 5), itemsize=2)
    for model in (MuonCost(), ShampooCost(), SoapCost(), AdamWCost()):
        assert isinstance(model, CostModel)
        assert model.comm_bytes(spec) == model.memory_bytes(spec) == 60
    assert AdamWCost().flops(spec) == 12 * 30


def test_square_matrix_costs_more_than_tall_skinny_per_byte() -> None:
    muon = MuonCost()
    square, tall = MatrixSpec("s", (1024, 1024)), MatrixSpec("t", (8192, 128))
    assert square.nbytes == tall.nbytes
    assert muon.flops(square) > 5 * muon.flops(tall)


def test_cost_model_factory() -> None:
    assert set(COST_MODELS) == {"muon", "shampoo", "soap", "adamw"}
    assert cost_model("muon") == MuonCost()
    assert cost_model("muon", ns_steps=3).ns_steps == 3  # type: ignore[attr-defined]
    soap = cost_model("soap", precondition_frequency=5, max_precond_dim=64)
    assert soap == SoapCost(precondition_frequency=5, max_precond_dim=64)
    assert cost_model("shampoo").name == "shampoo"
    with pytest.raises(ValueError, match="unknown optimizer"):
        cost_model("lion")
    with pytest.raises(ValueError, match="takes"):
        cost_model("muon", beta=0.9)
    with pytest.raises(ValueError, match="ns_steps"):
        cost_model("muon", ns_steps=-1)
    with pytest.raises(ValueError, match=r"ns_steps.*True"):
        cost_model("muon", ns_steps=True)
    with pytest.raises(ValueError, match="extra_elementwise"):
        cost_model("muon", extra_elementwise=-1)
    with pytest.raises(ValueError, match="precondition_frequency"):
        cost_model("soap", precondition_frequency=0)


class _OddMemory(MuonCost):
    """Muon's prices with a custom model's bytes in flight (``self.memory``)."""

    memory: float = float("nan")

    def memory_bytes(self, spec: MatrixSpec) -> int:
        return self.memory  # type: ignore[return-value]


@pytest.mark.parametrize(
    "memory", [float("nan"), -1.0, float("inf"), 10**400], ids=["nan", "negative", "inf", "huge"]
)
def test_a_price_that_is_no_finite_size_is_named(memory: float) -> None:
    """Catches: a custom model's bytes in flight taken unchecked (NaN or negative sizes put
    every matrix in one micro-group past the capacity), a huge int overflowing the check."""
    model = _OddMemory()
    object.__setattr__(model, "memory", memory)
    specs = [MatrixSpec(f"m{i}", (8, 8)) for i in range(6)]
    config = PlanConfig(strategy="numel", capacity_mb=104 / 2**20)
    with pytest.raises(
        ValueError, match=r"matrix 'm0' \(8, 8\) at 16000\.0 \(work\) and \S+ bytes in flight"
    ):
        build_plan(specs, 2, optimizer=model, config=config)


def test_the_planning_helpers_name_bad_arguments() -> None:
    """Catches: ZeroDivisionError, IndexError or AttributeError from deep inside for a
    world of 0, a pinned rank outside it, or a list given for GroupedCost's mapping."""
    with pytest.raises(ValueError, match="num_ranks must be an integer >= 1, got 0"):
        lower_bound([1.0], 0)
    with pytest.raises(ValueError, match=r"pinned needs one rank in \[0, 2\) .* got \[5\]"):
        lower_bound([1.0], 2, [5])
    with pytest.raises(ValueError, match="GroupedCost maps str keys to cost models, got list"):
        GroupedCost([("a", MuonCost())])  # type: ignore[arg-type]
