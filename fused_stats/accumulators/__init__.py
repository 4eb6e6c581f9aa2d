"""Accumulators and estimators: state, update, merge, all-reduce, save/load, fp64 finalisation."""

from .alignment import Misalignment, misalignment_probability, realized_alignment, split_alignments
from .estimators import Certificate, Estimate, certificate, finalize
from .grad_stats import GradStats, auto_pool_limit

__all__ = [
    "GradStats", "Estimate", "Certificate", "Misalignment", "certificate", "finalize",
    "misalignment_probability", "realized_alignment", "split_alignments", "auto_pool_limit",
]
