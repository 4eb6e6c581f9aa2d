"""All-reduce of a whole probe over ``torch.distributed`` (data-parallel probing).

Each rank runs the same probe on its own share of the batches; :func:`all_reduce_probe` then
replaces, on every rank, each point's train and test accumulators by their merge over all ranks
(:func:`fused_stats.accumulators.distributed.all_reduce_grad_stats`: common centre broadcast from
the lowest rank with data, exact recentring, SUM of the centred sums, MAX of ``max |q|``, pools
all-gathered). Afterwards every rank reports the statistics of the full data set.
"""

from __future__ import annotations

from ..accumulators.distributed import all_reduce_many
from .checkpoint import probe_accumulators


def all_reduce_probe(probe, group=None):
    """Sum every accumulator of ``probe`` (``stats`` and ``test_stats``) over ``group``; a collective.

    All ranks must hold the same points and streams (checked first: a mismatch raises
    :class:`~fused_stats.FusedStatsError` on every rank). Returns ``probe``.
    """
    accs = probe_accumulators(probe)
    all_reduce_many({f"{stream}/{name}": acc for (stream, name), acc in accs.items()}, group)
    return probe
