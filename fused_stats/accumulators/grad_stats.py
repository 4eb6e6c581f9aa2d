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

Moving the centre by ``δ`` is exact (:func:`shift`)::

    s' = s − nδ                 S' = S − δsᵀ − sδᵀ + nδδᵀ          A1' = A1 − 2δᵀs + n|δ|²
    t' = t − 2Sδ − A1δ + |δ|²s + 2(δᵀs)δ − n|δ|²δ
    A2' = A2 − 4δᵀt + 4δᵀSδ + 2|δ|²A1 − 4|δ|²δᵀs + n|δ|⁴

and in pool form ``Y' = Y − 1δᵀ``, ``G' = G − u1ᵀ − 1uᵀ + |δ|² 11ᵀ`` with ``u = Yδ``. Merging shifts
one state to the other's centre and adds (Chan et al.-style); with a shared centre a plain sum
(all-reduce) is a valid merge. :meth:`GradStats.estimate` shifts a copy to ``q̄`` and finalises.
The state is declared once (:attr:`GradStats.FIELDS`); copy, save/load, merge and all-reduce
derive from it (:mod:`fused_stats.accumulators.base`), the centre move being the one alignment hook.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch

from .. import ops
from ..backend import Backend, validate_backend
from ..contracts import all_finite
from ..errors import FusedStatsError
from .base import (
    NONFINITE_POLICIES,
    Accumulator,
    Field,
    IncompatibleStates,
    Nonfinite,
    Prepared,
    StackedPrepared,
    extend_gram,
)
from .batch_view import batch_view
from .estimators import Estimate, finalize

SecondMoment = Literal["auto", "dense", "pool"]
Unit = Literal["sample", "position", "flat"]
SECOND_MOMENTS: tuple[str, ...] = ("auto", "dense", "pool")
UNITS: tuple[str, ...] = ("sample", "position", "flat")
F64 = torch.float64
__all__ = ["NONFINITE_POLICIES", "SECOND_MOMENTS", "UNITS", "GradStats", "auto_pool_limit", "shift"]


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
    sums = (batch.a1, batch.a2, batch.norm_sum)
    if batch.a1.device.type == "cpu":  # three scalar reads cost fewer torch calls than one stacked check
        return all(math.isfinite(x.item()) for x in sums)
    return bool(torch.isfinite(torch.stack(sums)).all())  # one host sync


def shift(sums: Mapping, delta: torch.Tensor) -> dict:
    """The centred sums after moving their centre by ``delta`` (a pure function; new tensors).

    ``sums``: ``n``, ``s``, ``t``, ``a1``, ``a2`` and either ``S`` (dense) or ``pool`` and ``gram``
    (a pool of centred rows). With ``δ = delta`` (docs/design.md, section 2)::

        s' = s − nδ            S' = S − δsᵀ − sδᵀ + nδδᵀ            A1' = A1 − 2δᵀs + n|δ|²
        t' = t − 2Sδ − A1δ + |δ|²s + 2(δᵀs)δ − n|δ|²δ
        A2' = A2 − 4δᵀt + 4δᵀSδ + 2|δ|²A1 − 4|δ|²δᵀs + n|δ|⁴
        pool: Y' = Y − 1δᵀ,  G' = G − u1ᵀ − 1uᵀ + |δ|² 11ᵀ  with  u = Yδ

    Returns the moved ``s, t, a1, a2`` and ``S`` or ``pool, gram`` (``a1``, ``a2`` as 0-d fp64).
    """
    n, s, t = sums["n"], sums["s"], sums["t"]
    a1, a2 = float(sums["a1"]), float(sums["a2"])
    dense = sums.get("S") is not None
    dd = float(delta @ delta)
    ds = float(delta @ s)
    if dense:
        S = sums["S"]
        S_delta = S @ delta
        dSd = float(delta @ S_delta)
    else:
        pool = sums["pool"]
        u = pool @ delta
        S_delta = pool.T @ u
        dSd = float(u @ u)
    out = {
        "s": s - n * delta,
        "t": t - 2 * S_delta - a1 * delta + dd * s + 2 * ds * delta - n * dd * delta,
        "a1": torch.tensor(a1 - 2 * ds + n * dd, dtype=F64, device=s.device),
        "a2": torch.tensor(
            a2 - 4 * float(delta @ t) + 4 * dSd + 2 * dd * a1 - 4 * dd * ds + n * dd * dd,
            dtype=F64,
            device=s.device,
        ),
    }
    if dense:
        # one new (d, d) tensor updated by three rank-one additions (no d x d temporaries)
        moved = S.clone()
        moved.addr_(delta, s, alpha=-1).addr_(s, delta, alpha=-1).addr_(delta, delta, alpha=n)
        out["S"] = moved
    else:
        out["pool"] = pool - delta
        out["gram"] = sums["gram"] - u[:, None] - u[None, :] + dd
    return out


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


class GradStats(Accumulator):
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

    @classmethod
    def prepare_many(
        cls, accumulators, grads, masks=None, unit: Unit = "sample", feature_dims=None
    ) -> list[Prepared] | StackedPrepared | None:
        """:meth:`prepare` for several accumulators at once (the points of a probe), each with its
        own batch; nothing changes. ``grads``: a list (``masks``, ``feature_dims``: lists or None
        for none / -1 each) gives a list of :class:`Prepared`; unmasked ``unit="sample"`` batches
        of one shape with one row per sample share batched calls where they apply, anything else
        is prepared one at a time. ``grads`` a (P, B, d) tensor (one batch per accumulator,
        unmasked) gives one :class:`StackedPrepared` for :meth:`commit_many`, or None where the
        batched calls do not apply (:meth:`_prepare_stacked`)."""
        accs = list(accumulators)
        if isinstance(grads, torch.Tensor):
            if masks is not None:
                raise FusedStatsError("prepare_many: a stacked batch (P, B, d) takes no masks")
            return cls._prepare_stacked(accs, grads, unit)
        masks = [None] * len(accs) if masks is None else list(masks)
        feature_dims = [-1] * len(accs) if feature_dims is None else list(feature_dims)
        if len(accs) > 1 and unit == "sample" and all(m is None for m in masks):
            views = [acc._as_batch(g, None, unit, fd) for acc, g, fd in zip(accs, grads, feature_dims)]
            g0 = views[0][0]
            if g0.shape[1] == 1 and all(g.shape == g0.shape and g.dtype == g0.dtype for g, _ in views):
                stacked = cls._prepare_stacked(accs, torch.stack([g[:, 0] for g, _ in views]), unit)
                if stacked is not None:
                    return cls._split_stacked(accs, stacked)
        return [acc.prepare(g, m, unit, fd) for acc, g, m, fd in zip(accs, grads, masks, feature_dims)]

    @classmethod
    def _prepare_stacked(
        cls, accumulators, grads: torch.Tensor, unit: Unit = "sample"
    ) -> StackedPrepared | None:
        """The batches ``grads[i]`` (B, d) of P accumulators past their first batch, stacked as
        ``grads`` (P, B, d), reduced by one set of batched calls (``ops.capture_reduce_stacked``,
        torch path), with one finiteness read for all; nothing changes. None where that does not
        apply (another unit or backend, a fresh accumulator, or a batch :meth:`prepare` would
        refuse: it then says why). A pool the batch would overfill raises, as in :meth:`prepare`."""
        accs = list(accumulators)
        if unit != "sample" or grads.dim() != 3 or grads.shape[0] != len(accs) or not accs:
            return None
        P, B, d = grads.shape
        first = accs[0]
        if not B or not grads.is_floating_point() or grads.device.type == "meta":
            return None
        for acc in accs:
            if (
                acc.centre is None
                or acc.dim != d
                or acc.device != grads.device
                or acc.unit not in (None, unit)
                or acc.backend != first.backend
            ):
                return None
        out = ops.capture_reduce_stacked(grads, torch.stack([acc.centre for acc in accs]), first.backend)
        if out is None:
            return None
        rows, st, sums = out
        # as sums_finite (a1, a2, norm_sum); norm_max <= norm_sum is finite with them
        finite = [True] * P if all_finite(sums) else torch.isfinite(sums).all(dim=1).tolist()
        for acc, ok in zip(accs, finite):
            if ok:
                acc._check_pool_room(B)
        return StackedPrepared(unit, tuple(acc.n for acc in accs), finite, (rows, st, sums))

    @staticmethod
    def _stacked_parts(stacked: StackedPrepared):
        """Per accumulator: rows (B, d) and the sums ``(s, t, a1, a2, norm_sum)``, ``norm_max``."""
        rows, st, sums = stacked.tensors
        P, _, d = rows.shape
        scalars = sums.reshape(-1).unbind(0)  # (a1, a2, norm_max, norm_sum) of each batch in turn
        vectors = st.reshape(2 * P, d).unbind(0)  # (s, t) of each batch in turn
        parts = [
            (vectors[2 * i], vectors[2 * i + 1], scalars[4 * i], scalars[4 * i + 1], scalars[4 * i + 3])
            for i in range(P)
        ]
        return rows.unbind(0), parts, scalars[2::4]

    @classmethod
    def _split_stacked(cls, accs, stacked: StackedPrepared) -> list[Prepared]:
        """Per-accumulator :class:`Prepared` from :meth:`_prepare_stacked`."""
        rows, parts, maxima = cls._stacked_parts(stacked)
        valid = torch.ones(rows[0].shape[0], dtype=torch.bool, device=rows[0].device)
        return [
            Prepared(
                stacked.unit,
                n,
                ops.BatchSums(
                    rows=y, valid=valid, n=y.shape[0], s=s, t=t, a1=a1, a2=a2, norm_max=mx, norm_sum=ns
                ),
                finite=ok,
                centre=acc.centre,
            )
            for acc, n, ok, y, (s, t, a1, a2, ns), mx in zip(
                accs, stacked.base_n, stacked.finite, rows, parts, maxima
            )
        ]

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

    @classmethod
    def commit_many(cls, accumulators, prepared) -> None:
        """:meth:`commit` of several accumulators' batches (the points of a probe): ``prepared``
        a list of :class:`Prepared` or one :class:`StackedPrepared` of :meth:`prepare_many`.
        Folded together (:meth:`_fold_together`) where every batch is one ``commit`` would fold;
        otherwise one by one (a stale or non-finite batch goes through ``commit``, which refuses
        or skips it)."""
        accs = list(accumulators)
        if isinstance(prepared, StackedPrepared):
            cls._commit_stacked(accs, prepared)
            return
        prepared = list(prepared)
        devices = [getattr(getattr(p, "centre", None), "device", None) for p in prepared]
        if len(accs) < 2 or not cls._all_fold(accs, prepared, devices):
            super().commit_many(accs, prepared)
            return
        for acc, p in zip(accs, prepared):
            if acc.centre is None:
                acc._init_state(p.centre)
        batches = [p.batch for p in prepared]
        rows = [b.valid_rows() if a.mode == "pool" else b.rows for a, b in zip(accs, batches)]
        stack = torch.stack(rows) if all(r.shape == rows[0].shape for r in rows) else None
        cls._fold_together(
            accs,
            prepared[0].unit,
            [b.n for b in batches],
            rows,
            stack,
            [(b.s, b.t, b.a1, b.a2, b.norm_sum) for b in batches],
            [b.norm_max for b in batches],
        )

    @classmethod
    def _commit_stacked(cls, accs, stacked: StackedPrepared) -> None:
        """:meth:`commit_many` of the batches of :meth:`_prepare_stacked`."""
        if not stacked.folds_into(accs):
            cls.commit_many(accs, cls._split_stacked(accs, stacked))
            return
        rows, parts, maxima = cls._stacked_parts(stacked)
        counts = [r.shape[0] for r in rows]  # every row a sample (nothing masked)
        cls._fold_together(accs, stacked.unit, counts, rows, stacked.tensors[0], parts, maxima)

    @classmethod
    def _fold_together(cls, accs, unit, counts, rows, stack, parts, maxima) -> None:
        """Add batches of ``counts[i]`` samples that ``commit`` would fold to ``accs`` (``rows[i]``
        centred at their centres, rows that are not samples exactly zero): second
        moments first, by one batched product where every state is dense and ``stack`` (P, B, d)
        holds the rows (``ops.second_moment_update_stacked``: the same products, summed in that
        product's order, so S may differ from one update each in the last bits), else one
        update each; then the plain sums ``parts[i] = (s, t, a1, a2, norm_sum)`` by one foreach
        add and ``maxima`` by one foreach maximum (the same bits as one by one). If a
        second-moment update raises, the accumulators before it are fully committed and the rest
        untouched, as with sequential commits."""
        done = 0
        if (
            stack is not None
            and all(a.mode == "dense" and a.backend == accs[0].backend for a in accs)
            and ops.second_moment_update_stacked([a._S for a in accs], stack, accs[0].backend)
        ):
            done = len(accs)
        try:
            for acc, count, r in zip(accs[done:], counts[done:], rows[done:]):
                acc._add_second_moment(count, rows=r)
                done += 1
        except BaseException:
            for acc, count, part, mx in zip(accs[:done], counts, parts, maxima):
                acc.unit = unit
                acc._add_parts(count, part, mx)
            raise
        states, sums = [], []
        for acc, count, part in zip(accs, counts, parts):
            states += (acc.s, acc.t, acc.a1, acc.a2, acc.norm_sum)
            sums += part
            acc.n += count
            acc.unit = unit
        torch._foreach_add_(states, sums)
        torch._foreach_maximum_([a.norm_max for a in accs], list(maxima))

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

    def _target_mode(self, modes_with_data, total: int) -> str:
        """The representation one accumulator fed every sample would end in: dense once any part
        turned dense (``auto`` never switches back) or the total passes the switch point."""
        if self.second_moment == "dense" or any(m == "dense" for m in modes_with_data):
            return "dense"
        limit = self.pool_limit
        if self.second_moment == "auto" and limit is not None and total > limit:
            return "dense"
        return "pool"

    def _as_mode(self, state: dict, mode: str) -> dict:
        """``state`` (a state_dict with samples) in representation ``mode`` (pool -> dense only)."""
        if state["mode"] == mode:
            return state
        S = torch.zeros(self.dim, self.dim, dtype=F64, device=state["pool"].device)
        ops.second_moment_update(S, state["pool"], self.backend)
        return dict(state, S=S, pool=None, gram=None, mode="dense")

    def _align(self, other):
        """The alignment hook of merge: ``other`` moved to this centre (:func:`shift`) and both in
        the representation the merged state takes."""
        theirs = other.state_dict()
        if other.n == 0:
            mine = self.state_dict()
            mine["skipped_batches"] += other.skipped_batches
            return mine, None, mine
        total = self.n + other.n
        modes = [m for m, k in ((self.mode, self.n), (other.mode, other.n)) if k]
        target = self._target_mode(modes, total)
        if self.n == 0:
            merged = self._as_mode(theirs, target)
            merged["skipped_batches"] += self.skipped_batches
            return merged, None, merged
        moved = shift(theirs, self.centre - other.centre)
        theirs.update(moved, centre=self.centre)
        mine = self._as_mode(self.state_dict(), target)
        theirs = self._as_mode(theirs, target)
        return mine, theirs, self._combined_counters(mine, dict(theirs, mode=target))

    def settings_row(self) -> list[int]:
        return [
            self.dim,
            self.n,
            1 if self.mode == "pool" else 0,
            SECOND_MOMENTS.index(self.second_moment),
            -1 if self.unit is None else UNITS.index(self.unit),
            -1 if self.pool_capacity is None else self.pool_capacity,
            self.skipped_batches,
        ]

    def check_settings(self, table: torch.Tensor) -> None:
        where = self._where()
        for col, what in ((0, "dim"), (3, "second_moment"), (5, "pool_capacity")):
            values = table[:, col].tolist()
            if len(set(values)) > 1:
                if col == 3:
                    values = [SECOND_MOMENTS[v] for v in values]
                raise IncompatibleStates(f"all_reduce{where}: ranks disagree on {what}: {values} (by rank)")
        units = {int(u) for u, n in zip(table[:, 4], table[:, 1]) if n > 0}
        if len(units) > 1:
            raise IncompatibleStates(
                f"all_reduce{where}: ranks were fed different units: "
                f"{[None if u < 0 else UNITS[u] for u in table[:, 4].tolist()]} (by rank)"
            )
        total = int(table[:, 1].sum())
        if self.second_moment == "pool" and self.pool_capacity is not None and total > self.pool_capacity:
            raise IncompatibleStates(
                f"all_reduce{where}: the ranks hold {table[:, 1].tolist()} samples, {total} in all, "
                f"more than pool_capacity={self.pool_capacity}. Use second_moment='auto' or 'dense'"
            )

    def _row_counts(self, table: torch.Tensor) -> list[int]:
        return [int(v) for v in table[:, 1]]

    def _reduce_start(self, table: torch.Tensor, group, device):
        """The alignment hook of all-reduce: the centre of the lowest rank with data is
        broadcast and every rank moves its sums there (:func:`shift`); an empty rank takes part
        with zeros at that centre."""
        import torch.distributed as dist

        from .distributed import global_rank

        counts = table[:, 1]
        total = int(counts.sum())
        skipped = int(table[:, 6].sum())
        if total == 0:
            return self.state_dict() | {"skipped_batches": skipped}, None
        state_device = self.device if self.device is not None else device
        modes = ["pool" if p else "dense" for p, n in zip(table[:, 2].tolist(), counts) if n > 0]
        target = self._target_mode(modes, total)
        units = [int(u) for u, n in zip(table[:, 4], counts) if n > 0]
        source = int(torch.nonzero(counts > 0)[0, 0])
        centre = (
            self.centre.to(device=device, dtype=F64, copy=True)
            if dist.get_rank(group) == source
            else torch.zeros(self.dim, dtype=F64, device=device)
        )
        dist.broadcast(centre, src=global_rank(group, source), group=group)
        centre = centre.to(state_device)
        if self.n == 0:
            d = self.dim
            zero = torch.zeros((), dtype=F64, device=state_device)
            state = {
                "n": 0,
                "mode": target,
                "unit": None,
                "skipped_batches": 0,
                "s": torch.zeros(d, dtype=F64, device=state_device),
                "t": torch.zeros(d, dtype=F64, device=state_device),
                "a1": zero,
                "a2": zero,
                "norm_max": zero,
                "norm_sum": zero,
                "S": torch.zeros(d, d, dtype=F64, device=state_device) if target == "dense" else None,
                "pool": torch.zeros(0, d, dtype=F64, device=state_device),
                "gram": torch.zeros(0, 0, dtype=F64, device=state_device),
            }
        else:
            state = self.state_dict()
            state.update(shift(state, centre - self.centre))
            state = self._as_mode(state, target)
        state["centre"] = centre
        counters = {"n": total, "mode": target, "unit": UNITS[units[0]], "skipped_batches": skipped}
        return state, counters
