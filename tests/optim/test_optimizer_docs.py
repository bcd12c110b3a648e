"""docs/optimizers.md agrees with the classes: the routing example runs, the defaults are right."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import canzona

DOC = Path(__file__).resolve().parents[2] / "docs" / "optimizers.md"


def _section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _defaults(cls: type) -> dict[str, object]:
    params = inspect.signature(cls.__init__).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def test_routing_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", _section("Parameter routing"), flags=re.DOTALL)
    assert blocks, "the routing section has no python example"
    namespace: dict[str, object] = {"__name__": "routing_example"}
    for block in blocks:
        exec(compile(block, f"{DOC}:routing", "exec"), namespace)
    opt = namespace["opt"]
    assert isinstance(opt, canzona.Muon)
    assert all(int(s["step"]) == 3 for s in opt.state.values())


def test_shampoo_blocks_example_runs() -> None:
    """Catches: a split of the example removed or mistyped (the parameter keeps one set of
    unsuffixed factors, or its blocks have other sizes), and per-block state that is missing
    or not at the block's shape after one step."""
    blocks = re.findall(r"```python\n(.*?)```", _section("Shampoo"), flags=re.DOTALL)
    assert len(blocks) == 1, "the Shampoo section has no python example"
    namespace: dict[str, object] = {"__name__": "shampoo_blocks_example"}
    exec(compile(blocks[0], f"{DOC}:shampoo", "exec"), namespace)
    opt = namespace["opt"]
    assert isinstance(opt, canzona.Shampoo)
    hidden, head_dim, ffn = (int(namespace[k]) for k in ("hidden", "head_dim", "ffn"))
    heads, kv_heads = int(namespace["heads"]), int(namespace["kv_heads"])
    sd = opt.state_dict()
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    state = {names[i]: s for i, s in sd["state"].items()}
    blocks_of = {  # (rows, cols) of every matrix the optimizer sees, in order
        "qkv_proj.weight": [(head_dim, hidden)] * (heads + 2 * kv_heads),
        "o_proj.weight": [(hidden, head_dim)] * heads,
        "gate_up_proj.weight": [(ffn, hidden)] * 2,
        "down_proj.weight": [(hidden, ffn)],
    }
    assert set(state) == set(blocks_of)
    assert sum(len(b) for b in blocks_of.values()) == 15
    for name, shapes in blocks_of.items():
        s = state[name]
        assert int(s["step"]) == 1, name
        tags = [""] if len(shapes) == 1 else [f"#{i}" for i in range(len(shapes))]
        want: dict[str, tuple[int, ...]] = {"step": ()}
        for tag, (m, n) in zip(tags, shapes, strict=True):
            want |= {f"exp_avg{tag}": (m, n), f"graft_exp_avg_sq{tag}": (m, n)}
            want |= {f"factor_left{tag}": (m, m), f"inv_root_left{tag}": (m, m)}
            want |= {f"factor_right{tag}": (n, n), f"inv_root_right{tag}": (n, n)}
        assert {k: tuple(v.shape) for k, v in s.items()} == want, name


@pytest.mark.parametrize(
    ("title", "cls"),
    [
        ("Muon", canzona.Muon),
        ("NorMuon", canzona.NorMuon),
        ("Shampoo", canzona.Shampoo),
        ("SOAP", canzona.SOAP),
    ],
)
def test_hyper_parameter_tables_match_the_classes(title: str, cls: type) -> None:
    rows = re.findall(r"^\| `(\w+)` \| `([^`|]+)` \|", _section(title), flags=re.MULTILINE)
    defaults = _defaults(cls)
    documented = {name: value for name, value in rows if name in defaults}
    assert "lr" in documented
    for name, value in documented.items():
        assert eval(value, {"torch": torch}) == defaults[name], (title, name, value)
    missing = (
        set(defaults) - set(documented) - {"params", "plan", "pipeline", "adamw_betas", "adamw_eps"}
    )
    assert not missing, f"{title}: hyper-parameters without a row: {sorted(missing)}"


def test_adamw_entries_match_the_classes() -> None:
    rows = dict(
        re.findall(
            r"^\| `(adamw_\w+)` \| `([^`|]+)` \|", _section("Parameter routing"), flags=re.MULTILINE
        )
    )
    assert set(rows) == {"adamw_betas", "adamw_eps"}
    for cls in (canzona.Muon, canzona.NorMuon, canzona.Shampoo, canzona.SOAP):
        defaults = _defaults(cls)
        for name, value in rows.items():
            assert eval(value) == defaults[name], (cls.__name__, name)
