"""fused_stats: exact streaming statistics of activation gradients at residual insertion points.

See README.md and DESIGN.md. Public names only; everything else lives in submodules.
"""

from .errors import FusedStatsError
from .accumulators import (
    Certificate,
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
from .api.streaming import stream_blocks

__version__ = "0.1.0"

__all__ = [
    "FusedStatsError",
    "GradStats",
    "Estimate",
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
    "stream_blocks",
    "__version__",
]
