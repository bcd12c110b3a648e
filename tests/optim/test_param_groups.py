"""canzona.param_groups routes a model's parameters as documented, and AdamW groups are AdamW."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import canzona

V, D = 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D, bias=False)
        self.mlp_norm = nn.RMSNorm(D)
        self.experts = nn.Parameter(torch.randn(4, D, 2 * D) / D**0.5)  # grouped experts
        self.gate = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        x = x + self.proj(v * torch.sigmoid(q * k))
        h = torch.einsum("btd,edf->btef", self.mlp_norm(x), self.experts).mean(dim=2)
        a, b = h.chunk(2, dim=-1)
        return x + self.gate * torch.tanh(a) * b


class Tiny(nn.Module):
    def __init__(self, *, tied: bool, head: str = "lm_head") -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(D)
        self.head_name = head
        self.add_module(head, nn.Linear(D, V, bias=False))
        if tied:
            getattr(self, head).weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = getattr(self, self.head_name)(self.norm(x))
        return out


def _model(*, tied: bool = False, head: str = "lm_head") -> Tiny:
    torch.manual_seed(0)
    return Tiny(tied=tied, head=head)


MATRICES = [f"blocks.{i}.{n}" for i in range(2) for n in ("qkv.weight", "proj.weight", "experts")]
OTHERS = [
    f"blocks.{i}.{n}"
    for i in range(2)
    for n in (
        "attn_norm.weight",
        "attn_norm.bias",
        "qkv.bias",
        "mlp_norm.weight",
        "gate",
    )
]


def _routing(groups: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for group in groups:
        out[group.get("algorithm", "matrix")] = [n for n, _ in group["params"]]
    return out


@pytest.mark.parametrize("head", ["lm_head", "output"])
def test_default_routing_untied(head: str) -> None:
    model = _model(head=head)
    routing = _routing(canzona.param_groups(model))
    assert sorted(routing["matrix"]) == sorted(MATRICES)
    assert sorted(routing["adamw"]) == sorted(
        ["embed.weight", "norm.weight", f"{head}.weight", *OTHERS]
    )


def test_default_routing_tied() -> None:
    model = _model(tied=True)
    routing = _routing(canzona.param_groups(model))
    assert sorted(routing["matrix"]) == sorted(MATRICES)
    # named_parameters() lists a tied weight once, under its first name
    assert sorted(routing["adamw"]) == sorted(["embed.weight", "norm.weight", *OTHERS])


def test_weight_tied_to_an_embedding_under_any_name() -> None:
    model = _model(tied=True, head="unembed")
    routing = _routing(canzona.param_groups(model))
    assert "embed.weight" in routing["adamw"]
    assert sorted(routing["matrix"]) == sorted(MATRICES)


def test_groups_hold_named_parameters_of_the_model() -> None:
    model = _model()
    groups = canzona.param_groups(model)
    by_name = dict(model.named_parameters())
    for group in groups:
        for name, p in group["params"]:
            assert p is by_name[name]
    assert sum(len(g["params"]) for g in groups) == len(by_name)


def test_overrides() -> None:
    model = _model()
    groups = canzona.param_groups(
        model,
        to_adamw=["blocks.1.*"],
        to_matrix=["lm_head.weight", "embed.weight", "blocks.1.proj.weight"],
    )
    routing = _routing(groups)
    assert sorted(routing["matrix"]) == sorted(
        [
            "blocks.0.qkv.weight",
            "blocks.0.proj.weight",
            "blocks.0.experts",
            "lm_head.weight",
            "embed.weight",
        ]
    )
    # to_adamw wins over to_matrix
    assert "blocks.1.proj.weight" in routing["adamw"]
    assert "blocks.1.experts" in routing["adamw"]


@pytest.mark.parametrize("pattern", ["*.bias", "blocks.0.gate", "*norm.weight"])
def test_forcing_a_non_matrix_to_the_matrix_algorithm_raises(pattern: str) -> None:
    with pytest.raises(ValueError, match=r"parameter 'blocks\.0\.[a-z_.]+' is [01]-D"):
        canzona.param_groups(_model(), to_matrix=[pattern])


@pytest.mark.parametrize("key", ["to_adamw", "to_matrix"])
def test_an_override_pattern_that_matches_nothing_warns(key: str) -> None:
    """Catches: a typo in an override (``lm_haed.weight``) ignored without a word. A
    warning, not an error: a pipeline stage may hold no parameter a pattern names."""
    model = _model()
    with pytest.warns(UserWarning, match=rf"^{key} pattern 'lm_haed\.\*' matches no parameter"):
        groups = canzona.param_groups(model, **{key: ["*.proj.weight", "lm_haed.*"]})
    assert _routing(groups) == _routing(canzona.param_groups(model, **{key: ["*.proj.weight"]}))


def test_the_model_s_parameters_instead_of_the_model_are_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"pass the model .*got generator"):
        canzona.param_groups(_model().parameters())  # type: ignore[arg-type]


def test_group_entries_and_empty_groups() -> None:
    model = _model()
    groups = canzona.param_groups(model, lr=0.02, adamw={"lr": 3e-4, "weight_decay": 0.0})
    matrix, adamw = groups
    assert {k: v for k, v in matrix.items() if k != "params"} == {"lr": 0.02}
    assert {k: v for k, v in adamw.items() if k != "params"} == {
        "lr": 3e-4,
        "weight_decay": 0.0,
        "algorithm": "adamw",
    }
    only_vectors = nn.LayerNorm(4)
    assert [g["algorithm"] for g in canzona.param_groups(only_vectors)] == ["adamw"]
    only_matrices = nn.Linear(4, 4, bias=False)
    (group,) = canzona.param_groups(only_matrices)
    assert "algorithm" not in group


@pytest.mark.parametrize(
    ("adamw", "decay"), [(None, 0.0), ({"lr": 3e-4}, 0.0), ({"weight_decay": 0.05}, 0.05)]
)
def test_adamw_group_is_not_decayed_unless_asked(
    adamw: dict[str, Any] | None, decay: float
) -> None:
    """Catches: embeddings, the head, norms and biases decayed with the matrix optimizer's
    weight decay (Muon's 0.1) when the AdamW group does not set its own."""
    model = _model()
    opt = canzona.Muon(canzona.param_groups(model, adamw=adamw), lr=0.02, weight_decay=0.1)
    matrix, vectors = opt.param_groups
    assert (matrix["weight_decay"], vectors["weight_decay"]) == (0.1, decay)
    before = [p.detach().clone() for p in vectors["params"]]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # AdamW moves nothing: only the decay acts
    opt.step()
    for name, p, old in zip(vectors["param_names"], vectors["params"], before, strict=True):
        torch.testing.assert_close(p.detach(), old * (1 - vectors["lr"] * decay), msg=name)


@pytest.mark.parametrize("cls", [canzona.Muon, canzona.Shampoo, canzona.SOAP])
@pytest.mark.parametrize("tied", [False, True])
def test_groups_work_with_every_optimizer(cls: type[torch.optim.Optimizer], tied: bool) -> None:
    model = _model(tied=tied)
    opt = cls(canzona.param_groups(model, lr=0.01, adamw={"lr": 1e-3}))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # SOAP's first step only computes its eigenbases
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
    for n, p in model.named_parameters():
        assert int(opt.state[p]["step"]) == 2, n
        assert not torch.equal(p.detach(), start[n]), n


# ------------------------------------------------------------------ the AdamW route
def _step_both(
    opt: torch.optim.Optimizer,
    ref: torch.optim.Optimizer,
    ours: list[nn.Parameter],
    theirs: list[nn.Parameter],
    grads: list[list[torch.Tensor]],
    schedulers: tuple[Any, ...] = (),
) -> None:
    """Step both optimizers on the same gradients (and their schedulers after)."""
    for step in grads:
        for a, b, g in zip(ours, theirs, step, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for s in schedulers:
            s.step()


@pytest.mark.parametrize("cls", [canzona.Muon, canzona.Shampoo, canzona.SOAP])
def test_adamw_group_is_torch_adamw(cls: type[torch.optim.Optimizer]) -> None:
    """``lr`` and ``weight_decay`` of the group, ``adamw_betas`` and ``adamw_eps`` of the
    optimizer (or the group), and nothing else: bitwise ``torch.optim.AdamW(foreach=False)``.

    Catches also: a 0-dim parameter, real or complex, decayed by a float64 tensor lr's
    factor rounded to float32 first (torch's ``mul_`` of two 0-dim tensors multiplies in
    float64; a complex one's before AdamW views it as real pairs)."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(7, generator=gen), torch.randn(3, 4, generator=gen)]
    values += [torch.randn((), generator=gen) for _ in range(8)]
    values += [torch.randn((), dtype=torch.complex64, generator=gen) for _ in range(8)]
    grads = [[torch.randn(v.shape, dtype=v.dtype, generator=gen) for v in values] for _ in range(5)]
    cases: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = [
        # (optimizer kwargs, group entries, torch.optim.AdamW kwargs)
        (
            {"lr": 0.1, "weight_decay": 0.2, "adamw_betas": (0.8, 0.99), "adamw_eps": 1e-6},
            {"lr": 3e-3, "weight_decay": 0.05},
            {"lr": 3e-3, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6},
        ),
        (
            {"lr": 0.01, "weight_decay": 0.0},
            {"adamw_betas": (0.5, 0.9), "adamw_eps": 1e-3},
            {"lr": 0.01, "weight_decay": 0.0, "betas": (0.5, 0.9), "eps": 1e-3},
        ),
        (  # a float32 tensor lr: torch's arithmetic in float32 (1 ulp from the float's)
            {"lr": 0.1, "weight_decay": 0.1},
            {"lr": torch.tensor(0.02)},
            {"lr": torch.tensor(0.02), "weight_decay": 0.1, "betas": (0.9, 0.95)},
        ),
        (  # a float64 tensor lr
            {"lr": 0.1, "weight_decay": 0.1},
            {"lr": torch.tensor(0.1, dtype=torch.float64)},
            {
                "lr": torch.tensor(0.1, dtype=torch.float64),
                "weight_decay": 0.1,
                "betas": (0.9, 0.95),
            },
        ),
        (  # nothing given: the optimizer's lr and weight_decay, adamw_betas=(0.9, 0.95)
            {},
            {},
            {
                "lr": cls([nn.Parameter(torch.zeros(2, 2))]).defaults["lr"],
                "weight_decay": cls([nn.Parameter(torch.zeros(2, 2))]).defaults["weight_decay"],
                "betas": (0.9, 0.95),
                "eps": 1e-8,
            },
        ),
    ]
    for kwargs, entries, torch_kwargs in cases:
        ours = [nn.Parameter(v.clone()) for v in values]
        theirs = [nn.Parameter(v.clone()) for v in values]
        opt = cls([{"params": ours, "algorithm": "adamw", **entries}], **kwargs)
        ref = torch.optim.AdamW(theirs, foreach=False, **torch_kwargs)
        _step_both(opt, ref, ours, theirs, grads)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), (kwargs, entries)


@pytest.mark.parametrize("cls", [canzona.Muon, canzona.NorMuon, canzona.Shampoo, canzona.SOAP])
@pytest.mark.parametrize("schedule", ["one_cycle", "cyclic"])
def test_adamw_group_beta1_follows_a_cycled_momentum(
    cls: type[torch.optim.Optimizer], schedule: str
) -> None:
    """Catches: an AdamW group that keeps ``adamw_betas[0]`` while ``OneCycleLR``/``CyclicLR``
    cycle momentum (into ``momentum`` for Muon and NorMuon, ``betas[0]`` for Shampoo and
    SOAP), where ``torch.optim.AdamW`` under the same scheduler cycles its beta1."""
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(7, generator=gen), torch.randn(3, 4, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(6)]

    def scheduler(opt: torch.optim.Optimizer) -> Any:
        if schedule == "one_cycle":
            return torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=0.01, total_steps=8, base_momentum=0.8, max_momentum=0.95
            )
        return torch.optim.lr_scheduler.CyclicLR(
            opt, 1e-3, 1e-2, step_size_up=2, base_momentum=0.8, max_momentum=0.95
        )

    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    matrix = nn.Parameter(torch.randn(4, 4, generator=gen))
    groups = [{"params": [matrix]}, {"params": ours, "algorithm": "adamw"}]
    opt = cls(groups, lr=1e-3, weight_decay=0.01, adamw_betas=(0.9, 0.95))
    ref = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), foreach=False)
    ours_s, theirs_s = scheduler(opt), scheduler(ref)
    matrix.grad = torch.ones_like(matrix)  # the same gradient every step
    _step_both(opt, ref, ours, theirs, grads, (ours_s, theirs_s))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_adamw_group_takes_complex_parameters_as_torch_adamw() -> None:
    """Catches: complex moments squared as complex numbers (``g * g``, not the real and
    imaginary parts' squares as torch.optim.AdamW's ``view_as_real``): 3e-2 from torch."""
    gen = torch.Generator().manual_seed(2)
    values = [torch.randn(5, dtype=torch.complex64, generator=gen), torch.randn(3, 4)]
    grads = [[torch.randn(v.shape, dtype=v.dtype, generator=gen) for v in values] for _ in range(4)]
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    opt = canzona.Muon([{"params": ours, "algorithm": "adamw"}], lr=0.01, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    _step_both(opt, ref, ours, theirs, grads)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"])


def test_adamw_group_takes_any_shape() -> None:
    """Embeddings, 4-D convolution kernels and scalars go to AdamW without complaint."""
    params = [nn.Parameter(torch.randn(s)) for s in [(), (5,), (3, 3), (2, 3, 3, 3)]]
    opt = canzona.Muon([{"params": params, "algorithm": "adamw"}])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(int(opt.state[p]["step"]) == 1 for p in params)


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Module()
        self.router.gate = nn.Linear(8, 4, bias=False)  # TorchTitan: moe.router.gate
        self.gate = nn.Linear(8, 4, bias=False)  # Hugging Face: mlp.gate
        self.gate_proj = nn.Linear(8, 16, bias=False)  # a SwiGLU gate: a matrix
        self.qkv_proj = nn.Linear(8, 24, bias=True)
        self.conv = nn.Conv2d(3, 4, 3)


def test_routers_go_to_adamw_but_gate_projections_do_not() -> None:
    groups = canzona.param_groups(_Moe())
    matrix = [n for n, _ in groups[0]["params"]]
    adamw = [n for n, _ in groups[-1]["params"]]
    assert matrix == ["gate_proj.weight", "qkv_proj.weight"]
    assert {"router.gate.weight", "gate.weight", "conv.weight"} <= set(adamw)


def test_embedding_bags_go_to_adamw() -> None:
    """Catches: an nn.EmbeddingBag's 2-D table sent to the matrix algorithm."""
    model = nn.Module()
    model.bag = nn.EmbeddingBag(16, 8)
    model.proj = nn.Linear(8, 8, bias=False)
    assert _routing(canzona.param_groups(model)) == {
        "matrix": ["proj.weight"],
        "adamw": ["bag.weight"],
    }


class _BiasStacksAndTokens(nn.Module):
    """gpt-oss's per-expert bias stacks and a vision encoder's bare parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.mlp1_weight = nn.Parameter(torch.randn(4, 8, 6))  # a stack: matrices
        self.experts.mlp1_bias_EG = nn.Parameter(torch.randn(4, 6))  # a stack of biases
        self.experts.w2 = nn.Parameter(torch.randn(4, 6, 8))
        self.pos_embed = nn.Parameter(torch.randn(4, 4, 8))
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.register_tokens = nn.Parameter(torch.randn(1, 2, 8))
        self.attn = nn.Module()
        self.attn.relative_position_bias_table = nn.Parameter(torch.randn(9, 2))
        self.embed_proj = nn.Linear(8, 8, bias=False)  # a weight of a module named embed_...
        self.token_mixer = nn.Linear(8, 8, bias=False)


def test_bias_stacks_embeddings_and_tokens_go_to_adamw_whatever_their_shape() -> None:
    """Catches: a 2-D stack of expert biases orthogonalised as one matrix (coupling the
    experts' biases), a bare positional embedding or class token run through Muon as a
    stack; and weights of modules whose names have those words sent to AdamW."""
    assert _routing(canzona.param_groups(_BiasStacksAndTokens())) == {
        "matrix": [
            "experts.mlp1_weight",
            "experts.w2",
            "embed_proj.weight",
            "token_mixer.weight",
        ],
        "adamw": [
            "pos_embed",
            "cls_token",
            "register_tokens",
            "experts.mlp1_bias_EG",
            "attn.relative_position_bias_table",
        ],
    }
    forced = canzona.param_groups(_BiasStacksAndTokens(), to_matrix=["pos_embed"])
    assert "pos_embed" in _routing(forced)["matrix"]


def test_the_first_matching_split_pattern_wins() -> None:
    """Catches: a later pattern overriding an earlier one for the same parameter."""
    heads = canzona.Split(dim=0, size=8)
    qkv = canzona.Split(dim=0, sizes=(8, 8, 8))
    groups = canzona.param_groups(_Moe(), split={"qkv_proj.weight": qkv, "*_proj.weight": heads})
    by_split = {g.get("split"): [n for n, _ in g["params"]] for g in groups[:-1]}
    assert by_split == {qkv: ["qkv_proj.weight"], heads: ["gate_proj.weight"]}


def test_splits_make_one_group_per_declaration() -> None:
    qkv = canzona.Split(dim=0, sizes=(8, 8, 8))
    halves = canzona.Split(dim=0, size=8)
    groups = canzona.param_groups(
        _Moe(), split={"qkv_proj.weight": qkv, "gate_proj.weight": halves}, lr=0.02
    )
    by_split = {g.get("split"): [n for n, _ in g["params"]] for g in groups[:-1]}
    assert by_split == {qkv: ["qkv_proj.weight"], halves: ["gate_proj.weight"]}
    assert all(g["lr"] == 0.02 for g in groups[:-1])
    canzona.Muon(groups)  # the optimizer accepts them


def test_bad_split_declarations_name_the_culprit() -> None:
    model = _Moe()
    with pytest.raises(ValueError, match=r"'nothing\.\*' matches no parameter"):
        canzona.param_groups(model, split={"nothing.*": canzona.Split(dim=0, size=2)})
    with pytest.raises(ValueError, match=r"'qkv_proj\.bias'.*not a matrix"):
        canzona.param_groups(model, split={"qkv_proj.*": canzona.Split(dim=0, size=8)})
    with pytest.raises(ValueError, match=r"'qkv_proj\.weight': Split sizes \(8, 8\) sum to 16"):
        canzona.param_groups(model, split={"qkv_proj.weight": canzona.Split(dim=0, sizes=(8, 8))})
    with pytest.raises(ValueError, match=r"'gate_proj\.weight'.*not a multiple of Split size 5"):
        canzona.param_groups(model, split={"gate_proj.weight": canzona.Split(dim=0, size=5)})
    with pytest.raises(ValueError, match=r"must be a canzona\.Split"):
        canzona.param_groups(model, split={"gate_proj.weight": (0, 8)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="exactly one of sizes= and size="):
        canzona.Split(dim=0)
    with pytest.raises(ValueError, match="dim must be 0"):
        canzona.Split(dim=2, size=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": True, "size": 4}, r"Split\.dim must be 0 \(rows\) or 1 \(columns\), got True"),
        ({"dim": 0, "sizes": (4.0, 4)}, r"Split\.sizes must be positive integers, got \(4\.0, 4\)"),
        ({"dim": 0, "sizes": (4, False)}, r"Split\.sizes must be positive integers"),
        ({"dim": 0, "size": 2.5}, r"Split\.size must be a positive integer, got 2\.5"),
        ({"dim": 1, "size": True}, r"Split\.size must be a positive integer, got True"),
    ],
)
def test_split_refuses_what_is_not_a_plain_integer(kwargs: dict[str, Any], match: str) -> None:
    """Catches: bools and floats taken as sizes or dims (``True`` would split by 1, a float
    size would make fractional blocks)."""
    with pytest.raises(ValueError, match=match):
        canzona.Split(**kwargs)


def test_split_takes_numpy_integers_as_plain_ints() -> None:
    """Catches: ``Split(size=np.int64(16))`` (a head dimension read from a config array)
    refused, or kept as a numpy scalar whose repr would enter the description ranks compare."""
    split = canzona.Split(dim=np.int64(1), size=np.int64(16))
    assert split == canzona.Split(dim=1, size=16)
    assert split.describe() == ("Split", 1, None, 16)
    assert [type(v) for v in (split.dim, split.size)] == [int, int]
    sizes = canzona.Split(dim=0, sizes=np.array([8, 4, 4]))
    assert sizes.sizes == (8, 4, 4) and {type(v) for v in sizes.sizes} == {int}
    assert repr(sizes.describe()) == "('Split', 0, (8, 4, 4), None)"
    with pytest.raises(ValueError, match=r"Split\.size must be a positive integer"):
        canzona.Split(dim=0, size=np.float64(4.0))


def test_split_descriptions_tell_every_declaration_apart() -> None:
    """Catches: a description (what ranks compare) that leaves out the block size: ranks
    declaring heads of 8 and of 4 would plan different blocks unnoticed."""
    splits = [
        canzona.Split(dim=0, size=8),
        canzona.Split(dim=0, size=4),
        canzona.Split(dim=1, size=8),
        canzona.Split(dim=0, sizes=(8, 8)),
        canzona.Split(dim=0, sizes=(4, 12)),
    ]
    assert len({s.describe() for s in splits}) == len(splits)


def test_flatten_sends_convolutions_to_the_matrix_algorithm() -> None:
    groups = canzona.param_groups(_Moe(), flatten=True)
    flat = [g for g in groups if g.get("flatten")]
    assert [n for n, _ in flat[0]["params"]] == ["conv.weight"]
    assert "conv.weight" not in [n for n, _ in groups[-1]["params"]]
    canzona.Muon(groups)


def test_a_conv1d_weight_is_one_matrix_never_a_stack() -> None:
    """Catches: a Conv1d weight ``(out, in, k)`` taken for a stack of ``out`` experts of
    ``(in, k)`` by its number of dimensions: AdamW by default like a Conv2d's, and with
    flatten=True the ``(out, in·k)`` matrix, stepping as torch.optim.Muon on it."""
    model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.Conv2d(8, 6, 3), nn.Linear(5, 7, bias=False))
    assert _routing(canzona.param_groups(model)) == {
        "matrix": ["2.weight"],
        "adamw": ["0.weight", "0.bias", "1.weight", "1.bias"],
    }
    groups = canzona.param_groups(model, flatten=True, lr=0.02)
    [flat] = [g for g in groups if g.get("flatten")]
    assert [n for n, _ in flat["params"]] == ["0.weight", "1.weight"]
    assert canzona.param_groups(model, to_matrix=["0.weight"])[0]["params"][0][0] == "0.weight"
    conv = model[0].weight
    ref = nn.Parameter(conv.detach().reshape(8, 12).clone())
    expected = torch.optim.Muon([ref], lr=0.02)
    opt = canzona.Muon([{**flat, "params": flat["params"][:1]}])
    for _ in range(2):
        conv.grad = torch.randn_like(conv)
        ref.grad = conv.grad.reshape(8, 12).clone()
        opt.step()
        expected.step()
    assert torch.equal(conv.detach().reshape(8, 12), ref.detach())


def test_a_channels_last_convolution_steps_as_its_matrix() -> None:
    """A model in ``channels_last`` (its 4-D weights have no ``(out, in*kh*kw)`` view).

    Catches: the apply viewing the weight as that matrix: a RuntimeError after the vote
    (the other matrices already updated), or an update written into a copy and lost."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 2)).to(
        memory_format=torch.channels_last
    )
    assert not model[0].weight.is_contiguous()
    groups = canzona.param_groups(model, flatten=True, lr=0.02)
    [flat] = [g for g in groups if g.get("flatten")]
    weights = [p for _, p in flat["params"]]
    refs = [nn.Parameter(w.detach().reshape(w.shape[0], -1).clone()) for w in weights]
    expected = torch.optim.Muon(refs, lr=0.02)
    opt = canzona.Muon([flat])
    for _ in range(3):
        for w, ref in zip(weights, refs, strict=True):
            w.grad = torch.randn_like(w)
            ref.grad = w.grad.reshape(ref.shape).clone()
        opt.step()
        expected.step()
    for w, ref in zip(weights, refs, strict=True):
        assert not w.is_contiguous()  # updated in place, layout kept
        assert torch.equal(w.detach().reshape(ref.shape), ref.detach())


def test_flatten_leaves_a_convolution_forced_to_adamw_there() -> None:
    """Catches: flatten=True taking a >3-D weight that a to_adamw pattern names."""
    groups = canzona.param_groups(_Moe(), flatten=True, to_adamw=["conv.*"])
    assert not [g for g in groups if g.get("flatten")]
    assert "conv.weight" in [n for n, _ in groups[-1]["params"]]


class _Vision(nn.Module):
    """A ViT/SAM-like stem: a patch convolution, 4-D embeddings and tokens, a conv head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2)
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, 4, 8))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 1, 8))
        self.conv1d = nn.Conv1d(1, 8, 4, bias=False)
        self.output = nn.Conv2d(8, 5, 1)


def _flattened(groups: list[dict[str, Any]]) -> list[str]:
    return [n for g in groups if g.get("flatten") for n, _ in g["params"]]


def test_flatten_takes_no_weight_that_adamws_rules_claim() -> None:
    """Catches: flatten=True taking every >3-D or convolution weight left to AdamW, among
    them positional embeddings and class tokens registered as 4-D parameters (a 1×8 token
    orthogonalised as a matrix) and an output head that is a convolution."""
    groups = canzona.param_groups(_Vision(), flatten=True)
    assert _flattened(groups) == ["patch.weight", "conv1d.weight"]
    adamw = [n for n, _ in groups[-1]["params"]]
    assert adamw == ["pos_embed", "cls_token", "patch.bias", "output.weight", "output.bias"]


def test_to_matrix_with_flatten_matricises_a_convolution() -> None:
    """Catches: a to_matrix pattern taking a convolution weight before flatten could: a
    Conv1d weight updated as a stack of (in, k) matrices, a Conv2d one refused as 4-D."""
    model = _Vision()
    groups = canzona.param_groups(model, flatten=True, to_matrix=["conv1d.*", "output.weight"])
    assert _flattened(groups) == ["patch.weight", "conv1d.weight", "output.weight"]
    assert not [g for g in groups if not g.get("flatten") and g.get("algorithm") != "adamw"]
    with pytest.raises(
        ValueError,
        match=r"'output\.weight' is 4-D and cannot use the matrix "
        r"algorithm \(flatten=True sends it as its \(shape\[0\], rest\) matrix\)",
    ):
        canzona.param_groups(model, to_matrix=["output.weight"])


def test_a_split_of_a_flattened_convolution_is_muon_per_block() -> None:
    """Catches: ``flatten=True`` with a split naming a convolution refused (it is not among
    the 2-D/3-D matrices), or its blocks cut from the 4-D weight instead of its
    ``(shape[0], rest)`` matricisation: each block must step as torch.optim.Muon on it."""
    model = _Moe()
    split = canzona.Split(dim=0, size=2)
    groups = canzona.param_groups(model, flatten=True, split={"conv.weight": split}, lr=0.02)
    [flat] = [g for g in groups if g.get("flatten")]
    assert flat["split"] == split and [n for n, _ in flat["params"]] == ["conv.weight"]
    conv = model.conv.weight
    start = conv.detach().reshape(4, -1).clone()
    refs = [nn.Parameter(start[a:b].clone()) for a, b in split.spans(4)]
    ref = torch.optim.Muon(refs, lr=0.02)
    opt = canzona.Muon([flat])
    torch.manual_seed(1)
    for _ in range(2):
        grad = torch.randn_like(conv)
        conv.grad = grad
        for r, (a, b) in zip(refs, split.spans(4), strict=True):
            r.grad = grad.reshape(4, -1)[a:b].clone()
        opt.step()
        ref.step()
    got = conv.detach().reshape(4, -1)
    assert torch.equal(got, torch.cat([r.detach() for r in refs]))
    assert not torch.equal(got[:2], start[:2])
    bad = {"conv.weight": canzona.Split(dim=1, size=5)}  # 27 columns
    with pytest.raises(ValueError, match=r"'conv\.weight'.*not a multiple of Split size 5"):
        canzona.param_groups(model, flatten=True, split=bad)


def test_a_split_naming_a_tied_weight_says_which_name_it_has() -> None:
    """Catches: a pattern that names the second name of a tied weight (``lm_head.weight``
    tied to ``embed.weight``) reported as naming nothing at all."""
    model = _model(tied=True)
    tied = r"matches only 'lm_head\.weight' \(tied to 'embed\.weight'"
    with pytest.raises(ValueError, match=tied):
        canzona.param_groups(model, split={"lm_head.*": canzona.Split(dim=0, size=4)})
    with pytest.raises(ValueError, match=r"'nothing' matches no parameter of the model$"):
        canzona.param_groups(model, split={"nothing": canzona.Split(dim=0, size=4)})


# ------------------------------------------------- split declared in a raw param group
def _raw_group_error(group: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as info:
        canzona.Muon([group])
    return str(info.value)


def test_raw_group_split_sizes_that_do_not_tile_the_dimension_raise() -> None:
    """Catches: a raw group's split taken unchecked (blocks past the matrix, or rows left out)."""
    qkv = nn.Parameter(torch.zeros(24, 8))
    bad = canzona.Split(dim=0, sizes=(8, 8))
    msg = _raw_group_error({"params": [("qkv_proj.weight", qkv)], "split": bad})
    assert (
        "parameter 'qkv_proj.weight': Split sizes (8, 8) sum to 16, but dimension 0 of the "
        "matrix has 24"
    ) in msg
    # unnamed parameters are named by position, counting the earlier groups
    opt = canzona.Muon([nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError, match=r"parameter 'param1': dimension 1 of the matrix has 8"):
        opt.add_param_group({"params": [qkv], "split": canzona.Split(dim=1, size=3)})


def test_raw_group_split_on_a_vector_raises() -> None:
    """Catches: the split shape check reached with a 1-D parameter (an IndexError, or the
    vector silently updated as blocks)."""
    bias = nn.Parameter(torch.zeros(24))
    msg = _raw_group_error({"params": [("qkv_proj.bias", bias)], "split": canzona.Split(0, size=8)})
    assert "parameter 'qkv_proj.bias' ((24,)) is 1-D; Muon updates 2-D matrices" in msg


def test_raw_group_split_with_adamw_raises() -> None:
    """Catches: a split silently ignored in an AdamW group."""
    w = nn.Parameter(torch.zeros(24, 8))
    split = canzona.Split(dim=0, size=8)
    msg = _raw_group_error(
        {"params": [("qkv_proj.weight", w)], "split": split, "algorithm": "adamw"}
    )
    assert (
        "the param group of 'qkv_proj.weight' has a split, which applies to matrix groups, "
        f'not algorithm="adamw": {split!r}'
    ) in msg


def test_raw_group_split_that_is_not_a_split_raises() -> None:
    """Catches: a tuple or dict taken for a Split (and failing later, inside the step)."""
    w = nn.Parameter(torch.zeros(24, 8))
    for value in [(0, 8), {"dim": 0, "size": 8}]:
        msg = _raw_group_error({"params": [("qkv_proj.weight", w)], "split": value})
        assert (
            "the split of the param group of 'qkv_proj.weight' must be a canzona.Split, "
            f"got {value!r}"
        ) in msg


def test_a_split_flattened_weight_is_checked_without_a_collective() -> None:
    """Catches: the split check of a flattened weight reading its matrix width from
    ``p[0]``, which gathers a sharded DTensor (one collective in ``param_groups`` and one in
    the constructor, even when the declaration is wrong). One process on a fake world-2
    process group counts the collectives."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        conv = nn.Conv2d(2, 8, 3, bias=False)
        mesh = init_device_mesh("cpu", (2,))
        conv.weight = nn.Parameter(distribute_tensor(conv.weight.detach(), mesh, [Shard(0)]))
        model = nn.Sequential(conv)
        with CommDebugMode() as comm:
            canzona.param_groups(model, flatten=True, split={"0.weight": canzona.Split(1, size=6)})
            group = {"params": [("conv", conv.weight)], "flatten": True}
            with pytest.raises(ValueError, match="18 elements, not a multiple of Split size 7"):
                canzona.SOAP([{**group, "split": canzona.Split(dim=1, size=7)}])
        assert comm.get_total_counts() == 0
    finally:
        dist.destroy_process_group()


def test_adamw_group_counts_each_parameters_own_steps() -> None:
    """Catches: an AdamW group bias-corrected by one step count for all its parameters: a
    bias with no gradient at the first step (a newly unfrozen one) must step as in
    ``torch.optim.AdamW``, which counts per parameter."""
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(7, generator=gen), torch.randn(5, generator=gen)]
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    w = nn.Parameter(torch.randn(8, 8, generator=gen))
    opt = canzona.Muon([{"params": [w]}, {"params": ours, "algorithm": "adamw"}], lr=0.01)
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    for step in range(3):
        w.grad = torch.randn(8, 8, generator=gen)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = (None, None) if i == 0 and step == 0 else (g.clone(), g.clone())
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_a_split_of_a_flattened_conv1d_is_checked_on_its_matrix() -> None:
    """Catches: ``param_groups`` checking a split of a flattened ``Conv1d`` weight
    ``(out, in, k)`` against ``(in, k)`` (the rule it kept for N-D weights above 3-D)
    while the optimizer splits its ``(out, in·k)`` matrix: a valid split refused, a wrong
    one let through to the constructor."""
    model = nn.Sequential(nn.Conv1d(4, 8, 3, bias=False))
    groups = canzona.param_groups(model, flatten=True, split={"0.weight": canzona.Split(1, size=6)})
    canzona.Muon(groups)
    with pytest.raises(ValueError, match=r"'0\.weight': dimension 1 of the matrix has 12 elements"):
        canzona.param_groups(model, flatten=True, split={"0.weight": canzona.Split(1, size=5)})


@pytest.mark.parametrize("cls", [canzona.Muon, canzona.Shampoo, canzona.SOAP])
@pytest.mark.parametrize("how", ["data", "swap_tensors"])
def test_a_replaced_complex_parameter_is_the_one_adamw_updates(
    cls: type[torch.optim.Optimizer], how: str
) -> None:
    """Complex AdamW-routed parameters replaced between steps (``p.data = ...``,
    ``torch.utils.swap_tensors``): bitwise ``torch.optim.AdamW``. Catches: a real view
    of the parameter kept from the first step (the steps after ``p.data = ...`` updated
    the old storage, and ``swap_tensors`` refused the parameter the view referenced)."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(6, dtype=torch.complex64, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn(v.shape, dtype=v.dtype, generator=gen) for v in values] for _ in range(3)]
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    opt = cls([{"params": ours, "algorithm": "adamw"}], lr=0.02, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    _step_both(opt, ref, ours, theirs, grads[:1])
    for p in (*ours, *theirs):
        if how == "data":
            p.data = p.data.clone()
        else:
            torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))
    _step_both(opt, ref, ours, theirs, grads[1:])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(a, values[0] if a.is_complex() else values[1])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_numpy_learning_rate_is_used_as_torch_uses_it(dtype: str) -> None:
    """An ``lr`` given as a NumPy scalar: bitwise ``torch.optim.Muon`` and, in an
    ``algorithm="adamw"`` group, ``torch.optim.AdamW``, whose arithmetic on it is NumPy's in
    its dtype. Catches: the value converted to a Python float first (products in float64)."""
    np = pytest.importorskip("numpy")
    lr = getattr(np, dtype)(0.0213)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(8, 6, generator=gen), torch.randn(7, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(4)]
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    groups = [{"params": ours[:1]}, {"params": ours[1:], "algorithm": "adamw"}]
    opt = canzona.Muon(groups, lr=lr, weight_decay=0.1)
    muon = torch.optim.Muon(theirs[:1], lr=lr, weight_decay=0.1)
    adamw = torch.optim.AdamW(theirs[1:], lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    for step in grads:
        for a, b, g in zip(ours, theirs, step, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        muon.step()
        adamw.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_a_pattern_that_matches_only_under_a_wrapper_prefix_says_so() -> None:
    """Catches: ``qkv.weight``-style patterns written as for the bare model reported as a
    typo once DDP (``module.``) or torch.compile (``_orig_mod.``) prefixes the names."""
    wrapped = nn.Sequential()
    wrapped.add_module("module", _model())  # DDP's name for the model it wraps
    hint = (
        r"carry a prefix \('module\.blocks\.0\.qkv\.weight', .*'\*blocks\.0\.qkv\.weight' matches"
    )
    with pytest.raises(ValueError, match=hint):
        canzona.param_groups(wrapped, split={"blocks.0.qkv.weight": canzona.Split(dim=0, size=4)})
    with pytest.warns(UserWarning, match=hint):
        canzona.param_groups(wrapped, to_adamw=["blocks.0.qkv.weight"])
