"""CUDA checks (skipped on machines without a GPU)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import _gpu_ranks
import canzona
from canzona.updates import cuda_graphs, newton_schulz

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _assert_three_steps_match_torch(shapes: list[tuple[int, int]], seed: int) -> None:
    """canzona.Muon and torch.optim.Muon (defaults, lr 0.02) on CUDA: equal after 3 steps."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    fulls = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    ours = [nn.Parameter(t.clone()) for t in fulls]
    ref = [nn.Parameter(t.clone()) for t in fulls]
    a, b = canzona.Muon(ours, lr=0.02), torch.optim.Muon(ref, lr=0.02)
    for _ in range(3):
        for p, q in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, device="cuda", generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p, q)


def test_muon_on_cuda_matches_torch() -> None:
    _assert_three_steps_match_torch([(64, 32), (32, 96), (48, 48)], seed=0)


def test_small_stacks_on_cuda_match_torch() -> None:
    """Stacks below the batched kernels' side run matrix by matrix with the element-wise ops
    on the whole stack, in 512-byte-aligned matrices: bitwise torch.optim.Muon on CUDA too
    (where cuBLAS, like MKL, may pick kernels by alignment)."""
    _assert_three_steps_match_torch([(5, 9)] * 6 + [(16, 12)] * 5 + [(8, 8)] * 4, seed=1)


@pytest.mark.parametrize(
    ("shape", "batched"),
    [((8, 16, 24), None), ((6, 24, 9), None), ((4, 128, 640), False), ((7, 128, 5120), False)],
)
def test_per_matrix_stacks_replay_from_cuda_graphs_bit_for_bit(
    shape: tuple[int, int, int], batched: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-matrix Newton–Schulz loop (sides below 32, or batched kernels refused) replays
    from CUDA graphs, one per piece (7 head blocks of 128x5120: pieces of 4, 2 and 1): the
    same bits as the eager loop, and a result stays valid after the next replay (the graph's
    output is copied out)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(shape, device="cuda", generator=gen) * 10.0**i for i in range(3)]
    kw = {"dtype": torch.bfloat16, "batched": batched}
    replayed = [newton_schulz(x, **kw) for x in xs]
    device = torch.device("cuda", torch.cuda.current_device())
    for size in cuda_graphs.piece_sizes(shape[0], shape[1] * shape[2]):
        piece = (device, torch.float32, (size, *shape[1:]))
        keys = [k for k in cuda_graphs._GRAPHS if k[:3] == piece]
        assert len(keys) == 1 and cuda_graphs._GRAPHS[keys[0]] is not None  # captured, matched
    monkeypatch.setenv(cuda_graphs.ENV_VAR, "0")
    for x, got in zip(xs, replayed, strict=True):
        assert torch.equal(got, newton_schulz(x, **kw))


def test_the_loop_forked_onto_branch_streams_gives_the_same_bits() -> None:
    """What a captured graph replays side by side: each matrix's products on its own branch
    stream, forked from and joined back to the current stream, bit for bit the plain loop."""
    loop = importlib.import_module("canzona.updates.newton_schulz")._ns_loop
    schedule = ((3.4445, -4.775, 2.0315),) * 5
    gen = torch.Generator(device="cuda").manual_seed(5)
    branches = [torch.cuda.Stream() for _ in range(3)]
    for shape in ((7, 128, 640), (5, 640, 128), (9, 12, 20)):
        x = torch.randn(shape, device="cuda", generator=gen)
        plain = loop(x, schedule, 1e-7, torch.bfloat16, 1.0)
        forked = loop(x, schedule, 1e-7, torch.bfloat16, 1.0, branches)
        assert torch.equal(forked, plain)


def test_a_new_stack_size_of_a_checked_shape_replays_without_a_sync() -> None:
    """The bitwise check is per matrix shape: a piece of a new size captures its own graph
    without reading the device (a re-plan that changes an owner's stack sizes adds no sync)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    newton_schulz(torch.randn(3, 12, 20, device="cuda", generator=gen), dtype=torch.bfloat16)
    x = torch.randn(5, 12, 20, device="cuda", generator=gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = newton_schulz(x, dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    key = (torch.device("cuda", torch.cuda.current_device()), torch.float32, (4, 12, 20))
    assert cuda_graphs.piece_sizes(3, 240) == [2, 1] and cuda_graphs.piece_sizes(5, 240) == [4, 1]
    assert [v is not None for k, v in cuda_graphs._GRAPHS.items() if k[:3] == key] == [True]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cuda_graphs.ENV_VAR, "0")
        assert torch.equal(got, newton_schulz(x, dtype=torch.bfloat16))


def test_shampoo_state_stays_on_cuda() -> None:
    p = nn.Parameter(torch.randn(16, 24, device="cuda"))
    opt = canzona.Shampoo([p], precondition_frequency=1, start_preconditioning_step=1)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state_dict()["state"][0]
    assert all(v.device.type == "cuda" for k, v in state.items() if k != "step")


def test_a_healthy_step_does_not_synchronise_with_the_device() -> None:
    """After the first step (kernel probes, plan), a step makes no device-to-host sync.

    The syncs a distributed step makes are listed in docs/design.md (the header, the vote);
    on one device there is neither, so ``set_sync_debug_mode("error")`` must stay quiet.
    """
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((64, 32), (64, 32), (32, 96), (48, 48))
    params = [nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]
    extra = nn.Parameter(torch.randn(7, device="cuda", generator=gen))
    opt = canzona.Muon([{"params": params}, {"params": [extra], "algorithm": "adamw"}], lr=0.02)

    def step() -> None:
        for p in (*params, extra):
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        opt.step()

    step()  # first step: batched-kernel probes and planning read the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_cuda_learning_rate_is_read_once_per_group_and_step() -> None:
    """A learning rate given as a CUDA tensor (a scheduler keeping ``initial_lr`` beside it):
    one device read per param group and step, however many shapes or step counts, and the
    result bitwise ``torch.optim.Muon``'s with the same tensor rate.

    Catches: the apply computing its factors from the group's tensor and reading each on
    the host (a sync per call, in the middle of the step's kernels)."""
    import warnings

    from torch.optim.lr_scheduler import StepLR

    gen = torch.Generator(device="cuda").manual_seed(3)
    shapes = ((64, 32), (32, 96), (48, 48))
    fulls = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    ours = [nn.Parameter(t.clone()) for t in fulls]
    ref = [nn.Parameter(t.clone()) for t in fulls]
    extra = nn.Parameter(torch.randn(7, device="cuda", generator=gen))
    opt = canzona.Muon(
        [
            {"params": ours, "lr": torch.tensor(0.02, device="cuda")},
            {"params": [extra], "lr": torch.tensor(0.01, device="cuda"), "algorithm": "adamw"},
        ]
    )
    theirs = torch.optim.Muon(ref, lr=torch.tensor(0.02, device="cuda"))
    schedulers = [StepLR(o, step_size=2, gamma=0.5) for o in (opt, theirs)]
    syncs = []
    for step in range(4):
        for p, q in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, device="cuda", generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        extra.grad = torch.randn(7, device="cuda", generator=gen)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if step else "default")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum(_gpu_ranks.SYNC_MESSAGE in str(w.message) for w in caught))
        theirs.step()
        for scheduler in schedulers:
            scheduler.step()
    assert syncs[1:] == [2, 2, 2]  # one per group (step 0 plans and probes the kernels)
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p, q)


def test_a_checkpoint_loaded_onto_the_gpu_steps_on() -> None:
    """``torch.load(..., map_location="cuda")`` puts the step counters on the GPU (torch's
    ``load_state_dict`` keeps them there); a parameter that had not stepped yet starts its
    counter on the host. The next step takes both, and later steps make no sync.

    Catches: the counters stacked across devices (the step failed: "Tensor on device cpu is
    not on the expected device")."""
    import io

    gen = torch.Generator(device="cuda").manual_seed(4)
    a = nn.Parameter(torch.randn(32, 16, device="cuda", generator=gen))
    b = nn.Parameter(torch.randn(16, 24, device="cuda", generator=gen))
    opt = canzona.Muon([a, b], lr=0.02)
    a.grad = torch.randn(a.shape, device="cuda", generator=gen)
    opt.step()  # b has no gradient: no state, no counter
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="cuda")
    assert loaded["state"][0]["step"].device.type == "cuda"
    again = canzona.Muon([a, b], lr=0.02)
    again.load_state_dict(loaded)
    for _ in range(2):
        a.grad = torch.randn(a.shape, device="cuda", generator=gen)
        b.grad = torch.randn(b.shape, device="cuda", generator=gen)
        again.step()
    assert [int(again.state[p]["step"]) for p in (a, b)] == [3, 2]
    assert all(again.state[p]["step"].device.type == "cpu" for p in (a, b))


def _distinct_shapes() -> list[list[int]]:
    return sorted([list(s) for s in set(_gpu_ranks.SHAPES)])


def test_a_distributed_step_synchronises_only_where_documented(tmp_path: Path) -> None:
    """Two ranks on the GPU (gloo): bitwise torch.optim.Muon, CUDA-event calibration, 2 syncs.

    The two host reads of a healthy step (docs/design.md, "Host synchronisation"): the
    header (its own all-to-all in watchdog.py at the second step; from the third, steady,
    its slot in the first gather, in pipeline.py) and the vote on the last scatter
    (pipeline.py).
    """
    reports = _gpu_ranks.launch("gloo", 2, tmp_path)
    print(json.dumps(reports))
    for r in reports:
        assert r["bitwise"] == [True] * len(_gpu_ranks.SHAPES)
        assert r["planned"] is True
        assert r["syncs_per_step"] == [2, 2, 2], r["sync_sites"]
        assert {site.split(":")[0] for site in r["sync_sites"]} == {"watchdog.py", "pipeline.py"}
        assert "MeasuredCost" in r["cost_models"]
        assert r["timed_shapes"] == _distinct_shapes()  # every shape timed with CUDA events
        assert r["timed_on"] == [r["device"]]
        assert r["bytes_sent"] > 0
    assert reports[0]["timed_shapes"] == reports[1]["timed_shapes"]


def test_tiny_micro_groups_share_all_to_alls_on_cuda(tmp_path: Path) -> None:
    """A tiny capacity cuts the plan into several micro-groups, which share all-to-alls
    (n groups in n + 1) on CUDA tensors: still bitwise torch.optim.Muon, still 2 syncs."""
    reports = _gpu_ranks.launch("gloo", 2, tmp_path, capacity_mb=1e-3)
    print(json.dumps(reports))
    for r in reports:
        assert r["bitwise"] == [True] * len(_gpu_ranks.SHAPES)
        assert r["syncs_per_step"] == [2, 2, 2], r["sync_sites"]
        assert r["micro_groups"] >= 3 and r["collectives"] == r["micro_groups"] + 1, r


def test_the_steps_reprice_the_plan_with_cuda_events(tmp_path: Path) -> None:
    """Steps 2-4 time their owner calls with CUDA events (read once, at the re-pricing
    before step 5, which re-plans): still bitwise torch.optim.Muon after 6 steps, 2 syncs
    per step while recording, every shape priced."""
    reports = _gpu_ranks.launch("gloo", 2, tmp_path, steps=6)
    print(json.dumps(reports))
    for r in reports:
        assert r["bitwise"] == [True] * len(_gpu_ranks.SHAPES)
        assert r["syncs_per_step"] == [2, 2, 2], r["sync_sites"]
        assert r["repricings"] == 1
        assert r["priced_shapes"] == _distinct_shapes()
    assert reports[0]["priced_shapes"] == reports[1]["priced_shapes"]


def test_one_rank_under_nccl(tmp_path: Path) -> None:
    """The NCCL path at world 1: no plan (each matrix is whole on its rank), bitwise, no sync."""
    (r,) = _gpu_ranks.launch("nccl", 1, tmp_path)
    print(json.dumps(r))
    assert r["bitwise"] == [True] * len(_gpu_ranks.SHAPES)
    assert r["planned"] is False
    assert r["syncs_per_step"] == [0, 0, 0], r["sync_sites"]


def test_a_per_head_model_times_its_large_matrices_on_cuda(tmp_path: Path) -> None:
    """Two Qwen3-32B layers split per head, calibrated on CUDA within the runtime's 1.5 s:
    the MLP matrices are timed, not fitted. Catches: the CPU's order on a GPU (the
    launch-bound head blocks first, whose seconds per FLOP priced the MLP calls past the cap)."""
    from canzona.optim.calibration import calibrate_model
    from canzona.plan.models import model_specs

    specs = [s for s in model_specs("qwen3-32b", split="heads") if s.name.startswith("layers.0.")]
    out = tmp_path / "table.json"
    summary = calibrate_model(specs, optimizer="muon", out=out, device="cuda", budget_s=1.5)
    rows = json.loads(out.read_text())["models"]["0"]["table"]
    print(json.dumps({"shapes": summary["shapes"], "timed": [r[:2] for r in rows]}))
    assert sorted(r[:2] for r in rows) == [[128, 5120], [5120, 128], [5120, 25600], [25600, 5120]]
