"""The ``canzona demo`` job: train a tiny Qwen3-style model on 4 CPU ranks with FSDP×TP.

``main(argv)`` is the command; :mod:`canzona.demo.train` holds the per-rank work and
:mod:`canzona.demo.model` the model and its sharding. Importing this package does not
import torch, so the command can limit OpenMP threads before torch loads.
"""

from __future__ import annotations

from canzona.demo.cli import main

__all__ = ["main"]
