"""Float64 single-device reference optimizers for checking canzona's results in tests."""

from __future__ import annotations

from canzona.testing.reference import ReferenceShampoo, ReferenceSOAP

__all__ = ["ReferenceSOAP", "ReferenceShampoo"]
