"""Split parameters (fused QKV, heads, stacks) equal their blocks as separate parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

import canzona
from canzona import Split

from _cases import (
    assert_bitwise,
    compare,
    full_tensors,
    grad_steps,
    plan,
    set_grads,
    sharded_params,
    strategies,
)
from _dist import mesh

KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
SHAPES: dict[str, tuple[int, ...]] = {
    "qkv": (16, 12),  # q 8, k 4, v 4 rows: uneven blocks that straddle row shards
    "o": (12, 16),  # four heads of 4 columns each
    "experts": (3, 8, 6),  # a stack whose matrices split into two row blocks
    "plain": (10, 12),  # an unsplit matrix in the same optimizer
}
SPLITS = {
    "qkv": Split(dim=0, sizes=(8, 4, 4)),
    "o": Split(dim=1, size=4),
    "experts": Split(dim=0, size=4),
}


def _blocks(t: torch.Tensor, split: Split) -> list[torch.Tensor]:
    """The blocks of a matrix (or of every matrix of a stack), as separate tensors."""
    mats = [t] if t.ndim == 2 else list(t)
    out = []
    for mat in mats:
        extent = mat.shape[split.dim]
        for a, b in split.spans(extent):
            out.append(mat[a:b] if split.dim == 0 else mat[:, a:b])
    return out


def _join(blocks: list[torch.Tensor], like: torch.Tensor, split: Split) -> torch.Tensor:
    per = len(blocks) // (1 if like.ndim == 2 else like.shape[0])
    mats = [torch.cat(blocks[i : i + per], dim=split.dim) for i in range(0, len(blocks), per)]
    return mats[0] if like.ndim == 2 else torch.stack(mats)


def reference_blocks(
    fulls: dict[str, torch.Tensor],
    grads: list[dict[str, torch.Tensor]],
    make: Any,
    splits: dict[str, Split] = SPLITS,
) -> dict[str, torch.Tensor]:
    """Each block of each split parameter as its own parameter of one optimizer ``make``."""
    out: dict[str, torch.Tensor] = {}
    for name, full in fulls.items():
        split = splits.get(name)
        mats = _blocks(full, split) if split else ([full] if full.ndim == 2 else list(full))
        ps = [nn.Parameter(m.clone()) for m in mats]
        opt = make(ps)
        for g in grads:
            gs = (
                _blocks(g[name], split)
                if split
                else ([g[name]] if full.ndim == 2 else list(g[name]))
            )
            for p, gg in zip(ps, gs, strict=True):
                p.grad = gg.clone()
            opt.step()
        got = [p.detach() for p in ps]
        out[name] = (
            _join(got, full, split) if split else (got[0] if full.ndim == 2 else torch.stack(got))
        )
    return out


def _groups(params: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = [
        {"params": [(n, p)], "split": SPLITS[n]} for n, p in params if n in SPLITS
    ]
    plain = [(n, p) for n, p in params if n not in SPLITS]
    return [*groups, {"params": plain}] if plain else groups


def _case(
    mesh_shape: tuple[int, ...], placements: dict[str, tuple[Placement, ...]]
) -> dict[str, Any]:
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 3)
    want = reference_blocks(fulls, grads, lambda ps: torch.optim.Muon(ps, **KW))
    dm = mesh(mesh_shape)
    out: dict[str, Any] = {}
    for strategy in strategies():
        params = sharded_params(fulls, dm, placements)
        opt = canzona.Muon(_groups(params), **KW, plan=plan(strategy))
        for g in grads:
            set_grads(params, g)
            opt.step()
            opt.zero_grad(set_to_none=True)
        got = {n: p.full_tensor() for n, p in params}
        out[strategy] = compare(got, want)
    return out


BLOCKS_VS_TORCH = "blocks not bitwise torch.optim.Muon"


def test_single_device_blocks_match_torch_muon() -> None:
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 3)
    want = reference_blocks(fulls, grads, lambda ps: torch.optim.Muon(ps, **KW))
    params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    opt = canzona.Muon(_groups(params), **KW)
    for g in grads:
        set_grads(params, g)
        opt.step()
    got = {n: p.detach() for n, p in params}
    for name, (eq, rel) in compare(got, want).items():
        assert eq, f"{name}: {rel}"


ROWS = {n: (Shard(0),) if len(s) == 2 else (Shard(1),) for n, s in SHAPES.items()}


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [
        ((4,), ROWS),
        ((4,), {n: (Shard(len(s) - 1),) for n, s in SHAPES.items()}),
        ((2, 2), {n: (Shard(len(s) - 2), Shard(len(s) - 1)) for n, s in SHAPES.items()}),
        ((2, 2), {n: (Replicate(), Shard(len(s) - 2)) for n, s in SHAPES.items()}),
        # each rank's rows of a split parameter are two runs (rows 0-3 and 8-11 of q/k/v on
        # the first ranks): blocks meet the second run part-way through the local shard
        (
            (2, 2),
            {
                n: (_StridedShard(len(s) - 2, split_factor=2), Shard(len(s) - 1))
                if n in SPLITS
                else (Shard(0), Shard(1))
                for n, s in SHAPES.items()
            },
        ),
    ],
    ids=["rows", "columns", "2d", "hsdp", "strided-rows"],
)
def test_blocks_on_meshes_match_torch_muon(dist: Any, mesh_shape: Any, placements: Any) -> None:
    assert_bitwise(dist(4).run(_case, mesh_shape, placements), BLOCKS_VS_TORCH)


def _fsdp_tp_case() -> dict[str, bool]:
    """parallelize_module + fully_shard: q/k/v blocks cut through ``_StridedShard`` runs."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(12, 16, bias=False), nn.Linear(16, 12, bias=False))
    fulls = {"qkv": ref[0].weight.detach().clone(), "o": ref[1].weight.detach().clone()}
    model = nn.Sequential(nn.Linear(12, 16, bias=False), nn.Linear(16, 12, bias=False))
    model.load_state_dict(ref.state_dict())
    dm = mesh((2, 2), ("dp", "tp"))
    parallelize_module(model, dm["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=dm["dp"])
    names = {"0.weight": "qkv", "1.weight": "o"}
    params = [(names[n], p) for n, p in model.named_parameters()]
    assert "_StridedShard" in repr(params[0][1].placements)
    gen = torch.Generator().manual_seed(5)
    grads = [{n: torch.randn(t.shape, generator=gen) for n, t in fulls.items()} for _ in range(3)]
    want = reference_blocks(fulls, grads, lambda ps: torch.optim.Muon(ps, **KW))
    opt = canzona.Muon(_groups(params), **KW)
    for g in grads:
        set_grads(params, g)
        opt.step()
    return {n: bool(torch.equal(p.full_tensor(), want[n])) for n, p in params}


def test_blocks_across_strided_shards_match_torch_muon(dist: Any) -> None:
    for out in dist(4).run(_fsdp_tp_case):
        assert out == {"qkv": True, "o": True}


OWNER_KW: dict[str, dict[str, Any]] = {
    "Shampoo": {"lr": 0.01, "precondition_frequency": 2, "start_preconditioning_step": 2},
    "SOAP": {"lr": 0.01, "precondition_frequency": 2},
}


def _owner_case(name: str) -> dict[str, Any]:
    """Shampoo/SOAP on blocks equal themselves on the separate blocks; a checkpoint taken
    mid-run (per-block owner state) resumes on another plan and continues exactly."""
    cls = getattr(canzona, name)
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 4)
    want = reference_blocks(fulls, grads, lambda ps: cls(ps, **OWNER_KW[name]))
    params = sharded_params(fulls, mesh((4,)), ROWS)
    opt = cls(_groups(params), **OWNER_KW[name])
    for g in grads[:2]:
        set_grads(params, g)
        opt.step()
    sd = opt.state_dict()
    keys = sorted(k for k in sd["state"][0] if "#" in k)
    opt = cls(_groups(params), **OWNER_KW[name], plan=plan("round_robin"))
    opt.load_state_dict(sd)
    for g in grads[2:]:
        set_grads(params, g)
        opt.step()
    got = {n: p.full_tensor() for n, p in params}
    return {"same": {n: eq for n, (eq, _) in compare(got, want).items()}, "keys": keys}


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_owner_state_per_block_matches_separate_blocks(dist: Any, name: str) -> None:
    for out in dist(4).run(_owner_case, name):
        assert all(out["same"].values()), out["same"]
        assert out["keys"] and all(k.rsplit("#", 1)[1] in {"0", "1", "2"} for k in out["keys"])


# ---------------------------------------------------- two ranks, default settings, FSDP2 / TP
TWO_SPLITS = {
    "qkv": Split(dim=0, sizes=(12, 4, 4)),  # GQA: q's 12 rows straddle the shard boundary at 10
    "q": Split(dim=0, size=4),  # heads: 0 on rank 0, 1 across the boundary at 6, 2 on rank 1
    "o": Split(dim=1, size=4),  # column heads: across every row shard (FSDP), like q (TP)
}
TWO_PLACEMENTS = {
    "fsdp": {"qkv": "S(0)", "q": "S(0)", "o": "S(0)"},
    "tp": {"qkv": "S(0)", "q": "S(0)", "o": "S(1)"},
}


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(12, 20, bias=False)
        self.q = nn.Linear(12, 12, bias=False)
        self.o = nn.Linear(12, 12, bias=False)


def _declaration_errors(model: nn.Module) -> tuple[list[str], int]:
    """The messages of bad split declarations, and how many collectives they issued."""
    import torch.distributed as tdist

    group = tdist.distributed_c10d._get_default_group()  # mesh((2,)) runs on it
    before = group._get_sequence_number_for_group()
    bad = Split(dim=0, sizes=(8, 4, 4))
    attempts = [
        lambda: canzona.param_groups(model, split={"nothing.*": Split(dim=0, size=4)}),
        lambda: canzona.param_groups(model, split={"qkv.weight": bad}),
        lambda: canzona.Muon([{"params": [("qkv.weight", model.qkv.weight)], "split": bad}]),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    return messages, group._get_sequence_number_for_group() - before


def _two_rank_case(layout: str) -> dict[str, Any]:
    """canzona.Muon's defaults on fused qkv and per-head blocks of an FSDP2 or a TP model."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = _Attention()
    fulls = {n.split(".")[0]: p.detach().clone() for n, p in model.named_parameters()}
    if layout == "fsdp":
        fully_shard(model, mesh=mesh((2,)))
    else:
        plan_tp = {"qkv": ColwiseParallel(), "q": ColwiseParallel(), "o": RowwiseParallel()}
        parallelize_module(model, mesh((2,)), plan_tp)
    errors, collectives = _declaration_errors(model)
    placements = {n.split(".")[0]: str(p.placements[0]) for n, p in model.named_parameters()}
    splits = {f"{n}.weight": s for n, s in TWO_SPLITS.items()}
    opt = canzona.Muon(canzona.param_groups(model, split=splits))
    params = [(n.split(".")[0], p) for n, p in model.named_parameters()]
    gen = torch.Generator().manual_seed(5)
    grads = [{n: torch.randn(t.shape, generator=gen) for n, t in fulls.items()} for _ in range(3)]
    for g in grads:
        set_grads(params, g)
        opt.step()
    want = reference_blocks(fulls, grads, lambda ps: torch.optim.Muon(ps), TWO_SPLITS)
    got = {n: p.full_tensor() for n, p in params}
    (qkv_group,) = [g for g in opt.param_groups if g["param_names"] == ["qkv.weight"]]
    declared = qkv_group["split"]
    qkv_group["split"] = Split(dim=0, sizes=(8, 4))  # edited between steps: 12 of 20 rows
    edited = []
    for _ in range(2):  # refused at every step until resolved
        try:
            opt.step()
            edited.append("no error")
        except canzona.UpdateFailedError as exc:
            edited.append(str(exc))
    qkv_group["split"] = declared
    opt.step()  # resolved: the step goes on
    return {
        "same": compare(got, want),
        "placements": placements,
        "errors": errors,
        "collectives": collectives,
        "edited": edited,
    }


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_blocks_on_two_ranks_with_defaults_match_torch_muon(dist: Any, layout: str) -> None:
    """Default canzona.Muon on a (2,) mesh is torch.optim.Muon on the separate blocks; bad
    declarations, made first, raise the same message on both ranks and issue no collective.

    Catches: a block straddling the one shard boundary gathered from the wrong offset (or
    from its first rank only), defaults that differ from torch's, a declaration checked after
    (or inside) a collective, a message that differs between ranks, and a split edited into
    a bad one between steps failing the step without naming its parameter."""
    out = dist(2).run(_two_rank_case, layout)
    assert_bitwise([{layout: r["same"]} for r in out], BLOCKS_VS_TORCH)
    assert all(r["placements"] == TWO_PLACEMENTS[layout] for r in out), out[0]["placements"]
    errors = [r["errors"] for r in out]
    assert errors[0] == errors[1], errors
    nothing, summed, raw = errors[0]
    assert "'nothing.*' matches no parameter" in nothing
    sums = "Split sizes (8, 4, 4) sum to 16, but dimension 0 of the matrix has 20"
    assert f"parameter 'qkv.weight': {sums}" in summed
    assert f"parameter 'qkv.weight': {sums}" in raw
    assert [r["collectives"] for r in out] == [0, 0]
    edited = "parameter 'qkv.weight': Split sizes (8, 4) sum to 12, but dimension 0 of the matrix"
    assert all(edited in message for r in out for message in r["edited"]), out[0]["edited"]


#: Equal row blocks (heads) and experts split into blocks: 3-D targets of 30 and 24 elements.
BF16_SHAPES = {
    "heads": (12, 10),
    "experts": (3, 8, 6),
    "rows": (2, 8, 6),
    "square_columns": (16, 32),
    "wide_columns": (4, 48),
    "tall_columns": (40, 24),
}
BF16_SPLITS = {
    **{n: Split(dim=0, size=3 if n == "heads" else 4) for n in ("heads", "experts", "rows")},
    "square_columns": Split(dim=1, size=16),
    "wide_columns": Split(dim=1, size=24),
    "tall_columns": Split(dim=1, sizes=(8, 16)),
}


def test_bf16_blocks_on_one_device_equal_torch_muon_per_block() -> None:
    """Catches: a half-precision stack of blocks updated whole (row blocks of a split matrix,
    blocks of every expert): CPU element-wise kernels round a bf16 element by its place in
    the tensor they are given, so the blocks differed from torch.optim.Muon on each alone."""
    fulls = {n: t.bfloat16() for n, t in full_tensors(BF16_SHAPES).items()}
    grads = [{n: t.bfloat16() for n, t in g.items()} for g in grad_steps(BF16_SHAPES, 5)]
    want = reference_blocks(fulls, grads, lambda ps: torch.optim.Muon(ps, **KW), BF16_SPLITS)
    params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    groups = [{"params": [(n, p)], "split": BF16_SPLITS[n]} for n, p in params]
    opt = canzona.Muon(groups, **KW)
    for g in grads:
        set_grads(params, g)
        opt.step()
    same = {n: torch.equal(p.detach(), want[n]) for n, p in params}
    assert same == dict.fromkeys(BF16_SHAPES, True)
