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
from .api.growth.advise import Advice, advise
from .api.growth.architecture import growth_points
from .api.growth.first_step import predicted_change
from .api.growth.gradmax import gradmax_directions
from .api.growth.grow import GrowthResult, grow
from .api.growth.insert import insert_zero_block, remove_inserted_block
from .api.growth.intervene import intervene
from .api.growth.plan import GrowthPlan, plan_growth
from .api.growth.protocol import GrowthProtocol
from .api.growth.record import growth_history
from .api.growth.schedule import GrowthSchedule
from .api.growth.scores import CurvatureGain, SplitAdamScore, curvature_gain, split_adam_score
from .api.probe.driver import Probe
from .api.probe.losses import causal_lm_loss, classification_loss
from .api.probe.points import residual_points
from .api.probe.spec import CrossSpec
from .api.report.document import Report
from .api.streaming.builders import stream_blocks
from .api.training.monitor_log import MonitorLog
from .errors import FusedStatsError
from .networks.pretrained import pretrained, pretrained_folder

__all__ = [
    "Advice",
    "Alignment",
    "Certificate",
    "CrossEstimate",
    "CrossSpec",
    "CrossStats",
    "CurvatureGain",
    "Estimate",
    "FusedStatsError",
    "GradStats",
    "GrowthPlan",
    "GrowthProtocol",
    "GrowthResult",
    "GrowthSchedule",
    "Misalignment",
    "MonitorLog",
    "Probe",
    "Report",
    "Saturation",
    "SplitAdamScore",
    "__version__",
    "advise",
    "causal_lm_loss",
    "classification_loss",
    "curvature_gain",
    "gradmax_directions",
    "grow",
    "growth_history",
    "growth_points",
    "insert_zero_block",
    "intervene",
    "misalignment_probability",
    "plan_growth",
    "predicted_change",
    "pretrained",
    "pretrained_folder",
    "realized_alignment",
    "remove_inserted_block",
    "residual_points",
    "split_adam_score",
    "stream_blocks",
]
