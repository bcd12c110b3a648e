"""The layout agreement's gather against ``all_gather_object``: medians, taken in turn.

    python benchmarks/agreement_gather.py            # world 2 and 4, 200 of each

Prints, per world size and rank, the median milliseconds of ``dist.all_gather_object`` and of
``canzona.runtime.watchdog.gather_objects`` (two small all-to-alls through the watchdog) on
an object the size of the agreement's, after a barrier each time. Quoted in design.md
(*Failure handling*) and docs/benchmarks.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import launch
from canzona.runtime.watchdog import Watchdog, gather_objects

ROUNDS = 400


def body(rank: int, world: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    watchdog = Watchdog(process_group=None, rank=rank, world=world, timeout_s=60)
    obj = ("d" * 40, {(("dp",), (world,)): tuple(range(world))}, None, "0123456789ab.1")
    old: list[float] = []
    new: list[float] = []
    for i in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        if i % 2:
            out: list[object] = [None] * world
            dist.all_gather_object(out, obj)
            old.append(time.perf_counter() - start)
        else:
            gather_objects(obj, watchdog=watchdog, phase=-1, what="the layout agreement")
            new.append(time.perf_counter() - start)
    return statistics.median(old) * 1e3, statistics.median(new) * 1e3


def main() -> None:
    for world in (2, 4):
        for rank, (old, new) in enumerate(launch(body, world)):
            print(f"world {world} rank {rank}: all_gather_object {old:.2f} ms, gather {new:.2f} ms")


if __name__ == "__main__":
    main()
