"""Update math on full matrices ``(..., m, n)``: Newton–Schulz, (Nor)Muon, Shampoo, SOAP, AdamW.

Every algorithm is split the same way so that the runtime can run the middle phase on the one
rank that holds the full matrix: an element-wise *prepare* (any shard), an owner-side
*direction* on full matrices that owns the non-element-wise state, and an element-wise *apply*
that holds everything that depends on the learning rate. These functions see plain local
tensors only and import no other canzona layer.
"""

from __future__ import annotations

from canzona.updates.adamw import adamw_
from canzona.updates.common import State
from canzona.updates.muon import (
    ADJUST_LR_FNS,
    muon_apply_,
    muon_direction,
    muon_lr,
    muon_prepare_,
)
from canzona.updates.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    MIN_BATCHED_SIDE,
    batch_kernels_exact,
    newton_schulz,
    newton_schulz_flops,
)
from canzona.updates.normuon import (
    NORMUON_RESCALES,
    NorMuonHParams,
    normuon_batch_exact,
    normuon_direction,
    normuon_init,
)
from canzona.updates.ns_schedules import (
    NS_SCHEDULES,
    NSCoefficients,
    Schedule,
    ns_norm_scale,
    resolve_ns_coefficients,
)
from canzona.updates.shampoo import (
    ShampooHParams,
    inverse_fourth_root,
    shampoo_apply_,
    shampoo_direction,
    shampoo_init,
    shampoo_refresh_due,
)
from canzona.updates.soap import (
    SOAPHParams,
    soap_apply_,
    soap_direction,
    soap_init,
    soap_step_size,
)

__all__ = [
    "ADJUST_LR_FNS",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_EPS",
    "DEFAULT_NS_STEPS",
    "MIN_BATCHED_SIDE",
    "NORMUON_RESCALES",
    "NS_SCHEDULES",
    "NSCoefficients",
    "NorMuonHParams",
    "SOAPHParams",
    "Schedule",
    "ShampooHParams",
    "State",
    "adamw_",
    "batch_kernels_exact",
    "inverse_fourth_root",
    "muon_apply_",
    "muon_direction",
    "muon_lr",
    "muon_prepare_",
    "newton_schulz",
    "newton_schulz_flops",
    "normuon_batch_exact",
    "normuon_direction",
    "normuon_init",
    "ns_norm_scale",
    "resolve_ns_coefficients",
    "shampoo_apply_",
    "shampoo_direction",
    "shampoo_init",
    "shampoo_refresh_due",
    "soap_apply_",
    "soap_direction",
    "soap_init",
    "soap_step_size",
]
