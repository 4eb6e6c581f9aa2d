"""Accumulators and estimators: state, update, merge, all-reduce, save/load, fp64 finalisation.

Every accumulator derives from :class:`~fused_stats.accumulators.base.Accumulator` and declares
its state once (:class:`~fused_stats.accumulators.base.Field`).
"""

from .alignment import (Alignment, Misalignment, misalignment_probability, realized_alignment,
                        split_alignments)
from .base import Accumulator, Field, IncompatibleStates, Prepared, state_differences
from .cross_stats import CrossEstimate, CrossStats, Saturation
from .estimators import Certificate, Estimate, certificate, finalize
from .grad_stats import GradStats, auto_pool_limit, shift
from .norm_histogram import NormHistogram

__all__ = [
    "Accumulator", "Field", "Prepared", "IncompatibleStates", "state_differences",
    "GradStats", "CrossStats", "NormHistogram", "Estimate", "CrossEstimate", "Certificate",
    "Saturation", "Alignment", "Misalignment", "certificate", "finalize", "shift",
    "misalignment_probability", "realized_alignment", "split_alignments", "auto_pool_limit",
]
