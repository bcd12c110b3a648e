"""canzona.Muon on one device gives torch.optim.Muon's parameters, bit for bit."""

from __future__ import annotations

import copy
import io
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

import canzona
from canzona.updates.batched import LERP_OUT_NUMEL

SHAPES = {
    "square": (16, 16),
    "tall": (24, 8),
    "wide": (8, 24),
    "odd": (7, 13),
    "skinny": (33, 5),
    "row": (1, 9),
}
STEPS = 4


def _start(
    shapes: Sequence[tuple[int, int]], seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(2 * STEPS)]
    return values, grads


def _run(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    values: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    params = [nn.Parameter(v.clone()) for v in values]
    opt = make(params)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()
    return params, opt


def _assert_same(ours: list[nn.Parameter], theirs: list[nn.Parameter], what: Any) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), (
            f"{what}: parameter {i} differs by {(a - b).abs().max().item():.3g}"
        )


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_torch_muon(shape: str, adjust_lr_fn: str | None) -> None:
    values, grads = _start([SHAPES[shape]])
    for weight_decay, nesterov, momentum in itertools.product(
        [0.0, 0.1], [True, False], [0.9, 0.95]
    ):
        kw = {
            "lr": 0.02,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "momentum": momentum,
            "adjust_lr_fn": adjust_lr_fn,
        }
        ours, opt = _run(lambda ps, kw=kw: canzona.Muon(ps, **kw), values, grads[:STEPS])
        theirs, ref = _run(lambda ps, kw=kw: torch.optim.Muon(ps, **kw), values, grads[:STEPS])
        _assert_same(ours, theirs, kw)
        assert torch.equal(
            opt.state[ours[0]]["momentum_buffer"], ref.state[theirs[0]]["momentum_buffer"]
        )


@pytest.mark.parametrize(
    "spelling",
    [
        {"ns_coefficients": "quintic"},
        {"ns_coefficients": [[3.4445, -4.775, 2.0315]] * 5},
        {"ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "scale": 1.0},
        {"ns_coefficients": "quintic", "ns_steps": 5, "adjust_lr_fn": "original"},
    ],
    ids=["name", "schedule", "explicit", "name_with_steps"],
)
def test_other_spellings_of_the_default_match_torch_muon(spelling: dict[str, Any]) -> None:
    """The default iteration named, listed per iteration or spelled out (``scale=1``) is still
    ``torch.optim.Muon``'s, bit for bit. Catches: a schedule path with other ops, a norm
    margin on ``"quintic"``, a ``scale`` multiply that rounds."""
    values, grads = _start([SHAPES["tall"], SHAPES["odd"]], seed=7)
    ours, _ = _run(lambda ps: canzona.Muon(ps, lr=0.02, **spelling), values, grads)
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, lr=0.02), values, grads)
    _assert_same(ours, theirs, spelling)


def test_many_parameters_and_groups() -> None:
    """Same-shape matrices (batched together) in two groups with different hyper-parameters."""
    shapes = [(16, 16), (16, 16), (24, 8), (24, 8), (8, 24), (7, 13), (16, 16)]
    values, grads = _start(shapes, seed=1)

    def groups(ps: list[nn.Parameter]) -> list[dict[str, Any]]:
        return [
            {"params": ps[:4] + ps[5:6], "lr": 0.03, "ns_steps": 4},
            {"params": ps[4:5] + ps[6:], "momentum": 0.8, "nesterov": False, "weight_decay": 0.0},
        ]

    ours, _ = _run(lambda ps: canzona.Muon(groups(ps), lr=0.02), values, grads)
    theirs, _ = _run(lambda ps: torch.optim.Muon(groups(ps), lr=0.02), values, grads)
    _assert_same(ours, theirs, "groups")


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_state_dict_save_and_load_mid_run(how: str) -> None:
    shapes = list(SHAPES.values())
    values, grads = _start(shapes, seed=2)
    kw = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, **kw), values, grads)

    half, opt = _run(lambda ps: canzona.Muon(ps, **kw), values, grads[:STEPS])
    if how == "deepcopy":
        saved = copy.deepcopy(opt.state_dict())
    else:
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
    del opt
    resumed = [nn.Parameter(p.detach().clone()) for p in half]
    fresh = canzona.Muon(resumed, **kw)
    fresh.load_state_dict(saved)
    for step in grads[STEPS:]:
        for p, g in zip(resumed, step, strict=True):
            p.grad = g.clone()
        fresh.step()
    _assert_same(resumed, theirs, "resumed")


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_a_float32_tensor_lr_is_torchs(adjust_lr_fn: str | None, weight_decay: float) -> None:
    """A float32 tensor lr: torch computes ``1 - lr * weight_decay`` and the adjusted lr as
    float32 tensors, which differ from the float products by an ulp for most values.

    Catches: the tensor read as a Python float and the products taken in float64 (the tall
    matrix at lr 0.03 differed by 1.2e-7 so)."""
    shapes = [SHAPES["square"], SHAPES["tall"], SHAPES["wide"], (16, 8)]
    values, grads = _start(shapes, seed=7)
    for lr in (0.03, 0.013, 0.0029):
        ours, _ = _run(
            lambda ps, lr=lr: canzona.Muon(
                ps, lr=torch.tensor(lr), weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn
            ),
            values,
            grads,
        )
        theirs, _ = _run(
            lambda ps, lr=lr: torch.optim.Muon(
                ps, lr=torch.tensor(lr), weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn
            ),
            values,
            grads,
        )
        _assert_same(ours, theirs, f"tensor lr {lr}")


@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float16, torch.bfloat16),
    ],
)
def test_gradients_of_another_dtype_than_the_weight(
    param_dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    """``p.grad_dtype`` (e.g. fp32 gradients of bf16 weights): the momentum takes the
    gradient's dtype and the blend is computed in it, as torch's.

    Catches: the momentum made like the weight (the step failed: "expected dtype ... for
    `end`"), or the Nesterov blend computed in the payload's dtype; the blend cast to the
    weight's dtype before Newton-Schulz's bf16 (fp16 weights with fp32 gradients: rounded
    twice, and small values lost to fp16's range), where torch casts it once."""
    values, grads = _start([SHAPES["square"], SHAPES["tall"]], seed=9)
    grads = [[g * 1e-5 for g in step] for step in grads]  # within fp16's subnormals
    runs = []
    for cls in (canzona.Muon, torch.optim.Muon):
        params = [nn.Parameter(v.to(param_dtype)) for v in values]
        for p in params:
            p.grad_dtype = grad_dtype
        opt = cls(params, lr=0.02)  # type: ignore[call-arg]
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.to(grad_dtype)
            opt.step()
        assert opt.state[params[0]]["momentum_buffer"].dtype == grad_dtype
        runs.append(params)
    _assert_same(runs[0], runs[1], (param_dtype, grad_dtype))


@pytest.mark.parametrize("cls", [canzona.Muon, canzona.NorMuon])
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype", "declared"),
    [
        (torch.bfloat16, torch.float32, True),
        (torch.float32, torch.bfloat16, True),
        (torch.bfloat16, torch.float32, False),  # grad_dtype=None: any gradient dtype
    ],
)
def test_a_momentum_in_the_gradients_dtype_survives_a_checkpoint(
    cls: type, param_dtype: torch.dtype, grad_dtype: torch.dtype, declared: bool
) -> None:
    """Saved and loaded mid-run, the momentum keeps the gradient's dtype: the run goes on
    bit for bit as if it had not stopped.

    Catches: the load casting it to the weight's dtype, as torch.optim's does (fp32 into
    bf16: the next step failed, "expected dtype c10::BFloat16 for `end`"; bf16 into fp32:
    the blend then computed in fp32), also where ``p.grad_dtype`` is None."""
    values, grads = _start([SHAPES["square"], SHAPES["tall"]], seed=10)

    def run(stop: bool) -> list[nn.Parameter]:
        params = [nn.Parameter(v.to(param_dtype)) for v in values]
        for p in params:
            p.grad_dtype = grad_dtype if declared else None
        opt = cls(params, lr=0.02)
        for t, step in enumerate(grads):
            if stop and t == STEPS // 2:
                saved = io.BytesIO()
                torch.save(opt.state_dict(), saved)
                saved.seek(0)
                opt = cls(params, lr=0.02)
                opt.load_state_dict(torch.load(saved))
                assert opt.state[params[0]]["momentum_buffer"].dtype == grad_dtype
            for p, g in zip(params, step, strict=True):
                p.grad = g.to(grad_dtype)
            opt.step()
        return params

    _assert_same(run(True), run(False), (param_dtype, grad_dtype))


@pytest.mark.parametrize("how", ["zero tensor", "clear"])
def test_a_momentum_reset_between_steps_is_torchs(how: str) -> None:
    """A job resetting the momentum mid-run (a new zero tensor, or a cleared state).

    Catches: the step's cached momentum lists outliving the user's edit of
    ``optimizer.state`` (the reset ignored: 1.6e-2 from torch)."""
    values, grads = _start([SHAPES["square"], SHAPES["tall"]], seed=8)
    runs = []
    for cls in (canzona.Muon, torch.optim.Muon):
        params = [nn.Parameter(v.clone()) for v in values]
        opt = cls(params, lr=0.02)  # type: ignore[call-arg]
        for t, step in enumerate(grads):
            if t == STEPS:
                if how == "clear":
                    opt.state.clear()
                else:
                    for p in params:
                        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        runs.append(params)
    _assert_same(runs[0], runs[1], how)


@pytest.mark.parametrize(("old", "new"), [((0, 4), (3, 4)), ((5, 6), (6, 5)), ((5, 6), (7, 6))])
def test_a_parameter_given_another_shape_is_updated_at_it(
    old: tuple[int, int], new: tuple[int, int]
) -> None:
    """``p.data`` replaced by a tensor of another shape and its state cleared, as torch.optim
    allows. Catches: the step's table keyed without shapes (a matrix empty at the first step
    never updated once filled; a new shape failing in the apply, after the decision)."""
    gen = torch.Generator().manual_seed(9)
    first, other = torch.randn(old, generator=gen), torch.randn(4, 4, generator=gen)
    replaced = torch.randn(new, generator=gen)
    grads = [(torch.randn(old, generator=gen), torch.randn(4, 4, generator=gen))]
    grads += [(torch.randn(new, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(2)]
    runs = []
    for cls in (canzona.Muon, torch.optim.Muon):
        params = [nn.Parameter(first.clone()), nn.Parameter(other.clone())]
        opt = cls(params, lr=0.02)  # type: ignore[call-arg]
        for t, step in enumerate(grads):
            if t == 1:
                params[0].data = replaced.clone()
                opt.state.pop(params[0], None)
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        runs.append(params)
    assert not torch.equal(runs[0][0], replaced)
    _assert_same(runs[0], runs[1], (old, new))


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_step_lr_scheduler(tensor_lr: bool) -> None:
    values, grads = _start([(16, 16), (24, 8)], seed=3)

    def run(cls: type[torch.optim.Optimizer]) -> list[nn.Parameter]:
        params = [nn.Parameter(v.clone()) for v in values]
        lr: float | torch.Tensor = torch.tensor(0.02) if tensor_lr else 0.02
        opt = cls(params, lr=lr)  # type: ignore[call-arg]
        scheduler = StepLR(opt, step_size=2, gamma=0.3)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
            scheduler.step()
        return params

    _assert_same(run(canzona.Muon), run(torch.optim.Muon), "scheduled")


def test_float64_parameters() -> None:
    values, grads = _start(list(SHAPES.values()), seed=4, dtype=torch.float64)
    ours, _ = _run(lambda ps: canzona.Muon(ps, lr=0.02), values, grads)
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, lr=0.02), values, grads)
    _assert_same(ours, theirs, "float64")


@pytest.mark.parametrize("shape", ["square", "wide", "odd", "row"])
def test_bfloat16_parameters(shape: str) -> None:
    """bf16 parameters with Nesterov (without it, torch's Newton–Schulz rescales its own momentum
    buffer in place: a documented torch quirk that canzona does not copy)."""
    values, grads = _start([SHAPES[shape]], seed=5, dtype=torch.bfloat16)
    ours, _ = _run(lambda ps: canzona.Muon(ps, lr=0.02), values, grads)
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, lr=0.02), values, grads)
    _assert_same(ours, theirs, "bfloat16")


@pytest.mark.parametrize("ns_steps", [5, 1, 0])
@pytest.mark.parametrize("shape", ["tall", "skinny"])
def test_bfloat16_tall_parameters(shape: str, ns_steps: int) -> None:
    """Catches: the direction of a tall matrix added in row-major layout where torch's is
    column-major (after an iteration), or column-major where it is row-major (no iteration:
    torch's two transposes cancel)."""
    values, grads = _start([SHAPES[shape]], seed=5, dtype=torch.bfloat16)
    ours, _ = _run(lambda ps: canzona.Muon(ps, lr=0.02, ns_steps=ns_steps), values, grads)
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, lr=0.02, ns_steps=ns_steps), values, grads)
    _assert_same(ours, theirs, ("bfloat16", ns_steps))


def test_bfloat16_add_depends_on_the_memory_layout() -> None:
    """The torch behaviour behind the tall-matrix case above (a torch change shows up here)."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(64, 24, generator=gen).bfloat16()
    update = torch.randn(24, 64, generator=gen).bfloat16().T
    strided = param.clone().add_(update, alpha=-0.0346)
    dense = param.clone().add_(update.contiguous(), alpha=-0.0346)
    assert not torch.equal(strided, dense)
    assert torch.equal(
        param.float().add_(update, alpha=-0.0346),
        param.float().add_(update.contiguous(), alpha=-0.0346),
    )


def test_groups_with_different_ns_dtype() -> None:
    values, grads = _start([(16, 16), (16, 16)], seed=6)

    def joint(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return canzona.Muon(
            [
                {"params": ps[:1], "ns_dtype": torch.bfloat16},
                {"params": ps[1:], "ns_dtype": torch.float32},
            ]
        )

    ours, _ = _run(joint, values, grads)
    first, _ = _run(
        lambda ps: canzona.Muon(ps, ns_dtype=torch.bfloat16), values[:1], [g[:1] for g in grads]
    )
    second, _ = _run(
        lambda ps: canzona.Muon(ps, ns_dtype=torch.float32), values[1:], [g[1:] for g in grads]
    )
    _assert_same(ours, first + second, "ns_dtype groups")


@pytest.mark.parametrize("nesterov", [True, False])
def test_large_cpu_payloads_are_prepared_in_their_travel_dtype(nesterov: bool) -> None:
    """On the CPU the Nesterov blend (or the momentum) of an fp32 matrix of at least
    ``LERP_OUT_NUMEL`` elements is written straight in the payload's (Newton–Schulz) bf16,
    with no fp32 copy staged and cast; a smaller one is staged in fp32 and cast. Both give
    torch.optim.Muon's parameters bit for bit. Catches: the large payload prepared in fp32
    again (a cast every step), the small one written in bf16 (a call per tensor for runs of
    small ones), and a blend that rounds differently from torch's."""
    values, grads = _start([(128, 96), (16, 16)])
    assert 128 * 96 >= LERP_OUT_NUMEL > 16 * 16
    kw = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov}
    ours, opt = _run(lambda ps: canzona.Muon(ps, **kw), values, grads[:STEPS])
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, **kw), values, grads[:STEPS])
    _assert_same(ours, theirs, kw)
    (pipeline,) = opt._runtime._pipelines.values()  # type: ignore[attr-defined]
    schedule = pipeline.schedule
    assert [v.dtype for _, v in sorted(schedule.payload.items())] == [
        torch.bfloat16,
        torch.float32,
    ]
    assert [(a.dtype, b.dtype) for a, b in schedule.casts] == [(torch.float32, torch.bfloat16)]
