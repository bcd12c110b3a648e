"""torch.optim front classes (Muon, NorMuon, Shampoo, SOAP), param groups, state conversion."""

from canzona.optim.base import MatrixOptimizer
from canzona.optim.muon import Muon
from canzona.optim.normuon import NorMuon
from canzona.optim.param_groups import param_groups
from canzona.optim.shampoo import Shampoo
from canzona.optim.soap import SOAP
from canzona.optim.torch_state import from_torch_state

__all__ = [
    "SOAP",
    "MatrixOptimizer",
    "Muon",
    "NorMuon",
    "Shampoo",
    "from_torch_state",
    "param_groups",
]
