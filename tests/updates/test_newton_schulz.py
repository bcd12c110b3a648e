"""Newton–Schulz: bitwise parity with torch's Muon, batch == loop, the published singular band."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from canzona.updates import (
    DEFAULT_NS_COEFFICIENTS,
    MIN_BATCHED_SIDE,
    batch_kernels_exact,
    newton_schulz,
    newton_schulz_flops,
)

# tall, wide, square, a small odd shape (batched kernels never used), a row vector
SHAPES = [(24, 16), (16, 24), (32, 32), (64, 96), (96, 64), (5, 9), (9, 5), (1, 17)]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_bitwise_equal_to_torch_muon(shape: tuple[int, int]) -> None:
    x = _randn(*shape)
    expected = torch_ns(x.clone(), DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(newton_schulz(x), expected)
    # other coefficients, step counts and eps go through unchanged
    coeffs = (3.0, -3.2, 1.2)
    expected = torch_ns(x.clone(), coeffs, 3, 1e-3)
    assert torch.equal(newton_schulz(x, coefficients=coeffs, steps=3, eps=1e-3), expected)


def test_bf16_input_is_not_modified() -> None:
    # torch's version divides its argument in place when it already is bf16
    x = _randn(16, 24).bfloat16()
    before = x.clone()
    out = newton_schulz(x)
    assert torch.equal(x, before)
    assert torch.equal(out, torch_ns(x.clone(), DEFAULT_NS_COEFFICIENTS, 5, 1e-7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 16), (16, 48), (32, 32), (5, 9), (9, 5)])
def test_batched_equals_loop_bitwise(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = _randn(2, 3, *shape, seed=1)
    out = newton_schulz(x, dtype=dtype)
    assert out.shape == x.shape and out.dtype == dtype
    loop = torch.stack([newton_schulz(m, dtype=dtype) for m in x.reshape(6, *shape)])
    assert torch.equal(out, loop.reshape(x.shape))
    # small half-precision matrices never take the batched kernels: a probe cannot see
    # their rare rounding differences; fp32 ones do where the probe passes
    uses_batched = batch_kernels_exact(6, *shape, dtype=dtype)
    assert not uses_batched or min(shape) >= MIN_BATCHED_SIDE or dtype == torch.float32


@pytest.mark.parametrize("shape", [(8, 8), (16, 8), (6, 8), (11, 11), (5, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_wide_dtype_stacks_batched_where_the_probe_passes(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """Catches: small fp32/fp64 stacks batched without the probe (6 x 8 and 11 x 11 round
    differently with torch 2.13's batched CPU kernels, on every input), and the probe
    skipped for them altogether (8 x 8 and 16 x 8 batch bit for bit: the per-matrix loop
    costs ~16 µs a matrix where the stack costs ~1, docs/optimizers.md)."""
    x = _randn(64, *shape, seed=5)
    loop = torch.stack([newton_schulz(m, dtype=dtype, steps=2) for m in x])
    assert torch.equal(newton_schulz(x, dtype=dtype, steps=2), loop)
    if shape in ((8, 8), (16, 8)):
        assert batch_kernels_exact(64, *shape, dtype=dtype, schedule=(DEFAULT_NS_COEFFICIENTS,) * 2)
        assert not batch_kernels_exact(64, *shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("coefficients", [DEFAULT_NS_COEFFICIENTS, "polar_express"])
@pytest.mark.parametrize(
    ("in_dtype", "dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.float32),
        (torch.float64, torch.float32),
    ],
)
@pytest.mark.parametrize("shape", [(8, 8), (5, 9), (12, 5), (5, 12), (1, 7)])
def test_small_stack_equals_torch_muon_matrix_by_matrix(
    shape: tuple[int, int], in_dtype: torch.dtype, dtype: torch.dtype, coefficients: object
) -> None:
    """Catches: products on matrices that start off an allocation boundary (5 x 9 fp32 rounds
    differently there), element-wise ops on the stack that differ from the per-matrix ones.

    Small stacks run matrix by matrix with the element-wise ops on the whole stack; every
    matrix must equal the 2-D path bit for bit, and the 2-D path equals torch's function,
    including a zero matrix (the clamp), a large and a tiny scale, bf16 inputs that are not
    cast, and a norm scale other than 1 (``polar_express``)."""
    x = _randn(7, *shape, seed=5)
    x[2] = 0
    x[3] *= 1e4
    x[4] *= 1e-4
    x = x.to(in_dtype)
    out = newton_schulz(x, coefficients=coefficients, dtype=dtype)  # type: ignore[arg-type]
    loop = [newton_schulz(m, coefficients=coefficients, dtype=dtype) for m in x]  # type: ignore[arg-type]
    assert out.dtype == dtype
    for got, want in zip(out, loop, strict=True):
        assert torch.equal(got, want)
    if coefficients == DEFAULT_NS_COEFFICIENTS and dtype == torch.bfloat16:
        for got, m in zip(out, x, strict=True):
            assert torch.equal(got, torch_ns(m.clone(), DEFAULT_NS_COEFFICIENTS, 5, 1e-7))


def test_stack_norms_equal_matrix_norms_below_the_grain() -> None:
    """The measured fact behind the per-matrix loop's one norm call per stack on the CPU:
    for matrices of at most 32768 elements (ATen's reduction grain), the norms of a stack,
    transposed or not, in fp32, bf16 and fp16, equal each matrix's own norm bit for bit.

    Catches: a torch build that sums a stack's matrices in another order (the loop would
    then no longer equal torch.optim.Muon on small matrices)."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(120):
        m = int(torch.randint(1, 200, (1,), generator=gen))
        n = int(torch.randint(1, max(2, min(200, 32768 // m)), (1,), generator=gen))
        dtype = (torch.float32, torch.bfloat16, torch.float16)[trial % 3]
        x = (torch.randn(3, m, n, generator=gen) * 10.0 ** (trial % 5 - 2)).to(dtype)
        for stack in (x, x.mT):
            each = torch.stack([torch.linalg.vector_norm(one) for one in stack.unbind(0)])
            assert torch.equal(torch.linalg.vector_norm(stack, dim=(-2, -1)), each), (m, n)


@pytest.mark.parametrize("shape", [(16, 4096), (4096, 16)])
def test_small_side_stack_of_large_matrices_equals_matrix_by_matrix(
    shape: tuple[int, int],
) -> None:
    """Matrices above the reduction grain take one norm call each in the loop."""
    x = _randn(3, *shape, seed=9)
    loop = torch.stack([newton_schulz(m, steps=1) for m in x])
    assert torch.equal(newton_schulz(x, steps=1), loop)


def test_side_16_bf16_stack_that_batched_kernels_round_differently() -> None:
    """Catches: a minimum side of 16 (or any below 17). This (16, 16, 64) input passes the
    probe's shape check yet rounds differently with batched bf16 kernels on torch 2.13's CPU
    build; the default must run it matrix by matrix, as torch.optim.Muon does."""
    x = _randn(16, 16, 64, seed=12)
    loop = torch.stack([newton_schulz(m) for m in x])
    assert torch.equal(newton_schulz(x), loop)
    assert not batch_kernels_exact(16, 16, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forced_batched_kernels_match_loop_above_min_side(dtype: torch.dtype) -> None:
    # The measured fact behind the default: at these sizes this backend's baddbmm/bmm and
    # batched norm reproduce addmm/mm/norm bit for bit.
    x = _randn(4, 48, 32, seed=2)
    forced = newton_schulz(x, dtype=dtype, batched=True)
    loop = newton_schulz(x, dtype=dtype, batched=False)
    assert torch.equal(forced, loop)
    assert batch_kernels_exact(4, 48, 32, dtype=dtype)


def _skew_stacks(monkeypatch: pytest.MonkeyPatch, *, steps: int, norm_scale: float) -> None:
    """Make the batched kernels differ from the loop by one ulp, only for schedules of
    ``steps`` iterations and the given norm scale; clear the probe's verdicts."""
    mod = importlib.import_module("canzona.updates.newton_schulz")  # the function shadows it

    real = mod._ns_stack
    monkeypatch.setattr(mod, "_BATCH_EXACT", {})

    def skewed(
        x: torch.Tensor,
        schedule: tuple[tuple[float, float, float], ...],
        eps: float,
        dtype: torch.dtype,
        scale: float,
    ) -> torch.Tensor:
        out = real(x, schedule, eps, dtype, scale)
        if len(schedule) == steps and scale == norm_scale:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))
        return out

    monkeypatch.setattr(mod, "_ns_stack", skewed)


def test_the_probe_judges_each_schedule_and_norm_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a verdict reused for another schedule or norm scale (BLAS may special-case
    some scalars), or a probe run with another norm scale than the one asked about."""
    _skew_stacks(monkeypatch, steps=2, norm_scale=1.01)
    schedule = (DEFAULT_NS_COEFFICIENTS,) * 2
    assert batch_kernels_exact(4, 48, 32, dtype=torch.float32, schedule=schedule)
    assert not batch_kernels_exact(
        4, 48, 32, dtype=torch.float32, schedule=schedule, norm_scale=1.01
    )
    three = schedule[:1] * 3
    assert batch_kernels_exact(4, 48, 32, dtype=torch.float32, schedule=three, norm_scale=1.01)


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_singular_values_land_in_the_quintic_band(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    # Input with singular values spread over [1, 10]. Five steps of the quintic
    # p(s) = 3.4445 s - 4.7750 s^3 + 2.0315 s^5 leave every singular value oscillating in about
    # [0.68, 1.13] (measured; torch's docstring says "roughly 0.5-1.5"); the band asserted adds
    # margin for bf16 rounding. The spread (max / min) drops from 10 to under 2.
    m, n = shape
    k = min(m, n)
    u = torch.linalg.qr(_randn(m, m, seed=3))[0][:, :k]
    v = torch.linalg.qr(_randn(n, n, seed=4))[0][:, :k]
    x = u @ torch.diag(torch.linspace(1, 10, k)) @ v.T
    s = torch.linalg.svdvals(newton_schulz(x, dtype=dtype).double())
    assert s.min() > 0.6 and s.max() < 1.25, (s.min().item(), s.max().item())
    assert s.max() / s.min() < 2.0


@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (64, 96)])
def test_fp32_close_to_bf16(shape: tuple[int, int]) -> None:
    # bf16 keeps 8 significant bits (relative rounding 2^-9 per op); over 5 steps of 3 matmuls
    # the two paths drift apart by 1-2 % (measured), well below the 5 % asserted.
    x = _randn(*shape, seed=5)
    a = newton_schulz(x, dtype=torch.float32).double()
    b = newton_schulz(x, dtype=torch.bfloat16).double()
    assert ((a - b).norm() / a.norm()).item() < 0.05


def test_zero_and_empty_inputs() -> None:
    zero = newton_schulz(torch.zeros(3, 16, 24))
    assert torch.equal(zero, torch.zeros(3, 16, 24, dtype=torch.bfloat16))
    assert newton_schulz(torch.zeros(0, 4, 5)).shape == (0, 4, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 100}, "steps"),
        ({"steps": -1}, "steps"),
        ({"coefficients": (1.0, 2.0)}, "coefficients"),
        ({"eps": 0.0}, "eps"),
        ({"dtype": torch.int32}, "dtype"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.ones(4, 4), **kwargs)  # type: ignore[arg-type]


def test_needs_a_matrix() -> None:
    with pytest.raises(ValueError, match="shape"):
        newton_schulz(torch.ones(4))


def test_flops() -> None:
    assert newton_schulz_flops(8, 2, steps=1) == 4 * 4 * 8 + 2 * 8
    assert newton_schulz_flops(2, 8) == newton_schulz_flops(8, 2) == 5 * (4 * 4 * 8 + 2 * 8)
