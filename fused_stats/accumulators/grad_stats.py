"""Streaming accumulator of per-sample activation-gradient statistics (DESIGN sections 2 and 7).

State, centred at ``c`` (the first batch's mean; rounded to fp32 so that the fp32 kernels subtract
it exactly): ``y_i = q_i − c``, ``n``, ``s = Σy``, ``t = Σ|y|²y``, ``A1 = Σ|y|²``, ``A2 = Σ|y|⁴``,
the largest and the summed ``|q_i|``, and a second moment, either

* ``dense``: ``S = Σ y yᵀ`` (d × d, fp64), or
* ``pool``: every ``y_i`` (N × d, fp64) and their Gram matrix ``G = Y Yᵀ`` (N × N, fp64), which
  also allows Monte Carlo over random train/test splits (:func:`misalignment_probability`).

``auto`` keeps a pool while ``N d + N² ≤ d²`` (and ``N ≤ pool_capacity``), then folds it into a
dense ``S``. Running totals are fp64; the per-batch work goes through the ops layer (Triton on
CUDA, the fp64 torch twin on CPU).

Moving the centre by ``δ`` is exact (DESIGN section 2)::

    s' = s − nδ                 S' = S − δsᵀ − sδᵀ + nδδᵀ          A1' = A1 − 2δᵀs + n|δ|²
    t' = t − 2Sδ − A1δ + |δ|²s + 2(δᵀs)δ − n|δ|²δ
    A2' = A2 − 4δᵀt + 4δᵀSδ + 2|δ|²A1 − 4|δ|²δᵀs + n|δ|⁴

and in pool form ``Y' = Y − 1δᵀ``, ``G' = G − u1ᵀ − 1uᵀ + |δ|² 11ᵀ`` with ``u = Yδ``. Merging shifts
one state to the other's centre and adds (Chan et al.-style); with a shared centre a plain sum
(all-reduce) is a valid merge. :meth:`GradStats.estimate` shifts a copy to ``q̄`` and finalises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from .. import ops
from ..backend import validate_backend
from ..errors import FusedStatsError
from .estimators import Estimate, finalize

SECOND_MOMENTS = ("auto", "dense", "pool")
UNITS = ("sample", "position", "flat")
NONFINITE_POLICIES = ("raise", "skip")
F64 = torch.float64


def auto_pool_limit(dim: int) -> int:
    """Largest pool size N with ``N d + N² ≤ d²`` (pool no larger than the dense matrix)."""
    n = int(dim * (math.sqrt(5.0) - 1.0) / 2.0)
    while n * dim + n * n > dim * dim:
        n -= 1
    while (n + 1) * dim + (n + 1) ** 2 <= dim * dim:
        n += 1
    return max(n, 0)


def sums_finite(batch) -> bool:
    """A NaN/Inf anywhere in a counted position makes A1 = Σ|y|² non-finite; values so large that
    Σ|y|⁴ overflows would poison every later estimate just the same."""
    return bool(torch.isfinite(torch.stack([batch.a1, batch.a2, batch.norm_sum])).all())


@dataclass
class PreparedBatch:
    """A validated, reduced batch waiting for :meth:`GradStats.commit`."""

    unit: str
    base_n: int  # the accumulator's n when prepared: commit refuses a stale batch
    centre: torch.Tensor | None
    batch: ops.BatchSums | None
    finite: bool

    @property
    def n(self) -> int:
        return 0 if self.batch is None else self.batch.n


class GradStats:
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

    def __init__(self, dim: int, second_moment: str = "auto", pool_capacity: int | None = None,
                 device=None, backend: str = "auto", nonfinite: str = "raise",
                 name: str | None = None):
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

    def _init_state(self, centre: torch.Tensor) -> None:
        dev, d = centre.device, self.dim
        self.device = dev
        self.centre = centre.to(F64)
        self.s = torch.zeros(d, dtype=F64, device=dev)
        self.t = torch.zeros(d, dtype=F64, device=dev)
        self.a1, self.a2, self.norm_max, self.norm_sum = (
            torch.zeros((), dtype=F64, device=dev) for _ in range(4))
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

    def _where(self) -> str:
        return f" at point {self.name!r}" if self.name else ""

    # ------------------------------------------------------------------ update
    def _as_batch(self, grad, mask, unit: str, feature_dim: int):
        """Validate and view ``grad`` as (B, T, d) and ``mask`` as (B, T) bool or None."""
        w = self._where()
        if not isinstance(grad, torch.Tensor):
            raise FusedStatsError(f"grad{w} must be a torch.Tensor, got {type(grad).__name__}")
        if not grad.is_floating_point():
            raise FusedStatsError(f"grad{w} must be a floating-point tensor, got dtype {grad.dtype}")
        if grad.device.type == "meta":  # shapes only: there are no values to accumulate
            raise FusedStatsError(
                f"grad{w} is on the meta device (shape {tuple(grad.shape)}, no data); expected a "
                f"tensor on {self.device or 'a real device'}")
        if unit not in UNITS:
            raise FusedStatsError(f"unit must be one of {UNITS}, got {unit!r}")
        if self.unit is not None and unit != self.unit:
            raise FusedStatsError(f"this accumulator{w} was fed unit={self.unit!r}; got unit={unit!r}")
        if self.device is not None and grad.device != self.device:
            raise FusedStatsError(f"grad{w} is on {grad.device}, the accumulator on {self.device}")
        if unit == "flat":
            if grad.dim() < 1:
                raise FusedStatsError(f"grad{w} needs a batch dimension, got shape {tuple(grad.shape)}")
            size = math.prod(grad.shape[1:])
            if size != self.dim:
                raise FusedStatsError(
                    f"unit='flat'{w}: one sample of shape {tuple(grad.shape[1:])} has {size} "
                    f"elements, expected dim={self.dim} (grad shape {tuple(grad.shape)})")
            if mask is not None:
                raise FusedStatsError(f"unit='flat'{w} takes no mask (got shape {tuple(mask.shape)})")
            return grad.reshape(grad.shape[0], 1, self.dim), None
        if grad.dim() < 2:
            raise FusedStatsError(
                f"grad{w} must have shape (B, d) or (B, *positions, d), got {tuple(grad.shape)}")
        if not isinstance(feature_dim, int) or isinstance(feature_dim, bool):
            raise FusedStatsError(f"feature_dim must be an int, got {feature_dim!r}")
        fd = feature_dim if feature_dim >= 0 else grad.dim() + feature_dim
        if not 1 <= fd < grad.dim():
            raise FusedStatsError(
                f"feature_dim={feature_dim} is not a non-batch dimension of grad{w} with shape "
                f"{tuple(grad.shape)}")
        if grad.shape[fd] != self.dim:
            raise FusedStatsError(
                f"grad{w} has {grad.shape[fd]} features on dim {feature_dim} (shape "
                f"{tuple(grad.shape)}, dtype {grad.dtype}); expected dim={self.dim}")
        g = grad.movedim(fd, -1)
        positions = tuple(g.shape[1:-1])
        B = g.shape[0]
        g = g.reshape(B, math.prod(positions), self.dim)  # not -1: B or a position may be 0
        if mask is None:
            return g, None
        if not isinstance(mask, torch.Tensor):
            raise FusedStatsError(f"mask{w} must be a torch.Tensor, got {type(mask).__name__}")
        if mask.device != grad.device:
            raise FusedStatsError(f"mask{w} is on {mask.device}, grad on {grad.device}")
        if tuple(mask.shape) == (B,):
            m = mask.reshape(B, 1).expand(B, g.shape[1])
        elif tuple(mask.shape) == (B, *positions):
            m = mask.reshape(B, g.shape[1])
        else:
            raise FusedStatsError(
                f"mask{w} has shape {tuple(mask.shape)}; expected "
                f"{f'{(B, *positions)} or ' if positions else ''}{(B,)} "
                f"for grad of shape {tuple(grad.shape)} with feature_dim={feature_dim}")
        if m.dtype != torch.bool:
            if m.is_floating_point() and not torch.isfinite(m).all():
                raise FusedStatsError(f"mask{w} contains NaN/Inf")
            m = m != 0
        return g, m

    def update(self, grad: torch.Tensor, mask: torch.Tensor | None = None, unit: str = "sample",
               feature_dim: int = -1) -> None:
        """Fold one batch into the state.

        ``grad``: (B, d), (B, *positions, d) or, with ``feature_dim``, e.g. NCHW with
        ``feature_dim=1``. ``mask``: (B, *positions) or (B,), nonzero = counted. ``unit``:
        ``"sample"`` sums each sample's counted positions into one ``q``; ``"position"`` makes each
        counted position a sample; ``"flat"`` flattens each sample to one vector of size ``dim``.
        A rejected batch (error or ``nonfinite="skip"``) leaves the state unchanged.
        Equivalent to ``commit(prepare(...))``.
        """
        self.commit(self.prepare(grad, mask, unit, feature_dim))

    def prepare(self, grad: torch.Tensor, mask: torch.Tensor | None = None, unit: str = "sample",
                feature_dim: int = -1) -> PreparedBatch:
        """Validate and reduce a batch without changing the state.

        Raises :class:`FusedStatsError` for anything :meth:`commit` could not take (shapes, dtype,
        device, pool capacity); a non-finite batch comes back with ``finite=False`` and is handled
        by :meth:`commit` according to ``nonfinite``. Several accumulators (the points of a probe)
        can thus all be prepared before any of them is committed: all or nothing.
        """
        g, m = self._as_batch(grad, mask, unit, feature_dim)
        op_unit = "sample" if unit == "flat" else unit
        empty = PreparedBatch(unit=unit, base_n=self.n, centre=None, batch=None, finite=True)
        if g.shape[0] == 0 or g.shape[1] == 0:
            return empty
        if self.centre is None:
            first = ops.capture_reduce(g, m, torch.zeros(self.dim, dtype=F64, device=g.device),
                                       op_unit, self.backend)
            if first.n == 0:
                return empty
            if not sums_finite(first):
                return PreparedBatch(unit, self.n, None, first, finite=False)
            centre = first.s / first.n
            if g.dtype != F64:  # exactly representable for the fp32 kernels (exact subtraction)
                centre = centre.to(torch.float32).to(F64)
        else:
            centre = self.centre
        batch = ops.capture_reduce(g, m, centre, op_unit, self.backend)
        if batch.n == 0:
            return empty
        if not sums_finite(batch):
            return PreparedBatch(unit, self.n, centre, batch, finite=False)
        limit = self.pool_limit
        if self.second_moment == "pool" and limit is not None and self.n + batch.n > limit:
            raise FusedStatsError(
                f"pool{self._where()} holds {self.n} samples; {batch.n} more exceed "
                f"pool_capacity={limit}. Use second_moment='auto' or 'dense', or a larger capacity")
        return PreparedBatch(unit, self.n, centre, batch, finite=True)

    def commit(self, prepared: PreparedBatch) -> None:
        """Fold a batch returned by :meth:`prepare` (on this accumulator, with no update between)."""
        if prepared.base_n != self.n:
            raise FusedStatsError(
                f"stale prepared batch{self._where()}: prepared at n={prepared.base_n}, the state "
                f"now has n={self.n}; prepare it again")
        batch = prepared.batch
        if batch is None or batch.n == 0:
            return
        if not prepared.finite:
            if self.nonfinite == "skip":
                self.skipped_batches += 1
                return
            raise FusedStatsError(
                f"non-finite gradient (NaN or Inf, or so large that |y|^4 overflows){self._where()} "
                f"in a batch of {batch.n} samples; "
                "nothing was accumulated. Pass nonfinite='skip' to skip such batches and count them")
        # ---- nothing below rejects the batch. The second moment goes first: it is the part that
        # allocates and runs kernels, so if it fails (e.g. out of memory) the sums still agree
        if self.centre is None:
            self._init_state(prepared.centre)
        self._add_second_moment(batch.n, rows=batch.valid_rows() if self.mode == "pool" else batch.rows)
        self.unit = prepared.unit
        self._add_sums(batch)

    def _add_sums(self, part) -> None:
        """Add the centred sums of ``part`` (a batch, or a state at this centre): all of them are
        plain sums, and ``max |q|`` a maximum."""
        self.n += part.n
        self.s += part.s
        self.t += part.t
        self.a1 += part.a1
        self.a2 += part.a2
        self.norm_sum += part.norm_sum
        torch.maximum(self.norm_max, part.norm_max, out=self.norm_max)

    def _add_second_moment(self, count: int, rows: torch.Tensor | None = None,
                           dense: torch.Tensor | None = None) -> None:
        """Add ``count`` samples' ``rows`` (centred at this centre) or another dense ``S`` to the
        second moment, before ``n`` grows; ``auto`` turns dense when the pool would pass its limit.
        New tensors are built completely before any attribute is assigned."""
        if self.mode == "dense":
            if rows is not None:
                ops.second_moment_update(self.S, rows, self.backend)
            else:
                self.S += dense
            return
        limit = self.pool_limit
        if rows is None or (self.second_moment == "auto" and limit is not None
                            and self.n + count > limit):
            S = self._dense_from_pool()
            if rows is not None:
                ops.second_moment_update(S, rows, self.backend)
            else:
                S += dense
            self.S, self.pool, self.gram, self.mode = S, None, None, "dense"
            return
        self.pool, self.gram = self._appended(rows)

    def _appended(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool and its Gram matrix with ``rows`` appended (new tensors; state untouched)."""
        cross = ops.gram_rows(rows, self.pool, self.backend)  # (B, N)
        inner = ops.gram_rows(rows, rows, self.backend)  # (B, B)
        N, B = self.pool.shape[0], rows.shape[0]
        gram = torch.empty(N + B, N + B, dtype=F64, device=self.gram.device)
        gram[:N, :N] = self.gram
        gram[N:, :N] = cross
        gram[:N, N:] = cross.T
        gram[N:, N:] = inner
        return torch.cat([self.pool, rows.to(F64)], dim=0), gram

    def _dense_from_pool(self) -> torch.Tensor:
        S = torch.zeros(self.dim, self.dim, dtype=F64, device=self.device)
        ops.second_moment_update(S, self.pool, self.backend)
        return S

    def _to_dense(self) -> None:
        S = self._dense_from_pool()
        self.S, self.pool, self.gram, self.mode = S, None, None, "dense"

    # ------------------------------------------------------------------ centring
    def _moved_sums(self, delta: torch.Tensor):
        """``(t', A1', A2')`` after moving the centre by ``delta`` (module docstring)."""
        n, s, a1 = self.n, self.s, self.a1.item()
        dd = float(delta @ delta)
        ds = float(delta @ s)
        if self.mode == "dense":
            S_delta = self.S @ delta
            dSd = float(delta @ S_delta)
        else:
            u = self.pool @ delta
            S_delta = self.pool.T @ u
            dSd = float(u @ u)
        t_new = self.t - 2 * S_delta - a1 * delta + dd * s + 2 * ds * delta - n * dd * delta
        a1_new = a1 - 2 * ds + n * dd
        a2_new = (self.a2.item() - 4 * float(delta @ self.t) + 4 * dSd + 2 * dd * a1
                  - 4 * dd * ds + n * dd * dd)
        return t_new, a1_new, a2_new

    def _moved_second_moment(self, delta: torch.Tensor) -> torch.Tensor:
        """``S'`` (dense) or ``G'`` (pool) after moving the centre by ``delta``."""
        if self.mode == "dense":
            s, n = self.s, self.n
            return (self.S - torch.outer(delta, s) - torch.outer(s, delta)
                    + n * torch.outer(delta, delta))
        u = self.pool @ delta
        return self.gram - u[:, None] - u[None, :] + float(delta @ delta)

    def _recentre(self, new_centre: torch.Tensor) -> None:
        """Move the stored state to ``new_centre`` in place (used by merge and all-reduce)."""
        new_centre = new_centre.to(device=self.device, dtype=F64)
        delta = new_centre - self.centre
        t, a1, a2 = self._moved_sums(delta)
        moved = self._moved_second_moment(delta)
        if self.mode == "dense":
            self.S = moved
        else:
            self.gram = moved
            self.pool = self.pool - delta
        self.t = t
        self.a1 = torch.tensor(a1, dtype=F64, device=self.device)
        self.a2 = torch.tensor(a2, dtype=F64, device=self.device)
        self.s = self.s - self.n * delta
        self.centre = new_centre.clone()

    # ------------------------------------------------------------------ results
    def estimate(self) -> Estimate:
        """Unbiased fp64 estimates (see :mod:`fused_stats.accumulators.estimators`); needs n >= 4."""
        if self.n < 4:
            raise FusedStatsError(
                f"estimate(){self._where()} needs at least 4 samples (degree-4 U-statistics), "
                f"have n={self.n}")
        delta = self.s / self.n
        t, a1, a2 = self._moved_sums(delta)
        moved = self._moved_second_moment(delta)  # S' (d x d) or G' (N x N): tr(S'^2) = |.|_F^2
        mean = self.centre + delta
        if self.mode == "dense":
            beta = float(mean @ (moved @ mean))
        else:
            beta = float(((self.pool - delta) @ mean).square().sum())
        return finalize(
            n=self.n, dim=self.dim, kappa=float(mean @ mean), a1=a1, a2=a2,
            F=float(moved.square().sum()), beta=beta, tau=float(mean @ t),
            ag_max=self.norm_max.item(), ag_sum=self.norm_sum.item())

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
        return (f"accumulator{self._where()} holds no sample pool (mode={self.mode!r}, n={self.n}); "
                "use second_moment='pool', or 'auto' with fewer samples than its switch point "
                f"({self.pool_limit})")

    # ------------------------------------------------------------------ merging
    def _check_compatible(self, other: "GradStats") -> None:
        if not isinstance(other, GradStats):
            raise FusedStatsError(f"can only merge a GradStats, got {type(other).__name__}")
        if other.dim != self.dim:
            raise FusedStatsError(f"cannot merge dim={other.dim} into dim={self.dim}{self._where()}")
        if self.unit and other.unit and self.unit != other.unit:
            raise FusedStatsError(f"cannot merge unit={other.unit!r} into unit={self.unit!r}")
        if self.device is not None and other.device is not None and self.device != other.device:
            raise FusedStatsError(
                f"cannot merge state on {other.device} into state on {self.device}{self._where()}")
        if self.second_moment == "pool" and other.n and other.mode == "dense":
            raise FusedStatsError("cannot merge a dense accumulator into a second_moment='pool' one")

    def merge(self, other: "GradStats") -> "GradStats":
        """Add ``other``'s samples to this accumulator (exact; ``other`` is not modified)."""
        self._check_compatible(other)
        if other.n == 0:
            self.skipped_batches += other.skipped_batches
            return self
        if self.second_moment == "pool" and self.pool_limit is not None \
                and self.n + other.n > self.pool_limit:
            raise FusedStatsError(
                f"merge would put {self.n + other.n} samples ({self.n} + {other.n}) in the "
                f"pool{self._where()} of capacity {self.pool_limit}")
        theirs = other.copy()
        if self.n == 0:
            skipped = self.skipped_batches
            self._adopt(theirs)
            limit = self.pool_limit
            # the adopted state keeps THIS accumulator's representation rules: a pool too large for
            # 'auto' (or any pool for 'dense') is folded into S at once
            if self.mode == "pool" and (self.second_moment == "dense" or (
                    self.second_moment == "auto" and limit is not None and self.n > limit)):
                self._to_dense()
            self.skipped_batches += skipped
            return self
        theirs._recentre(self.centre)
        # second moment first (allocations, kernels), then the sums: see commit()
        if theirs.mode == "pool":
            self._add_second_moment(theirs.n, rows=theirs.pool)
        else:
            self._add_second_moment(theirs.n, dense=theirs.S)
        self._add_sums(theirs)
        self.skipped_batches += theirs.skipped_batches
        return self

    def _adopt(self, other: "GradStats") -> None:
        for key in ("n", "mode", "centre", "s", "t", "a1", "a2", "norm_max", "norm_sum", "S",
                    "pool", "gram", "unit", "device", "skipped_batches"):
            setattr(self, key, getattr(other, key))

    def copy(self) -> "GradStats":
        out = GradStats(self.dim, self.second_moment, self.pool_capacity, self.device,
                        self.backend, self.nonfinite, self.name)
        out._adopt(self)
        for key in ("centre", "s", "t", "a1", "a2", "norm_max", "norm_sum", "S", "pool", "gram"):
            value = getattr(self, key)
            setattr(out, key, None if value is None else value.clone())
        return out

    def all_reduce(self, group=None) -> "GradStats":
        """Sum this accumulator over the ranks of ``group`` (see :mod:`fused_stats.accumulators.distributed`)."""
        from .distributed import all_reduce_grad_stats

        all_reduce_grad_stats(self, group)
        return self

    # ------------------------------------------------------------------ persistence
    def save(self, path) -> None:
        """Write the state atomically to ``path`` (safetensors, versioned and checksummed)."""
        from .persistence import save_grad_stats

        save_grad_stats(self, path)

    @classmethod
    def load(cls, path, device=None, backend: str = "auto") -> "GradStats":
        """Read a state written by :meth:`save`; never executes code from the file."""
        from .persistence import load_grad_stats

        return load_grad_stats(path, device=device, backend=backend)
