"""All-reduce of a whole probe over ``torch.distributed`` (data-parallel probing).

Each rank runs the same probe on its own share of the batches; :func:`all_reduce_probe` then
replaces, on every rank, each point's train and test accumulators by their merge over all ranks
(:func:`fused_stats.accumulators.distributed.all_reduce_grad_stats`: common centre broadcast from
the lowest rank with data, exact recentring, SUM of the centred sums, MAX of ``max |q|``, pools
all-gathered), and sums the probe's step counters. With ``cross=`` the cross-gradient statistics
of every point and stream are reduced too
(:func:`fused_stats.accumulators.distributed.all_reduce_cross_stats`: a SUM of ``n``, ``Σ c_i``,
``Σ |c_i|_F²``, the tuple sums and counts, after checking that every rank probes the same block).
Afterwards every rank reports the statistics of the full data set (``probe.report()``,
``probe.saturation(point)``), exactly as one process fed every rank's batches would.

A :class:`~fused_stats.Probe` creates a point's accumulators at its first step, so a rank that saw
no batch of a stream has none. Before reducing, the ranks exchange, for every (stream, point) of
``probe.points``, the dimension of its GradStats and of its CrossStats (and the dtype of the
latter's ``W_in``); a rank lacking an accumulator that another rank has creates an empty one
through the probe's own factories (``Probe._new_accumulator``, ``Probe._new_cross_accumulator``:
same settings and names as the probe's), so that every rank takes part in every reduce. A rank
whose probe has no ``cross=`` while another holds cross statistics is an error on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..accumulators import GradStats
from ..accumulators.distributed import (_require_initialised, all_reduce_many, comm_device,
                                         names_digest, tensor_digest)
from ..errors import FusedStatsError
from .checkpoint import (CROSS_STREAMS, STREAMS, _probe_device, probe_accumulators,
                         probe_cross_accumulators)

# W_in dtype codes exchanged between ranks (0: no cross accumulator)
_W_DTYPES = {torch.float32: 1, torch.float64: 2}


def _new_accumulator(probe, stream: str, name: str, dim: int) -> GradStats:
    """An empty GradStats made as ``probe`` makes its own.

    A :class:`~fused_stats.Probe` has the factory; a probe-shaped stand-in (e.g. the copies a
    MonitorLog reduces) borrows the Probe's with its own ``second_moment``/``pool_capacity``/
    ``backend`` attributes, so the settings and naming live in one place."""
    factory = getattr(probe, "_new_accumulator", None)
    if factory is None:
        from .probe import Probe

        return Probe._new_accumulator(probe, stream, name, dim)
    return factory(stream, name, dim)


def _new_cross_accumulator(probe, stream: str, name: str, dim: int, dtype, device):
    factory = getattr(probe, "_new_cross_accumulator", None)
    if factory is None:
        from .probe import Probe

        return Probe._new_cross_accumulator(probe, stream, name, dim, dtype, device)
    return factory(stream, name, dim, dtype, device)


def _gather(row: list[int], group, device) -> torch.Tensor:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    return torch.stack(table).cpu()


def _check_points(points: list[str], group, device) -> None:
    # before any collective whose size depends on the points: unequal sizes would hang, not fail
    table = _gather([names_digest(points), len(points)], group, device)
    if bool((table != table[0]).any()):
        raise FusedStatsError(
            f"all_reduce_probe: ranks probe different points (counts by rank {table[:, 1].tolist()}); "
            f"this rank has different sets of accumulators at points {points}")


def _fill_missing(probe, group, device) -> None:
    points = list(getattr(probe, "points", None) or [])
    _check_points(points, group, device)
    if not points:
        return
    keys = [(stream, name) for stream in STREAMS for name in points]
    accs = probe_accumulators(probe)
    cross = probe_cross_accumulators(probe)
    has_spec = getattr(probe, "cross", None) is not None
    # one row per rank: [has cross=, then per key: GradStats dim, CrossStats dim, W_in dtype code,
    # digest of (activation, W_in)]; the block is compared here, before any accumulator is reduced,
    # so a mismatch at a later point cannot leave earlier points already reduced
    row = [int(has_spec)]
    for key in keys:
        c = cross.get(key)
        if c is not None and c.w_in.dtype not in _W_DTYPES:
            raise FusedStatsError(f"all_reduce_probe: cross statistics at {key[1]!r} ({key[0]}) have "
                                  f"W_in of dtype {c.w_in.dtype}; expected float32 or float64")
        row += [accs[key].dim if key in accs else 0, 0 if c is None else c.dim,
                0 if c is None else _W_DTYPES[c.w_in.dtype],
                0 if c is None else names_digest([c.activation, str(tensor_digest(c.w_in))])]
    table = _gather(row, group, device)
    specs = table[:, 0].tolist()
    new = []
    for index, (stream, name) in enumerate(keys):
        grad_col, cross_col, dtype_col, block_col = (table[:, 1 + 4 * index + k] for k in range(4))
        dims = {int(v) for v in grad_col if v > 0}
        if len(dims) > 1:
            raise FusedStatsError(
                f"all_reduce_probe: point {name!r} ({stream}) has dim {grad_col.tolist()} "
                "by rank (0 = no accumulator)")
        if dims and (stream, name) not in accs:
            new.append(("grad", stream, name, dims.pop(), None))
        cdims = {int(v) for v in cross_col if v > 0}
        if not cdims:
            continue
        codes = {int(v) for v in dtype_col if v > 0}
        blocks = [int(v) for v in block_col if v > 0]
        if len(cdims) > 1 or len(codes) > 1 or len(set(blocks)) > 1 or not all(specs):
            first: dict = {}
            groups = [first.setdefault(int(v), len(first)) if v > 0 else None for v in block_col]
            raise FusedStatsError(
                f"all_reduce_probe: cross statistics at point {name!r} ({stream}) differ between "
                f"ranks: dim {cross_col.tolist()}, W_in dtype code {dtype_col.tolist()} "
                f"(1 float32, 2 float64, 0 none), block (activation, W_in) groups {groups}, probe "
                f"built with cross= {[bool(s) for s in specs]} (by rank)")
        if (stream, name) not in cross:
            dtype = {code: dt for dt, code in _W_DTYPES.items()}[codes.pop()]
            new.append(("cross", stream, name, cdims.pop(), dtype))
    # ---- every rank agreed: create the missing (empty) accumulators
    if new:
        state_device = _probe_device(probe) or torch.device("cpu")
    for kind, stream, name, dim, dtype in new:
        if kind == "grad":
            getattr(probe, STREAMS[stream])[name] = _new_accumulator(probe, stream, name, dim)
            if isinstance(getattr(probe, "dims", None), dict):
                probe.dims.setdefault(name, dim)
        else:
            getattr(probe, CROSS_STREAMS[stream])[name] = _new_cross_accumulator(
                probe, stream, name, dim, dtype, state_device)


def _sum_counters(probe, group, device) -> None:
    tables = [getattr(probe, attr, None) for attr in ("steps", "skipped_steps")]
    tables = [t for t in tables if isinstance(t, dict)]
    if not tables:
        return
    values = torch.tensor([int(t.get(stream, 0)) for t in tables for stream in STREAMS],
                          dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    values = values.cpu().tolist()
    for i, t in enumerate(tables):
        for j, stream in enumerate(STREAMS):
            t[stream] = values[i * len(STREAMS) + j]


def all_reduce_probe(probe, group=None):
    """Sum every accumulator of ``probe`` (``stats`` and ``test_stats`` and, with ``cross=``,
    ``cross_stats`` and ``test_cross_stats``) over ``group``; a collective.

    All ranks must probe the same points (and the same cross block); a mismatch raises
    :class:`~fused_stats.FusedStatsError` on every rank. ``probe.steps`` and
    ``probe.skipped_steps`` become the totals over the ranks. Returns ``probe``.
    """
    _require_initialised()
    accs = probe_accumulators(probe)
    some = next(iter(accs.values()), None)
    device = comm_device(group, None if some is None else some.device)
    _fill_missing(probe, group, device)
    named = {f"{stream}/{name}": acc for (stream, name), acc in probe_accumulators(probe).items()}
    named.update({f"cross/{stream}/{name}": acc
                  for (stream, name), acc in probe_cross_accumulators(probe).items()})
    all_reduce_many(named, group)
    _sum_counters(probe, group, device)
    return probe
