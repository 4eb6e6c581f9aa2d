"""Triton kernels and their launchers (imported lazily; each has a torch twin in ``fused_stats.ops``)."""

from ..errors import FusedStatsError


def _missing(*args, **kwargs):
    raise FusedStatsError("the Triton kernels are not built yet in this version")


capture_reduce = second_moment_update = gram_rows = _missing
