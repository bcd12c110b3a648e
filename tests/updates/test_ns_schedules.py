"""Newton–Schulz schedules: the published sets, what they do, how values resolve, clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from canzona.updates import (
    DEFAULT_NS_COEFFICIENTS,
    NS_SCHEDULES,
    batch_kernels_exact,
    newton_schulz,
    newton_schulz_flops,
    ns_norm_scale,
    resolve_ns_coefficients,
)

# Typed again from the listing of "The Polar Express" (arXiv 2505.16932), before its safety
# scaling, so that a typo in the library's table or a wrong safety exponent fails below.
PAPER_POLAR_EXPRESS = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _compose(schedule: tuple[tuple[float, float, float], ...], x: torch.Tensor) -> torch.Tensor:
    """The scalar map that the iteration applies to every singular value."""
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


def _with_singular_values(m: int, n: int, values: torch.Tensor) -> torch.Tensor:
    k = min(m, n)
    u = torch.linalg.qr(_randn(m, m, seed=3, dtype=torch.float64))[0][:, :k]
    v = torch.linalg.qr(_randn(n, n, seed=4, dtype=torch.float64))[0][:, :k]
    return u @ torch.diag(values) @ v.T


def test_quintic_and_a_triple_are_torchs_default_repeated() -> None:
    assert resolve_ns_coefficients("quintic") == (DEFAULT_NS_COEFFICIENTS,) * 5
    assert resolve_ns_coefficients("quintic", 3) == (DEFAULT_NS_COEFFICIENTS,) * 3
    assert resolve_ns_coefficients(DEFAULT_NS_COEFFICIENTS) == (DEFAULT_NS_COEFFICIENTS,) * 5
    assert resolve_ns_coefficients([3, -3.2, 1.2], 2) == ((3.0, -3.2, 1.2),) * 2
    assert resolve_ns_coefficients((1.0, 2.0, 3.0), 0) == ()
    assert all(isinstance(x, float) for x in resolve_ns_coefficients([3, -3, 1], 1)[0])


def test_an_explicit_schedule_sets_the_number_of_iterations() -> None:
    schedule = [(4.0, -6.0, 3.0), [3.0, -3.0, 1.0]]
    assert resolve_ns_coefficients(schedule) == ((4.0, -6.0, 3.0), (3.0, -3.0, 1.0))
    assert resolve_ns_coefficients(schedule, 2) == resolve_ns_coefficients(schedule)


def test_named_sets_take_their_first_steps_and_repeat_the_last() -> None:
    # The rule of the Polar Express code and of the Canzona paper's reference code.
    full = resolve_ns_coefficients("polar_express")
    assert len(full) == 8 and len(resolve_ns_coefficients("tuned_quintic")) == 5
    assert resolve_ns_coefficients("polar_express", 5) == full[:5]
    assert resolve_ns_coefficients("polar_express", 10) == (*full, full[-1], full[-1])
    assert resolve_ns_coefficients("polar_express", 0) == ()


def test_polar_express_is_the_published_set_with_its_safety_scaling() -> None:
    # Every polynomial but the last becomes p(x / 1.01): a / 1.01, b / 1.01^3, c / 1.01^5.
    expected = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PAPER_POLAR_EXPRESS[:-1])
    assert resolve_ns_coefficients("polar_express") == (*expected, PAPER_POLAR_EXPRESS[-1])
    assert ns_norm_scale("polar_express") == 1.01
    for name in ("quintic", "tuned_quintic", "qwen_express"):
        assert ns_norm_scale(name) == 1.0
    assert ns_norm_scale((1.0, 2.0, 3.0)) == ns_norm_scale([(1.0, 2.0, 3.0)]) == 1.0
    assert set(NS_SCHEDULES) == {"quintic", "polar_express", "tuned_quintic", "qwen_express"}


@pytest.mark.parametrize(
    ("name", "steps", "low", "band"),
    [
        # Polar Express is optimal for singular values in [1e-3, 1] (after its 1.01 margin):
        # eight polynomials take all of them to 1 (measured: within 4e-15).
        ("polar_express", 8, 1e-3, (1 - 1e-12, 1 + 1e-12)),
        ("qwen_express", 8, 1e-3, (1 - 1e-12, 1 + 1e-12)),
        # Five of them already give [0.840, 1.124]; torch's quintic leaves [0.682, 1.134]
        # even from 1e-2; the tuned quintics [0.978, 1.032] (float64, docs/optimizers.md
        # quotes them: bands of the quoted digits).
        ("polar_express", 5, 1e-3, (0.8395, 1.1245)),
        ("quintic", 5, 1e-2, (0.6815, 1.1345)),
        ("tuned_quintic", 5, 1e-2, (0.9775, 1.0325)),
    ],
)
def test_composed_polynomials_give_the_published_band(
    name: str, steps: int, low: float, band: tuple[float, float]
) -> None:
    x = torch.logspace(torch.log10(torch.tensor(low)).item(), 0, 20001, dtype=torch.float64)
    y = _compose(resolve_ns_coefficients(name, steps), x / ns_norm_scale(name))
    assert band[0] < y.min().item() and y.max().item() < band[1], (y.min(), y.max())


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 0.01)],
)
@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_polar_express_orthogonalises_ill_conditioned_matrices(
    shape: tuple[int, int], dtype: torch.dtype, tolerance: float
) -> None:
    # Singular values over [0.01, 1] (condition number 100): after the Frobenius normalisation
    # they lie in [1.8e-3, 1], inside the interval the paper optimised for. The default quintic
    # leaves them far apart; Polar Express takes them to 1 up to the dtype's rounding
    # (measured: 1e-15 in float64, 3e-7 in float32, 5e-3 in bf16).
    x = _with_singular_values(*shape, torch.logspace(-2, 0, min(shape), dtype=torch.float64))
    s = torch.linalg.svdvals(newton_schulz(x, coefficients="polar_express", dtype=dtype).double())
    assert (s - 1).abs().max().item() < tolerance
    quintic = torch.linalg.svdvals(newton_schulz(x, dtype=dtype).double())
    assert (quintic - 1).abs().max().item() > 0.1


def test_default_paths_are_torchs_bit_for_bit() -> None:
    x = _randn(24, 16)
    expected = torch_ns(x.clone(), DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    for coefficients in ("quintic", DEFAULT_NS_COEFFICIENTS, [DEFAULT_NS_COEFFICIENTS] * 5):
        assert torch.equal(newton_schulz(x, coefficients=coefficients), expected), coefficients
    assert torch.equal(newton_schulz(x, coefficients="quintic", steps=5), expected)


def _float64_schedule(x: torch.Tensor, schedule: list[tuple[float, float, float]]) -> torch.Tensor:
    """Newton–Schulz written out in float64 (x wide)."""
    x = x / x.norm()
    for a, b, c in schedule:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_schedule_runs_in_its_order(shape: tuple[int, int]) -> None:
    # Iteration k uses triple k: a reversed or shifted schedule differs by far more than the
    # float64 rounding the comparison allows.
    x = _randn(*shape, seed=5, dtype=torch.float64)
    schedule = list(resolve_ns_coefficients("tuned_quintic"))
    wide = x if shape[0] <= shape[1] else x.T
    expected = _float64_schedule(wide, schedule)
    expected = expected if shape[0] <= shape[1] else expected.T
    out = newton_schulz(x, coefficients=schedule, dtype=torch.float64)
    assert (out - expected).abs().max().item() < 1e-12
    reversed_out = newton_schulz(x, coefficients=schedule[::-1], dtype=torch.float64)
    assert (reversed_out - expected).abs().max().item() > 1e-3


def test_polar_express_divides_the_norm_by_its_margin() -> None:
    x = _randn(32, 48, seed=6)
    schedule = resolve_ns_coefficients("polar_express")
    named = newton_schulz(x, coefficients="polar_express", dtype=torch.float32)
    explicit = newton_schulz(x, coefficients=schedule, norm_scale=1.01, dtype=torch.float32)
    assert torch.equal(named, explicit)
    unscaled = newton_schulz(x, coefficients=schedule, dtype=torch.float32)
    assert not torch.equal(named, unscaled)  # an explicit schedule has no margin by default
    override = newton_schulz(x, coefficients="polar_express", norm_scale=1.0, dtype=torch.float32)
    assert torch.equal(override, unscaled)
    five = newton_schulz(x, coefficients="polar_express", steps=5, dtype=torch.float32)
    assert torch.equal(
        five, newton_schulz(x, coefficients=schedule[:5], norm_scale=1.01, dtype=torch.float32)
    )


@pytest.mark.parametrize("name", ["polar_express", "tuned_quintic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 16), (16, 48), (5, 9)])
def test_batched_equals_loop_bitwise_with_schedules(
    shape: tuple[int, int], dtype: torch.dtype, name: str
) -> None:
    x = _randn(2, 3, *shape, seed=7)
    out = newton_schulz(x, coefficients=name, dtype=dtype)
    loop = torch.stack(
        [newton_schulz(m, coefficients=name, dtype=dtype) for m in x.reshape(6, *shape)]
    )
    assert torch.equal(out, loop.reshape(x.shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forced_batched_kernels_match_loop_with_polar_express(dtype: torch.dtype) -> None:
    # The probe runs the schedule itself (and its norm margin), and on this backend the batched
    # kernels reproduce the per-matrix ones for it too.
    x = _randn(4, 48, 32, seed=8)
    forced = newton_schulz(x, coefficients="polar_express", dtype=dtype, batched=True)
    loop = newton_schulz(x, coefficients="polar_express", dtype=dtype, batched=False)
    assert torch.equal(forced, loop)
    schedule = resolve_ns_coefficients("polar_express")
    assert batch_kernels_exact(4, 48, 32, dtype=dtype, schedule=schedule, norm_scale=1.01)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("value", "steps", "match"),
    [
        ((), None, r"must not be empty, got \(\)"),
        ([], 3, r"must not be empty, got \[\]"),
        ((1.0, 2.0), None, r"three coefficients \(a, b, c\), got \(1\.0, 2\.0\)"),
        ((1.0, 2.0, 3.0, 4.0), None, r"three coefficients .*got \(1\.0, 2\.0, 3\.0, 4\.0\)"),
        ([(1.0, 2.0, 3.0), (1.0, 2.0)], None, r"ns_coefficients\[1\] .*got \(1\.0, 2\.0\)"),
        ((1.0, NAN, 3.0), None, r"finite, got \(1\.0, nan, 3\.0\)"),
        ([(1.0, 2.0, 3.0), (INF, 2.0, 3.0)], None, r"ns_coefficients\[1\] must be finite"),
        ((1.0, True, 3.0), None, r"real numbers, got \(1\.0, True, 3\.0\)"),
        ([(1.0, 2.0, 3.0), 4.0], None, r"ns_coefficients\[1\] must be a sequence .*got 4\.0"),
        ([(1.0, 2.0, 3.0), "abc"], None, r"ns_coefficients\[1\] must be a sequence .*'abc'"),
        ("polar", None, r"one of \['polar_express', .*got 'polar'"),
        (3.0, None, r"a name, an \(a, b, c\) triple or a sequence of triples, got 3\.0"),
        ([(1.0, 2.0, 3.0)] * 2, 3, r"ns_steps=3 contradicts the schedule of 2 iterations"),
        ([(1.0, 2.0, 3.0)] * 100, None, r"fewer than 100 iterations, got 100"),
        (DEFAULT_NS_COEFFICIENTS, 100, r"ns_steps .*\[0, 100\), got 100"),
        ("quintic", -1, r"ns_steps .*got -1"),
        ("quintic", 2.0, r"ns_steps .*got 2\.0"),
    ],
)
def test_invalid_coefficients_name_the_offending_value(
    value: object, steps: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_ns_coefficients(value, steps)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):  # newton_schulz resolves the same way
        newton_schulz(torch.ones(4, 4), coefficients=value, steps=steps)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [0.0, -1.0, NAN, INF])
def test_norm_scale_must_be_positive_and_finite(scale: float) -> None:
    with pytest.raises(ValueError, match=f"norm_scale .*{scale!r}"):
        newton_schulz(torch.ones(4, 4), norm_scale=scale)
    with pytest.raises(ValueError, match="unknown Newton–Schulz coefficient set"):
        ns_norm_scale("nope")


def test_flops_count_the_schedule_length() -> None:
    steps = len(resolve_ns_coefficients("polar_express"))
    assert newton_schulz_flops(8, 2, steps=steps) == 8 * (4 * 4 * 8 + 2 * 8)


def test_resolved_schedules_are_reused_only_for_the_same_values() -> None:
    """A step resolves the schedule once per batch, so results are reused by value.
    Catches: a cache keyed by equality alone (``True == 1``: a refused bool would be accepted
    after an accepted 1, a -0.0 would come back as 0.0), or by the list object (a list
    changed in place would keep its old schedule)."""
    assert resolve_ns_coefficients((1, 2.0, 3.0), 2) == ((1.0, 2.0, 3.0),) * 2
    with pytest.raises(ValueError, match="three real numbers"):
        resolve_ns_coefficients((True, 2.0, 3.0), 2)
    with pytest.raises(ValueError, match=r"ns_steps .*got True"):
        resolve_ns_coefficients((1, 2.0, 3.0), True)  # type: ignore[arg-type]
    schedule = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert resolve_ns_coefficients(schedule) == ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0))
    schedule[1][0] = 7.0
    assert resolve_ns_coefficients(schedule) == ((1.0, 2.0, 3.0), (7.0, 5.0, 6.0))
    assert math.copysign(1.0, resolve_ns_coefficients((3.0, 0.0, 2.0), 1)[0][1]) == 1.0
    assert math.copysign(1.0, resolve_ns_coefficients((3.0, -0.0, 2.0), 1)[0][1]) == -1.0
    assert resolve_ns_coefficients("quintic", 3) == resolve_ns_coefficients("quintic", 3)
    assert len(resolve_ns_coefficients("quintic", 3)) == 3
