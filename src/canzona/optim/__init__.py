"""torch.optim front classes: Muon, NorMuon, Shampoo and SOAP, and the param-group helper."""

from canzona.optim.base import MatrixOptimizer
from canzona.optim.muon import Muon
from canzona.optim.normuon import NorMuon
from canzona.optim.param_groups import param_groups
from canzona.optim.shampoo import Shampoo
from canzona.optim.soap import SOAP

__all__ = ["SOAP", "MatrixOptimizer", "Muon", "NorMuon", "Shampoo", "param_groups"]
