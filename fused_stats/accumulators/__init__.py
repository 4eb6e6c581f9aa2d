"""Accumulators and estimators: state, update, merge, all-reduce, save/load, fp64 finalisation.

Every accumulator derives from :class:`~fused_stats.accumulators.base.Accumulator` and declares
its state once (:class:`~fused_stats.accumulators.base.Field`).
"""

from .alignment import Alignment, Misalignment, misalignment_probability, realized_alignment, split_alignments
from .base import Accumulator, Field, IncompatibleStates, Prepared, state_differences
from .cross_stats import CrossEstimate, CrossStats, Saturation
from .estimators import Certificate, Estimate, certificate, finalize
from .grad_stats import GradStats, auto_pool_limit, shift
from .norm_histogram import NormHistogram

__all__ = [
    "Accumulator",
    "Alignment",
    "Certificate",
    "CrossEstimate",
    "CrossStats",
    "Estimate",
    "Field",
    "GradStats",
    "IncompatibleStates",
    "Misalignment",
    "NormHistogram",
    "Prepared",
    "Saturation",
    "auto_pool_limit",
    "certificate",
    "finalize",
    "misalignment_probability",
    "realized_alignment",
    "shift",
    "split_alignments",
    "state_differences",
]
