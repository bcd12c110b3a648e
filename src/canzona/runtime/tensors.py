"""DTensor helpers: local shards, gradients, meshes and state in a parameter's storage layout."""

from __future__ import annotations

import contextlib
import hashlib
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from canzona.runtime.layout import check_placements, fragment_for


def fingerprint(value: object) -> str:
    """sha256 of a value's repr (used for hyper-parameters)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()


_SHAPE = operator.attrgetter("shape")


def shapes(tensors: Sequence[torch.Tensor]) -> tuple[torch.Size, ...]:
    """The tensors' (global) shapes: a parameter whose ``.data`` was replaced changes them."""
    return tuple(map(_SHAPE, tensors))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing storage), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def tensor_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where the parameters live (the device of communication buffers and checks)."""
    for t in tensors:
        if isinstance(t, DTensor):
            return t._local_tensor.device
    return tensors[0].device if tensors else torch.device("cpu")


def process_group_of(configured: object | None) -> dist.ProcessGroup | None:
    """The process group an optimizer runs its checks and collectives on, or None.

    The configured group, else the default one, when it has more than one rank: plain
    tensors replicated on several ranks (a DDP-style job) take part in the step's checks
    and success vote too, so that replicas never diverge.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = configured if configured is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None  # type: ignore[arg-type,return-value]


def param_mesh(p: torch.Tensor) -> object | None:
    """The DeviceMesh of a DTensor parameter (None for a plain tensor)."""
    return p.device_mesh if isinstance(p, DTensor) else None


def validate_param(name: str, p: torch.Tensor) -> None:
    """Reject storage layouts the runtime cannot reconstruct (e.g. ``Partial``), by name.

    Raises:
        canzona.runtime.layout.LayoutError: a ``ValueError`` naming the parameter.
    """
    if isinstance(p, DTensor):
        check_placements(name, tuple(p.placements), p.ndim)


def all_finite(grads: Sequence[torch.Tensor]) -> bool:
    """True when every local gradient shard is free of NaN and Inf (one host read)."""
    flags = [torch.isfinite(local_tensor(g)).all() for g in grads if local_tensor(g).numel()]
    return bool(torch.stack(flags).all()) if flags else True


def _other_mesh(grad: DTensor, p: DTensor) -> bool:
    """Whether ``grad`` lies on another mesh than ``p`` (whose local shards do not match)."""
    return grad._spec.mesh is not p._spec.mesh and grad._spec.mesh != p._spec.mesh


def local_grad(name: str, p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``p.grad`` in ``p``'s storage layout.

    Raises:
        RuntimeError: for a missing or sparse gradient.
        TypeError: for a plain gradient on a DTensor parameter.
    """
    grad = p.grad
    if grad is None:
        raise RuntimeError(f"parameter {name!r} has no gradient")
    if grad.is_sparse:
        raise RuntimeError(f"parameter {name!r}: sparse gradients are not supported")
    if isinstance(p, DTensor):
        if not isinstance(grad, DTensor):
            raise TypeError(
                f"parameter {name!r} is a DTensor but its gradient is a plain tensor; "
                "set .grad to a DTensor with the parameter's placements"
            )
        if _other_mesh(grad, p):
            raise RuntimeError(
                f"parameter {name!r} is on {p.device_mesh} but its gradient on "
                f"{grad.device_mesh}; set .grad to a DTensor on the parameter's mesh"
            )
        # the specs' own tuples: the ``placements`` properties cost a Python call each
        if grad._spec.placements != p._spec.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        return grad._local_tensor
    return grad


def local_grads(
    names: Sequence[str],
    idxs: Sequence[int],
    params: Sequence[torch.Tensor],
    raw: Sequence[torch.Tensor | None],
    codes: Sequence[int],
) -> list[torch.Tensor]:
    """:func:`local_grad` of every ``params[j]`` (named ``names[idxs[j]]``), in one pass.

    ``raw[idxs[j]]`` is ``params[j].grad`` as the step read it (each gradient is read once
    a step). The common case (every gradient a dense tensor of its parameter's kind,
    DTensors in their parameter's placements) costs one attribute read per parameter;
    anything else goes through :func:`local_grad`, which raises its errors or
    redistributes. A gradient that raises does not stop the pass: the ones after it are
    still read (and redistributed: every rank must enter the same collectives), then the
    first error is raised. ``codes[idxs[j]]`` is the gradient's :func:`grad_codes` entry
    (placements compared once, there).
    """
    out: list[torch.Tensor] = []
    append = out.append
    error: Exception | None = None
    for i, p in zip(idxs, params, strict=True):
        grad = raw[i]
        if isinstance(grad, DTensor):
            if isinstance(p, DTensor) and codes[i] == GRAD:  # its parameter's placements
                append(grad._local_tensor)
                continue
        elif not (grad is None or grad.is_sparse or isinstance(p, DTensor)):
            append(grad)
            continue
        try:
            append(local_grad(names[i], p))  # raises or redistributes
        except (RuntimeError, TypeError) as exc:
            error = error or exc
    if error is not None:
        raise error
    return out


#: :func:`grad_codes`: no gradient, one in its parameter's layout, one to redistribute.
NO_GRAD, GRAD, REDISTRIBUTED = 0, 1, 2


def grad_codes(params: Sequence[torch.Tensor], raw: Sequence[torch.Tensor | None]) -> list[int]:
    """Per parameter, how its gradient is read: ``NO_GRAD``, ``GRAD`` or ``REDISTRIBUTED``.

    A DTensor in other placements than its parameter's is redistributed as it is read: a
    collective every rank must enter (one on another mesh is coded alike, and raises
    there). The ranks compare the codes before any such read (a rank redistributing alone
    would wait forever).
    """
    out: list[int] = []
    append = out.append
    for p, grad in zip(params, raw, strict=True):
        if grad is None:
            append(NO_GRAD)
        elif (
            isinstance(grad, DTensor)
            and isinstance(p, DTensor)
            and grad._spec is not p._spec  # FSDP2 gives the gradient its parameter's spec
            and (grad._spec.placements != p._spec.placements or _other_mesh(grad, p))
        ):
            append(REDISTRIBUTED)
        else:
            append(GRAD)
    return out


def read_gradients(
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    raw: Sequence[torch.Tensor | None],
    codes: Sequence[int],
) -> None:
    """Redistribute the gradients a step's prepare would, for a rank that does not prepare.

    A rank that failed before its prepare still redistributes the gradients held in other
    placements than their parameters' (``codes``: :func:`grad_codes`, the same on every
    rank; each a collective of its mesh) that the other ranks' prepares redistribute, in
    the same order: a rank left out would leave the others waiting in it. Errors are the
    prepare's to report; here they are dropped.
    """
    idxs = [i for i, code in enumerate(codes) if code == REDISTRIBUTED]
    with contextlib.suppress(RuntimeError, TypeError):
        local_grads(names, idxs, [params[i] for i in idxs], raw, codes)


def check_loadable(value: torch.Tensor, p: torch.Tensor) -> None:
    """Raise what :func:`as_storage_layout` raises for ``value``, without a collective.

    Raises:
        ValueError: for a DTensor on another mesh than the DTensor parameter's.
    """
    if isinstance(p, DTensor) and isinstance(value, DTensor) and value.device_mesh != p.device_mesh:
        raise ValueError(
            f"state on mesh {value.device_mesh} cannot be loaded for a parameter on {p.device_mesh}"
        )


def as_storage_layout(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Element-wise state in ``p``'s storage layout, from a loaded value.

    A plain tensor of the parameter's global shape (a consolidated checkpoint) becomes a
    DTensor holding this rank's slice; a DTensor in other placements on the same mesh is
    redistributed (collective: every rank loads the same structure); a DTensor loaded
    for a plain parameter is gathered.

    Raises:
        ValueError: for a DTensor on another mesh than the parameter's.
    """
    if not isinstance(p, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    mesh, placements = p.device_mesh, tuple(p.placements)
    check_loadable(value, p)
    if isinstance(value, DTensor):
        if tuple(value.placements) == placements:
            return value
        return value.redistribute(mesh, placements)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank holds the parameter, so it is in its mesh"
    frag = fragment_for(tuple(p.shape), tuple(mesh.shape), placements, coordinate)
    # this rank's slice first: a whole tensor loaded on the host moves only its slice
    local = frag.read(value).to(p._local_tensor.device).contiguous()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
    )
