"""The step's hooks as torch.optim runs them, with a pre-hook's failure shared by every rank."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from canzona.runtime import Failure, process_group_of

_F = TypeVar("_F", bound=Callable[..., Any])


def hooked_step(step: _F) -> _F:
    """``step`` wrapped as ``torch.optim.Optimizer.profile_hook_step`` wraps it.

    The global and the optimizer's step pre-hooks run first (in the caller's grad mode; one
    may return new ``(args, kwargs)``), then ``step``, then the post-hooks. Where torch's
    wrapper lets a pre-hook's exception leave ``step()`` on its rank alone (the others
    would go on into the step and pair it with that rank's next one), here, in a job, it
    is kept for the step (``optimizer._hook_failure``), which then fails on every rank
    with :class:`~canzona.UpdateFailedError` naming it; in one process it propagates, as
    in torch.optim. Marked ``hooked`` so that torch does not wrap it again.
    """

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        self = args[0]
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            hooks = [
                *_global_optimizer_pre_hooks.values(),
                *self._optimizer_step_pre_hooks.values(),
            ]
            try:
                for hook in hooks:
                    result = hook(self, args, kwargs)
                    if result is None:
                        continue
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            f"{step} must return None or a tuple of (new_args, new_kwargs), "
                            f"but got {result}."
                        )
                    args, kwargs = result
            except Exception as exc:
                if process_group_of(self.pipeline_config.process_group) is None:
                    raise  # one process: as torch.optim
                self._hook_failure = Failure("running a step pre-hook", exc)
            out = step(*args, **kwargs)
            self._optimizer_step_code()
            for hook in [
                *self._optimizer_step_post_hooks.values(),
                *_global_optimizer_post_hooks.values(),
            ]:
                hook(self, args, kwargs)
            return out

    wrapper.hooked = True  # type: ignore[attr-defined]
    return cast(_F, wrapper)
