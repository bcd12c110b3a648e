"""A cost model of measured seconds: kernel time per shape, a fit elsewhere, transfer time."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from canzona.plan.cost import CostModel, GroupedCost, cost_model, cost_model_params
from canzona.plan.spec import MatrixSpec

_T = TypeVar("_T")

__all__ = [
    "MAX_BATCH",
    "TABLE_FORMAT",
    "MeasuredCost",
    "batch_line",
    "class_fits",
    "fit_loglog",
    "load_cost_file",
    "load_cost_table",
    "owner_stack",
    "owner_transfer_share",
    "piece_size",
    "predict_seconds",
    "reprice",
    "save_cost_table",
    "shape_classes",
]

#: Version of the JSON written by :func:`save_cost_table` (``canzona calibrate``).
TABLE_FORMAT = 1
#: Most matrices stacked in one timed call (the pipeline's batches per owner and shape).
MAX_BATCH = 8


def owner_stack(count: int, world: int) -> int:
    """Matrices of one shape an owner is expected to stack: ``count / world``, in [1, MAX_BATCH].

    The calibration times each shape at this stack (:mod:`canzona.runtime.calibrate`), and the
    CLI checks a cost table's stacks against it.
    """
    return max(1, min(MAX_BATCH, math.ceil(count / world)))


def fit_loglog(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``log t = a + b log x`` over positive points; ``(a, b)``.

    One point (or points with a single ``x``) gives ``b = 1``: time proportional to work.
    """
    pts = [(math.log(x), math.log(t)) for x, t in points if x > 0 and t > 0]
    if not pts:
        return (0.0, 1.0)
    mx = math.fsum(x for x, _ in pts) / len(pts)
    my = math.fsum(y for _, y in pts) / len(pts)
    var = math.fsum((x - mx) ** 2 for x, _ in pts)
    if var == 0:
        return (my - mx, 1.0)
    slope = math.fsum((x - mx) * (y - my) for x, y in pts) / var
    return (my - slope * mx, slope)


def shape_classes(m: int, n: int) -> tuple[tuple[str, int], ...]:
    """The classes a shape's fit is looked up in, most specific first.

    ``("side", min(m, n))``: the same smaller side, whose kernels' efficiency follows the
    larger one smoothly; then ``("aspect", round(log2(larger / smaller)))``.
    """
    small, large = min(m, n), max(m, n)
    return (("side", small), ("aspect", round(math.log2(large / small)) if small > 0 else 0))


def class_fits(
    points: Sequence[tuple[tuple[int, int], float, float]],
) -> tuple[tuple[str, int, float, float], ...]:
    """Per shape class, ``(kind, value, a, b)`` of a log-log fit of its timed shapes.

    ``points`` are ``((m, n), work, seconds)``; a class gets a fit only when its shapes have
    at least two distinct works (one point does not give a slope).
    """
    members: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for (m, n), work, seconds in points:
        if work > 0 and seconds > 0:
            for cls in shape_classes(m, n):
                members.setdefault(cls, []).append((work, seconds))
    out = []
    for (kind, value), pts in sorted(members.items()):
        if len({w for w, _ in pts}) >= 2:
            out.append((kind, value, *fit_loglog(pts)))
    return tuple(out)


def batch_line(a: tuple[int, float], b: tuple[int, float]) -> tuple[float, float] | None:
    """``(fixed, per_matrix)`` of the line through two timings ``(k, seconds of one call)``.

    None when the points do not give a line with both parts non-negative (equal batch
    sizes, or timing noise that makes a bigger batch cheaper).
    """
    (k1, t1), (k2, t2) = sorted((a, b))
    if k1 == k2 or k1 <= 0:
        return None
    per = (t2 - t1) / (k2 - k1)
    fixed = t1 - k1 * per
    if not (per >= 0 and fixed >= 0 and math.isfinite(per) and math.isfinite(fixed)):
        return None
    return (fixed, per)


def piece_size(
    k: int, line: tuple[float, float], seconds: float, stack: int | None = None
) -> int | None:
    """The piece size that a timing of a longer stack shows, or None: ``k`` or no limit.

    ``line`` is ``(fixed, per_matrix)`` through the timings at ``k`` and a smaller batch;
    ``seconds`` is one call on ``stack`` matrices (default ``2 k``). In one piece that call
    would take ``fixed + stack per_matrix``; in pieces of ``k``, each paying the fixed part,
    ``ceil(stack / k) fixed + stack per_matrix``. The model whose prediction is nearer wins
    (a tie keeps one piece). On a CPU the batched kernels keep their economy of scale; on a
    GPU the per-matrix graph replays run a piece's matrices side by side and the pieces in
    turn.
    """
    fixed, per = line
    stack = 2 * k if stack is None else stack
    if k < 1 or stack <= k or not (fixed > 0 and seconds > 0):
        return None
    own = stack * per
    pieces = -(-stack // k) * fixed + own
    return k if abs(seconds - pieces) < abs(seconds - fixed - own) else None


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredCost:
    """Seconds on the owner per matrix, measured on the device the job runs on.

    ``flops(spec)`` returns time, not FLOPs: the measured seconds of the owner's math for
    the matrix's shape (``table``), or, for a shape that was not timed, the prediction of
    a log-log fit of time against the closed-form FLOPs of ``base`` over the timed shapes of
    its class (:func:`shape_classes`: the same smaller side, else the same aspect bucket),
    else over all of them;
    plus the share of the payload's transfer time at the measured ``bytes_per_s`` that
    owning the matrix adds to a rank (``transfer_share``; none for a matrix that ranks
    already hold whole: it is owned where it lies). Balancing it balances time: FLOP
    counts do not predict kernel time across shapes.

    Attributes:
        base: The closed-form model (its FLOPs drive the fit; its bytes are the payload).
        table: ``((m, n), seconds per matrix)`` for every timed shape.
        fit: ``(a, b)`` of ``log seconds = a + b log FLOPs`` over every timed shape.
        class_fits: ``(kind, value, a, b)`` of the same fit per shape class
            (:func:`class_fits`); a shape's first class with a fit predicts it.
        bytes_per_s: Measured transfer rate (0: transfers not counted).
        transfer_share: The part of a payload's transfer time that falls on its owner beyond
            what every rank pays, in [0, 1] (:func:`owner_transfer_share`: 0 on two ranks,
            where owning a matrix changes no rank's bytes).
        name: The optimizer's name.
        batches: ``((m, n), fixed, per_matrix)`` for every shape timed at two batch sizes:
            one call on ``k`` stacked matrices takes ``fixed + k * per_matrix`` seconds
            (:meth:`batch_seconds`). ``table`` prices a matrix at the batch an owner is
            expected to stack; this prices the batches a plan actually forms.
        pieces: ``((m, n), size)`` for every shape whose calls run in pieces of at most
            ``size`` matrices, one after another, each paying the fixed part: ``k`` stacked
            matrices take ``fixed * ceil(k / size) + k * per_matrix`` seconds (a shape with a
            batch line only). Calibration finds it by timing a third batch size (see
            :func:`piece_size`): per-matrix CUDA-graph replays run ``size`` matrices side by
            side and the pieces in turn, so a longer stack saves no fixed part.
    """

    base: CostModel
    table: tuple[tuple[tuple[int, int], float], ...]
    fit: tuple[float, float] = (0.0, 1.0)
    class_fits: tuple[tuple[str, int, float, float], ...] = ()
    bytes_per_s: float = 0.0
    name: str = field(default="")
    batches: tuple[tuple[tuple[int, int], float, float], ...] = ()
    transfer_share: float = 1.0
    pieces: tuple[tuple[tuple[int, int], int], ...] = ()
    _index: dict[tuple[int, int], float] = field(init=False, repr=False, compare=False)
    _lines: dict[tuple[int, int], tuple[float, float]] = field(
        init=False, repr=False, compare=False
    )
    _fits: dict[tuple[str, int], tuple[float, float]] = field(init=False, repr=False, compare=False)
    _pieces: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.base, CostModel):
            raise ValueError(f"MeasuredCost.base must be a cost model, got {self.base!r}")
        index: dict[tuple[int, int], float] = {}
        for (m, n), seconds in self.table:
            if not (isinstance(seconds, int | float) and seconds >= 0 and math.isfinite(seconds)):
                raise ValueError(f"measured seconds must be finite and >= 0, got {seconds!r}")
            index[(int(m), int(n))] = float(seconds)
        if len(self.fit) != 2 or not all(
            isinstance(v, int | float) and math.isfinite(v) for v in self.fit
        ):
            raise ValueError(f"fit must be two finite coefficients (a, b), got {self.fit!r}")
        if not (self.bytes_per_s >= 0 and math.isfinite(self.bytes_per_s)):
            raise ValueError(f"bytes_per_s must be finite and >= 0, got {self.bytes_per_s!r}")
        share = self.transfer_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise ValueError(f"transfer_share must be a number in [0, 1], got {share!r}")
        # one digest for equal values: 0, 0.0 and -0.0 are written as 0.0
        object.__setattr__(self, "transfer_share", float(share) + 0.0)
        object.__setattr__(self, "fit", tuple(float(v) + 0.0 for v in self.fit))
        object.__setattr__(self, "bytes_per_s", float(self.bytes_per_s) + 0.0)
        lines: dict[tuple[int, int], tuple[float, float]] = {}
        for (m, n), fixed, per in self.batches:
            for value in (fixed, per):
                if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
                    raise ValueError(f"batch seconds must be finite and >= 0, got {value!r}")
            lines[(int(m), int(n))] = (float(fixed), float(per))
        fits: dict[tuple[str, int], tuple[float, float]] = {}
        for kind, value, a, b in self.class_fits:
            if kind not in ("side", "aspect") or not isinstance(value, int):
                raise ValueError(f"a class fit's class is ('side'|'aspect', int), got {kind!r}")
            if not all(isinstance(v, int | float) and math.isfinite(v) for v in (a, b)):
                raise ValueError(f"a class fit's coefficients must be finite, got {(a, b)!r}")
            fits[(kind, value)] = (float(a) + 0.0, float(b) + 0.0)
        object.__setattr__(
            self, "class_fits", tuple((k, v, *fits[(k, v)]) for k, v, _, _ in self.class_fits)
        )
        pieces: dict[tuple[int, int], int] = {}
        for (m, n), size in self.pieces:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"a piece size must be an integer >= 1, got {size!r}")
            if (int(m), int(n)) not in lines:
                raise ValueError(f"pieces of {m}x{n} need its batch line, got none")
            pieces[(int(m), int(n))] = size
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_lines", lines)
        object.__setattr__(self, "_fits", fits)
        object.__setattr__(self, "_pieces", pieces)
        if not self.name:
            object.__setattr__(self, "name", self.base.name)

    def seconds(self, m: int, n: int) -> float:
        """The owner's time for one ``m x n`` matrix (measured, else predicted by a fit)."""
        measured = self._index.get((m, n))
        if measured is not None:
            return measured
        work = self.base.flops(MatrixSpec("fit", (m, n)))
        a, b = next((self._fits[c] for c in shape_classes(m, n) if c in self._fits), self.fit)
        if work <= 0:
            return 0.0
        try:
            return math.exp(a + b * math.log(work))
        except OverflowError:
            raise ValueError(
                f"the fit log seconds = {a!r} + {b!r} log FLOPs predicts no finite time for {m}x{n}"
            ) from None

    def batch_seconds(self, m: int, n: int, k: int) -> float:
        """The owner's time for one call on ``k`` stacked ``m x n`` matrices.

        ``fixed + k * per_matrix`` where the shape was timed at two batch sizes (the fixed
        part once per piece where its calls run in pieces), else ``k`` times :meth:`seconds`.
        """
        line = self._lines.get((m, n))
        if line is None:
            return k * self.seconds(m, n)
        fixed, per = line
        return fixed * self.calls(m, n, k) + k * per if k > 0 else 0.0

    def piece_size(self, m: int, n: int) -> int | None:
        """Most ``m x n`` matrices that one piece of a call runs (None: any number)."""
        return self._pieces.get((m, n))

    def calls(self, m: int, n: int, k: int) -> int:
        """Fixed parts that one call on ``k`` stacked ``m x n`` matrices pays (its pieces)."""
        size = self._pieces.get((m, n))
        return 1 if size is None else -(-k // size)

    def call_parts(self, spec: MatrixSpec) -> tuple[float, float]:
        """``(fixed, own)`` seconds: a call's fixed part and the spec's own part of it.

        The fixed part is the batch line's for the spec's shape (paid once per piece where
        its calls run in pieces: :meth:`piece_size`); the own part prices its matrices at
        the line's price per matrix, plus the payload's transfer time. Without a batch line:
        ``(0, flops(spec))``.
        """
        line = self._lines.get((spec.m, spec.n))
        if line is None:
            return 0.0, self.flops(spec)
        return line[0], spec.batch * line[1] + self._transfer(spec)

    def for_world(self, num_ranks: int) -> MeasuredCost:
        """This table with the transfer share of a plan over ``num_ranks`` ranks."""
        return replace(self, transfer_share=owner_transfer_share(num_ranks))

    def flops(self, spec: MatrixSpec) -> float:
        """Seconds: the math of every matrix of the spec plus its owner's share of the transfer."""
        return spec.batch * self.seconds(spec.m, spec.n) + self._transfer(spec)

    def _transfer(self, spec: MatrixSpec) -> float:
        """Seconds that moving the spec's payload adds to its owner (``transfer_share`` of it).

        0 when transfers are not counted, and for a matrix that ranks already hold whole
        (:attr:`MatrixSpec.holders`): it is owned on a holder, where nothing moves, as the
        planner counts its bytes. Owning it elsewhere costs :meth:`move_seconds` on the
        owner and on each holder, which the planner adds where it does
        (:func:`~canzona.plan.held.settle_held`).
        """
        if not self.bytes_per_s or not self.transfer_share or spec.holders is not None:
            return 0.0
        return self.transfer_share * spec.nbytes / self.bytes_per_s

    def move_seconds(self, spec: MatrixSpec) -> float:
        """The payload's transfer time at the measured rate (0 when transfers are not counted).

        What owning a held matrix off its holders costs the owner, which receives the whole
        payload and sends the whole direction back, and each holder, which does the reverse.
        """
        return spec.nbytes / self.bytes_per_s if self.bytes_per_s else 0.0

    def comm_bytes(self, spec: MatrixSpec) -> int:
        """The base model's payload bytes."""
        return self.base.comm_bytes(spec)

    def memory_bytes(self, spec: MatrixSpec) -> int:
        """The base model's bytes in flight."""
        return self.base.memory_bytes(spec)

    def params(self) -> dict[str, Any]:
        """Everything that prices a matrix (what the plan digest covers).

        ``pieces`` appears only where some shape has them, so a table without pieces keeps
        the parameters (and plan digests) it had before they existed.
        """
        out = {
            "base": {"name": self.base.name, "params": cost_model_params(self.base)},
            "table": [[m, n, s] for (m, n), s in sorted(self._index.items())],
            "fit": list(self.fit),
            "class_fits": [list(f) for f in self.class_fits],
            "bytes_per_s": self.bytes_per_s,
            "transfer_share": self.transfer_share,
            "batches": [[m, n, f, g] for (m, n), (f, g) in sorted(self._lines.items())],
        }
        if self._pieces:
            out["pieces"] = [[m, n, size] for (m, n), size in sorted(self._pieces.items())]
        return out


def owner_transfer_share(num_ranks: int) -> float:
    """The part of a matrix's transfer time that owning it adds to a rank: ``(W - 2) / W``.

    The gather sends an owner the other ranks' ``(W - 1) / W`` of the payload and the
    scatter sends as much back, while each other rank sends and receives its own ``1 / W``:
    every rank moves ``2 / W`` of it whoever owns it, and the owner ``2 (W - 2) / W`` more,
    which at the measured rate (bytes each way per second, sent and received at once) takes
    ``(W - 2) / W`` of the payload's transfer time. On two ranks owning changes nothing.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    return max(0.0, (num_ranks - 2) / num_ranks)


def _fitted_line(
    points: Sequence[tuple[int, float]], size: int | None = None
) -> tuple[float, float] | None:
    """``(fixed, per_matrix)`` of the least squares ``seconds = fixed * calls + per_matrix * k``.

    ``calls`` is 1, or ``ceil(k / size)`` for calls that run in pieces of ``size``. None
    when the points do not determine both parts (fewer than two batch sizes, or pieces
    proportional to ``k``), or when a part comes out negative.
    """
    if len({k for k, _ in points}) < 2:
        return None
    if size is None:
        mk = math.fsum(k for k, _ in points) / len(points)
        mt = math.fsum(t for _, t in points) / len(points)
        var = math.fsum((k - mk) ** 2 for k, _ in points)
        per = math.fsum((k - mk) * (t - mt) for k, t in points) / var
        fixed = mt - per * mk
        return (fixed, per) if per >= 0 and fixed >= 0 else None
    xs = [(-(-k // size), k, t) for k, t in points]
    spp = math.fsum(p * p for p, _, _ in xs)
    spk = math.fsum(p * k for p, k, _ in xs)
    skk = math.fsum(k * k for _, k, _ in xs)
    spt = math.fsum(p * t for p, _, t in xs)
    skt = math.fsum(k * t for _, k, t in xs)
    det = spp * skk - spk * spk
    if not det > 1e-9 * spp * skk:
        return None
    fixed = (spt * skk - skt * spk) / det
    per = (skt * spp - spt * spk) / det
    return (fixed, per) if per >= 0 and fixed >= 0 else None


def reprice(
    model: MeasuredCost, observed: Mapping[tuple[int, int], Mapping[int, float]]
) -> MeasuredCost:
    """The model re-priced by the calls a running job made: ``{(m, n): {k: seconds}}``.

    ``observed`` holds, per shape and batch size, the seconds of one call on ``k`` stacked
    matrices as the steps ran it (in place, after the others of its step). A shape seen at
    two or more batch sizes gets the least-squares line through them (its fixed part and
    its part per matrix); one seen at a single batch size keeps its line's (or its
    table's) proportions, scaled so that the price of that batch is the observed one.
    Shapes not observed keep their prices; the fits that price unmeasured shapes stay.
    """
    table = dict(model._index)
    lines = dict(model._lines)
    for (m, n), calls in sorted(observed.items()):
        points = sorted((int(k), float(t)) for k, t in calls.items() if k > 0 and t > 0)
        if not points:
            continue
        line = _fitted_line(points, model.piece_size(m, n))
        if line is None:
            k, t = points[-1]
            predicted = model.batch_seconds(m, n, k)
            if not predicted > 0:
                continue
            scale = t / predicted
            table[(m, n)] = model.seconds(m, n) * scale
            if (m, n) in lines:
                fixed, per = lines[(m, n)]
                lines[(m, n)] = (fixed * scale, per * scale)
            continue
        lines[(m, n)] = line
        k = points[-1][0]
        table[(m, n)] = (line[0] * model.calls(m, n, k) + k * line[1]) / k
    return replace(
        model,
        table=tuple(sorted(table.items())),
        batches=tuple((shape, f, g) for shape, (f, g) in sorted(lines.items())),
    )


def predict_seconds(
    specs: Sequence[MatrixSpec],
    groups: Sequence[Sequence[str]],
    computing_ranks: Callable[[str], Sequence[int]],
    cost: MeasuredCost | GroupedCost,
    num_ranks: int,
) -> list[float]:
    """Per rank, the predicted seconds of its owner math, batch by batch.

    The runtime stacks, per micro-group and computing rank, the matrices of one param group
    (``cost_key``), shape and payload size into one call; each such batch of ``k`` matrices
    costs :meth:`MeasuredCost.batch_seconds`. Transfer time is left out.

    Args:
        specs: The planned matrices.
        groups: The names of each micro-group (or any partition into rounds).
        computing_ranks: The ranks that compute a matrix (its owner, or all when replicated).
        cost: The measured model the plan was priced with (per ``cost_key`` when grouped).
        num_ranks: Number of ranks.
    """
    by_name = {s.name: s for s in specs}
    out = [0.0] * num_ranks
    for names in groups:
        counts: dict[tuple[int, str | None, int, int, int], list[MatrixSpec]] = {}
        for name in names:
            s = by_name[name]
            for r in computing_ranks(name):
                counts.setdefault((r, s.cost_key, s.m, s.n, s.itemsize), []).append(s)
        for (r, _, m, n, _), batch in counts.items():
            model = cost.model_of(batch[0]) if isinstance(cost, GroupedCost) else cost
            if not isinstance(model, MeasuredCost):
                raise ValueError(f"predict_seconds needs measured costs, got {model!r}")
            out[r] += model.batch_seconds(m, n, sum(s.batch for s in batch))
    return out


def save_cost_table(path: Path, cost: MeasuredCost | GroupedCost, meta: Mapping[str, Any]) -> None:
    """Write a measured cost model as JSON (``canzona calibrate``)."""
    models = cost.models if isinstance(cost, GroupedCost) else {"0": cost}
    body = {
        "format": TABLE_FORMAT,
        "meta": dict(meta),
        "models": {
            key: model.params() for key, model in models.items() if isinstance(model, MeasuredCost)
        },
    }
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def measured_from_params(base: CostModel, entry: Mapping[str, Any]) -> MeasuredCost:
    """A measured cost model from :meth:`MeasuredCost.params`' fields, priced over ``base``."""
    fit = entry["fit"]
    if len(fit) != 2:
        raise ValueError(f"fit must be two coefficients (a, b), got {fit!r}")
    return MeasuredCost(
        base=base,
        table=tuple(((_whole(m), _whole(n)), float(s)) for m, n, s in entry["table"]),
        fit=(float(fit[0]), float(fit[1])),
        class_fits=tuple(
            (str(kind), _whole(value), float(a), float(b))
            for kind, value, a, b in entry.get("class_fits", ())
        ),
        bytes_per_s=float(entry["bytes_per_s"]),
        transfer_share=float(entry.get("transfer_share", 1.0)),
        batches=tuple(
            ((_whole(m), _whole(n)), float(f), float(g)) for m, n, f, g in entry.get("batches", ())
        ),
        pieces=tuple(
            ((_whole(m), _whole(n)), _whole(size)) for m, n, size in entry.get("pieces", ())
        ),
    )


def _whole(value: Any) -> int:
    """A table's integer (a side, a class, a piece size), refusing what is not one."""
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def load_cost_table(path: Path, *, key: str = "0") -> MeasuredCost:
    """Read one measured cost model written by :func:`save_cost_table`.

    Raises:
        ValueError: naming the file, for anything that is not such a table.
    """
    return load_cost_file(path, key=key)[0]


def load_cost_file(path: Path, *, key: str = "0") -> tuple[MeasuredCost, dict[str, Any]]:
    """One measured cost model and its timing's record (``meta``), from one read of the file.

    ``meta`` is what :func:`save_cost_table` recorded (``{}`` when nothing).

    Raises:
        ValueError: naming the file, for anything that is not such a table.
    """

    def read(body: dict[str, Any]) -> tuple[MeasuredCost, dict[str, Any]]:
        meta = body.get("meta", {})
        if not isinstance(meta, dict):
            raise TypeError(f"its 'meta' is a {type(meta).__name__}, not an object")
        return _model_of(body, key), meta

    return _read_table(path, read)


def _model_of(body: dict[str, Any], key: str) -> MeasuredCost:
    entry = body["models"][key]
    base = cost_model(entry["base"]["name"], **entry["base"]["params"])
    return measured_from_params(base, entry)


def _read_table(path: Path, read: Callable[[dict[str, Any]], _T]) -> _T:
    """``read`` of the JSON object in ``path``; any failure a ValueError naming the file."""
    try:
        body = json.loads(path.read_text())
        if not isinstance(body, dict):
            raise TypeError(f"it holds a JSON {type(body).__name__}, not an object")
        if body.get("format") != TABLE_FORMAT:
            raise ValueError(f"format {body.get('format')!r}, expected {TABLE_FORMAT}")
        return read(body)
    except KeyError as exc:
        raise ValueError(f"{str(path)!r} is not a canzona cost table: no field {exc}") from None
    except (OSError, AttributeError, IndexError, TypeError, ValueError, ArithmeticError) as exc:
        raise ValueError(f"{str(path)!r} is not a canzona cost table: {exc}") from None
    except RecursionError:
        raise ValueError(f"{str(path)!r} is not a canzona cost table: nested too deeply") from None
