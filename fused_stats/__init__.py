"""fused_stats: exact streaming statistics of activation gradients at residual insertion points.

See README.md and docs/design.md. Public names only; everything else lives in submodules.
"""

from .errors import FusedStatsError
from .accumulators import (
    Alignment,
    Certificate,
    CrossEstimate,
    CrossStats,
    Estimate,
    GradStats,
    Misalignment,
    misalignment_probability,
    realized_alignment,
)
from .api.report import Report
from .api.probe import Probe
from .api.points import residual_points
from .api.losses import causal_lm_loss, classification_loss
from .api.growth import CrossSpec, insert_zero_block, remove_inserted_block
from .api.intervene import intervene
from .accumulators.cross_stats import Saturation
from .api.monitor_log import MonitorLog

from ._version import __version__

__all__ = [
    "FusedStatsError",
    "GradStats",
    "CrossStats",
    "Estimate",
    "CrossEstimate",
    "Alignment",
    "Certificate",
    "Misalignment",
    "misalignment_probability",
    "realized_alignment",
    "Report",
    "Probe",
    "residual_points",
    "causal_lm_loss",
    "classification_loss",
    "CrossSpec",
    "insert_zero_block",
    "remove_inserted_block",
    "intervene",
    "Saturation",
    "MonitorLog",
    "__version__",
]
