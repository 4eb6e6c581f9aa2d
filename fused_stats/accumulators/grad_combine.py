"""Combining GradStats states: merge and all-reduce bring them to one centre and one representation.

Every sum of a GradStats is taken about its centre ``c``, so two states add only once both are moved
to one centre (:func:`~fused_stats.accumulators.centre_shift.shift`, exact) and held in the
representation one accumulator fed every sample would end in (dense once any part turned dense or
the total passes ``auto``'s switch point; pool -> dense by ``S = YᵀY``). Merge moves the other state
to this centre; all-reduce broadcasts the centre of the lowest rank with data and every rank moves
there, after the ranks' settings rows are compared (:class:`GradStatsCombine`, a mixin of
:class:`~fused_stats.accumulators.grad_stats.GradStats`).
"""

from __future__ import annotations

import torch

from .. import ops
from .base import IncompatibleStates
from .centre_shift import shift
from .grad_options import SECOND_MOMENTS, UNITS

F64 = torch.float64
__all__ = ["GradStatsCombine"]


class GradStatsCombine:
    """The alignment hooks of merge and all-reduce of :class:`GradStats` (module docstring)."""

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
