"""What the training-loop callbacks share: argument checks, the per-step record and its metrics.

Role: a callback (HF ``Trainer``, Lightning) checks its common arguments with
:func:`check_callback_args`; after an optimizer step it builds one record with :func:`step_record`
(a :class:`~fused_stats.MonitorLog` line, or the same dict when no log is given) from the probe or,
under data parallelism, from :func:`merged_probe` (accumulator copies merged over the ranks), and
turns the record's points into the trainer's log metrics with :func:`metrics_of`. No peer library
is imported here.
"""

from __future__ import annotations

from ...errors import FusedStatsError
from .monitor_log import MonitorLog, point_record
from .observe import LOSS_REDUCTIONS

PREFIX = "fused_stats"
METRIC_KEYS = ("n", "d_align", "ag_max", "cross_frob", "saturated")


def check_callback_args(loss_reduction: str, every, log) -> None:
    """FusedStatsError unless ``loss_reduction`` is known, ``every`` a positive int and ``log``
    None or a MonitorLog."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise FusedStatsError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise FusedStatsError(f"every must be a positive int, got {every!r}")
    if log is not None and not isinstance(log, MonitorLog):
        raise FusedStatsError(f"log must be a fused_stats.MonitorLog, got {type(log).__name__}")


def merged_probe(probe, group=None):
    """A shallow copy of ``probe`` whose accumulators are copies merged over the process group."""
    from ..state.distributed import all_reduce_probe

    return all_reduce_probe(probe.state_copy(), group)


def step_record(probe, source, log, stream: str, step: int) -> dict:
    """The record of optimizer step ``step``: ``log``'s line when a MonitorLog is given (it merges
    itself when ``all_reduce=True``, otherwise it is given ``source``), else the same fields built
    from ``source`` (``probe``, or its merged view under data parallelism)."""
    if log is not None:
        return log.write(probe if log.all_reduce else source, stream=stream, step=step)
    return {
        "step": step,
        "stream": stream,
        "points": {name: point_record(source, name, stream) for name in probe.points},
    }


def metrics_of(record_points: dict) -> dict[str, float]:
    """Trainer log metrics ``{"fused_stats/<point>/<key>": float}`` from a MonitorLog line's
    ``points`` (None values are left out; booleans become 0.0 / 1.0)."""
    out = {}
    for name, point in record_points.items():
        for key in METRIC_KEYS:
            value = point.get(key)
            if value is None or isinstance(value, str):
                continue
            out[f"{PREFIX}/{name}/{key}"] = float(value)
    return out
