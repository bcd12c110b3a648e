"""One asynchronous all-to-all issued on the process group itself, without c10d's wrapper."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

#: Whether a process group issues an all-to-all itself (torch 2.13's ``ProcessGroup`` does;
#: where it does not, as in torch 2.11, the call goes through the c10d wrapper).
DIRECT = hasattr(dist.ProcessGroup, "all_to_all_single")


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> Any:
    """``dist.all_to_all_single(..., async_op=True)`` for the runtime's own buffers.

    The runtime's buffers are dense, contiguous, real and of one dtype, and every rank of
    ``group`` takes part, so the wrapper's checks (group membership, tensor kinds, the
    exception logger) always pass; skipping them saves about a third of the host time of
    issuing a small all-to-all on gloo. Tensors with a ``__torch_function__`` override
    (tracing, export) take the wrapper, which redirects them, and so does every call where
    process groups have no ``all_to_all_single`` of their own (:data:`DIRECT`).

    Args:
        out: Receive buffer (``sum(out_splits)`` elements along dim 0).
        inp: Send buffer.
        out_splits: Elements received from each rank (empty: equal parts).
        in_splits: Elements sent to each rank (empty: equal parts).
        group: The process group (None: the default one).

    Returns:
        The collective's work handle.
    """
    if not DIRECT or has_torch_function((inp, out)):
        return dist.all_to_all_single(
            out, inp, list(out_splits), list(in_splits), group=group, async_op=True
        )
    pg = dist.group.WORLD if group is None else group
    assert pg is not None, "the default process group is not initialised"
    opts = dist.AllToAllOptions()
    opts.asyncOp = True
    return pg.all_to_all_single(out, inp, list(out_splits), list(in_splits), opts)
