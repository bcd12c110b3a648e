"""What keys a calibration's timings: the device's name and a param group's timed settings."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["UNTIMED_SETTINGS", "device_name", "group_settings"]

#: Param-group entries that never change the owner math's operations (so not its time): a
#: learning rate moved by a scheduler must not invalidate the cached timings.
UNTIMED_SETTINGS = frozenset({"params", "param_names", "lr", "initial_lr"})


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (Linux: ``/proc/cpuinfo``), else what ``platform`` reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device) -> str:
    """What the timings were taken on (part of their cache key)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{_cpu_model()}:{torch.get_num_threads()} threads"


#: Environment variables that choose the kernels the owner math runs on this device.
KERNEL_ENV = ("CANZONA_CUDA_GRAPHS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def kernel_settings() -> str:
    """The process-wide settings that choose the owner math's kernels (part of the key).

    The float32 matmul precision (TF32 on a GPU: Shampoo's and SOAP's fp32 matmuls, Muon
    with ``ns_dtype=float32``), whether stacks replay from CUDA graphs, and the CPU's
    instruction-set cap: a table timed under other ones is not reused.
    """
    env = ",".join(f"{k}={os.environ.get(k, '')}" for k in KERNEL_ENV)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    return f"{torch.get_float32_matmul_precision()}:tf32={tf32}:{env}"


def _timed_form(value: object) -> object:
    """What of a setting can change the owner math's operations, so its time.

    A float (or a 0-dim floating tensor) only scales the math, except where the math
    branches on it, always against 0 or 1 (``momentum > 0``, ``beta2 == 1``): its range
    among ``nan, < 0, 0, (0, 1), 1, > 1`` keeps every such branch apart, and a momentum,
    weight decay or ``betas`` that a scheduler moves (OneCycleLR's cycled momentum) times
    nothing again. Everything else (integers such as ``ns_steps``, dtypes, strings) counts
    by its value.
    """
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point():
        value = float(value)
    if isinstance(value, float):
        if value != value or value in (0.0, 1.0):
            return repr(value)
        return "<0" if value < 0 else "(0,1)" if value < 1 else ">1"
    if isinstance(value, tuple | list):
        return tuple(_timed_form(v) for v in value)
    return repr(value)


def group_settings(hparams: Mapping[str, Any]) -> str:
    """A param group's settings that may change its owner math (sorted, as text)."""
    return repr(
        sorted((k, _timed_form(v)) for k, v in hparams.items() if k not in UNTIMED_SETTINGS)
    )
