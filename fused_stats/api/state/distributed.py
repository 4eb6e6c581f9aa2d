"""All-reduce of a whole probe over ``torch.distributed`` (data-parallel probing).

Each rank runs the same probe on its own share of the batches; :func:`all_reduce_probe` then
replaces, on every rank, every accumulator of the probe's table (``(kind, stream, point)``:
GradStats and, as configured, CrossStats and norm histograms) by its merge over all ranks (each
accumulator's ``all_reduce``: settings row, alignment, SUM / MAX / gather per declared field), and
sums the probe's step counters. Afterwards every rank reports the statistics of the full data set
(``probe.report()``, ``probe.saturation(point)``), exactly as one process fed every rank's batches
would.

A probe creates a point's accumulators at its first step, so a rank that saw no batch of a stream
has none. Before reducing, the ranks exchange, for every (kind, stream, point), the dimension of
the accumulator (0: none), the dtype it was built with and a digest of its block (e.g. the cross
block's activation and ``W_in``); a rank lacking an accumulator that another rank has creates an
empty one through :meth:`Probe.new_accumulator <fused_stats.Probe.new_accumulator>` (same settings
and names), so that every rank takes part in every reduce. A rank whose probe does not keep a kind
that another rank holds (e.g. no ``cross=``) is an error on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...accumulators.distributed import (
    all_reduce_many,
    comm_device,
    gather_rows,
    names_digest,
    require_initialised,
)
from ...errors import FusedStatsError
from ..probe.fold import BUILTIN_KINDS, REGISTRY
from ..probe.table import STREAMS, probe_device

# dtype codes exchanged between ranks (0: no accumulator, or the kind's default)
_DTYPES = {torch.float32: 1, torch.float64: 2}


def exchanged_kinds(probe) -> tuple[str, ...]:
    """The kinds whose accumulators the ranks compare: the built-in ones (a rank that does not
    keep one another rank holds is named in the error) and those added with ``register_kind``
    that this probe keeps or holds (a registered kind no probe uses does not matter), in an
    order every rank agrees on."""
    used = set(probe.kinds) | {kind for kind, _, _ in probe.table}
    return (*BUILTIN_KINDS, *sorted(k for k in used if k in REGISTRY and k not in BUILTIN_KINDS))


def _check_points(points: list[str], kinds: tuple[str, ...], group, device) -> None:
    # before any collective whose size depends on the points or kinds: unequal sizes would hang
    table = gather_rows([names_digest(points), len(points), names_digest(list(kinds))], group, device)
    if bool((table[:, :2] != table[0, :2]).any()):
        raise FusedStatsError(
            f"all_reduce_probe: ranks probe different points (counts by rank {table[:, 1].tolist()}); "
            f"this rank has different sets of accumulators at points {points}"
        )
    if bool((table[:, 2] != table[0, 2]).any()):
        raise FusedStatsError(
            "all_reduce_probe: ranks keep different accumulator kinds added with register_kind; "
            f"this rank keeps {list(kinds[len(BUILTIN_KINDS) :])}"
        )


def _fill_missing(probe, group, device) -> None:
    points, kinds = list(probe.points), exchanged_kinds(probe)
    _check_points(points, kinds, group, device)
    if not points:
        return
    keys = [(kind, stream, name) for kind in kinds for stream in STREAMS for name in points]
    held = probe.kinds
    # one row per rank: [kinds the probe keeps (bits)], then per key: dim, dtype code, block
    # digest. The blocks are compared here, before any accumulator is reduced, so a mismatch at
    # a later point cannot leave earlier points already reduced
    row = [sum(1 << i for i, kind in enumerate(kinds) if kind in held)]
    for key in keys:
        acc = probe.table.get(key)
        dtype = None if acc is None else acc.factory_dtype()
        if dtype is not None and dtype not in _DTYPES:
            raise FusedStatsError(
                f"all_reduce_probe: the {key[0]} statistics at {key[2]!r} "
                f"({key[1]}) are built with dtype {dtype}; expected float32 or float64"
            )
        row += [
            0 if acc is None else acc.dim,
            0 if dtype is None else _DTYPES[dtype],
            0 if acc is None else acc.block_digest(),
        ]
    table = gather_rows(row, group, device)
    kept = table[:, 0].tolist()
    new = []
    for index, (kind, stream, name) in enumerate(keys):
        dim_col, dtype_col, block_col = (table[:, 1 + 3 * index + k] for k in range(3))
        dims = {int(v) for v in dim_col if v > 0}
        if not dims:
            continue
        bit = 1 << kinds.index(kind)
        codes = {int(v) for v in dtype_col if v > 0}
        blocks = [int(v) for v, d in zip(block_col, dim_col) if d > 0]
        if kind == "grad" and len(dims) > 1:
            raise FusedStatsError(
                f"all_reduce_probe: point {name!r} ({stream}) has dim {dim_col.tolist()} "
                "by rank (0 = no accumulator)"
            )
        if len(dims) > 1 or len(codes) > 1 or len(set(blocks)) > 1 or not all(k & bit for k in kept):
            first: dict = {}
            groups = [
                first.setdefault(int(b), len(first)) if d > 0 else None for b, d in zip(block_col, dim_col)
            ]
            kept_by_rank = [bool(k & bit) for k in kept]
            if kind == "cross":
                raise FusedStatsError(
                    f"all_reduce_probe: cross statistics at point {name!r} ({stream}) differ "
                    f"between ranks: dim {dim_col.tolist()}, W_in dtype code {dtype_col.tolist()} "
                    f"(1 float32, 2 float64, 0 none), block (activation, W_in) groups {groups}, "
                    f"probe built with cross= {kept_by_rank} (by rank)"
                )
            raise FusedStatsError(
                f"all_reduce_probe: {kind} statistics at point {name!r} ({stream}) differ between "
                f"ranks: dim {dim_col.tolist()}, settings groups {groups}, probe keeps {kind} "
                f"{kept_by_rank} (by rank)"
            )
        if (kind, stream, name) not in probe.table:
            dtype = {code: dt for dt, code in _DTYPES.items()}[codes.pop()] if codes else None
            new.append((kind, stream, name, dims.pop(), dtype))
    # ---- every rank agreed: create the missing (empty) accumulators
    if new:
        state_device = probe_device(probe)
    for kind, stream, name, dim, dtype in new:
        probe.table[(kind, stream, name)] = probe.new_accumulator(
            kind, stream, name, dim, dtype=dtype, device=state_device
        )
        if kind == "grad":
            probe.dims.setdefault(name, dim)


def _sum_counters(probe, group, device) -> None:
    tables = [probe.steps, probe.skipped_steps]
    values = torch.tensor(
        [int(t.get(stream, 0)) for t in tables for stream in STREAMS], dtype=torch.int64, device=device
    )
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    values = values.cpu().tolist()
    for i, t in enumerate(tables):
        for j, stream in enumerate(STREAMS):
            t[stream] = values[i * len(STREAMS) + j]


def all_reduce_probe(probe, group=None):
    """Sum every accumulator of ``probe.table`` over ``group``; a collective.

    All ranks must probe the same points (and the same cross block); a mismatch raises
    :class:`~fused_stats.FusedStatsError` on every rank. ``probe.steps`` and
    ``probe.skipped_steps`` become the totals over the ranks. Returns ``probe``.
    """
    require_initialised()
    some = next(iter(probe.table.values()), None)
    device = comm_device(group, None if some is None else some.device)
    _fill_missing(probe, group, device)
    named = {"/".join(key if key[0] != "grad" else key[1:]): acc for key, acc in probe.table.items()}
    all_reduce_many(named, group)
    _sum_counters(probe, group, device)
    return probe
