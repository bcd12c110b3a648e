"""Puts this directory on ``sys.path`` so the optimizer tests share ``_optim_cases``."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
