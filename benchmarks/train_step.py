"""Whole training iterations (forward + backward + optimizer step) at world 4, FSDP x TP.

The Qwen3-like decoder of ``_qwen.py`` (embedding and head on the ``dp`` mesh, the blocks
tensor-parallel on ``tp`` and FSDP2-sharded on ``dp`` of a (2, 2) mesh) trains on the same
seeded token batches with three optimizers, interleaved iteration by iteration: ``canzona.Muon``
(matrices; embedding, head and norms by its AdamW route), the same with
``strategy="replicated"`` (every rank orthogonalises every matrix), and ``torch.optim.AdamW``.
Reported per optimizer: iteration time, forward + backward time, step time and the step's share
of the iteration (the paper's end-to-end comparison). Writes ``benchmarks/results/
train_step[_quick].json`` and the ``train_step`` section of ``docs/benchmarks.md``.

    python benchmarks/train_step.py --quick    # about 40 s on 2 cores
    python benchmarks/train_step.py --full     # about 2 minutes
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _qwen
import canzona
from _ranks import WARMUP, launch
from kernels import cpu_description

from _report import DOC, RESULTS, machine_info, markdown_table, update_section, write_json

PRESETS: dict[str, dict[str, Any]] = {
    "full": {"widths": (512,) * 4, "batch": 2, "seq": 128, "steps": 10},
    "quick": {"widths": (256,) * 4, "batch": 2, "seq": 64, "steps": 10},
    "tiny": {"widths": (64,) * 2, "batch": 1, "seq": 16, "steps": 2},
}
OPTIMIZERS = ("canzona", "replicated", "adamw")
LABELS = {
    "canzona": "`canzona.Muon` (`canzona` strategy)",
    "replicated": "`canzona.Muon` (`replicated`)",
    "adamw": "`torch.optim.AdamW`",
}
WORLD, MESH = 4, "fsdp_tp"


def _make(name: str, model: _qwen.Decoder, capacity_mb: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    plan = canzona.PlanConfig(strategy=name, capacity_mb=capacity_mb)
    groups = canzona.param_groups(model, adamw={"lr": 3e-4})
    return canzona.Muon(groups, lr=0.02, weight_decay=0.1, plan=plan)


def rank_body(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every optimizer, interleaved iteration by iteration, on this rank."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    config = _qwen.ModelConfig(name="qwen3-like", widths=tuple(cfg["widths"]))
    model, mesh = _qwen.build(config, MESH, world)
    assert mesh is not None
    dp = mesh["dp"].get_local_rank()
    params = list(model.parameters())
    init = [_qwen.local(p).detach().clone() for p in params]
    gen = torch.Generator().manual_seed(1000 + dp)  # the tp ranks of a dp group share data
    batches = [
        torch.randint(0, config.vocab, (cfg["batch"], cfg["seq"] + 1), generator=gen)
        for _ in range(2)
    ]
    capacity = max(0.05, _qwen.mib(config) / world / 4)
    opts = {name: _make(name, model, capacity) for name in OPTIMIZERS}
    values = {name: [x.clone() for x in init] for name in OPTIMIZERS}
    record: dict[str, dict[str, list[float]]] = {
        n: {"fwd_bwd": [], "step": [], "loss": []} for n in OPTIMIZERS
    }
    for it in range(WARMUP + cfg["steps"]):
        shift = it % len(OPTIMIZERS)
        for name in OPTIMIZERS[shift:] + OPTIMIZERS[:shift]:
            with torch.no_grad():
                for p, v in zip(params, values[name], strict=True):
                    _qwen.local(p).copy_(v)
            opts[name].zero_grad(set_to_none=True)
            tokens = batches[it % len(batches)]
            dist.barrier()
            t0 = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
            loss.backward()
            t1 = time.perf_counter()
            opts[name].step()
            t2 = time.perf_counter()
            with torch.no_grad():
                for p, v in zip(params, values[name], strict=True):
                    v.copy_(_qwen.local(p))
            if it >= WARMUP:
                record[name]["fwd_bwd"].append(t1 - t0)
                record[name]["step"].append(t2 - t1)
                record[name]["loss"].append(float(loss))
    for name in OPTIMIZERS:
        record[name]["fingerprint"] = _qwen.fingerprint(values[name])  # type: ignore[assignment]
    return record


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in OPTIMIZERS:
        per = [r[name] for r in ranks]
        fb = [max(x) for x in zip(*(p["fwd_bwd"] for p in per), strict=True)]
        st = [max(x) for x in zip(*(p["step"] for p in per), strict=True)]
        its = [
            max(x)
            for x in zip(
                *([a + b for a, b in zip(p["fwd_bwd"], p["step"], strict=True)] for p in per),
                strict=True,
            )
        ]
        out[name] = {
            "iteration_s": statistics.median(its),
            "iteration_min_s": min(its),
            "iteration_max_s": max(its),
            "fwd_bwd_s": statistics.median(fb),
            "step_s": statistics.median(st),
            "step_share": statistics.median(st) / statistics.median(its),
            "losses": per[0]["loss"],
        }
    base = out["replicated"]
    for name in OPTIMIZERS:
        out[name]["iteration_vs_replicated"] = out[name]["iteration_s"] / base["iteration_s"]
        out[name]["step_vs_replicated"] = out[name]["step_s"] / base["step_s"]
    out["canzona"]["same_parameters_as_replicated"] = all(
        r["canzona"]["fingerprint"] == r["replicated"]["fingerprint"] for r in ranks
    )
    return out


def render(payload: dict[str, Any]) -> str:
    m, res, cfg = payload["machine"], payload["results"], payload["config"]
    rows = [
        [
            LABELS[n],
            f"{res[n]['iteration_s'] * 1e3:.0f} ({res[n]['iteration_min_s'] * 1e3:.0f}–"
            f"{res[n]['iteration_max_s'] * 1e3:.0f})",
            f"{res[n]['fwd_bwd_s'] * 1e3:.0f}",
            f"{res[n]['step_s'] * 1e3:.0f}",
            f"{100 * res[n]['step_share']:.0f}%",
            f"{res[n]['step_vs_replicated']:.3f}",
            f"{res[n]['iteration_vs_replicated']:.3f}",
        ]
        for n in OPTIMIZERS
    ]
    same = res["canzona"]["same_parameters_as_replicated"]
    return "\n\n".join(
        [
            "## Training iterations: forward + backward + step",
            f"`{payload['command']}` ({payload['mode']} mode, {payload['date']}, commit "
            f"`{payload.get('commit', 'unknown')}`): "
            f"{payload['cpu']}, {m['cpu_count']} cores, torch {m['torch']}, gloo, 4 ranks on a "
            "(dp 2, tp 2) mesh, one intra-op thread per rank; "
            f"{payload['load_average']:.1f} load average during the run.",
            f"Model: Qwen3-like decoder, {cfg['layers']} (vocabulary {cfg['vocab']}, "
            f"{cfg['params_m']:.1f} M parameters), blocks Colwise/Rowwise tensor parallel then "
            f"FSDP2, embedding and head FSDP2 only; per dp rank {cfg['batch']} sequences of "
            f"{cfg['seq']} tokens. The three optimizers take turns iteration by iteration on the "
            f"same batches from their own copy of the weights; {payload['steps']} timed iterations "
            f"after {WARMUP} warm-up ones, a barrier before each, each phase timed on the slowest "
            "rank. Muon: lr 0.02, weight decay 0.1, bf16 Newton–Schulz; embedding, head and norms "
            "by canzona's AdamW route (lr 3e-4). AdamW: lr 3e-4 on every parameter.",
            markdown_table(
                [
                    "optimizer",
                    "iteration ms, median (min–max)",
                    "forward + backward ms",
                    "step ms",
                    "step share",
                    "step × replicated",
                    "iteration × replicated",
                ],
                rows,
            ),
            f"`canzona` and `replicated` end with bitwise identical parameters: "
            f"{'yes' if same else '**no**'}.",
        ]
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a smaller model (default)")
    mode.add_argument("--full", action="store_true", help="the step-latency model")
    mode.add_argument("--tiny", action="store_true", help="seconds; for smoke tests only")
    parser.add_argument("--steps", type=int, help="timed iterations")
    parser.add_argument("--out", type=Path, help="directory of the JSON (full: benchmarks/results)")
    parser.add_argument("--doc", type=Path, help="Markdown file (full: docs/benchmarks.md)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the run")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    full = name == "full"  # only full mode writes the published files
    args.out = args.out or (RESULTS if full else RESULTS / "quick")
    args.doc = args.doc or (DOC if full else RESULTS / "quick" / "benchmarks_quick.md")
    cfg = dict(PRESETS[name])
    if args.steps:
        cfg["steps"] = args.steps
    torch.set_num_threads(1)
    began = time.perf_counter()
    load0 = os.getloadavg()[0]
    ranks = launch(rank_body, WORLD, cfg, timeout=args.timeout)
    config = _qwen.ModelConfig(name="qwen3-like", widths=tuple(cfg["widths"]))
    n_params = sum(p.numel() for p in _qwen.Decoder(config).parameters())
    payload: dict[str, Any] = {
        "mode": name,
        "command": " ".join(["python benchmarks/train_step.py", *(argv or [f"--{name}"])]),
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "world": WORLD,
        "mesh": MESH,
        "steps": cfg["steps"],
        "warmup": WARMUP,
        "config": {
            **cfg,
            "widths": list(cfg["widths"]),
            "layers": config.describe(),
            "vocab": config.vocab,
            "params_m": n_params / 1e6,
        },
        "load_average": (load0 + os.getloadavg()[0]) / 2,
        "results": summarize(ranks),
        "bench_seconds": time.perf_counter() - began,
    }
    path = write_json(
        "train_step" if name == "full" else f"train_step_{name}", payload, out_dir=args.out
    )
    update_section("train_step", render({"machine": machine_info(), **payload}), doc=args.doc)
    for n in OPTIMIZERS:
        r = payload["results"][n]
        print(
            f"{n:10s} iteration {r['iteration_s'] * 1e3:7.1f} ms, step {r['step_s'] * 1e3:6.1f} "
            f"ms ({100 * r['step_share']:.0f}%), step x replicated {r['step_vs_replicated']:.3f}"
        )
    print(f"wrote {path} and the 'train_step' section of {args.doc}")
    return payload


if __name__ == "__main__":
    main()
