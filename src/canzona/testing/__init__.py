"""Float64 single-device reference optimizers for checking canzona's results in tests."""

from __future__ import annotations

from canzona.testing.reference import ReferenceNorMuon, ReferenceShampoo, ReferenceSOAP

__all__ = ["ReferenceNorMuon", "ReferenceSOAP", "ReferenceShampoo"]
