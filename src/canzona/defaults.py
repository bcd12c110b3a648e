"""Default hyper-parameters per optimizer: one source for its class, math, cost model, reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ADAMW_DEFAULTS",
    "MUON_DEFAULTS",
    "NORMUON_DEFAULTS",
    "SHAMPOO_DEFAULTS",
    "SOAP_DEFAULTS",
    "AdamWDefaults",
    "MuonDefaults",
    "NorMuonDefaults",
    "SOAPDefaults",
    "ShampooDefaults",
]


@dataclass(frozen=True, slots=True)
class MuonDefaults:
    """Muon's defaults (those of ``torch.optim.Muon``); ``eps`` is the Newton–Schulz clamp."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    ns_steps: int = 5


@dataclass(frozen=True, slots=True)
class NorMuonDefaults(MuonDefaults):
    """NorMuon's: Muon's, plus the per-row second moment and the rescale."""

    beta2: float = 0.95
    normuon_eps: float = 1e-10
    rescale: str = "rms"
    rms: float = 0.2


@dataclass(frozen=True, slots=True)
class ShampooDefaults:
    """Shampoo's, including the settings that set its work (and so its planned cost)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    epsilon: float = 1e-12
    weight_decay: float = 0.0
    precondition_frequency: int = 20
    start_preconditioning_step: int = 20
    max_precond_dim: int = 8192
    grafting: Literal["adam", "none"] = "adam"
    grafting_beta2: float = 0.999
    grafting_epsilon: float = 1e-8
    bias_correction: bool = True


@dataclass(frozen=True, slots=True)
class SOAPDefaults:
    """SOAP's, including the settings that set its work (and so its planned cost)."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float = -1.0
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_frequency: int = 10
    max_precond_dim: int = 10000
    normalize_grads: bool = False
    correct_bias: bool = True


@dataclass(frozen=True, slots=True)
class AdamWDefaults:
    """The AdamW that every optimizer runs on its ``algorithm="adamw"`` param groups."""

    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8


MUON_DEFAULTS = MuonDefaults()
NORMUON_DEFAULTS = NorMuonDefaults()
SHAMPOO_DEFAULTS = ShampooDefaults()
SOAP_DEFAULTS = SOAPDefaults()
ADAMW_DEFAULTS = AdamWDefaults()
