"""All-reduce of a whole probe over ``torch.distributed`` (data-parallel probing).

Each rank runs the same probe on its own share of the batches; :func:`all_reduce_probe` then
replaces, on every rank, each point's train and test accumulators by their merge over all ranks
(:func:`fused_stats.accumulators.distributed.all_reduce_grad_stats`: common centre broadcast from
the lowest rank with data, exact recentring, SUM of the centred sums, MAX of ``max |q|``, pools
all-gathered), and sums the probe's step counters. Afterwards every rank reports the statistics
of the full data set, exactly as one process fed every rank's batches would.

A :class:`~fused_stats.Probe` creates a point's accumulator at its first step, so a rank that saw no
batch of a stream has none. Before reducing, the ranks exchange the dimension of every
(stream, point) of ``probe.points`` and a rank lacking an accumulator that another rank has
creates an empty one with the probe's settings, so that every rank takes part in every reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..accumulators import GradStats
from ..accumulators.distributed import (_require_initialised, all_reduce_many, comm_device,
                                         names_digest)
from ..errors import FusedStatsError
from .checkpoint import STREAMS, probe_accumulators


def _new_accumulator(probe, stream: str, name: str, dim: int) -> GradStats:
    # the settings and naming a Probe uses for the accumulators it creates itself
    return GradStats(dim, getattr(probe, "second_moment", "auto"), getattr(probe, "pool_capacity", None),
                     backend=getattr(probe, "backend", "auto"),
                     name=name if stream == "train" else f"{name} [test]")


def _check_points(points: list[str], group, device) -> None:
    # before any collective whose size depends on the points: unequal sizes would hang, not fail
    mine = torch.tensor([names_digest(points), len(points)], dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    table = torch.stack(table).cpu()
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
    mine = torch.tensor([accs[key].dim if key in accs else 0 for key in keys], dtype=torch.int64,
                        device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    table = torch.stack(table).cpu()
    for column, (stream, name) in enumerate(keys):
        dims = {int(v) for v in table[:, column] if v > 0}
        if len(dims) > 1:
            raise FusedStatsError(
                f"all_reduce_probe: point {name!r} ({stream}) has dim {table[:, column].tolist()} "
                "by rank (0 = no accumulator)")
        if dims and (stream, name) not in accs:
            dim = dims.pop()
            getattr(probe, STREAMS[stream])[name] = _new_accumulator(probe, stream, name, dim)
            if isinstance(getattr(probe, "dims", None), dict):
                probe.dims.setdefault(name, dim)


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
    """Sum every accumulator of ``probe`` (``stats`` and ``test_stats``) over ``group``; a collective.

    All ranks must probe the same points (a mismatch raises
    :class:`~fused_stats.FusedStatsError` on every rank). ``probe.steps`` and
    ``probe.skipped_steps`` become the totals over the ranks. Returns ``probe``.
    """
    _require_initialised()
    accs = probe_accumulators(probe)
    some = next(iter(accs.values()), None)
    device = comm_device(group, None if some is None else some.device)
    _fill_missing(probe, group, device)
    accs = probe_accumulators(probe)
    all_reduce_many({f"{stream}/{name}": acc for (stream, name), acc in accs.items()}, group)
    _sum_counters(probe, group, device)
    return probe
