"""GPU check: batched Newton–Schulz throughput vs the matmul peak, and single-GPU step latency.

Runs on one CUDA device (``benchmarks/gpu_check.sh`` wraps it, ≤ 5 minutes). Measures:

* the bf16 matmul peak of the device (large square ``mm``),
* batched Newton–Schulz (``canzona.updates.newton_schulz``) on stacks of Qwen3-8B and
  Qwen3-32B shapes: matrices/s and achieved TFLOP/s against that peak,
* one optimizer step of ``canzona.Muon`` vs ``torch.optim.Muon`` on the matrices of a
  Qwen3-1.7B-sized layer stack (single GPU, same gradients, same bf16 Newton–Schulz),
* the host cost per matrix: one step on N small (64x32) matrices for canzona.Muon,
  torch.optim.Muon and ``AdamW(foreach=True)``, where the math is negligible on a GPU.

Writes ``benchmarks/results/gpu_check.json`` (or ``--out``) and the ``gpu_check`` section of
``docs/benchmarks.md`` (unless ``--no-doc``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import canzona
from canzona.updates import batch_kernels_exact, cuda_graphs, newton_schulz, newton_schulz_flops

from _report import markdown_table, update_section, write_json

SHAPES = {
    "qwen3-8b q/o (4096x4096)": (4096, 4096),
    "qwen3-8b k/v (1024x4096)": (1024, 4096),
    "qwen3-8b up (12288x4096)": (12288, 4096),
    "qwen3-32b q (8192x5120)": (8192, 5120),
    "qwen3-32b up (25600x5120)": (25600, 5120),
}


def _time(fn: Any, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_peak(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    seconds = _time(lambda: a @ b, 10)
    return 2 * size**3 / seconds


def ns_throughput(peak: float, batch: int) -> list[dict[str, Any]]:
    rows = []
    for label, (m, n) in SHAPES.items():
        x = torch.randn(batch, m, n, device="cuda")
        seconds = _time(lambda x=x: newton_schulz(x, dtype=torch.bfloat16, batched=True), 5)
        flops = batch * newton_schulz_flops(m, n)
        rows.append(
            {
                "shape": label,
                "batch": batch,
                "matrices_per_s": batch / seconds,
                "tflops": flops / seconds / 1e12,
                "fraction_of_peak": flops / seconds / peak,
            }
        )
    return rows


HEAD_SHAPES = {
    "qwen3-32b q head (128x5120)": (128, 5120),
    "qwen3-32b o head (5120x128)": (5120, 128),
}


def head_blocks(batch: int) -> list[dict[str, Any]]:
    """Per-head stacks: canzona's Newton–Schulz as it runs, its loop graphed and eager, batched.

    As it runs: the per-matrix loop from a CUDA graph where the batched kernels would change bits.
    """
    rows = []
    cases = [(lab, shape, k) for k in (batch, 8 * batch) for lab, shape in HEAD_SHAPES.items()]
    for label, (m, n), count in cases:
        x = torch.randn(count, m, n, device="cuda")
        row: dict[str, Any] = {"shape": label, "batch": count}
        row["exact_batched"] = batch_kernels_exact(count, m, n, dtype=torch.bfloat16, device="cuda")
        row["canzona"] = _time(lambda x=x: newton_schulz(x, dtype=torch.bfloat16), 10)
        os.environ[cuda_graphs.ENV_VAR] = "0"
        try:
            eager = newton_schulz(x, dtype=torch.bfloat16, batched=False)
            row["eager_loop"] = _time(
                lambda x=x: newton_schulz(x, dtype=torch.bfloat16, batched=False), 10
            )
        finally:
            del os.environ[cuda_graphs.ENV_VAR]
        graphed = newton_schulz(x, dtype=torch.bfloat16, batched=False)
        row["graph_loop"] = _time(
            lambda x=x: newton_schulz(x, dtype=torch.bfloat16, batched=False), 10
        )
        row["graph_equal_eager"] = bool(torch.equal(graphed, eager))
        row["batched"] = _time(lambda x=x: newton_schulz(x, dtype=torch.bfloat16, batched=True), 10)
        rows.append(row)
    return rows


def step_latency(layers: int) -> dict[str, Any]:
    shapes = [(2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048)]
    shapes += [(6144, 2048), (6144, 2048), (2048, 6144)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    fulls = [torch.randn(s, device="cuda", generator=gen) for _ in range(layers) for s in shapes]
    grads = [torch.randn_like(t) for t in fulls]
    out: dict[str, Any] = {"matrices": len(fulls)}
    for name, make in (
        ("torch.optim.Muon", lambda ps: torch.optim.Muon(ps, lr=0.02)),
        ("canzona.Muon", lambda ps: canzona.Muon(ps, lr=0.02)),
    ):
        params = [torch.nn.Parameter(t.clone()) for t in fulls]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt = make(params)
        out[name] = _time(opt.step, 5)
    out["ratio"] = out["canzona.Muon"] / out["torch.optim.Muon"]
    return out


HOST_COUNTS = (64, 256, 1024)
HOST_KEYS = ("canzona.Muon", "torch.optim.Muon", "AdamW(foreach)")


def host_cost() -> list[dict[str, Any]]:
    """Step time on N small matrices (the math takes microseconds; the rest is the host)."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for count in HOST_COUNTS:
        fulls = [torch.randn(64, 32, device="cuda", generator=gen) for _ in range(count)]
        row: dict[str, Any] = {"matrices": count}
        for name, make in (
            ("canzona.Muon", lambda ps: canzona.Muon(ps, lr=0.02)),
            ("torch.optim.Muon", lambda ps: torch.optim.Muon(ps, lr=0.02)),
            ("AdamW(foreach)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
        ):
            params = [torch.nn.Parameter(t.clone()) for t in fulls]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = make(params)
            opt.step()
            row[name] = _time(opt.step, 10)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="matrices per Newton–Schulz stack")
    parser.add_argument("--layers", type=int, default=8, help="layers of the step-latency model")
    parser.add_argument("--out", type=Path, default=None, help="directory of the JSON result")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    peak = matmul_peak()
    ns = ns_throughput(peak, args.batch)
    heads = head_blocks(args.batch)  # stacks of 8 and of 64 (replayed in pieces of 8)
    step = step_latency(args.layers)
    host = host_cost()
    payload = {
        "gpu": name,
        "torch": torch.__version__,
        "bf16_peak_tflops": peak / 1e12,
        "ns": ns,
        "heads": heads,
        "step": step,
        "host_cost": host,
    }
    write_json("gpu_check", payload, out_dir=args.out)
    rows = [
        [r["shape"], r["batch"], r["matrices_per_s"], r["tflops"], r["fraction_of_peak"]]
        for r in ns
    ]
    head_rows = [
        [
            h["shape"],
            h["batch"],
            *(h[k] * 1e3 for k in ("canzona", "graph_loop", "eager_loop", "batched")),
            h["graph_equal_eager"],
            h["exact_batched"],
        ]
        for h in heads
    ]
    host_rows = [
        [h["matrices"], *(h[k] * 1e3 for k in HOST_KEYS), h["canzona.Muon"] / h["AdamW(foreach)"]]
        for h in host
    ]
    md = (
        f"## GPU check ({name})\n\n`bash benchmarks/gpu_check.sh` (commit "
        f"`{payload['commit']}`, torch {torch.__version__}); bf16 matmul peak measured "
        f"{peak / 1e12:.0f} TFLOP/s.\n\n"
        + markdown_table(["shape", "batch", "matrices/s", "TFLOP/s", "of peak"], rows)
        + "\n\nPer-head stacks, ms per call: canzona's Newton–Schulz as it runs (*as run*), its "
        "per-matrix loop replayed from a CUDA graph and launched eagerly (*graph*, *eager*; "
        "equal bit for bit: *same bits*), and the batched kernels (*batched*; used where "
        "*batched exact*, else they would change bits):\n\n"
        + markdown_table(
            ["shape", "batch", "as run", "graph", "eager", "batched", "same bits", "batched exact"],
            head_rows,
        )
        + f"\n\nOne step on {step['matrices']} matrices of Qwen3-1.7B shapes: canzona.Muon "
        f"{step['canzona.Muon'] * 1e3:.1f} ms vs torch.optim.Muon "
        f"{step['torch.optim.Muon'] * 1e3:.1f} ms (ratio {step['ratio']:.2f}).\n\n"
        "Host cost: one step on N 64x32 matrices, one process, ms (the math is negligible "
        "here; what remains is each optimizer's host work):\n\n"
        + markdown_table(["N", *HOST_KEYS, "canzona / AdamW"], host_rows)
        + "\n"
    )
    if not args.no_doc:
        update_section("gpu_check", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
