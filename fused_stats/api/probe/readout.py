"""The probe's read side: what is read from its accumulator table once steps have folded into it.

A probe's ``stats`` (train) and ``test_stats`` (held-out) hold one accumulator per point. The
results are a view over the table (:attr:`ProbeReadout.results`,
:class:`~fused_stats.api.probe.results.ProbeResults`; the methods here delegate to it).
:meth:`~ProbeReadout.realized_alignment` is ``s_trainᵀ s_test/(M K)``;
:meth:`~ProbeReadout.certificate` evaluates the width paper's Theorem 1 at ``M`` = train n,
``K`` = test n with the moments estimated from the *pooled* train + test samples (both streams
sample the same population, so pooling gives the lower-variance unbiased estimate);
:meth:`~ProbeReadout.misalignment` draws random disjoint (M, K) splits of that pooled pool.

:class:`ProbeReadout` is the part of :class:`~fused_stats.api.probe.driver.Probe` that reads: the
results view (:attr:`results`), the per-point estimates, certificate, misalignment, saturation and
cross-gradient, and the report with the model's summary (:func:`model_summary`).
"""

from __future__ import annotations

import contextlib

from torch import nn

from ...accumulators import Alignment, Certificate, CrossEstimate, Estimate, GradStats, Misalignment
from ...errors import FusedStatsError
from ..report.data import report_data
from .points import residual_points
from .results import ProbeResults
from .spec import protocol_record

__all__ = ["ProbeReadout", "model_summary"]


def model_summary(model: nn.Module, points: list[str] | None = None) -> dict:
    """``{"class", "num_parameters", "config"}`` for a report; ``config`` holds a few plain sizes."""
    num = sum(p.numel() for p in model.parameters())
    config: dict = {}
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for key in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
        ):
            try:
                value = getattr(cfg, key)
            except AttributeError:
                continue
            if isinstance(value, (int, float, str, bool)):
                config[key] = value
    width = getattr(model, "width", None)
    if isinstance(width, int):
        config["width"] = width
    if "hidden_size" in config:
        config.setdefault("width", config["hidden_size"])
    with contextlib.suppress(FusedStatsError):
        config["depth"] = len(residual_points(model))
    if points is not None:
        config["num_points"] = len(points)
    return {"class": type(model).__name__, "num_parameters": int(num), "config": config}


class ProbeReadout:
    """The read side of :class:`~fused_stats.api.probe.driver.Probe` (module docstring); a mixin
    over the probe's ``table``, ``points``, ``cross`` and ``model``."""

    # ------------------------------------------------------------------ results
    @property
    def results(self) -> ProbeResults:
        """The results view of :attr:`table` (:class:`~fused_stats.api.probe.results.ProbeResults`):
        live, so later steps show in it; the result methods below delegate to it."""
        return ProbeResults(self.table, self.points, has_cross=self.cross is not None)

    def estimate(self, point: str, stream: str = "train") -> Estimate:
        """The unbiased :class:`~fused_stats.Estimate` at ``point`` from ``stream`` alone."""
        return self.results.estimate(point, stream)

    def estimates(self, stream: str = "train") -> dict[str, Estimate]:
        """Point name -> :class:`Estimate` for ``stream`` (raises for a point with n < 4)."""
        return self.results.estimates(stream)

    def pooled(self, point: str) -> GradStats:
        """A new accumulator holding the train and test samples of ``point`` (exact merge)."""
        return self.results.pooled(point)

    def realized_alignment(self, point: str) -> Alignment:
        """``μ_Mᵀ g_K = s_trainᵀ s_test / (M K)`` at ``point`` (needs both streams)."""
        return self.results.realized_alignment(point)

    def certificate(
        self,
        point: str,
        M: int | None = None,
        K: int | None = None,
        pooled: bool = True,
        stream: str | None = None,
    ) -> Certificate:
        """Theorem 1 at ``(M, K)``: :meth:`ProbeResults.certificate
        <fused_stats.api.probe.results.ProbeResults.certificate>`."""
        return self.results.certificate(point, M, K, pooled, stream)

    def misalignment(
        self, point: str, M: int | None = None, K: int | None = None, trials: int = 10_000, seed: int = 0
    ) -> Misalignment:
        """Fraction of random disjoint (M, K) splits of the pooled pool with ``μ_Mᵀg_K ≤ 0``:
        :meth:`ProbeResults.misalignment <fused_stats.api.probe.results.ProbeResults.misalignment>`."""
        return self.results.misalignment(point, M, K, trials, seed)

    def saturation(self, point: str, alpha: float = 0.05, stream: str = "train"):
        """The depth-saturation test at ``point`` (:class:`~fused_stats.Saturation`):
        :meth:`ProbeResults.saturation <fused_stats.api.probe.results.ProbeResults.saturation>`."""
        return self.results.saturation(point, alpha, stream)

    def cross_estimate(self, point: str, stream: str = "train") -> CrossEstimate:
        """The cross-gradient at ``point`` (:class:`~fused_stats.accumulators.CrossEstimate`):
        the unbiased ``|C|_F²``, the plug-in ``|C̄|_F²`` and ``C̄`` itself."""
        return self.results.cross_estimate(point, stream)

    # ------------------------------------------------------------------ report
    def _report_data(self, meta: dict | None = None, misalignment_trials: int = 2000) -> dict:
        """The version-1 report dict (:func:`fused_stats.api.report.data.report_data`)."""
        return report_data(
            self.results,
            self.model,
            points=self.points,
            dims=self.dims,
            unit=self.unit,
            second_moment=self.second_moment,
            summary=model_summary(self.model, self.points),
            norm_histograms=self.accumulators("norm_hist", "train"),
            protocol=protocol_record(self.cross, self),
            with_saturation=self.cross is not None,
            meta=meta,
            misalignment_trials=misalignment_trials,
        )

    def report(self, meta: dict | None = None, misalignment_trials: int = 2000):
        """A :class:`fused_stats.api.report.document.Report` of every point (train, test, certificate,
        misalignment when a pool exists, realized alignment). ``meta``: free-form, e.g. width."""
        from ..report.document import Report

        return Report(self._report_data(meta, misalignment_trials))
