"""TorchTitan route: routing by shape, the container's names, and the documented examples."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_torchtitan import batches, requires_torchtitan, tiny_qwen3, train
from torch import nn

import canzona
from canzona.integrations.torchtitan import OPTIMIZER_NAMES, canzona_optimizers, resolve_name

ADAMW = {"algorithm": "adamw"}


class _Plain(nn.Module):
    """No TorchTitan names: an embedding, a block with a LayerNorm, a head called ``proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 8))
        self.output = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.output(self.body(self.emb(tokens)))
        return out


@requires_torchtitan
@pytest.mark.parametrize("name", ["muon", "canzona.Muon", "canzona.Shampoo", "soap"])
def test_container_routes_by_shape_like_param_groups(name: str) -> None:
    """Catches: routing by FQN only (a LayerNorm weight ``body.1.weight`` or an embedding
    ``emb.weight`` sent to the matrix algorithm, which refuses it or orthogonalises a table)."""
    model = _Plain()
    opt = canzona_optimizers(name, lr=0.01, adamw_lr=1e-3).build(model_parts=[model])
    (inner,) = opt.optimizers
    assert type(inner).__name__ == OPTIMIZER_NAMES[resolve_name(name)]
    routed = {g["algorithm"]: g["param_names"] for g in inner.param_groups}
    matrix, adamw = (g["params"] for g in canzona.param_groups(model))
    assert routed["adamw"] == [n for n, _ in adamw]
    assert routed[inner.algorithm] == [n for n, _ in matrix] == ["body.0.weight", "body.2.weight"]
    assert "body.1.weight" in routed["adamw"] and "emb.weight" in routed["adamw"]
    tokens = torch.randint(0, 16, (2, 5))
    for _ in range(2):
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad()


@requires_torchtitan
def test_container_name_typo_lists_the_valid_names() -> None:
    """Catches: TorchTitan's bare ``Optimizer canzona.Muonn not added.``"""
    from torchtitan.components.optimizer import ParamGroupConfig

    from canzona.integrations.torchtitan import CanzonaOptimizersContainer

    config = CanzonaOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="canzona.Muonn", optimizer_kwargs={})
        ]
    )
    with pytest.raises(NotImplementedError) as info:
        config.build(model_parts=[_Plain()])
    message = str(info.value)
    assert "'canzona.Muonn' not added; did you mean 'canzona.Muon'?" in message
    for name in (*OPTIMIZER_NAMES, "AdamW", "DistMuon"):
        assert repr(name) in message


@requires_torchtitan
def test_hand_written_groups_keep_their_patterns() -> None:
    """Catches: routing by shape applied where the job's own patterns should rule (it is
    opt-in), and a shape-routed parameter with no AdamW group to go to passing silently."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from canzona.integrations.torchtitan import CanzonaOptimizersContainer

    groups = [
        ParamGroupConfig(pattern=r"\.bias$", optimizer_name="AdamW", optimizer_kwargs={}),
        ParamGroupConfig(pattern=".*", optimizer_name="canzona.Muon", optimizer_kwargs={}),
    ]
    with pytest.raises(ValueError, match=r"'emb\.weight' \(16, 8\) is 2-D|'body\.1\.weight'"):
        CanzonaOptimizersContainer.Config(param_groups=groups).build(model_parts=[_Plain()])
    routed = CanzonaOptimizersContainer.Config(param_groups=groups, route_by_shape=True)
    with pytest.raises(ValueError, match=r"canzona\.Muon: parameters \['emb\.weight', "):
        routed.build(model_parts=[_Plain()])


@requires_torchtitan
def test_shape_routed_parameters_go_to_their_own_optimizers_adamw_group() -> None:
    """Catches: a parameter that Muon's groups route to AdamW sent to the AdamW group of
    another optimizer of the job (here Shampoo's, listed first)."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from canzona.integrations.torchtitan import CanzonaOptimizersContainer

    adamw = {"algorithm": "adamw"}
    groups = [
        ParamGroupConfig(
            pattern=r"^body\.0\.", optimizer_name="canzona.Shampoo", optimizer_kwargs={}
        ),
        ParamGroupConfig(pattern=r"^$", optimizer_name="canzona.Shampoo", optimizer_kwargs=adamw),
        ParamGroupConfig(pattern=".*", optimizer_name="canzona.Muon", optimizer_kwargs={}),
        ParamGroupConfig(pattern=r"^$", optimizer_name="canzona.Muon", optimizer_kwargs=adamw),
    ]
    config = CanzonaOptimizersContainer.Config(param_groups=groups, route_by_shape=True)
    opt = config.build(model_parts=[_Plain()])
    routed = {
        type(inner).__name__: {g["algorithm"]: g["param_names"] for g in inner.param_groups}
        for inner in opt.optimizers
    }
    assert routed == {
        "Shampoo": {"shampoo": ["body.0.weight"]},
        "Muon": {
            "muon": ["body.2.weight"],
            "adamw": ["emb.weight", "body.1.weight", "body.1.bias", "body.2.bias", "output.weight"],
        },
    }


@requires_torchtitan
def test_a_shape_routed_canzona_pattern_that_matches_nothing_is_named() -> None:
    """Catches: with ``route_by_shape=True`` a mistyped canzona group dropped silently (the
    parameter it meant then trained with the catch-all's lr), where TorchTitan raises."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from canzona.integrations.torchtitan import CanzonaOptimizersContainer

    groups = [
        ParamGroupConfig(
            pattern=r"^body\.0\.wieght$",
            optimizer_name="canzona.Muon",
            optimizer_kwargs={"lr": 0.002},
        ),
        ParamGroupConfig(
            pattern=".*", optimizer_name="canzona.Muon", optimizer_kwargs={"lr": 0.02}
        ),
        ParamGroupConfig(pattern=r"^$", optimizer_name="canzona.Muon", optimizer_kwargs=ADAMW),
    ]
    config = CanzonaOptimizersContainer.Config(param_groups=groups, route_by_shape=True)
    match = r"pattern '\^body\\\.0\\\.wieght\$' matched no parameters"
    with pytest.raises(ValueError, match=match):
        config.build(model_parts=[_Plain()])
    # a group whose parameters routing sends to AdamW took them: it is left out, no error
    groups[0] = ParamGroupConfig(
        pattern=r"^body\.1\.", optimizer_name="canzona.Muon", optimizer_kwargs={"lr": 0.002}
    )
    config = CanzonaOptimizersContainer.Config(param_groups=groups, route_by_shape=True)
    (inner,) = config.build(model_parts=[_Plain()]).optimizers
    assert [g["lr"] for g in inner.param_groups if g["algorithm"] == "muon"] == [0.02]


class _Embeddings(nn.Module):
    """A pipeline stage that holds the embedding only (TorchTitan's first stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)


@requires_torchtitan
def test_model_parts_build_when_a_pattern_matches_in_some_part_only() -> None:
    """Catches: a split or group pattern required to match in every model part (a pipeline
    stage without attention failed to build), and one that matches in no part accepted."""
    split = {r"^body\.0\.weight$": canzona.Split(0, size=4)}
    config = canzona_optimizers("muon", lr=0.02, adamw_lr=1e-3, split=split)
    parts = [_Embeddings(), _Plain()]
    opt = config.build(model_parts=parts)
    routed = [
        [(g["algorithm"], g["param_names"], g.get("split")) for g in inner.param_groups]
        for inner in opt.optimizers
    ]
    adamw = ["emb.weight", "body.1.weight", "body.1.bias", "body.2.bias", "output.weight"]
    assert routed == [
        [("adamw", ["emb.weight"], None)],
        [
            ("adamw", adamw, None),
            ("muon", ["body.0.weight"], split[r"^body\.0\.weight$"]),
            ("muon", ["body.2.weight"], None),
        ],
    ]
    nowhere = canzona_optimizers(
        "muon", lr=0.02, adamw_lr=1e-3, split={r"\.wqkv\.": canzona.Split(0, size=4)}
    )
    with pytest.raises(ValueError, match=r"split pattern '\\\.wqkv\\\.' matched no matrix"):
        nowhere.build(model_parts=parts)


@requires_torchtitan
def test_canzona_optimizers_refuses_a_hyper_parameter_the_optimizer_lacks() -> None:
    """Catches: a misspelt or foreign keyword (``momentun``, Muon's ``momentum`` given to
    Shampoo) built into the group and ignored, where the constructor raises."""
    with pytest.raises(TypeError, match=r"'momentun': .* did you mean 'momentum'"):
        canzona_optimizers("muon", lr=0.02, adamw_lr=1e-3, momentun=0.5)
    with pytest.raises(TypeError, match="keyword 'momentum': it is not a hyper-parameter of"):
        canzona_optimizers("shampoo", lr=0.02, adamw_lr=1e-3, momentum=0.5)
    config = canzona_optimizers("muon", lr=0.02, adamw_lr=1e-3, momentum=0.5, ns_steps=3)
    (inner,) = config.build(model_parts=[_Plain()]).optimizers
    muon = next(g for g in inner.param_groups if g["algorithm"] == "muon")
    assert (muon["momentum"], muon["ns_steps"]) == (0.5, 3)


def _doc_block(marker: str) -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if marker in b]
    assert len(blocks) == 1, marker
    return blocks[0]


@requires_torchtitan
def test_docs_in_code_example_runs() -> None:
    """Catches: a documented example that no longer runs as written."""
    exec(compile(_doc_block("build(model_parts=[model])"), "<torchtitan.md>", "exec"), {})


TRAINER_PACKAGES = ("torchdata", "datasets", "tokenizers", "tensorboard", "PIL", "triton")


@requires_torchtitan
@pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in TRAINER_PACKAGES),
    reason="the job-config route needs TorchTitan's trainer packages (nox -s torchtitan)",
)
def test_docs_job_config_parses_and_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a documented job config that does not import with the documented packages,
    that TorchTitan's ``ConfigManager`` does not turn into this container, or whose
    container does not train TorchTitan's model."""
    from torchtitan.config import ConfigManager

    job = tmp_path / "my_canzona_job"
    job.mkdir()
    (job / "__init__.py").write_text("")
    (job / "config_registry.py").write_text(_doc_block("# my_job/config_registry.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--module", "my_canzona_job", "--config", "qwen3_debugmodel_canzona"]
    config = ConfigManager().parse_args([*argv, "--optimizer.implementation", "for-loop"])
    optimizer = config.optimizer
    assert type(optimizer).__qualname__ == "CanzonaOptimizersContainer.Config"
    assert optimizer.route_by_shape and optimizer.implementation == "for-loop"
    assert {g.optimizer_name for g in optimizer.param_groups} == {"canzona.Muon"}
    model = tiny_qwen3()
    container = optimizer.build(model_parts=[model])
    assert [type(o) for o in container.optimizers] == [canzona.Muon]
    losses = train(model, container, batches())
    assert losses[-1] < losses[0]


def _routed(opt: object) -> dict[str, dict[str, list[str]]]:
    return {
        type(inner).__name__: {
            g.get("algorithm", "torch"): g["param_names"] for g in inner.param_groups
        }
        for inner in opt.optimizers  # type: ignore[attr-defined]
    }


@requires_torchtitan
def test_shape_routing_leaves_frozen_parameters_out_and_takes_the_adamw_pattern() -> None:
    """Catches: a frozen parameter trained (TorchTitan leaves it out), and the documented
    ``adamw_pattern=`` replaced by the default one."""
    model = _Plain()
    model.emb.weight.requires_grad_(False)
    opt = canzona_optimizers("muon", lr=0.02, adamw_lr=1e-3).build(model_parts=[model])
    names = [n for groups in _routed(opt).values() for ns in groups.values() for n in ns]
    assert "emb.weight" not in names and "body.0.weight" in names
    config = canzona_optimizers("muon", lr=0.02, adamw_lr=1e-3, adamw_pattern=r"^body\.0\.")
    routed = _routed(config.build(model_parts=[_Plain()]))["Muon"]
    assert routed["muon"] == ["body.2.weight"]
    assert "body.0.weight" in routed["adamw"]  # a matrix: there by the pattern only


@requires_torchtitan
def test_shape_routing_keeps_torchtitans_own_groups_and_their_settings() -> None:
    """Catches: a TorchTitan optimizer's group losing ``implementation``'s foreach, its
    pattern that matches nothing passing silently (TorchTitan raises), and the parameters of
    a second AdamW group moved into the first (taking its lr)."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from canzona.integrations.torchtitan import CanzonaOptimizersContainer

    def build(groups: list[object]) -> object:
        config = CanzonaOptimizersContainer.Config(
            param_groups=groups, route_by_shape=True, implementation="foreach"
        )
        return config.build(model_parts=[_Plain()])

    muon = [
        ParamGroupConfig(pattern=r"^body\.0\.", optimizer_name="canzona.Muon", optimizer_kwargs={}),
        ParamGroupConfig(
            pattern=r"^body\.1\.weight$",
            optimizer_name="canzona.Muon",
            optimizer_kwargs={**ADAMW, "lr": 0.5},
        ),
        ParamGroupConfig(
            pattern=r"^body\.1\.bias$",
            optimizer_name="canzona.Muon",
            optimizer_kwargs={**ADAMW, "lr": 0.25},
        ),
        ParamGroupConfig(pattern=r".*", optimizer_name="canzona.Muon", optimizer_kwargs={}),
    ]
    opt = build([ParamGroupConfig(pattern=r"^emb\.", optimizer_name="AdamW"), *muon])
    adamw, inner = opt.optimizers  # type: ignore[attr-defined]
    assert [g["param_names"] for g in adamw.param_groups] == [["emb.weight"]]
    assert adamw.param_groups[0]["foreach"] is True
    lrs = {g["lr"]: g["param_names"] for g in inner.param_groups if g["algorithm"] == "adamw"}
    assert lrs[0.5][0] == "body.1.weight" and "body.1.bias" not in lrs[0.5]
    assert lrs[0.25] == ["body.1.bias"]
    nowhere = ParamGroupConfig(pattern=r"^embedding\.", optimizer_name="AdamW")
    with pytest.raises(ValueError, match=r"pattern '\^embedding\\\.' matched no parameters"):
        build([nowhere, *muon])


@requires_torchtitan
def test_a_split_pattern_that_matches_only_vectors_is_named() -> None:
    """Catches: a split declared on parameters that are all routed to AdamW (1-D) accepted."""
    config = canzona_optimizers(
        "muon", lr=0.02, adamw_lr=1e-3, split={r"^body\.1\.": canzona.Split(0, size=4)}
    )
    with pytest.raises(ValueError, match=r"split pattern '\^body\\\.1\\\.' matched no matrix"):
        config.build(model_parts=[_Plain()])


@requires_torchtitan
def test_wrapped_modules_keep_their_canonical_names() -> None:
    """Catches: ``param_names`` taken from the wrapped module's own names (activation
    checkpointing inserts ``_checkpoint_wrapped_module``), which checkpoints key by."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _Plain()
    model.body = checkpoint_wrapper(model.body)  # type: ignore[assignment]
    opt = canzona_optimizers("muon", lr=0.02, adamw_lr=1e-3).build(model_parts=[model])
    routed = _routed(opt)["Muon"]
    assert routed["muon"] == ["body.0.weight", "body.2.weight"]
    assert not any("_checkpoint_wrapped_module" in n for ns in routed.values() for n in ns)
