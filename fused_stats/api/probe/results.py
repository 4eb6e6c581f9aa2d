"""The results view of a probe's accumulator table: estimates, saturation, certificates.

Role: :class:`~fused_stats.Probe` collects (step, fold, observe into its table); a
:class:`ProbeResults` reads that table and computes, the way a metric's ``compute`` reads what its
``update`` gathered. It holds the table itself (a live view: later steps show in its results) and
never changes an accumulator. What it computes per point, from the GradStats of a stream:

* :meth:`~ProbeResults.estimate`: the unbiased :class:`~fused_stats.Estimate` of one stream;
* :meth:`~ProbeResults.realized_alignment`: ``s_trainᵀ s_test/(M K)``;
* :meth:`~ProbeResults.certificate`: the width paper's Theorem 1 at ``M`` = train n, ``K`` = test n
  with the moments of the pooled train + test samples (both streams sample one population);
* :meth:`~ProbeResults.misalignment`: random disjoint (M, K) splits of that pooled pool;
* :meth:`~ProbeResults.saturation` and :meth:`~ProbeResults.cross_estimate`: the depth test from
  the point's CrossStats (probes built with ``cross=``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...accumulators import (
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
from ...errors import FusedStatsError
from .table import check_stream


class ProbeResults:
    """Results over ``table`` (``(kind, stream, point) -> accumulator``) at ``points``.

    ``has_cross``: whether the probe keeps cross statistics (else :meth:`saturation` and
    :meth:`cross_estimate` are refused, naming ``cross=``)."""

    def __init__(self, table: dict, points: Sequence[str], has_cross: bool = False):
        self.table, self.points, self.has_cross = table, list(points), has_cross

    def grad_accumulator(self, point: str, stream: str = "train") -> GradStats:
        """The GradStats of ``point`` in ``stream``; refused when it holds no sample."""
        if point not in self.points:
            raise FusedStatsError(f"{point!r} is not a point of this probe; points: {self.points}")
        check_stream(stream)
        acc = self.table.get(("grad", stream, point))
        if acc is None or acc.n == 0:
            raise FusedStatsError(f"point {point!r} has no samples in the {stream} stream yet")
        return acc

    def cross_accumulator(self, point: str, stream: str = "train") -> CrossStats:
        """The CrossStats of ``point`` in ``stream``; refused without ``cross=`` or samples."""
        if not self.has_cross:
            raise FusedStatsError("saturation() needs a Probe built with cross=fs.CrossSpec(...)")
        check_stream(stream)
        cross = self.table.get(("cross", stream, point))
        if cross is None:
            raise FusedStatsError(f"point {point!r} has no cross-gradient samples in the {stream} stream")
        return cross

    def estimate(self, point: str, stream: str = "train") -> Estimate:
        """The unbiased :class:`~fused_stats.Estimate` at ``point`` from ``stream`` alone."""
        return self.grad_accumulator(point, stream).estimate()

    def estimates(self, stream: str = "train") -> dict[str, Estimate]:
        """Point name -> :class:`Estimate` for ``stream`` (raises for a point with n < 4)."""
        return {p: self.estimate(p, stream) for p in self.points}

    def pooled(self, point: str) -> GradStats:
        """A new accumulator holding the train and test samples of ``point`` (exact merge)."""
        out = self.grad_accumulator(point, "train").copy()
        test = self.table.get(("grad", "test", point))
        if test is not None and test.n:
            out.merge(test)
        return out

    def realized_alignment(self, point: str) -> Alignment:
        """``μ_Mᵀ g_K = s_trainᵀ s_test / (M K)`` at ``point`` (needs both streams)."""
        return realized_alignment(self.grad_accumulator(point, "train"), self.grad_accumulator(point, "test"))

    def sizes(self, point: str, M: int | None, K: int | None) -> tuple[int, int]:
        """``(M, K)`` with the defaults train n and test n filled in."""
        M = self.grad_accumulator(point, "train").n if M is None else M
        if K is None:
            test = self.table.get(("grad", "test", point))
            if test is None or test.n == 0:
                raise FusedStatsError(
                    f"point {point!r}: K defaults to the test stream's n, which is empty; "
                    "run test batches (stream='test') or pass K"
                )
            K = test.n
        return M, K

    def certificate(
        self,
        point: str,
        M: int | None = None,
        K: int | None = None,
        pooled: bool = True,
        stream: str | None = None,
    ) -> Certificate:
        """Theorem 1 at ``(M, K)`` (default: train n, test n). The moments come from the pooled
        train + test estimate, or from ``stream`` alone when it is given (``pooled=False`` is
        ``stream="train"``)."""
        M, K = self.sizes(point, M, K)
        if stream is None and not pooled:
            stream = "train"
        acc = self.pooled(point) if stream is None else self.grad_accumulator(point, stream)
        return acc.estimate().certificate(M, K)

    def misalignment(
        self, point: str, M: int | None = None, K: int | None = None, trials: int = 10_000, seed: int = 0
    ) -> Misalignment:
        """Fraction of random disjoint (M, K) splits of the pooled pool with ``μ_Mᵀg_K ≤ 0``.

        Defaults ``M`` = train n, ``K`` = test n: each split then partitions the whole pooled
        sample (a permutation estimate at the certificate's sizes). Needs a pool
        (``second_moment="pool"``, or ``"auto"`` before it turned dense).
        """
        M, K = self.sizes(point, M, K)
        return misalignment_probability(self.pooled(point), M, K, trials=trials, seed=seed)

    def saturation(self, point: str, alpha: float = 0.05, stream: str = "train"):
        """The depth-saturation test at ``point`` (:class:`~fused_stats.Saturation`): unbiased
        ``|C|_F²`` with its standard error and the decision at level ``alpha``, plus ``AG_max`` and
        the mean per-sample norm from the point's GradStats in ``stream``."""
        acc = self.grad_accumulator(point, stream)
        cross = self.cross_accumulator(point, stream)
        return cross.saturation(alpha, ag_max=float(acc.norm_max), ag_mean=float(acc.norm_sum) / acc.n)

    def cross_estimate(self, point: str, stream: str = "train") -> CrossEstimate:
        """The cross-gradient at ``point`` (:class:`~fused_stats.accumulators.CrossEstimate`):
        the unbiased ``|C|_F²``, the plug-in ``|C̄|_F²`` and ``C̄`` itself."""
        if point not in self.points:
            raise FusedStatsError(f"{point!r} is not a point of this probe; points: {self.points}")
        return self.cross_accumulator(point, stream).estimate()
