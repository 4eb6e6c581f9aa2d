"""Several GradStats fed at once: the points of a probe, one batch each, with batched calls.

:class:`StackedGradUpdates` is the part of :class:`~fused_stats.accumulators.grad_stats.GradStats`
that prepares and commits P accumulators' batches together. Unmasked ``unit="sample"`` batches of
one shape are stacked (P, B, d) and reduced by ``ops.capture_reduce_stacked`` with one finiteness
read; the plain sums ``(s, t, A1, A2, Σ|q|)`` are added by one foreach call (the same bits as one
by one) and the dense second moments ``S += YᵀY`` by one batched product where every state is
dense (the same products, summed in that product's order: S may differ in the last bits). Anything
else falls back to one :meth:`prepare` / :meth:`commit` per accumulator.
"""

from __future__ import annotations

import torch

from .. import ops
from ..contracts import all_finite
from ..errors import FusedStatsError
from .base import Prepared, StackedPrepared

__all__ = ["StackedGradUpdates"]


class StackedGradUpdates:
    """``prepare_many`` / ``commit_many`` of :class:`GradStats` (module docstring); a mixin that
    uses the accumulator's own ``_as_batch``, ``_check_pool_room``, ``_init_state``,
    ``_add_second_moment`` and ``_add_parts``."""

    @classmethod
    def prepare_many(
        cls, accumulators, grads, masks=None, unit: str = "sample", feature_dims=None
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
        cls, accumulators, grads: torch.Tensor, unit: str = "sample"
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
