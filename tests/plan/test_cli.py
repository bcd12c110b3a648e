"""The ``canzona`` command line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import canzona
from canzona import cli
from canzona.plan import GroupedCost, MuonCost, PlanConfig, build_plan
from canzona.plan.measured import MeasuredCost, save_cost_table
from canzona.plan.models import model_specs
from canzona.plan.report import format_bytes

SRC = Path(canzona.__file__).resolve().parents[1]
STRATEGIES = ["canzona", "numel", "round_robin", "count", "replicated"]


def _run(*args: str, module: str = "canzona.cli") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
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
    argv += ["--alpha", "0.5", "--capacity-mb", "400", "--split", "heads", "--json"]
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
        "makespan_ratio",
        "makespan",
        "lower_bound",
        "max_recv_bytes_per_rank",
        "micro_groups",
        "plan_seconds",
        "loads",
        "recv_bytes",
    }
    assert keys <= set(data["units"])  # every value has a unit
    for metrics in data["strategies"].values():
        assert set(metrics) == keys
        assert len(metrics["loads"]) == len(metrics["recv_bytes"]) == 32
        assert metrics["max_recv_bytes_per_rank"] == max(metrics["recv_bytes"])
    canz = data["strategies"]["canzona"]
    assert canz["makespan"] >= canz["lower_bound"]
    assert canz["makespan"] == max(canz["loads"])
    specs = model_specs("qwen3-8b", split="heads")
    plan = build_plan(specs, 32, PlanConfig(alpha=0.5, capacity_mb=400), optimizer="soap")
    assert data["digest"] == plan.digest()
    assert data["owners"] == dict(plan.assignment.owner)


def test_json_and_table_share_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: a JSON field that names or measures something else than its table column."""
    argv = ["plan", "--model", "qwen3-1.7b", "--world", "16"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert cli.main([*argv, "--json"]) == 0
    canz = json.loads(capsys.readouterr().out)["strategies"]["canzona"]
    row = next(line.split() for line in table.splitlines() if line.startswith("canzona "))
    ratios = [f"{canz['balance_ratio']:.3f}", f"{canz['makespan_ratio']:.3f}"]
    assert row[1:5] == [*ratios, *format_bytes(canz["max_recv_bytes_per_rank"]).split()]


def test_one_rank_receives_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: the payloads of a one-process job reported as bytes received."""
    assert cli.main(["plan", "--model", "qwen3-0.6b", "--world", "1", "--json"]) == 0
    for name, metrics in json.loads(capsys.readouterr().out)["strategies"].items():
        assert metrics["max_recv_bytes_per_rank"] == 0 and metrics["recv_bytes"] == [0], name
    assert cli.main(["plan", "--model", "qwen3-0.6b", "--world", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("canzona ")]
    assert " 0 B " in rows[0]


def test_more_ranks_than_matrices_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: a plan where most ranks own nothing, given without a word."""
    path = tmp_path / "three.json"
    path.write_text(json.dumps([{"name": f"w{i}", "shape": [8, 8]} for i in range(3)]))
    assert cli.main(["plan", "--model", str(path), "--world", "8", "--json"]) == 0
    out = capsys.readouterr()
    json.loads(out.out)  # stdout stays one JSON object
    assert out.err.startswith("canzona plan: warning: 8 ranks for 3 matrices")
    assert "the other 5 own nothing" in out.err
    assert cli.main(["plan", "--model", str(path), "--world", "3"]) == 0
    assert capsys.readouterr().err == ""


def test_model_from_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: a ``[batch, m, n]`` stack planned as one matrix with one owner, where the
    optimizers give each of its matrices its own (experts on 64 ranks all on rank 0)."""
    path = tmp_path / "tiny.json"
    entries = [{"name": f"w{i}", "shape": [64, 32 + i]} for i in range(6)]
    entries.append({"name": "half", "shape": [2, 64, 64], "itemsize": 2})
    path.write_text(json.dumps(entries))
    assert cli.main(["plan", "--model", str(path), "--world", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "tiny" and data["matrices"] == 8  # the stack's two matrices
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"matrices": entries}))
    assert cli.main(["plan", "--model", str(wrapped), "--world", "3"]) == 0


def test_model_files_carry_payload_sizes_and_eligible_ranks(tmp_path: Path) -> None:
    """Catches: a file's ``itemsize`` or ``ranks`` dropped (bf16 payloads planned as fp32,
    matrices planned on ranks that may not own them)."""
    path = tmp_path / "m.json"
    entries = [
        {"name": "a", "shape": [8, 8]},
        {"name": "b", "shape": [2, 8, 8], "itemsize": 2, "ranks": [0, 2]},
    ]
    path.write_text(json.dumps(entries))
    a, *b = cli.load_specs(path)
    assert (a.itemsize, a.ranks) == (4, None)
    # a stack: its matrices, each planned alone as the runtime plans a 3-D parameter's
    assert [(s.name, s.shape, s.itemsize, s.ranks) for s in b] == [
        ("b[0]", (8, 8), 2, (0, 2)),
        ("b[1]", (8, 8), 2, (0, 2)),
    ]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--alpha", "1.5", "--alpha must be in [0, 1], got 1.5"),
        ("--capacity-mb", "0", "--capacity-mb must be positive, got 0.0"),
        ("--capacity-mb", "inf", "--capacity-mb must be positive, got inf"),
        ("--world", "0", "--world must be in [1, 1048576], got 0"),
        # not an OverflowError or MemoryError from the planner after a warning
        ("--world", str(10**20), f"--world must be in [1, 1048576], got {10**20}"),
    ],
)
def test_bad_numbers_are_named_with_their_flag(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", "qwen3-8b", "--world", "8", flag, value]
    assert cli.main(argv) != 0
    assert capsys.readouterr().err.strip() == f"canzona plan: error: {message}"


def test_the_documented_bounds_of_alpha_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: ``--alpha 0`` (bytes only) or ``1`` refused by a strict comparison."""
    for alpha in ("0", "1"):
        argv = ["plan", "--model", "qwen3-0.6b", "--world", "4", "--alpha", alpha, "--json"]
        assert cli.main(argv) == 0
        assert json.loads(capsys.readouterr().out)["alpha"] == float(alpha)


def test_the_text_report_shows_canzonas_bytes_and_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: the header's total counting elements instead of bytes, and the histogram
    drawn from another strategy's loads (shapes whose FLOPs and sizes disagree)."""
    from canzona.plan.report import compare_strategies, load_histogram

    entries = [{"name": f"a{i}", "shape": [128, 128]} for i in range(7)]
    entries += [{"name": f"b{i}", "shape": [2048, 16]} for i in range(5)]
    path = tmp_path / "model.json"
    path.write_text(json.dumps(entries))
    specs = cli.load_specs(path)
    assert cli.main(["plan", "--model", str(path), "--world", "3"]) == 0
    out = capsys.readouterr().out
    total = format_bytes(sum(s.nbytes for s in specs))
    assert total == "1.1 MiB" != format_bytes(sum(s.numel for s in specs))
    assert out.startswith(f"model: 12 matrices ({total}), world 3, optimizer muon")
    runs = compare_strategies(specs, 3, optimizer="muon", alpha=1.0, capacity_mb=512.0)
    mine, other = (load_histogram(runs[n].plan.assignment.loads) for n in ("canzona", "numel"))
    assert mine != other  # the two strategies' histograms tell them apart
    assert mine in out.split("canzona per-rank load / mean load (3 ranks):\n", 1)[1]


def test_calibrate_defaults() -> None:
    """Catches: another default timing budget or Newton-Schulz dtype (Muon's bf16)."""
    args = cli._parser().parse_args(["calibrate", "--model", "m", "--out", "t.json"])
    assert (args.budget, args.ns_dtype, args.optimizer, args.world) == (
        60.0,
        "bfloat16",
        "muon",
        None,
    )


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
        ["plan", "--model", "qwen3-8b", "--world", "8", "--plot", "loads.txt"],
        ["plan", "--model", "qwen3-8b", "--world", "8", "--plot", "loads"],
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
    [
        "{not json",
        "[]",
        '[{"name": "a"}]',
        '[{"name": "a", "shape": [0, 3]}]',
        '{"x": 1}',
        '[{"name": "a", "shape": [4, 3], "item_size": 2}]',
        "[" * 100_000,  # nested past the parser's depth: RecursionError
        '[{"name": "a", "shape": [1%s, 4]}]' % ("0" * 120),  # past an int64 of bytes
    ],
    ids=["not_json", "empty", "no_shape", "zero_dim", "no_list", "unknown_key", "deep", "huge"],
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
    assert "has duplicate matrix names ['a']" in capsys.readouterr().err  # (the path says
    # "duplicate" too: tmp_path is named after the test)
    path.write_text(
        json.dumps([{"name": "a[1]", "shape": [2, 2]}, {"name": "a", "shape": [2, 3, 3]}])
    )
    assert cli.main(["plan", "--model", str(path), "--world", "2"]) == 2
    assert "has duplicate matrix names ['a[1]']" in capsys.readouterr().err


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "loads.png"
    assert cli.main(["plan", "--model", "qwen3-0.6b", "--world", "8", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().out


def test_plot_format_is_checked_before_planning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: a plan computed (minutes on a large model) before a bad ``--plot`` fails."""

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned before checking --plot")

    monkeypatch.setattr(cli, "compare_strategies", no_planning)
    argv = ["plan", "--model", "qwen3-0.6b", "--world", "8", "--plot", str(tmp_path / "x.txt")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ".png" in err[0] and "x.txt" in err[0]
    assert not (tmp_path / "x.txt").exists()


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


@pytest.mark.parametrize("module", ["canzona.cli", "canzona"])
def test_module_entry_point(module: str) -> None:
    """Catches: ``python -m canzona`` without the package's ``__main__`` (no such module)."""
    out = _run("plan", "--model", "qwen3-0.6b", "--world", "4", "--json", module=module)
    assert out.returncode == 0, out.stderr
    assert not out.stderr
    assert json.loads(out.stdout)["world"] == 4


def test_split_choices_change_the_matrices(capsys: pytest.CaptureFixture[str]) -> None:
    counts = {}
    for split in ("none", "qkv", "heads"):
        assert (
            cli.main(["plan", "--model", "qwen3-8b", "--world", "8", "--split", split, "--json"])
            == 0
        )
        counts[split] = json.loads(capsys.readouterr().out)["matrices"]
    assert counts == {"none": 36 * 4, "qkv": 36 * 7, "heads": 36 * (32 + 8 + 8 + 32 + 3)}


def test_a_split_for_a_model_file_is_refused_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model file lists its matrices as they are: ``--split heads`` would change nothing."""
    model = tmp_path / "model.json"
    model.write_text('[{"name": "a", "shape": [8, 4]}]')
    assert cli.main(["plan", "--model", str(model), "--world", "2"]) == 0
    capsys.readouterr()
    assert cli.main(["plan", "--model", str(model), "--world", "2", "--split", "heads"]) == 2
    assert f"--split applies to the built-in models, not to {str(model)!r}" in (
        capsys.readouterr().err
    )


def test_moe_experts_stay_on_their_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """qwen3-30b-a3b at world 8: 16 experts per rank, owned where they lie (pinned)."""
    assert cli.main(["plan", "--model", "qwen3-30b-a3b", "--world", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    owners = out["owners"]
    assert owners["layers.0.mlp.experts.0.up_proj"] == 0
    assert owners["layers.5.mlp.experts.127.down_proj"] == 7
    assert "layers.0.mlp.gate" not in owners  # the router goes to AdamW


def test_cost_table_from_calibrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "cost.json"
    argv = ["calibrate", "--model", "qwen3-0.6b", "--optimizer", "muon", "--out", str(table)]
    assert cli.main([*argv, "--ns-dtype", "float32", "--budget", "2"]) == 0
    assert "distinct shapes" in capsys.readouterr().out
    body = json.loads(table.read_text())
    model = body["models"]["0"]
    assert model["base"]["name"] == "muon" and model["table"]  # some shapes were timed
    assert all(s > 0 for _, _, s in model["table"])
    assert (
        cli.main(["plan", "--model", "qwen3-0.6b", "--world", "4", "--cost", str(table), "--json"])
        == 0
    )
    planned = json.loads(capsys.readouterr().out)
    assert planned["strategies"]["canzona"]["makespan_ratio"] >= 1.0
    assert (planned["optimizer"], planned["cost"]) == ("muon", "measured")
    plain = ["plan", "--model", "qwen3-0.6b", "--world", "4", "--json"]
    assert cli.main(plain) == 0
    flops = json.loads(capsys.readouterr().out)
    assert (flops["optimizer"], flops["cost"]) == ("muon", "flops")
    # the table prices the plan: loads in seconds (tens on this CPU), not in FLOPs
    assert 0 < planned["strategies"]["canzona"]["makespan"] < 1e4
    assert flops["strategies"]["canzona"]["makespan"] > 1e9
    assert planned["digest"] != flops["digest"]
    # the table says which optimizer it timed: another one is refused, not silently ignored
    shampoo = ["plan", "--model", "qwen3-0.6b", "--world", "4", "--optimizer", "shampoo"]
    assert cli.main([*shampoo, "--cost", str(table)]) == 2
    err = capsys.readouterr().err
    assert f"--optimizer shampoo contradicts the cost table {str(table)!r}, which times muon" in err
    assert cli.main(["plan", "--model", "qwen3-0.6b", "--world", "4", "--cost", str(table)]) == 0
    assert f"optimizer muon (measured costs: {table})" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    for content, why in (
        ("[]", "it holds a JSON list, not an object"),
        ('{"format": 1, "models": {}}', "no field '0'"),
    ):
        bad.write_text(content)
        assert cli.main(["plan", "--model", "qwen3-0.6b", "--world", "4", "--cost", str(bad)]) == 2
        assert f"{str(bad)!r} is not a canzona cost table: {why}" in capsys.readouterr().err


def test_a_table_plans_with_the_transfer_share_of_the_world_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A table saved by a job on some world size, planned for another. Catches: the saved
    share kept (on two ranks a slow link would then move math off large matrices' owners)."""
    fit = (math.log(1e-12), 1.0)  # seconds in proportion to FLOPs
    paths = {}
    for label, rate in (("slow", 2e6), ("none", 0.0)):
        model = MeasuredCost(base=MuonCost(), table=(), fit=fit, bytes_per_s=rate)
        paths[label] = tmp_path / f"{label}.json"
        save_cost_table(paths[label], GroupedCost({"0": model}), {"device": "cpu"})
    assert MeasuredCost(base=MuonCost(), table=()).for_world(8).transfer_share == 0.75

    def makespan(label: str, world: int) -> float:
        argv = ["plan", "--model", "qwen3-0.6b", "--world", str(world), "--json"]
        assert cli.main([*argv, "--cost", str(paths[label])]) == 0
        return float(json.loads(capsys.readouterr().out)["strategies"]["canzona"]["makespan"])

    assert makespan("slow", 2) == makespan("none", 2)  # two ranks: owning moves nothing more
    assert makespan("slow", 4) > makespan("none", 4)


def test_calibrate_reuses_its_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: ``--cache`` not passed on, or the cache not read (a second run would time
    the same shapes again and report none from the cache), or entries changed on the way."""
    cache = tmp_path / "cache"
    argv = ["calibrate", "--model", "qwen3-0.6b", "--ns-dtype", "float32", "--budget", "1"]
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert cli.main([*argv, "--out", str(first), "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(first.read_text())["models"]["0"]["table"]
    assert f", {len(rows)} with timings ({len(rows)} timed now, 0 from the cache) in " in out
    assert len(list(cache.iterdir())) == 1  # one file for this device and torch build
    assert cli.main([*argv, "--out", str(second), "--cache", str(cache)]) == 0
    assert f"(0 timed now, {len(rows)} from the cache)" in capsys.readouterr().out
    again = json.loads(second.read_text())["models"]["0"]["table"]
    assert all(row in again for row in rows)  # the stored seconds, not new timings


@pytest.mark.parametrize(
    ("world", "stacks"),
    [(None, [[8, 8, 1], [16, 8, 1]]), (4, [[8, 8, 1], [16, 8, 5]]), (2, [[8, 8, 2], [16, 8, 8]])],
)
def test_calibrate_times_the_stack_an_owner_forms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world: int | None, stacks: list[list[int]]
) -> None:
    """``--world W``: each shape timed on ``ceil(count / W)`` matrices, at most 8, as the
    runtime calibrates; without it one matrix per call. Catches: --world not passed on, the
    stack not taken from the shape's own count (matrices, a 3-D stack's each), the cap of 8
    missed, a floor for a ceiling."""
    model = tmp_path / "model.json"
    matrices = [{"name": f"a{i}", "shape": [16, 8]} for i in range(15)]
    matrices += [{"name": "a_stack", "shape": [2, 16, 8]}]  # two more 16x8 matrices
    matrices += [{"name": f"b{i}", "shape": [8, 8]} for i in range(3)]
    model.write_text(json.dumps(matrices))
    table = tmp_path / "cost.json"
    argv = ["calibrate", "--model", str(model), "--ns-dtype", "float32", "--out", str(table)]
    argv += ["--budget", "2"] + ([] if world is None else ["--world", str(world)])
    assert cli.main(argv) == 0
    meta = json.loads(table.read_text())["meta"]
    assert (meta["world"], meta["stacks"]) == (world, stacks)
    body = json.loads(table.read_text())["models"]["0"]
    assert [row[:2] for row in body["table"]] == [[8, 8], [16, 8]]  # both shapes timed


def test_calibrate_refuses_what_would_fail_after_the_timing_before_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: an --out in a missing folder failing with a traceback once every shape was
    timed, and a device this torch build lacks failing with torch's assertion."""
    out = tmp_path / "new" / "folder" / "t.json"
    argv = ["calibrate", "--model", "qwen3-0.6b", "--ns-dtype", "float32", "--budget", "0.5"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["models"]["0"]["table"]
    if not torch.cuda.is_available():
        other = tmp_path / "cuda.json"
        assert cli.main([*argv, "--out", str(other), "--device", "cuda"]) == 2
        assert "device 'cuda' is not available to this torch build" in capsys.readouterr().err
        assert not other.exists()


def test_a_plan_priced_by_a_table_reports_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: --json labelling a measured plan's makespan and loads as FLOPs."""
    table = tmp_path / "cost.json"
    save_cost_table(table, MeasuredCost(base=MuonCost(), table=(), fit=(-20.0, 1.0)), {})
    argv = ["plan", "--model", "qwen3-0.6b", "--world", "2", "--json"]
    assert cli.main([*argv, "--cost", str(table)]) == 0
    units = json.loads(capsys.readouterr().out)["units"]
    assert units["makespan"] == units["lower_bound"] == "seconds (measured)"
    assert units["loads"] == "seconds (measured) per rank"
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["units"]["loads"] == "FLOPs per rank"


def test_calibrate_refuses_a_world_below_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["calibrate", "--model", "qwen3-0.6b", "--out", str(tmp_path / "t.json")]
    assert cli.main([*argv, "--world", "0"]) == 2
    assert "--world must be in [1, 1048576], got 0" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
    from canzona.optim.calibration import calibrate_model

    with pytest.raises(ValueError, match="world must be a positive int or None, got True"):
        calibrate_model([], optimizer="muon", out=tmp_path / "t.json", world=True)


def test_normuon_is_planned_and_calibrated_as_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: NorMuon missing from the command line (its plans priced as Muon's, without
    the rescale's element-wise work) and a NorMuon table read back as Muon's."""
    plain = ["plan", "--model", "qwen3-0.6b", "--world", "4", "--json"]
    loads = {}
    for name in ("muon", "normuon"):
        assert cli.main([*plain, "--optimizer", name]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["optimizer"] == name
        loads[name] = out["strategies"]["canzona"]["lower_bound"]
    assert loads["normuon"] > loads["muon"]
    table = tmp_path / "normuon.json"
    argv = ["calibrate", "--model", "qwen3-0.6b", "--optimizer", "normuon", "--out", str(table)]
    assert cli.main([*argv, "--ns-dtype", "float32", "--budget", "1"]) == 0
    capsys.readouterr()
    assert cli.main([*plain, "--cost", str(table)]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer"] == "normuon"
    assert cli.main([*plain, "--cost", str(table), "--optimizer", "muon"]) == 2
    assert "--optimizer muon contradicts the cost table" in capsys.readouterr().err


def test_calibrate_refuses_an_out_it_cannot_write_before_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: ``--out`` naming a folder, or a path under a file, failing with a traceback
    after the whole timing budget."""
    import canzona.optim.calibration as calibration

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("timed before checking --out")

    monkeypatch.setattr(calibration, "calibrate_model", never)
    a_file = tmp_path / "file"
    a_file.write_text("")
    for out in (tmp_path, a_file / "t.json", a_file / "sub" / "t.json", Path("."), Path("/")):
        argv = ["calibrate", "--model", "qwen3-0.6b", "--out", str(out)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"canzona calibrate: error: cannot write the cost table to {str(out)!r}: "
            "not a file path"
        )


def test_calibrate_passes_its_split_and_dtype_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: ``--split`` or ``--ns-dtype`` not reaching the calibration (the table would
    time other shapes, or in another dtype, than the plan it is for)."""
    stacks = {}
    for split in ("none", "heads"):
        table = tmp_path / f"{split}.json"
        argv = ["calibrate", "--model", "qwen3-0.6b", "--split", split, "--out", str(table)]
        assert cli.main([*argv, "--ns-dtype", "float32", "--budget", "0.2"]) == 0
        meta = json.loads(table.read_text())["meta"]
        assert meta["ns_dtype"] == "float32"
        stacks[split] = {(m, n) for m, n, _ in meta["stacks"]}
    for split, shapes in stacks.items():
        assert shapes == {s.shape for s in model_specs("qwen3-0.6b", split=split)}
    assert stacks["none"] != stacks["heads"]


def test_plan_warns_when_the_table_was_timed_for_another_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: a table timed on other stacks than this plan's owners form (another world's,
    or one matrix per call), or on none of the model's shapes, used without a word; and a
    warning where the stacks are the same (every world whose owners stack the cap)."""
    from collections import Counter

    from canzona.plan.measured import owner_stack

    specs = model_specs("qwen3-0.6b")
    counts = Counter((s.m, s.n) for s in specs)
    fit = (math.log(1e-12), 1.0)
    table = tmp_path / "t.json"

    def save(shapes: tuple[tuple[int, int], ...], world: int | None) -> None:
        model = MeasuredCost(base=MuonCost(), table=tuple((s, 1e-3) for s in shapes), fit=fit)
        stacks = [
            [m, n, 1 if world is None else owner_stack(c, world)] for (m, n), c in counts.items()
        ]
        save_cost_table(table, GroupedCost({"0": model}), {"world": world, "stacks": stacks})

    def warnings(world: int) -> str:
        argv = ["plan", "--model", "qwen3-0.6b", "--cost", str(table), "--json"]
        assert cli.main([*argv, "--world", str(world)]) == 0
        return capsys.readouterr().err

    save(((999, 999),), 8)
    err = warnings(64)
    assert (
        f"warning: the cost table {str(table)!r} timed {len(counts)} of the model's shapes on "
        in err
    )
    assert "at world 64 (" in err and "canzona calibrate --world 64" in err
    assert f"the cost table {str(table)!r} timed none of the model's {len(counts)}" in err
    save((specs[0].shape,), 8)
    assert warnings(8) == ""
    save((specs[0].shape,), None)  # one matrix per call: not what owners of 8 ranks stack
    assert "on other stacks than an owner forms at world 8" in warnings(8)
    assert warnings(56) == ""  # 28 or 56 of each shape over 56 ranks: one a call
    save((specs[0].shape,), 2)  # every shape at the cap of 8 matrices per call
    assert min(owner_stack(c, 3) for c in counts.values()) == 8
    assert warnings(3) == ""


@pytest.mark.parametrize(("world", "warned"), [(8, False), (48, True), (256, True)])
def test_plan_says_when_experts_cannot_stay_on_their_ranks(
    world: int, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: 128 experts over 48 or 256 ranks planned as traveling matrices without a word
    (no rank holds an expert whole there)."""
    assert cli.main(["plan", "--model", "qwen3-30b-a3b", "--world", str(world), "--json"]) == 0
    err = capsys.readouterr().err
    message = (
        "qwen3-30b-a3b's experts are pinned to the ranks that hold them only when --world "
        f"divides its 128 experts per layer: over {world} ranks they travel"
    )
    assert (message in err) is warned


def test_a_model_file_named_like_a_moe_model_is_not_taken_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "qwen3-30b-a3b.json"
    path.write_text(json.dumps([{"name": f"w{i}", "shape": [64, 64]} for i in range(4)]))
    assert cli.main(["plan", "--model", str(path), "--world", "3", "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_calibrate_times_in_the_dtype_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: ``--ns-dtype`` (default Muon's bf16) not passed on to the calibration."""
    import canzona.optim.calibration as calibration

    seen: list[object] = []

    def record(specs: object, **kwargs: object) -> dict[str, object]:
        seen.append(kwargs["ns_dtype"])
        return {"shapes": 1, "timed": 1, "cached": 0, "seconds": 0.0, "device": "cpu"}

    monkeypatch.setattr(calibration, "calibrate_model", record)
    argv = ["calibrate", "--model", "qwen3-0.6b", "--out", str(tmp_path / "t.json")]
    assert cli.main(argv) == 0
    assert cli.main([*argv, "--ns-dtype", "float32"]) == 0
    assert seen == ["bfloat16", "float32"]
