"""Smoke tests of the benchmark scripts: tiny sizes, results in a temporary directory.

They check that each script runs end to end, that its report has the expected structure and
that every owner strategy ends with the same parameters. No timing is asserted.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from canzona.runtime.repricing import ROUNDS

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

pytest.importorskip("torch")

STRATEGIES = ("replicated", "round_robin", "count", "numel", "canzona", "canzona_no_overlap")
DEPTH = ("canzona_one_group", "canzona_depth2", "canzona_depth3", "canzona_not_atomic")
COMMIT = re.compile(r"^([0-9a-f]{4,40}(-dirty)?(-installed)?|unknown)$")


def _section(doc: Path, name: str) -> str:
    text = doc.read_text()
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    assert begin in text and end in text
    return text[text.index(begin) : text.index(end)]


def _check_case(case: dict[str, Any], peers: tuple[str, ...] = ()) -> None:
    runs = case["runs"]
    assert set(STRATEGIES) <= set(runs)
    for label in STRATEGIES:
        run = runs[label]
        assert run["identical"] is True, (case["case"], label)
        assert run["step_s"] > 0
        world = case["world"]
        for key in ("compute_cpu_s", "compute_s", "bytes_sent", "bytes_received", "collectives"):
            assert len(run[key]) == world, key
        assert run["redundancy"] > 0 and run["balance"] >= 1.0
    assert runs["replicated"]["vs_replicated"] == pytest.approx(1.0)
    assert case["single_device"]["matches_distributed"] is True
    for peer in peers:
        assert "step_s" in runs[peer] or "error" in runs[peer]
    _check_prediction(case)


def _check_prediction(case: dict[str, Any]) -> None:
    """Every strategy's plan priced with the canzona run's measured table; one calibration,
    ``ROUNDS`` re-pricings by the steps' calls (within the warm-up), no other re-plan."""
    world, runs = case["world"], case["runs"]
    canz = runs["canzona"]
    assert len(canz["calibration_s"]) == world and canz["calibrations"] == 1
    assert canz["repricings"] == ROUNDS and canz["replans_after_first_step"] == ROUNDS
    assert case["cost_table"] and all(m["table"] for m in case["cost_table"].values())
    for label in STRATEGIES:
        pred = runs[label]["prediction"]
        assert len(pred["predicted_s"]) == world and min(pred["predicted_s"]) > 0
        assert pred["measured_s"] == runs[label]["compute_s"]
        assert pred["error"] > -1 and pred["error_cpu"] > -1
    # replicated: every rank computes every matrix in the same batches, so predicts the same
    replicated = runs["replicated"]["prediction"]["predicted_s"]
    assert replicated == [replicated[0]] * world
    assert all("batches" in m for m in case["cost_table"].values())


def _check_diagnostics(case: dict[str, Any]) -> None:
    """Depth, one group and atomic=False end bitwise equal; only the atomic run copies state."""
    runs = case["runs"]
    for label in DEPTH:
        assert runs[label]["identical"] is True, label
        assert runs[label]["group_factor_measured"] >= 1.0 - 1e-9
    assert runs["canzona_one_group"]["micro_groups"] == 1
    assert runs["canzona_one_group"]["plan"]["group_factor"] == pytest.approx(1.0)
    assert min(runs["canzona"]["backup_bytes"]) > 0
    assert runs["canzona_not_atomic"]["backup_bytes"] == [0] * case["world"]


def _check_structure(case: dict[str, Any]) -> None:
    """Experts stay where they lie under canzona and numel; the plan says what moves."""
    sent = case["experts_bytes_sent"]
    assert sent["canzona"] == sent["numel"] == [0] * case["world"]
    assert min(sent["replicated"]) > 0 and min(sent["round_robin"]) > 0
    for label in ("canzona", "numel", "replicated"):  # the same whatever else is planned
        assert case["runs"][label]["plan"]["pinned_bytes_sent"] == sent[label], label


def test_step_latency_tiny(tmp_path: Path) -> None:
    import step_latency

    doc = tmp_path / "benchmarks.md"
    payload = step_latency.main(
        [
            "--tiny",
            "--world",
            "2",
            "--optimizer",
            "muon",
            "--peers",
            "full_tensor",
            "--out",
            str(tmp_path),
            "--doc",
            str(doc),
            "--chart",
            str(tmp_path / "c.png"),
        ]
    )
    saved = json.loads((tmp_path / "step_latency_tiny.json").read_text())
    assert saved["machine"]["torch"] and COMMIT.match(saved["commit"])
    keys = {
        "muon/qwen/fsdp/w2",
        "muon/hetero/fsdp/w2",
        "muon/structure/fsdp/w2",
        "muon/w128/fsdp/w2",
    }
    assert {c["case"] for c in saved["cases"]} == keys
    for case in payload["cases"]:
        peers = ("full_tensor",) if case["model"] in ("qwen", "structure") else ()
        _check_case(case, peers)
        if case["model"] in ("hetero", "structure"):
            _check_diagnostics(case)
    _check_structure(next(c for c in payload["cases"] if c["model"] == "structure"))
    assert payload["cases"][0]["runs"]["full_tensor"]["identical"] is True
    kinds = {t["kind"] for t in payload["targets"]}
    assert {"hetero", "prediction", "calibration", "experts_bytes", "exactness"} <= kinds
    exact = [t for t in payload["targets"] if t["kind"] in ("experts_bytes", "exactness")]
    assert all(t["met"] for t in exact)
    # a lower bound bounds: no plan's stacked prediction goes below it
    for case in payload["cases"]:
        for run in case["runs"].values():
            plan = run.get("plan", {}) if isinstance(run, dict) else {}
            if plan.get("lower_bound_s"):
                assert plan["lower_bound_s"] <= max(plan["predicted_s"]) * (1 + 1e-9), plan
    # only a missed target is excused by a lower bound that rules it out
    for t in payload["targets"]:
        if t["met"] is None and "floor" in t:
            assert t["measured"] > t["target"], t
    section = _section(doc, "step_latency")
    assert "### Targets" in section and "replicated" in section
    assert f"commit `{saved['commit']}`" in section
    for title in (
        "### Predicted and measured owner time",
        "### Structure: per-head blocks and experts",
        "### Cost of the all-or-nothing step",
        "### Micro-groups: pipeline depth and one group",
    ):
        assert title in section, title


def test_step_latency_tiny_fsdp_tp_shampoo(tmp_path: Path) -> None:
    import step_latency

    payload = step_latency.main(
        [
            "--tiny",
            "--world",
            "4",
            "--mesh",
            "fsdp_tp",
            "fsdp",
            "--model",
            "qwen",
            "small",
            "--optimizer",
            "muon",
            "shampoo",
            "--peers",
            "",
            "--out",
            str(tmp_path),
            "--doc",
            str(tmp_path / "b.md"),
            "--chart",
            str(tmp_path / "c.png"),
        ]
    )
    keys = {c["case"] for c in payload["cases"]}
    assert keys == {"muon/qwen/fsdp/w4", "muon/qwen/fsdp_tp/w4", "shampoo/small/fsdp/w4"}
    for case in payload["cases"]:
        _check_case(case)
    shampoo = next(c for c in payload["cases"] if c["optimizer"] == "shampoo")
    # the atomic step copies Shampoo's owner-held state too: more than the parameters
    runs = shampoo["runs"]
    assert runs["canzona_not_atomic"]["identical"] is True
    assert sum(runs["canzona"]["backup_bytes"]) > sum(shampoo["param_bytes"])
    assert runs["canzona_not_atomic"]["backup_bytes"] == [0] * 4
    # buffers freed after each step instead of kept: the same parameters, and a table row
    assert runs["canzona_free_buffers"]["identical"] is True
    section = _section(tmp_path / "b.md", "step_latency")
    assert "### Step buffers kept between steps" in section
    assert "| shampoo/small/fsdp/w4 |" in section.split("### Step buffers kept")[1]


def test_train_step_tiny(tmp_path: Path) -> None:
    import train_step

    doc = tmp_path / "benchmarks.md"
    payload = train_step.main(["--tiny", "--out", str(tmp_path), "--doc", str(doc)])
    results = payload["results"]
    assert set(results) == {"canzona", "replicated", "adamw"}
    for r in results.values():
        assert r["iteration_s"] > 0 and 0 < r["step_share"] < 1
    assert results["canzona"]["same_parameters_as_replicated"] is True
    assert results["canzona"]["losses"] == results["replicated"]["losses"]
    assert (tmp_path / "train_step_tiny.json").exists()
    assert "forward + backward" in _section(doc, "train_step")


def test_kernels_tiny(tmp_path: Path) -> None:
    import kernels

    doc = tmp_path / "benchmarks.md"
    payload = kernels.main(
        [
            "--models",
            "qwen3-0.6b",
            "--scale",
            "32",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--out-dir",
            str(tmp_path),
            "--doc",
            str(doc),
        ]
    )
    assert payload["results"] and (tmp_path / "kernels.json").exists()
    assert _section(doc, "kernels")


def test_plan_quality_quick(tmp_path: Path) -> None:
    import plan_quality

    doc = tmp_path / "b.md"
    args = ["--quick", "--out", str(tmp_path), "--doc", str(doc), "--plot", str(tmp_path / "p.png")]
    assert plan_quality.main(args) == 0
    saved = json.loads((tmp_path / "plan_quality_quick.json").read_text())
    assert saved["summary"]["all"]["canzona"]["mean_makespan_ratio"] >= 1.0
    assert f"commit `{saved['commit']}`" in _section(doc, "plan_quality")


def test_replay_plans_width_128(tmp_path: Path) -> None:
    import replay_plans

    rows = replay_plans.main(["--model", "w128", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "replay_plans.json").read_text())
    assert COMMIT.match(saved["commit"]) and saved["cases"] == rows
    published = json.loads(replay_plans.SOURCE.read_text())
    assert saved["source_commit"] == published["commit"]
    assert [r["case"] for r in rows] == ["muon/w128/fsdp/w2", "muon/w128/fsdp/w4"]
    for row, world in zip(rows, (2, 4), strict=True):
        stored = next(
            c["runs"]["canzona"]
            for c in published["cases"]
            if (c["model"], c["world"], c["mesh"]) == ("w128", world, "fsdp")
        )
        assert row["published"]["predicted_s"] == stored["plan"]["predicted_s"]
        replayed = row["replayed"]
        assert len(replayed["predicted_s"]) == len(replayed["calls"]) == world
        assert all(s > 0 for s in replayed["predicted_s"])
        # the stored table prices the same work: the replayed plan is no slower to compute
        assert max(replayed["predicted_s"]) <= max(stored["plan"]["predicted_s"])


def test_overhead_tiny(tmp_path: Path) -> None:
    import overhead

    doc = tmp_path / "b.md"
    payload = overhead.main(
        ["--tiny", "--out", str(tmp_path), "--doc", str(doc), "--plot", str(tmp_path / "o.png")]
    )
    saved = json.loads((tmp_path / "overhead_tiny.json").read_text())
    assert COMMIT.match(saved["commit"]) and saved["mode"] == "tiny"
    preset = overhead.PRESETS["tiny"]
    grid = {(r["n"], r["world"]) for r in saved["rows"]}
    assert grid == {(n, w) for n in preset["counts"] for w in preset["worlds"]}
    for row in saved["rows"]:
        impls = ("canzona", "torch_muon", "adamw_foreach") if row["world"] == 1 else ()
        impls = impls or ("canzona", "replicated", "redistribute", "shampoo", "soap")
        assert all(row["times"][i] > 0 for i in impls), row
        if row["world"] > 1:  # exact: rank 0's rows equal the one-process canzona.Muon's
            assert row["same_as_one_process"]["canzona"] is True
            assert row["same_as_one_process"]["replicated"] is True
    fitted = {(f["world"], f["impl"]) for f in payload["fits"]}
    assert {(1, "canzona"), (2, "canzona"), (2, "replicated"), (1, "adamw_foreach")} <= fitted
    assert {(2, "shampoo"), (2, "soap")} <= fitted
    names = {t["target"] for t in payload["targets"]}
    assert "slope (µs per matrix)" in names and "fixed (ms per step)" in names
    for row in saved["rows"]:  # the profiled steps and their replay without canzona
        if row["world"] > 1:
            prof = row["profile"]
            assert prof["collectives"] == 2  # a steady step: the gather and the scatter
            for key in ("host_gaps_s", "step_calls_s", "replay_calls_s", "replay_s"):
                assert prof[key] > 0, (key, row)
            assert prof["host_gaps_s"] + prof["step_calls_s"] < 2 * prof["step_s"]
    section = _section(doc, "overhead")
    assert f"commit `{saved['commit']}`" in section and "### Fit" in section
    assert "replayed without canzona, at the same moments, the same 2 calls take" in section


def test_fused_exchanges_tiny(tmp_path: Path) -> None:
    import fused_exchanges

    doc = tmp_path / "b.md"
    assert fused_exchanges.main(["--tiny", "--out", str(tmp_path), "--doc", str(doc)]) == 0
    saved = json.loads((tmp_path / "fused_exchanges.json").read_text())
    assert COMMIT.match(saved["commit"]) and saved["mode"] == "tiny"
    for result in saved["worlds"].values():
        for run in result["steps"].values():
            fused, apart = run["fused"], run["apart"]
            assert run["identical"] is True
            assert fused["micro_groups"] >= 2
            assert (fused["collectives"], apart["collectives"]) == (
                fused["micro_groups"] + 1,
                2 * fused["micro_groups"],
            )
        assert all(r["fused"] > 0 and r["apart"] > 0 for r in result["limit"])
    section = _section(doc, "fused_exchanges")
    assert f"commit `{saved['commit']}`" in section and "| world |" in section


def test_alloc_faults_tiny(tmp_path: Path) -> None:
    import alloc_faults

    doc = tmp_path / "b.md"
    assert alloc_faults.main(["--tiny", "--out", str(tmp_path), "--doc", str(doc)]) == 0
    saved = json.loads((tmp_path / "alloc_faults.json").read_text())
    assert COMMIT.match(saved["commit"]) and saved["mode"] == "tiny"
    assert [run["setting"] for run in saved["settings"]] == list(alloc_faults.SETTINGS)
    for run in saved["settings"]:
        env = alloc_faults.SETTINGS[run["setting"]]
        assert run["env"] == env
        assert run["seen_env"] == {k: env.get(k) for k in run["seen_env"]}  # in the child
        assert len(run["seen_env"]) == 2
        assert run["shapes"] == [list(s) for s in alloc_faults._batches(32)]
        for mode in ("back_to_back", "in_turn"):
            assert len(run[mode]) == 5 and all(c["ms"] > 0 and c["faults"] >= 0 for c in run[mode])
        assert run["first_touch"]["faults"] > 512  # a fresh 4 MiB block (1024 pages) faults in
    section = _section(doc, "alloc_faults")
    assert f"commit `{saved['commit']}`" in section and "| fixed thresholds | 4×96×32 |" in section


def test_gc_in_step_tiny(tmp_path: Path) -> None:
    """Both settings run in one launch and end with the same parameters; the section names them."""
    import gc_in_step

    doc = tmp_path / "b.md"
    assert gc_in_step.main(["--tiny", "--out", str(tmp_path), "--doc", str(doc)]) == 0
    saved = json.loads((tmp_path / "gc_in_step.json").read_text())
    assert COMMIT.match(saved["commit"]) and saved["mode"] == "tiny"
    assert [r["n"] for r in saved["rows"]] == [64]
    for row in saved["rows"]:
        assert (
            row["same_parameters"] is True and row["objects"] > 0 and row["full_collection_s"] > 0
        )
        assert set(row["variants"]) == {"paused", "on"}
        for variant in row["variants"].values():
            assert variant["step_s"] > 0 and set(variant["per_step"]) == {"0", "1", "2"}
    section = _section(doc, "gc_in_step")
    assert f"commit `{saved['commit']}`" in section
    assert "| 64 | `pause_gc=True` |" in section and "| 64 | `pause_gc=False` |" in section


def test_large_world_tiny(tmp_path: Path) -> None:
    """Ranks 0 and 15 of 16 on a fake process group: the model's matrices, split per head or
    not. Catches: a fake gather that loses the header riding it (every other later step
    declined and run again: ``case`` raises)."""
    import large_world

    doc = tmp_path / "b.md"
    assert large_world.main(["--tiny", "--out", str(tmp_path), "--doc", str(doc)]) == 0
    saved = json.loads((tmp_path / "large_world.json").read_text())
    assert COMMIT.match(saved["commit"]) and saved["mode"] == "tiny"
    rows = {(r["split"], r["rank"]): r for r in saved["rows"]}
    # two qwen3-0.6b layers: 16 q, 8 k, 8 v and 16 o heads and 3 MLP matrices each, or 7
    assert {k: (r["world"], r["matrices"]) for k, r in rows.items()} == {
        ("heads", 0): (16, 102),
        ("heads", 15): (16, 102),
        ("none", 0): (16, 14),
        ("none", 15): (16, 14),
    }
    for r in rows.values():
        assert r["first_step_s"] > 0 and r["later_step_s"] > 0 and r["micro_groups"] == 1
    section = _section(doc, "large_world")
    assert f"Commit `{saved['commit']}`" in section
    assert "| qwen3-0.6b (2 layers) | heads | 102 | 16 | 15 |" in section


def test_replay_timeline_takes_each_gap_from_the_previous_call_s_end() -> None:
    from _replay import _timeline

    def step(shift: float, length: float) -> tuple[list[tuple[object, ...]], float]:
        issue = ("issue", 1.0 + shift, 1.5 + shift, (2, 2), (2, 2), "f32", 0)
        wait = ("wait", 2.0 + 2 * shift, 4.0 + 2 * shift, 0)
        return [issue, wait], length

    plan = _timeline([step(0.0, 5.0), step(0.2, 6.0), step(0.4, 7.0)])
    assert plan is not None
    gaps = [round(gap, 9) for gap, _ in plan]
    # issue after 1.2 s (median start), wait 0.5 + shift after the issue ended, tail to the end
    assert gaps == [1.2, 0.7, 1.6]
    assert [e[0] for _, e in plan] == ["issue", "wait", "end"]
    other = step(9.0, 50.0)
    other[0][0] = (*other[0][0][:3], (1, 3), (2, 2), "f32", 0)  # other splits
    # a stray step drops out; without a majority there is no timeline
    assert _timeline([step(0.0, 5.0), other, step(0.2, 6.0), step(0.4, 7.0)]) == plan
    assert _timeline([step(0.0, 5.0), other]) is None
    foreign = ([("wait", 1.0, 2.0, -1)], 3.0)  # a wait for a collective it did not record
    assert _timeline([foreign, foreign]) is None


def test_overhead_report_fits_each_launch() -> None:
    from _overhead_report import _launch_fits, fit_line

    fixed, slope = fit_line([(0, 1.0), (10, 3.0), (20, 5.0)])
    assert (fixed, slope) == (1.0, 0.2)
    # launch k: 1 ms + (10 + k) µs per matrix, exactly
    rows = [
        {
            "shape": "8x8",
            "world": 2,
            "n": n,
            "launches": {"canzona": [1e-3 + (10 + k) * 1e-6 * n for k in range(3)]},
        }
        for n in (16, 256, 4096)
    ]
    rows.append({"shape": "8x8", "world": 1, "n": 16, "launches": {"canzona": [9.0, 9.0]}})
    text = _launch_fits(rows)
    assert "fixed cost is 1.00, 1.00, 1.00 ms (slope 10.0, 11.0, 12.0 µs per matrix)" in text
    assert "step at N = 16 (mostly fixed cost) took 1.16 to 1.19 ms in the 3 launches" in text
    assert (
        _launch_fits([{**r, "launches": {"canzona": r["launches"]["canzona"][:1]}} for r in rows])
        == ""
    )


def test_the_structure_notes_say_where_held_matrices_are_owned() -> None:
    from _latency_report import _held

    def case(canzona: int, numel: int, experts: int) -> dict[str, Any]:
        return {
            "runs": {
                "canzona": {"bytes_sent": [canzona, canzona]},
                "numel": {"bytes_sent": [numel, numel]},
                "full_tensor": {"identical": True},  # a peer: no bytes recorded
            },
            "experts_bytes_sent": {"canzona": [experts, 0], "numel": [0, 0]},
        }

    mib = 2**20
    moved = _held(case(10 * mib, 7 * mib, 0))
    assert "Every expert stays where it lies under `canzona` and `numel`" in moved
    assert "it sends 7.0/7.0 MiB per rank" in moved
    assert "moves some head blocks off their holders" in moved
    assert "`canzona` sends 10.0/10.0 MiB per rank" in moved
    kept = _held(case(7 * mib, 7 * mib, 4096))
    assert "Every expert stays where it lies under `numel` (0 bytes" in kept
    assert "So does `canzona` (7.0/7.0 MiB per rank)." in kept
    assert "moves some" not in kept


def test_run_all_knows_every_script() -> None:
    import run_all

    assert "overhead" in run_all.SCRIPTS
    for name in run_all.SCRIPTS:
        assert (BENCH / f"{name}.py").exists()
        # quick mode writes only under results/quick/: every path it passes is there
        paths = [a for a in run_all.QUICK_OUTPUTS[name] if not a.startswith("--")]
        assert paths and all(Path(p).is_relative_to(run_all.QUICK) for p in paths), name


def test_results_record_their_commit(tmp_path: Path) -> None:
    import _report

    payload: dict[str, Any] = {"x": 1}
    path = _report.write_json("probe", payload, out_dir=tmp_path)
    saved = json.loads(path.read_text())
    assert COMMIT.match(saved["commit"]) and saved["commit"] == payload["commit"]
    assert list(saved)[:2] == ["machine", "commit"] and saved["x"] == 1


def test_results_name_the_commit_the_run_started_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a commit or an edit of src/ during an hour-long run must not relabel its numbers
    import _report

    monkeypatch.setattr(_report, "git_commit", lambda: "0000000-dirty")
    payload: dict[str, Any] = {}
    _report.write_json("probe", payload, out_dir=tmp_path)
    assert payload["commit"] == _report.STARTED_ON != "0000000-dirty"


def test_a_stale_installed_copy_is_named_in_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.machinery
    import shutil

    import _report

    copy = tmp_path / "site" / "canzona"
    shutil.copytree(_report.SRC / "canzona", copy, ignore=shutil.ignore_patterns("__pycache__"))
    spec = importlib.machinery.ModuleSpec("canzona", None, origin=str(copy / "__init__.py"))
    monkeypatch.setattr(_report.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setenv("CANZONA_BENCH_COMMIT", "abc1234")
    assert _report.imported_is_src() and _report.git_commit() == "abc1234"  # the same files
    with (copy / "plan" / "__init__.py").open("a") as f:
        f.write("# edited after the install\n")
    assert not _report.imported_is_src()
    assert _report.git_commit() == "abc1234-installed"
    monkeypatch.delenv("CANZONA_BENCH_COMMIT")
    assert _report.git_commit().endswith("-installed")
