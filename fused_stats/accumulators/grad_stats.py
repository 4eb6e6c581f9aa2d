"""Streaming accumulator of per-sample activation-gradient statistics (docs/design.md, sections 2, 7).

State, centred at ``c`` (the first batch's mean; rounded to fp32 so that the fp32 kernels subtract
it exactly): ``y_i = q_i − c``, ``n``, ``s = Σy``, ``t = Σ|y|²y``, ``A1 = Σ|y|²``, ``A2 = Σ|y|⁴``,
the largest and the summed ``|q_i|``, and a second moment, either

* ``dense``: ``S = Σ y yᵀ`` (d × d, fp64), or
* ``pool``: every ``y_i`` (N × d, fp64) and their Gram matrix ``G = Y Yᵀ`` (N × N, fp64), which
  also allows Monte Carlo over random train/test splits (:func:`misalignment_probability`).

``auto`` keeps a pool while ``N d + N² ≤ d²`` (and ``N ≤ pool_capacity``), then folds it into a
dense ``S``. Running totals are fp64; the per-batch work goes through the ops layer (Triton on
CUDA, the fp64 torch twin on CPU).

Moving the centre by ``δ`` is exact (:func:`~fused_stats.accumulators.centre_shift.shift`, formulas
there). Merging shifts one state to the other's centre and adds (Chan et al.-style); with a shared
centre a plain sum (all-reduce) is a valid merge (:mod:`~fused_stats.accumulators.grad_combine`).
Several accumulators fed at once (a probe's points) share batched calls
(:mod:`~fused_stats.accumulators.grad_stacked`). :meth:`GradStats.estimate` shifts a copy to ``q̄`` and finalises.
The state is declared once (:attr:`GradStats.FIELDS`); copy, save/load, merge and all-reduce
derive from it (:mod:`fused_stats.accumulators.base`), the centre move being the one alignment hook.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from .. import ops
from ..backend import Backend, validate_backend
from ..errors import FusedStatsError
from .base import (
    NONFINITE_POLICIES,
    Accumulator,
    Field,
    IncompatibleStates,
    Nonfinite,
    Prepared,
    extend_gram,
)
from .batch_view import batch_view
from .centre_shift import shift
from .estimators import Estimate, finalize
from .grad_combine import GradStatsCombine
from .grad_options import SECOND_MOMENTS, UNITS, SecondMoment, Unit, auto_pool_limit
from .grad_stacked import StackedGradUpdates

F64 = torch.float64
__all__ = ["NONFINITE_POLICIES", "SECOND_MOMENTS", "UNITS", "GradStats", "auto_pool_limit", "shift"]


def sums_finite(batch) -> bool:
    """A NaN/Inf anywhere in a counted position makes A1 = Σ|y|² non-finite; values so large that
    Σ|y|⁴ overflows would poison every later estimate just the same."""
    sums = (batch.a1, batch.a2, batch.norm_sum)
    if batch.a1.device.type == "cpu":  # three scalar reads cost fewer torch calls than one stacked check
        return all(math.isfinite(x.item()) for x in sums)
    return bool(torch.isfinite(torch.stack(sums)).all())  # one host sync


def _held(acc, c) -> bool:
    return c["n"] > 0


def _dense(acc, c) -> bool:
    return c["n"] > 0 and c["mode"] == "dense"


def _pooled(acc, c) -> bool:
    return c["n"] > 0 and c["mode"] == "pool"


def _vector(acc, c) -> tuple:
    return (acc.dim,)


def _scalar(acc, c) -> tuple:
    return ()


class GradStats(StackedGradUpdates, GradStatsCombine, Accumulator):
    """Exact streaming statistics of per-sample vectors ``q_i ∈ R^dim``.

    Parameters
    ----------
    dim : int
        Feature dimension ``d`` (for ``unit="flat"``: the size of one flattened sample).
    second_moment : {"auto", "dense", "pool"}
        Representation of ``Σ y yᵀ`` (module docstring).
    pool_capacity : int, optional
        ``pool``: the most samples the pool may hold (a batch beyond it is rejected).
        ``auto``: the pool size at which it switches to dense (default, and at most: the memory
        crossover ``N d + N² ≤ d²``, so ``auto`` never holds more than the smaller representation).
    device : torch.device or str, optional
        Where the state lives; ``None`` adopts the first batch's device.
    backend : {"auto", "triton", "torch"}
    nonfinite : {"raise", "skip"}
        A batch with NaN/Inf in a counted position raises, or is skipped and counted in
        :attr:`skipped_batches`. Either way the state is unchanged.
    name : str, optional
        Used in error messages (e.g. the insertion point's name).

    Examples
    --------
    >>> import torch, fused_stats as fs
    >>> acc = fs.GradStats(8, second_moment="dense")
    >>> acc.update(torch.randn(32, 8) + 1.0)
    >>> est = acc.estimate()
    >>> est.n, est.dim
    (32, 8)
    """

    KIND = "grad"
    FORMAT = "fused_stats.GradStats"
    VERSION = 1
    FIELDS = (
        Field("centre", _vector, "same", present=_held),
        Field("s", _vector, "sum", present=_held),
        Field("t", _vector, "sum", present=_held),
        Field("a1", _scalar, "sum", present=_held),
        Field("a2", _scalar, "sum", present=_held),
        Field("norm_max", _scalar, "max", present=_held),
        Field("norm_sum", _scalar, "sum", present=_held),
        Field("S", lambda acc, c: (acc.dim, acc.dim), "sum", present=_dense),
        Field("pool", lambda acc, c: (c["n"], acc.dim), "rows", present=_pooled),
        Field("gram", lambda acc, c: (c["n"], c["n"]), "gram", present=_pooled, rows="pool"),
    )
    COUNTERS: ClassVar[dict[str, str]] = {
        "n": "sum",
        "mode": "label",
        "unit": "label",
        "skipped_batches": "sum",
    }

    def __init__(
        self,
        dim: int,
        second_moment: SecondMoment = "auto",
        pool_capacity: int | None = None,
        device=None,
        backend: Backend = "auto",
        nonfinite: Nonfinite = "raise",
        name: str | None = None,
    ):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise FusedStatsError(f"dim must be a positive int, got {dim!r}")
        if second_moment not in SECOND_MOMENTS:
            raise FusedStatsError(f"second_moment must be one of {SECOND_MOMENTS}, got {second_moment!r}")
        if pool_capacity is not None and (not isinstance(pool_capacity, int) or pool_capacity < 1):
            raise FusedStatsError(f"pool_capacity must be a positive int or None, got {pool_capacity!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise FusedStatsError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.dim = dim
        self.second_moment = second_moment
        self.pool_capacity = pool_capacity
        self.backend = validate_backend(backend)
        self.nonfinite = nonfinite
        self.name = name
        self.device = torch.device(device) if device is not None else None
        self.unit: str | None = None
        self.skipped_batches = 0
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self.n = 0
        self.mode = "dense" if self.second_moment == "dense" else "pool"
        self.centre: torch.Tensor | None = None
        self.s = self.t = None
        self.a1 = self.a2 = self.norm_max = self.norm_sum = None
        self.S: torch.Tensor | None = None
        self.pool: torch.Tensor | None = None
        self.gram: torch.Tensor | None = None

    @property
    def S(self) -> torch.Tensor | None:
        """The dense second moment ``Σ y yᵀ`` (None in pool mode). While streaming, the CPU path
        adds each batch to the upper triangle only; the lower one is completed here, once, when S
        is read (state_dict, estimate, merge, save, all_reduce all read it through this)."""
        if self._S_lower_stale:
            ops.mirror_upper(self._S)
            self._S_lower_stale = False
        return self._S

    @S.setter
    def S(self, value: torch.Tensor | None) -> None:
        self._S, self._S_lower_stale = value, False

    def _init_state(self, centre: torch.Tensor) -> None:
        dev, d = centre.device, self.dim
        self.device = dev
        self.centre = centre.to(F64)
        self.s = torch.zeros(d, dtype=F64, device=dev)
        self.t = torch.zeros(d, dtype=F64, device=dev)
        self.a1, self.a2, self.norm_max, self.norm_sum = (
            torch.zeros((), dtype=F64, device=dev) for _ in range(4)
        )
        if self.mode == "dense":
            self.S = torch.zeros(d, d, dtype=F64, device=dev)
        else:
            self.pool = torch.zeros(0, d, dtype=F64, device=dev)
            self.gram = torch.zeros(0, 0, dtype=F64, device=dev)

    @property
    def pool_limit(self) -> int | None:
        """Pool size beyond which ``auto`` turns dense (``pool``: the hard capacity)."""
        if self.second_moment == "pool":
            return self.pool_capacity
        if self.second_moment == "auto":
            limit = auto_pool_limit(self.dim)
            return limit if self.pool_capacity is None else min(limit, self.pool_capacity)
        return None

    def state_nbytes(self) -> int:
        """Bytes held by the state tensors."""
        tensors = [self.centre, self.s, self.t, self.S, self.pool, self.gram]
        return sum(x.numel() * x.element_size() for x in tensors if x is not None) + 4 * 8

    @staticmethod
    def planned_nbytes(dim: int, mode: str, pool_size: int = 0) -> int:
        """Bytes of state for ``mode`` ("dense" or "pool" with ``pool_size`` samples)."""
        vectors = 3 * dim * 8 + 4 * 8
        if mode == "dense":
            return vectors + dim * dim * 8
        if mode == "pool":
            return vectors + (pool_size * dim + pool_size * pool_size) * 8
        raise FusedStatsError(f"mode must be 'dense' or 'pool', got {mode!r}")

    def __repr__(self) -> str:
        where = f", name={self.name!r}" if self.name else ""
        return f"GradStats(dim={self.dim}, n={self.n}, mode={self.mode!r}{where})"

    # ------------------------------------------------------------------ update
    def _as_batch(self, grad, mask, unit: str, feature_dim: int):
        """Validate and view ``grad`` as (B, T, d) and ``mask`` as (B, T) bool or None."""
        return batch_view(
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

    def update(
        self,
        grad: torch.Tensor,
        mask: torch.Tensor | None = None,
        unit: Unit = "sample",
        feature_dim: int = -1,
    ) -> None:
        """Fold one batch into the state.

        ``grad``: (B, d), (B, *positions, d) or, with ``feature_dim``, e.g. NCHW with
        ``feature_dim=1``. ``mask``: (B, *positions) or (B,), nonzero = counted. ``unit``:
        ``"sample"`` sums each sample's counted positions into one ``q``; ``"position"`` makes each
        counted position a sample; ``"flat"`` flattens each sample to one vector of size ``dim``.
        A rejected batch (error or ``nonfinite="skip"``) leaves the state unchanged.
        Equivalent to ``commit(prepare(...))``.
        """
        self.commit(self.prepare(grad, mask, unit, feature_dim))

    def prepare(
        self,
        grad: torch.Tensor,
        mask: torch.Tensor | None = None,
        unit: Unit = "sample",
        feature_dim: int = -1,
    ) -> Prepared:
        """Validate and reduce a batch without changing the state.

        Raises :class:`FusedStatsError` for anything :meth:`commit` could not take (shapes, dtype,
        device, pool capacity); a non-finite batch comes back with ``finite=False`` and is handled
        by :meth:`commit` according to ``nonfinite``. Several accumulators (the points of a probe)
        can thus all be prepared before any of them is committed: all or nothing.
        """
        g, m = self._as_batch(grad, mask, unit, feature_dim)
        op_unit = "sample" if unit == "flat" else unit
        empty = Prepared(unit=unit, base_n=self.n, batch=None)
        if g.shape[0] == 0 or g.shape[1] == 0:
            return empty
        if self.centre is None:
            first = ops.capture_reduce(
                g, m, torch.zeros(self.dim, dtype=F64, device=g.device), op_unit, self.backend
            )
            if first.n == 0:
                return empty
            if not sums_finite(first):
                return Prepared(unit, self.n, first, finite=False)
            centre = first.s / first.n
            if g.dtype != F64:  # exactly representable for the fp32 kernels (exact subtraction)
                centre = centre.to(torch.float32).to(F64)
        else:
            centre = self.centre
        batch = ops.capture_reduce(g, m, centre, op_unit, self.backend)
        if batch.n == 0:
            return empty
        if not sums_finite(batch):
            return Prepared(unit, self.n, batch, finite=False, centre=centre)
        self._check_pool_room(batch.n)
        return Prepared(unit, self.n, batch, finite=True, centre=centre)

    def _check_pool_room(self, count: int) -> None:
        """A fixed pool (``second_moment="pool"``) refuses a batch of ``count`` samples that would
        pass its capacity; ``auto`` turns dense instead."""
        limit = self.pool_limit
        if self.second_moment == "pool" and limit is not None and self.n + count > limit:
            raise FusedStatsError(
                f"pool{self._where()} holds {self.n} samples; {count} more exceed "
                f"pool_capacity={limit}. Use second_moment='auto' or 'dense', or a larger capacity"
            )

    def commit(self, prepared: Prepared) -> None:
        """Fold a batch returned by :meth:`prepare` (on this accumulator, with no update between)."""
        if not self._admits(
            prepared,
            "non-finite gradient (NaN or Inf, or so large that |y|^4 overflows){where} in a batch "
            "of {n} samples; nothing was accumulated. Pass nonfinite='skip' to skip such batches "
            "and count them",
        ):
            return
        batch = prepared.batch
        # ---- nothing below rejects the batch. The second moment goes first: it is the part that
        # allocates and runs kernels, so if it fails (e.g. out of memory) the sums still agree
        if self.centre is None:
            self._init_state(prepared.centre)
        self._add_second_moment(batch.n, rows=batch.valid_rows() if self.mode == "pool" else batch.rows)
        self.unit = prepared.unit
        self._add_sums(batch)

    def _add_parts(self, count, part, norm_max) -> None:
        """Add ``count`` samples' plain sums ``part = (s, t, a1, a2, norm_sum)`` (centred at this
        centre) and the maximum ``norm_max``."""
        self.n += count
        for state, value in zip((self.s, self.t, self.a1, self.a2, self.norm_sum), part):
            state += value
        torch.maximum(self.norm_max, norm_max, out=self.norm_max)

    def _add_sums(self, part) -> None:
        """Add the centred sums of ``part`` (a batch, or a state at this centre): all of them are
        plain sums, and ``max |q|`` a maximum."""
        self._add_parts(part.n, (part.s, part.t, part.a1, part.a2, part.norm_sum), part.norm_max)

    def _add_second_moment(self, count: int, rows: torch.Tensor) -> None:
        """Add ``count`` samples' ``rows`` (centred at this centre) to the second moment, before
        ``n`` grows; ``auto`` turns dense when the pool would pass its limit. New tensors are
        built completely before any attribute is assigned."""
        if self.mode == "dense":
            S, stale = self._S, self._S_lower_stale
            self._S_lower_stale = ops.second_moment_update(S, rows, self.backend, mirror=False) or stale
            return
        limit = self.pool_limit
        if self.second_moment == "auto" and limit is not None and self.n + count > limit:
            S = self._dense_from_pool()
            ops.second_moment_update(S, rows, self.backend)
            self.S, self.pool, self.gram, self.mode = S, None, None, "dense"
            return
        gram = extend_gram(self.gram, self.pool, rows, self.backend)
        self.pool, self.gram = torch.cat([self.pool, rows.to(F64)], dim=0), gram

    def _dense_from_pool(self) -> torch.Tensor:
        S = torch.zeros(self.dim, self.dim, dtype=F64, device=self.device)
        ops.second_moment_update(S, self.pool, self.backend)
        return S

    # ------------------------------------------------------------------ results
    def estimate(self) -> Estimate:
        """Unbiased fp64 estimates (see :mod:`fused_stats.accumulators.estimators`); needs n >= 4."""
        if self.n < 4:
            raise FusedStatsError(
                f"estimate(){self._where()} needs at least 4 samples (degree-4 U-statistics), have n={self.n}"
            )
        delta = self.s / self.n
        moved = shift(self._sums(), delta)
        # tr(S'^2) = |S'|_F^2 (dense) or |G'|_F^2 (pool: G' = Y'Y'^T has the same nonzero spectrum)
        second = moved["S"] if self.mode == "dense" else moved["gram"]
        mean = self.centre + delta
        if self.mode == "dense":
            beta = float(mean @ (second @ mean))
        else:
            beta = float((moved["pool"] @ mean).square().sum())
        return finalize(
            n=self.n,
            dim=self.dim,
            kappa=float(mean @ mean),
            a1=float(moved["a1"]),
            a2=float(moved["a2"]),
            F=float(torch.dot(second.reshape(-1), second.reshape(-1))),
            beta=beta,
            tau=float(mean @ moved["t"]),
            ag_max=self.norm_max.item(),
            ag_sum=self.norm_sum.item(),
        )

    def _sums(self) -> dict:
        return {
            "n": self.n,
            "s": self.s,
            "t": self.t,
            "a1": self.a1,
            "a2": self.a2,
            "S": self.S,
            "pool": self.pool,
            "gram": self.gram,
        }

    def mean(self) -> torch.Tensor:
        """The sample mean ``q̄`` (fp64)."""
        if self.n == 0:
            raise FusedStatsError(f"mean(){self._where()} of an empty accumulator")
        return self.centre + self.s / self.n

    def raw_sum(self) -> torch.Tensor:
        """``Σ q_i`` (uncentred, fp64)."""
        if self.n == 0:
            return torch.zeros(self.dim, dtype=F64, device=self.device or "cpu")
        return self.s + self.n * self.centre

    def pool_rows(self) -> torch.Tensor:
        """The stored per-sample vectors ``q_i`` (uncentred, fp64), in arrival order."""
        if self.mode != "pool":
            raise FusedStatsError(self._no_pool_message())
        if self.n == 0:
            return torch.zeros(0, self.dim, dtype=F64)
        return self.pool + self.centre

    def _no_pool_message(self) -> str:
        head = f"accumulator{self._where()} holds no sample pool (mode={self.mode!r}, n={self.n}); "
        if self.second_moment == "auto" and self.pool_limit is not None:
            return (
                head + f"'auto' folded its pool into the dense moment past {self.pool_limit} "
                "samples: use second_moment='pool', or fewer samples"
            )
        return head + f"second_moment={self.second_moment!r} keeps none: use second_moment='pool'"

    # ------------------------------------------------------------------ protocol hooks
    def describe(self) -> dict:
        return {"mode": self.mode, "second_moment": self.second_moment}

    def config(self) -> dict:
        return {
            "dim": self.dim,
            "second_moment": self.second_moment,
            "pool_capacity": self.pool_capacity,
            "nonfinite": self.nonfinite,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config, tensors=None, device=None, backend="auto") -> GradStats:
        return cls(
            config["dim"],
            config["second_moment"],
            config["pool_capacity"],
            device,
            backend,
            config["nonfinite"],
            config["name"],
        )

    def _state_label(self, counters) -> str:
        return f"dim={self.dim}, n={counters['n']}, mode={counters['mode']!r}"

    def _check_counters(self, counters, where: str) -> None:
        n, mode, unit = counters["n"], counters["mode"], counters["unit"]
        allowed_modes = {"dense": ("dense",), "pool": ("pool",), "auto": ("pool", "dense")}
        if (
            not isinstance(n, int)
            or n < 0
            or mode not in allowed_modes[self.second_moment]
            or unit not in (None, *UNITS)
            or not isinstance(counters["skipped_batches"], int)
        ):
            raise FusedStatsError(
                f"{where} is inconsistent: n={n}, mode={mode!r}, unit={unit!r} for "
                f"second_moment={self.second_moment!r}"
            )

    def check_compatible(self, other) -> None:
        if not isinstance(other, GradStats):
            raise IncompatibleStates(f"can only merge a GradStats, got {type(other).__name__}")
        if other.dim != self.dim:
            raise IncompatibleStates(f"cannot merge dim={other.dim} into dim={self.dim}{self._where()}")
        if self.unit and other.unit and self.unit != other.unit:
            raise IncompatibleStates(f"cannot merge unit={other.unit!r} into unit={self.unit!r}")
        if self.device is not None and other.device is not None and self.device != other.device:
            raise IncompatibleStates(
                f"cannot merge state on {other.device} into state on {self.device}{self._where()}"
            )
        if self.second_moment == "pool" and other.n and other.mode == "dense":
            raise IncompatibleStates("cannot merge a dense accumulator into a second_moment='pool' one")
        if (
            self.second_moment == "pool"
            and self.pool_limit is not None
            and self.n + other.n > self.pool_limit
        ):
            raise IncompatibleStates(
                f"merge would put {self.n + other.n} samples ({self.n} + {other.n}) in the "
                f"pool{self._where()} of capacity {self.pool_limit}"
            )
