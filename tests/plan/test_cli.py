"""The ``canzona`` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import canzona
from canzona import cli
from canzona.plan import PlanConfig, build_plan
from canzona.plan.models import model_specs

SRC = Path(canzona.__file__).resolve().parents[1]
STRATEGIES = ["canzona", "numel", "round_robin", "count", "replicated"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "canzona.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--model", "qwen3-1.7b", "--world", "16"]) == 0
    out = capsys.readouterr().out
    for word in [*STRATEGIES, "makespan/LB", "balance", "max recv/rank", "groups", "plan time"]:
        assert word in out
    assert "canzona per-rank load / mean load (16 ranks)" in out
    digest = build_plan(model_specs("qwen3-1.7b"), 16).digest()
    assert f"digest: {digest}" in out


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "qwen3-8b", "--world", "32", "--optimizer", "soap"]
    argv += ["--alpha", "0.5", "--capacity-mb", "400", "--split-heads", "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"model", "world", "optimizer", "alpha", "strategies", "digest"} <= set(data)
    assert (data["model"], data["world"], data["optimizer"], data["alpha"]) == (
        "qwen3-8b",
        32,
        "soap",
        0.5,
    )
    assert list(data["strategies"]) == STRATEGIES
    keys = {
        "balance_ratio",
        "makespan",
        "lower_bound",
        "max_comm_bytes",
        "micro_groups",
        "plan_seconds",
    }
    for metrics in data["strategies"].values():
        assert set(metrics) == keys
    canz = data["strategies"]["canzona"]
    assert canz["makespan"] >= canz["lower_bound"]
    specs = model_specs("qwen3-8b", split_heads=True)
    plan = build_plan(specs, 32, PlanConfig(alpha=0.5, capacity_mb=400), optimizer="soap")
    assert data["digest"] == plan.digest()


def test_model_from_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.json"
    entries = [{"name": f"w{i}", "shape": [64, 32 + i]} for i in range(6)]
    entries.append({"name": "half", "shape": [2, 64, 64], "itemsize": 2})
    path.write_text(json.dumps(entries))
    assert cli.main(["plan", "--model", str(path), "--world", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "tiny" and data["matrices"] == 7
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"matrices": entries}))
    assert cli.main(["plan", "--model", str(wrapped), "--world", "3"]) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--model", "qwen3-nope", "--world", "8"],
        ["plan", "--model", "qwen3-8b", "--world", "0"],
        ["plan", "--model", "qwen3-8b", "--world", "eight"],
        ["plan", "--model", "qwen3-8b", "--world", "8", "--alpha", "1.5"],
        ["plan", "--model", "qwen3-8b", "--world", "8", "--capacity-mb", "0"],
        ["plan", "--model", "qwen3-8b", "--world", "8", "--optimizer", "lion"],
        ["plan", "--model", "missing.json", "--world", "8"],
        ["plan", "--world", "8"],
        ["plan", "--model", "qwen3-8b", "--world", "8", "--frobnicate"],
        ["launch"],
        [],
    ],
)
def test_bad_arguments_fail_with_one_line(args: list[str]) -> None:
    out = _run(*args)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], out.stderr


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", '[{"name": "a"}]', '[{"name": "a", "shape": [0, 3]}]', '{"x": 1}'],
)
def test_bad_model_files(tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert cli.main(["plan", "--model", str(path), "--world", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("canzona plan: error:")


def test_duplicate_names_in_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dup.json"
    path.write_text(json.dumps([{"name": "a", "shape": [2, 2]}, {"name": "a", "shape": [3, 3]}]))
    assert cli.main(["plan", "--model", str(path), "--world", "2"]) == 2
    assert "duplicate" in capsys.readouterr().err


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "loads.png"
    assert cli.main(["plan", "--model", "qwen3-0.6b", "--world", "8", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().out


def test_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["plan", "--model", "qwen3-0.6b", "--world", "8", "--plot", str(tmp_path / "x.png")]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0]


def test_demo_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import canzona.demo

    seen: list[list[str]] = []

    def fake(argv: list[str] | None = None) -> int:
        seen.append(list(argv or []))
        return 7

    monkeypatch.setattr(canzona.demo, "main", fake)
    assert cli.main(["demo", "--help", "--steps", "3", "extra"]) == 7
    assert cli.main(["demo"]) == 7
    assert seen == [["--help", "--steps", "3", "extra"], []]


def test_plan_command_leaves_torch_unloaded() -> None:
    code = (
        "import sys\n"
        "from canzona.cli import main\n"
        "assert main(['plan', '--model', 'qwen3-0.6b', '--world', '4', '--json']) == 0\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr


def test_module_entry_point() -> None:
    out = _run("plan", "--model", "qwen3-0.6b", "--world", "4")
    assert out.returncode == 0 and "canzona" in out.stdout and not out.stderr
