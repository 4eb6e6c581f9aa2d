"""Histogram of per-sample gradient norms ``|q_i|`` in log-spaced bins.

``bins`` bins with edges ``e_k = low · (high/low)^(k/bins)``, ``k = 0..bins``, plus an underflow
bin (``|q| < low``, including exact zeros) and an overflow bin (``|q| ≥ high``): count ``k+1``
holds the samples with ``e_k ≤ |q| < e_{k+1}``. ``q_i`` is formed as GradStats forms it (the sum
over a sample's counted positions, or every counted position for ``unit="position"``). The state
is the counts (fp64, exact up to 2⁵³) and ``n``; every part of it is a plain sum, so merge,
all-reduce and save/load come from the declaration alone. The depth paper uses the mean and the
largest per-sample norm as its saturation indicator; the histogram shows the whole distribution.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch

from ..backend import Backend, validate_backend
from ..errors import FusedStatsError
from .base import NONFINITE_POLICIES, Accumulator, Field, IncompatibleStates, Nonfinite, Prepared
from .batch_view import batch_view

F64 = torch.float64
HistogramUnit = Literal["sample", "position"]
UNITS: tuple[str, ...] = ("sample", "position")


class NormHistogram(Accumulator):
    """Counts of ``|q_i|`` in ``bins`` log-spaced bins over ``[low, high)`` (module docstring).

    Examples
    --------
    >>> import torch
    >>> from fused_stats.accumulators import NormHistogram
    >>> h = NormHistogram(4, low=0.1, high=10.0, bins=2)
    >>> h.update(torch.tensor([[0.5, 0, 0, 0], [3.0, 0, 0, 0], [0.0, 0, 0, 0]]))
    >>> h.counts.tolist()
    [1.0, 1.0, 1.0, 0.0]
    """

    KIND = "norm_hist"
    FORMAT = "fused_stats.NormHistogram"
    VERSION = 1
    FIELDS = (Field("counts", lambda acc, c: (acc.bins + 2,), "sum"),)
    COUNTERS: ClassVar[dict[str, str]] = {"n": "sum", "unit": "label", "skipped_batches": "sum"}

    def __init__(
        self,
        dim: int,
        low: float = 1e-6,
        high: float = 1e6,
        bins: int = 48,
        device=None,
        backend: Backend = "auto",
        nonfinite: Nonfinite = "raise",
        name: str | None = None,
    ):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise FusedStatsError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(bins, int) or bins < 1:
            raise FusedStatsError(f"bins must be a positive int, got {bins!r}")
        if not (0 < low < high < math.inf):
            raise FusedStatsError(f"need 0 < low < high < inf, got low={low!r}, high={high!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise FusedStatsError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.dim, self.low, self.high, self.bins = dim, float(low), float(high), bins
        self.backend = validate_backend(backend)
        self.nonfinite = nonfinite
        self.name = name
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.n = 0
        self.unit: str | None = None
        self.skipped_batches = 0
        self.counts = torch.zeros(bins + 2, dtype=F64, device=self.device)

    def edges(self) -> torch.Tensor:
        """The ``bins + 1`` bin edges (fp64, CPU)."""
        return torch.logspace(math.log10(self.low), math.log10(self.high), self.bins + 1, dtype=F64)

    def __repr__(self) -> str:
        return f"NormHistogram(dim={self.dim}, bins={self.bins}, n={self.n}{self._where()})"

    # ------------------------------------------------------------------ update
    def prepare(
        self,
        grad: torch.Tensor,
        mask: torch.Tensor | None = None,
        unit: HistogramUnit = "sample",
        feature_dim: int = -1,
    ) -> Prepared:
        """Validate a batch and bin its per-sample norms without changing the state."""
        g, m = batch_view(
            grad,
            mask,
            unit,
            feature_dim,
            dim=self.dim,
            units=UNITS,
            fed=self.unit,
            device=self.device,
            where=self._where(),
        )
        g = g.to(F64)
        if m is None:
            m = torch.ones(g.shape[:2], dtype=torch.bool, device=g.device)
        if unit == "sample":
            q = (g * m[..., None]).sum(dim=1)[m.any(dim=1)]
        else:
            q = g[m]
        norms = torch.linalg.vector_norm(q, dim=-1)
        finite = bool(torch.isfinite(norms).all())
        index = torch.bucketize(norms, self.edges().to(norms.device), right=True)
        counts = torch.bincount(index.clamp(0, self.bins + 1), minlength=self.bins + 2).to(F64)
        batch = _Binned(n=int(norms.numel()), counts=counts)
        return Prepared(unit=unit, base_n=self.n, batch=batch, finite=finite)

    def commit(self, prepared: Prepared) -> None:
        """Add a batch from :meth:`prepare`."""
        if not self._admits(
            prepared, "non-finite gradient{where} in a batch of {n} samples; nothing was accumulated"
        ):
            return
        self.counts += prepared.batch.counts
        self.n += prepared.n
        self.unit = prepared.unit

    def update(
        self,
        grad: torch.Tensor,
        mask: torch.Tensor | None = None,
        unit: HistogramUnit = "sample",
        feature_dim: int = -1,
    ) -> None:
        self.commit(self.prepare(grad, mask, unit, feature_dim))

    # ------------------------------------------------------------------ results
    def to_dict(self) -> dict:
        """``{"n", "edges", "counts", "underflow", "overflow"}`` (plain lists, for reports)."""
        counts = [int(v) for v in self.counts.tolist()]
        return {
            "n": self.n,
            "edges": self.edges().tolist(),
            "counts": counts[1:-1],
            "underflow": counts[0],
            "overflow": counts[-1],
        }

    # ------------------------------------------------------------------ protocol hooks
    def describe(self) -> dict:
        return {"bins": self.bins, "unit": self.unit}

    def block_digest(self) -> int:
        from .distributed import names_digest

        return names_digest([repr(self.low), repr(self.high), str(self.bins)])

    def config(self) -> dict:
        return {
            "dim": self.dim,
            "low": self.low,
            "high": self.high,
            "bins": self.bins,
            "nonfinite": self.nonfinite,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config, tensors=None, device=None, backend="auto") -> NormHistogram:
        return cls(
            int(config["dim"]),
            float(config["low"]),
            float(config["high"]),
            int(config["bins"]),
            device,
            backend,
            config["nonfinite"],
            config["name"],
        )

    def _check_counters(self, counters, where: str) -> None:
        if counters["n"] < 0 or counters["unit"] not in (None, *UNITS):
            raise FusedStatsError(f"{where} is inconsistent: n={counters['n']}, unit={counters['unit']!r}")

    def check_state(self, state, where: str) -> None:
        super().check_state(state, where)
        if float(state["counts"].sum()) != state["n"]:
            raise FusedStatsError(
                f"{where} is inconsistent: the counts add up to {float(state['counts'].sum())}, "
                f"n={state['n']}"
            )

    def check_compatible(self, other) -> None:
        if not isinstance(other, NormHistogram):
            raise IncompatibleStates(f"can only merge a NormHistogram, got {type(other).__name__}")
        diffs = [
            f"{k} {getattr(self, k)!r} vs {getattr(other, k)!r}"
            for k in ("dim", "low", "high", "bins", "device")
            if getattr(self, k) != getattr(other, k)
        ]
        if self.unit and other.unit and self.unit != other.unit:
            diffs.append(f"unit {self.unit!r} vs {other.unit!r}")
        if diffs:
            raise IncompatibleStates(
                f"cannot merge the norm histogram{other._where()} into{self._where()}: they differ "
                "in " + "; ".join(diffs),
                diffs,
            )

    def settings_row(self) -> list[int]:
        edges = int.from_bytes(self.edges().numpy().tobytes()[-8:], "little") & ((1 << 62) - 1)
        return [
            self.dim,
            self.bins,
            edges,
            self.n,
            -1 if self.unit is None else UNITS.index(self.unit),
            self.skipped_batches,
        ]

    def check_settings(self, table: torch.Tensor) -> None:
        for col, what in ((0, "dim"), (1, "bins"), (2, "bin edges")):
            if len(set(table[:, col].tolist())) > 1:
                raise IncompatibleStates(
                    f"all_reduce of the norm histogram{self._where()}: ranks disagree on {what}: "
                    f"{table[:, col].tolist()} (by rank)",
                    [what],
                )
        if len({int(u) for u, n in zip(table[:, 4], table[:, 3]) if n > 0}) > 1:
            raise IncompatibleStates(
                f"all_reduce of the norm histogram{self._where()}: ranks were fed different units", ["unit"]
            )

    def _reduce_start(self, table: torch.Tensor, group, device):
        units = [UNITS[int(u)] for u, n in zip(table[:, 4], table[:, 3]) if n > 0]
        return self.state_dict(), {
            "n": int(table[:, 3].sum()),
            "unit": units[0] if units else None,
            "skipped_batches": int(table[:, 5].sum()),
        }


class _Binned:
    """One prepared batch: ``n`` samples and their bin counts."""

    def __init__(self, n: int, counts: torch.Tensor):
        self.n, self.counts = n, counts
