"""Several CrossStats fed at once: the points of a probe, one batch each, with batched calls.

:class:`StackedCrossUpdates` is the part of
:class:`~fused_stats.accumulators.cross_stats.CrossStats` that prepares and commits P accumulators'
batches together. Unmasked ``unit="sample"`` batches of one shape, with projections of one dtype,
activation, width, group size, backend and device, are stacked (P, B, T, ·) and reduced by
``ops.cross_reduce_stacked`` (the ghost form, the whole batch one group) with one finiteness read;
batches of more than one sample each are then added by one foreach call (the same bits as one by
one: every entry is a plain sum). Anything else, and single-sample batches (which pair with the
previous one), go through one :meth:`prepare` / :meth:`commit` per accumulator.
"""

from __future__ import annotations

import torch

from .. import ops
from ..contracts import all_finite, tuple_counts
from ..errors import FusedStatsError
from .base import Prepared, StackedPrepared

__all__ = ["StackedCrossUpdates"]


class StackedCrossUpdates:
    """``prepare_many`` / ``commit_many`` of :class:`CrossStats` (module docstring); a mixin that
    uses the accumulator's own ``_checked``, ``prepare`` and ``commit``."""

    @classmethod
    def prepare_many(
        cls, accumulators, grads, acts, masks=None, unit: str = "sample"
    ) -> list[Prepared] | StackedPrepared | None:
        """:meth:`prepare` for several accumulators at once (the points of a probe), each with its
        own batch; nothing changes. ``grads``, ``acts`` lists (``masks`` a list or None for none)
        give a list of :class:`Prepared`: batches of one shape, unmasked, share batched calls
        where they apply, any other mix is prepared one accumulator at a time. ``grads`` (P, B,
        T, d) and ``acts`` (P, B, T, d_in) tensors (one unmasked batch per accumulator) give one
        :class:`StackedPrepared` for :meth:`commit_many`, or None where the batched calls do not
        apply (:meth:`_prepare_stacked`)."""
        accs = list(accumulators)
        if isinstance(grads, torch.Tensor):
            if masks is not None:
                raise FusedStatsError("prepare_many: a stacked batch (P, B, T, d) takes no masks")
            return cls._prepare_stacked(accs, grads, acts, unit)
        masks = [None] * len(accs) if masks is None else list(masks)
        if any(acc.w_in is None for acc in accs):
            return [acc.prepare(g, a, m, unit=unit) for acc, g, a, m in zip(accs, grads, acts, masks)]
        checked = [acc._checked(g, a, m, unit) for acc, g, a, m in zip(accs, grads, acts, masks)]
        if len(accs) > 1 and all(m is None for m in masks):
            g0, a0 = checked[0]
            if all(
                g.shape == g0.shape and a.shape == a0.shape and g.dtype == g0.dtype and a.dtype == a0.dtype
                for g, a in checked
            ):
                stacked = cls._prepare_stacked(
                    accs, torch.stack([g for g, _ in checked]), torch.stack([a for _, a in checked]), unit
                )
                if stacked is not None:
                    return cls._split_stacked(accs, stacked)
        return [acc.prepare(g, a, m, unit=unit) for acc, (g, a), m in zip(accs, checked, masks)]

    def _stack_key(self) -> tuple:
        """What must agree for the batches of several accumulators to share batched calls."""
        return (self._dtype, self.activation, self.group_size, self.rank, self.backend, self.device)

    @classmethod
    def _prepare_stacked(
        cls, accumulators, grads: torch.Tensor, acts: torch.Tensor, unit: str = "sample"
    ) -> StackedPrepared | None:
        """The batches ``grads[i]`` (B, T, d) and ``acts[i]`` (B, T, d_in) of P accumulators,
        stacked as (P, B, T, ·), unmasked, reduced by one set of batched calls
        (``ops.cross_reduce_stacked``: ``unit="sample"`` in the ghost form with the whole batch one
        group, torch path) with one finiteness read for all; nothing changes. None where that
        does not apply (or for a batch :meth:`prepare` would refuse: it then says why)."""
        accs = list(accumulators)
        if any(acc.w_in is None for acc in accs):
            return None
        if unit != "sample" or grads.dim() != 4 or acts.dim() != 4 or grads.shape[0] != len(accs) or not accs:
            return None
        _, B, T, d = grads.shape
        first = accs[0]
        key = first._stack_key()
        if (
            not (B and T)
            or acts.shape[1:3] != grads.shape[1:3]
            or not (grads.is_floating_point() and acts.is_floating_point())
            or grads.device != first.device
            or acts.device != first.device
            or not ops.cross_stacks(B, T, d, first.rank, unit, first.group_size)
        ):
            return None
        for acc in accs:
            if (
                acc.dim != d
                or acc.in_dim != acts.shape[3]
                or acc.unit not in (None, unit)
                or acc._stack_key() != key
            ):
                return None
        out = ops.cross_reduce_stacked(
            grads, acts, torch.stack([acc.w_in for acc in accs]), first.activation, first.backend
        )
        if out is None:
            return None
        c_sum, sums, n = out
        if all_finite(sums, c_sum):
            finite = [True] * len(accs)
        else:
            finite = (torch.isfinite(sums).all(dim=1) & torch.isfinite(c_sum).flatten(1).all(dim=1)).tolist()
        return StackedPrepared(unit, tuple(acc.n for acc in accs), finite, (c_sum, sums, n))

    @staticmethod
    def _stacked_parts(stacked: StackedPrepared):
        """Per accumulator: ``c_sum``, ``sq_norm_sum``, ``(u2, u3, u4)`` as views of the stack."""
        c_sum, sums, _ = stacked.tensors
        return c_sum.unbind(0), sums[:, 0].unbind(0), sums[:, 1:].unbind(0)

    @classmethod
    def _split_stacked(cls, accs, stacked: StackedPrepared) -> list[Prepared]:
        """Per-accumulator :class:`Prepared` from :meth:`_prepare_stacked`."""
        n = stacked.tensors[2]
        p2, p3, p4 = tuple_counts(n)
        return [
            Prepared(
                unit=stacked.unit,
                base_n=base,
                batch=ops.CrossBatch(
                    n=n, c_sum=c, sq_norm_sum=sq, u2=u[0], u3=u[1], u4=u[2], p2=p2, p3=p3, p4=p4, u=u
                ),
                finite=ok,
            )
            for base, ok, c, sq, u in zip(stacked.base_n, stacked.finite, *cls._stacked_parts(stacked))
        ]

    @classmethod
    def commit_many(cls, accumulators, prepared) -> None:
        """:meth:`commit` of several accumulators' batches (the points of a probe): ``prepared``
        a list of :class:`Prepared` or one :class:`StackedPrepared` of :meth:`prepare_many`.
        Folded together (:meth:`_fold_together`) where every batch holds more than one sample (no
        single-sample pairing) and is one ``commit`` would fold; otherwise one by one (a stale or
        non-finite batch goes through ``commit``, which refuses or skips it)."""
        accs = list(accumulators)
        if isinstance(prepared, StackedPrepared):
            cls._commit_stacked(accs, prepared)
            return
        prepared = list(prepared)
        if (
            len(accs) < 2
            or not cls._all_fold(accs, prepared, [a.device for a in accs])
            or not all(p.batch.n > 1 for p in prepared)
        ):
            super().commit_many(accs, prepared)
            return
        batches = [p.batch for p in prepared]
        cls._fold_together(
            accs,
            prepared[0].unit,
            [b.n for b in batches],
            [(b.p2, b.p3, b.p4) for b in batches],
            [b.c_sum for b in batches],
            [b.sq_norm_sum for b in batches],
            [b.u if b.u is not None else torch.stack([b.u2, b.u3, b.u4]) for b in batches],
        )

    @classmethod
    def _commit_stacked(cls, accs, stacked: StackedPrepared) -> None:
        """:meth:`commit_many` of the batches of :meth:`_prepare_stacked`."""
        n = stacked.tensors[2]
        if n < 2 or not stacked.folds_into(accs):
            cls.commit_many(accs, cls._split_stacked(accs, stacked))
            return
        P = len(accs)
        cls._fold_together(accs, stacked.unit, [n] * P, [tuple_counts(n)] * P, *cls._stacked_parts(stacked))

    @staticmethod
    def _fold_together(accs, unit, sizes, counts, c_sums, sq_sums, u_sums) -> None:
        """Add batches of ``sizes[i]`` > 1 samples (tuple counts ``counts[i] = (p2, p3, p4)``, tuple
        sums ``u_sums[i] = (u2, u3, u4)``), each one
        ``commit`` would fold, by one foreach call (the same bits as one by one)."""
        states, parts = [], []
        for acc, size, (p2, p3, p4), c, sq, u in zip(accs, sizes, counts, c_sums, sq_sums, u_sums):
            states += (acc.c_sum, acc.sq_norm_sum, acc.u)
            parts += (c, sq, u)
            acc.n += size
            acc.batches += 1
            acc.unit = unit
            acc.p = [acc.p[0] + p2, acc.p[1] + p3, acc.p[2] + p4]
            acc.carry = None
        torch._foreach_add_(states, parts)
