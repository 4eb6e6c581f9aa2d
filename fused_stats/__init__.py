"""fused_stats: exact streaming statistics of activation gradients at residual insertion points.

See README.md and docs/design.md. Public names only; everything else lives in submodules.
"""

from ._version import __version__
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
from .accumulators.cross_stats import Saturation
from .api.growth import CrossSpec, insert_zero_block, remove_inserted_block
from .api.intervene import intervene
from .api.losses import causal_lm_loss, classification_loss
from .api.monitor_log import MonitorLog
from .api.points import residual_points
from .api.probe import Probe
from .api.report import Report
from .api.streaming import stream_blocks
from .errors import FusedStatsError

__all__ = [
    "Alignment",
    "Certificate",
    "CrossEstimate",
    "CrossSpec",
    "CrossStats",
    "Estimate",
    "FusedStatsError",
    "GradStats",
    "Misalignment",
    "MonitorLog",
    "Probe",
    "Report",
    "Saturation",
    "__version__",
    "causal_lm_loss",
    "classification_loss",
    "insert_zero_block",
    "intervene",
    "misalignment_probability",
    "realized_alignment",
    "remove_inserted_block",
    "residual_points",
    "stream_blocks",
]
