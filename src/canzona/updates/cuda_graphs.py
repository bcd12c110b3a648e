"""Small CUDA kernel sequences replayed from CUDA graphs, used only where bitwise equal to eager."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ENV_VAR",
    "MAX_ELEMENTS",
    "MAX_GRAPHS",
    "MAX_HELD_ELEMENTS",
    "graphs_enabled",
    "piece_sizes",
    "replay_exact",
    "replay_in_pieces",
]

#: Set to ``0`` to run every sequence eagerly (read at each call).
ENV_VAR = "CANZONA_CUDA_GRAPHS"
#: Largest input (elements) replayed from one graph: a graph's private memory pool keeps its
#: intermediates, and above a few million elements the kernels, not their launches, take the
#: time. Larger stacks replay in pieces (:func:`replay_in_pieces`).
MAX_ELEMENTS = 1 << 23
#: Most graphs kept per process; keys past it run eagerly.
MAX_GRAPHS = 128
#: Most input elements over all kept graphs; keys past it run eagerly. A graph holds its
#: input and, in its private pool, about three copies of it in the iteration's dtype (the
#: Newton–Schulz loop's cast, results and stack): some 10 bytes per element from fp32 into
#: bf16, so at most about 640 MiB of device memory per process.
MAX_HELD_ELEMENTS = 1 << 26
#: Streams a captured function may fork its independent work onto (run side by side on replay).
BRANCHES = 8

#: ``fn(x, branches)``: the work on ``x``; ``branches`` is empty when it runs eagerly and holds
#: :data:`BRANCHES` streams while it is captured, onto which it may fork independent kernels.
Sequenceable = Callable[[Tensor, Sequence[torch.cuda.Stream]], Tensor]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: Tensor
    static_out: Tensor


# key -> the captured graph, or None where the graph was not bitwise equal to eager (or failed)
_GRAPHS: dict[Hashable, _Graph | None] = {}
# check key -> whether its graph gave the eager bits
_CHECKED: dict[Hashable, bool] = {}
# device index -> the capture stream and the branch streams
_STREAMS: dict[int, tuple[torch.cuda.Stream, list[torch.cuda.Stream]]] = {}


def graphs_enabled() -> bool:
    """False when the environment variable :data:`ENV_VAR` is ``0``."""
    return os.environ.get(ENV_VAR, "1") != "0"


def _streams(device: torch.device) -> tuple[torch.cuda.Stream, list[torch.cuda.Stream]]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        new = [torch.cuda.Stream(device=device) for _ in range(1 + BRANCHES)]  # type: ignore[no-untyped-call]
        _STREAMS[index] = (new[0], new[1:])
    return _STREAMS[index]


def _admits(numel: int) -> bool:
    """Whether one more graph of ``numel`` input elements stays within both limits."""
    held = sum(g.static_in.numel() for g in _GRAPHS.values() if g is not None)
    return len(_GRAPHS) < MAX_GRAPHS and held + numel <= MAX_HELD_ELEMENTS


def _capture(fn: Sequenceable, static_in: Tensor) -> _Graph | None:
    """Warm ``fn`` up on a side stream, capture it there; None when the capture fails."""
    device = static_in.device
    side, branches = _streams(device)
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        fn(static_in, branches)  # warm-up: library handles and workspaces of every stream
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            static_out = fn(static_in, branches)
        except RuntimeError:
            with contextlib.suppress(RuntimeError):
                graph.capture_end()
            current.wait_stream(side)
            return None
        graph.capture_end()
    current.wait_stream(side)
    return _Graph(graph, static_in, static_out)


def replay_exact(
    fn: Sequenceable, x: Tensor, key: Hashable, check_key: Hashable | None = None
) -> Tensor | None:
    """``fn(x)`` replayed from a CUDA graph, or None where it should run eagerly.

    A sequence of small kernels on CUDA is bound by their launches (on the H200 of the GPU
    check, the per-matrix Newton–Schulz loop on a 128x5120 matrix takes 0.7 ms eagerly and
    0.12 ms from a graph). ``key`` must determine everything ``fn`` does besides ``x``'s
    values (``x``'s device, shape and dtype are added to it); each key gets its own graph,
    captured at its first call on a contiguous, freshly allocated input. Before a graph is
    used, a graph for its ``check_key`` (default: the key) has been run on a seeded random
    input next to ``fn`` run eagerly on it and compared with :func:`torch.equal` (one host
    sync per check key); a check key whose graph differed runs eagerly from then on. A
    caller whose graphs for different keys run the same kernels on each part of the input
    (a per-matrix loop at every stack size) passes one check key for them, so that a new key
    of a checked family costs no sync. Later calls copy ``x`` into the graph's input, replay
    it on the current stream and return a copy of its output, so a result stays valid after
    the next replay. ``fn(x, branches)`` must be a pure function of ``x``'s values; while it
    is captured, ``branches`` holds :data:`BRANCHES` streams onto which it may fork work on
    independent parts of ``x`` (the graph then runs them side by side), eagerly it is empty.

    None (run eagerly) off CUDA, while a stream is being captured, for inputs above
    :data:`MAX_ELEMENTS`, past :data:`MAX_GRAPHS` keys or :data:`MAX_HELD_ELEMENTS` elements
    held, for keys whose capture failed or whose check differed, and when :data:`ENV_VAR` is
    ``0``.
    """
    if x.device.type != "cuda" or x.numel() > MAX_ELEMENTS or not graphs_enabled():
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    full_key = (x.device, x.dtype, tuple(x.shape), key)
    check = full_key if check_key is None else (x.device, x.dtype, check_key)
    if full_key not in _GRAPHS:
        if _CHECKED.get(check) is False or not _admits(x.numel()):
            return None
        static_in = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if check in _CHECKED:
            static_in.copy_(x)
            _GRAPHS[full_key] = _capture(fn, static_in)
        else:
            gen = torch.Generator(device=x.device).manual_seed(0)
            probe = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
            static_in.copy_(probe)
            captured = _capture(fn, static_in)
            if captured is not None:
                static_in.copy_(probe)
                captured.graph.replay()
                _CHECKED[check] = torch.equal(captured.static_out, fn(probe, ()))
                if not _CHECKED[check]:
                    captured = None
            _GRAPHS[full_key] = captured
    entry = _GRAPHS[full_key]
    if entry is None:
        return None
    entry.static_in.copy_(x)
    entry.graph.replay()
    return entry.static_out.clone()


def piece_sizes(count: int, elements: int) -> list[int]:
    """How :func:`replay_in_pieces` cuts ``count`` items of ``elements`` each: powers of two.

    Full pieces of the largest power of two whose items fit in :data:`MAX_ELEMENTS`, then the
    remainder's binary digits, largest first, so that one item shape needs at most
    ``log2(piece) + 1`` graphs whatever the counts; empty when one item is too large (or
    empty).
    """
    if count < 1 or not 0 < elements <= MAX_ELEMENTS:
        return []
    full = 1 << (MAX_ELEMENTS // elements).bit_length() - 1
    rest = count % full
    tail = [1 << b for b in reversed(range(full.bit_length())) if rest >> b & 1]
    return [full] * (count // full) + tail


def replay_in_pieces(
    fn: Sequenceable, x: Tensor, key: Hashable, check_key: Hashable | None = None
) -> Tensor | None:
    """``fn`` over the leading dimension of ``x`` in pieces, each replayed from a graph.

    For an ``fn`` that treats each item ``x[i]`` on its own (a per-matrix loop), so that
    ``fn`` on a piece gives that piece's rows of ``fn(x)`` bit for bit: the pieces of
    :func:`piece_sizes`, each through :func:`replay_exact` (one graph per piece size; a
    piece it declines runs ``fn`` eagerly), concatenated. None (run eagerly) off CUDA, while
    a stream is being captured, when :data:`ENV_VAR` is ``0`` or an item alone is larger
    than :data:`MAX_ELEMENTS`.
    """
    if x.device.type != "cuda" or not graphs_enabled() or torch.cuda.is_current_stream_capturing():
        return None
    sizes = piece_sizes(x.size(0), x[0].numel() if x.size(0) else 0)
    if not sizes:
        return None
    parts, start = [], 0
    for size in sizes:
        piece = x.narrow(0, start, size)
        got = replay_exact(fn, piece, key, check_key)
        parts.append(fn(piece, ()) if got is None else got)
        start += size
    return parts[0] if len(parts) == 1 else torch.cat(parts)
